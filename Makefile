# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: serve test bench clean

$(STAMP): pyproject.toml scripts/install_torch.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	scripts/install_torch.sh $(PY)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pdserve serve

test: $(STAMP)
	PDSERVE_DEBUG_INVARIANTS=1 $(PY) -m pytest -q $(PYTEST_ARGS) tests

bench: $(STAMP)
	$(PY) benchmarks/bench_offline.py

clean:
	rm -rf $(VENV)
