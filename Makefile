# The two commands of the README: `make demo` and `make test`. Each sets up .venv first when needed.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh $(PY) $(VENV)
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python launch/cluster.py --generators 2 --learners 1

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf runs/demo runs/test
