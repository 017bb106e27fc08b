# The two commands of the README. Both set up (or reuse) .venv first.
.PHONY: setup demo test sglang-wheel

setup:
	@bash scripts/setup_env.sh

demo: setup
	@bash scripts/demo.sh

# The released SGLang wheel (no dependencies, cached) that tests/test_sglang_contract.py reads.
sglang-wheel: setup
	@.venv/bin/python -m specforge_opd.sglang.wheel

test: setup sglang-wheel
	@.venv/bin/python -m pytest -q -rs --durations=15 tests
