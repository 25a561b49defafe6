# sluice: `make serve` serves the default model on 127.0.0.1:8000; `make test` runs the tests.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test model clean-venv

$(STAMP): pyproject.toml $(wildcard sluice/attention/cpu/*.cpp sluice/attention/cpu/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m sluice.attention.cpu.build || echo "cpu attention unavailable; the engine will use the torch backend"
	touch $(STAMP)

install: $(STAMP)

model: install
	$(PY) -m sluice.cli models fetch-default

serve: model
	$(VENV)/bin/sluice serve --host 127.0.0.1 --port 8000

test: model
	$(PY) -m pytest -q tests

clean-venv:
	rm -rf $(VENV)
