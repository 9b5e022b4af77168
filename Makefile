# Two entry points: `make serve` and `make test`. Both set up .venv from scratch when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8080
MODEL ?= smollm2-135m

.PHONY: serve test setup clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/stratum pull $(MODEL)
	$(VENV)/bin/stratum serve --model $(MODEL) --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(VENV)/bin/stratum pull $(MODEL)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
