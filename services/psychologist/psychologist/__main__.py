from psychologist.app import run

run()
