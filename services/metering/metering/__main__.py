from metering.app import run

run()
