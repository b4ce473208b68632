from handoff.app import run

run()
