# Set-up and everyday commands. Everything installs into ./.venv; nothing is downloaded but packages.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL := examples/models/tiny-qwen2
CONFIG ?= examples/math_code.yaml
PYTEST_ARGS ?=

.PHONY: install model run test test-fast lint clean

install: $(STAMP)

# torch first, pinned, so pip takes the CPU wheel; DeepSpeed next without build isolation so its build sees that
# torch instead of fetching another; then the project itself.
$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (Python 3.11 is required)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	DS_BUILD_OPS=0 $(BIN)/pip install --quiet --no-build-isolation deepspeed==0.19.8
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

model: install
	$(BIN)/roll model build-tiny --out $(MODEL)

run: model
	$(BIN)/roll run $(CONFIG)

test: model
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: model
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf runs mlflow.db .pytest_cache
