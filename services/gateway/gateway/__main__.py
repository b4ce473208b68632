from gateway.app import run

run()
