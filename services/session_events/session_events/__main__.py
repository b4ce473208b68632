from session_events.app import run

run()
