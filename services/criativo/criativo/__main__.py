from criativo.app import run

run()
