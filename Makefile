# Two commands for a newcomer: `make run` (the product on embedded defaults) and `make test`.
# Each creates the virtual environment and installs what it needs on first use.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
OUT    ?= out

.PHONY: run demo test lint typecheck unit bench clean help

help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

run: $(STAMP) ## replay the Mooncake trace at 3x through three routing policies (8 x H100)
	$(BIN)/controlplane replay --trace mooncake --rate-scale 3 \
		--policies round_robin,prefix_affinity,predicted_finish \
		--json $(OUT)/run.json --plot $(OUT)/run.png

demo: $(STAMP) ## saturate 8 H100 replicas with the Mooncake trace at 3x; out/demo.{json,png}
	$(BIN)/controlplane replay --trace mooncake --rate-scale 3 \
		--replicas 8 --gpu h100 --model llama-3.1-8b \
		--json $(OUT)/demo.json --plot $(OUT)/demo.png

lint: $(STAMP) ## ruff check + ruff format --check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP) ## mypy --strict
	$(BIN)/mypy

unit: $(STAMP) ## the test suite
	$(BIN)/pytest -q

test: lint typecheck unit ## everything CI runs

bench: $(STAMP) ## benchmarks: tables on stdout, JSON under out/bench/
	$(BIN)/python bench/run_all.py --out $(OUT)/bench

clean: ## remove build and output folders (keeps the virtual environment)
	rm -rf $(OUT) .pytest_cache .mypy_cache .ruff_cache *.egg-info
