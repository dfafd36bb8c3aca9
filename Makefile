# The two commands of the README: `make demo` and `make test`. Each sets up .venv first when needed.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast test-gpu lint clean scale

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh $(PY) $(VENV)
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python launch/cluster.py --generators 2 --learners 1 run.overwrite=true

# TEST_WORKERS=2 runs two test files at a time (pytest-xdist; a file's tests stay on one worker, so its module
# fixtures start once; the longest tiers first, tests/conftest.py RUN_ORDER). Not the default: on 2 cores it was
# no faster than one file after another (docs/testing.md, "Two files at a time").
TEST_WORKERS ?= 1
XDIST = $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q $(XDIST) --durations=40 tests

# the unit tier alone (no server, no process group, no engine): a minute or two
test-fast: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q -m unit tests

# GPU machines: a venv of its own with the pinned gpu extra, then the tests marked gpu (1 GPU: the smoke test;
# 2 GPUs: all four). Skipped with their reason where CUDA shows fewer devices.
GPU_VENV := .venv-gpu
test-gpu:
	[ -x $(GPU_VENV)/bin/python ] || $(PY) -m venv $(GPU_VENV)
	[ -f $(GPU_VENV)/.installed ] || ($(GPU_VENV)/bin/python -m pip install --quiet -e ".[gpu,dev]" \
	  && $(GPU_VENV)/bin/python -m async_rlhf.prebuild && touch $(GPU_VENV)/.installed)
	$(GPU_VENV)/bin/python -m pytest -q -rs -m gpu tests/gpu

# bench/scale.py in full: N = 1, 2, 4, 8, 16 generators and as many learner ranks over 4 network-namespace nodes
# (root, iproute2; 3-5 minutes on 2 cores, 2026-12-07), one Ray/vLLM/DeepSpeed stack at a time. Not part of `make test` (its
# 8 + 8 row runs there as a cluster-tier scenario). Writes runs/scale/scale.json and docs/scale.png
scale: $(STAMP)
	flock /tmp/stack.lock $(VENV)/bin/python bench/scale.py --full --out runs/scale/scale.json --plot docs/scale.png

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf runs/demo runs/test
