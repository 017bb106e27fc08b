# The two commands of the README. Both set up (or reuse) .venv first.
.PHONY: setup demo test bench

setup:
	@bash scripts/setup_env.sh

demo: setup
	@bash scripts/demo.sh

test: setup
	@.venv/bin/python -m pytest -q --durations=15 tests

bench: setup
	@bash benchmarks/run_all.sh
