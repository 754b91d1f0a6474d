# Two commands on a fresh clone: `make demo` and `make test`. Each creates .venv first if it is missing.
PY := .venv/bin/python
PYTEST_ARGS ?=
# Test processes (pytest-xdist); each gets its share of the cores. TEST_WORKERS=0 runs in this process. They take
# the tests marked `slow` first (tests/conftest.py).
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

.PHONY: demo demo-ocr test test-fast fuzz bench lint docs docs-serve help-texts

.venv: pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]' || (rm -rf .venv; exit 1)
	touch .venv

demo: .venv
	$(PY) -m vitkit.demo

# Image-to-text on composed digit strings (about 10 minutes on 2 CPU cores).
demo-ocr: .venv
	$(PY) -m vitkit.demo ocr

# The whole suite, the tests marked `slow` included.
test: .venv
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

# The quick tier, for the loop while working: every test not marked `slow` (markers: pyproject.toml).
test-fast: .venv
	$(PY) -m pytest -q $(XDIST) -m "not slow" $(PYTEST_ARGS)

# The property tests alone, with 2,000 examples each instead of 25 (a few minutes).
fuzz: .venv
	$(PY) -m pytest -q -m fuzz $(PYTEST_ARGS)

# The manual (docs/, mkdocs with the material theme) into site/; docs-serve serves it at http://127.0.0.1:8000.
docs: .venv
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs-serve: .venv
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

bench: .venv
	$(PY) -m vitkit.cli bench

lint: .venv
	$(PY) -m ruff check vitkit tests benchmarks train.py

# The help of `vitkit train ... --help` and `vitkit evaluate --help` that ships with vitkit (vitkit/cli/help-texts/),
# written again with the libraries installed now: after a changed argument or docstring, or an upgrade.
help-texts: .venv
	$(PY) -m vitkit.cli.help_cache
