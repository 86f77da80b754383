# Two commands for a new user: `make demo` and `make test`.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test bench typecheck clean

$(VENV)/.torch:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	touch $@

$(VENV)/.core: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e ".[test,hf,progress,tracking,docs]"
	touch $@ $(VENV)/.core

demo: $(VENV)/.core
	$(PY) -m trainfold.cli demo

test: $(VENV)/.test
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m ruff format --check src tests benchmarks examples
	$(PY) -m mypy  # zero errors on src/ (pyproject's [tool.mypy])
	# the docs build runs even when a test fails (a red run shows everything at once); either failing fails `make`.
	# mkdocs --strict: broken links fail; ~15 s, offline
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=20; tests=$$?; \
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -q -d $(VENV)/site; docs=$$?; \
	test $$tests -eq 0 && test $$docs -eq 0

typecheck: $(VENV)/.test  # mypy over src/ alone (pyproject's [tool.mypy]); `make test` runs it too
	$(PY) -m mypy

bench: $(VENV)/.test
	$(PY) benchmarks/step_overhead.py

clean:
	rm -rf $(VENV) runs
