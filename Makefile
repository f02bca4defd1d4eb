# Set-up is idempotent: the virtual environment is (re)built only when the pinned
# requirements change; the project itself is always re-installed in editable mode (~2 s).
VENV ?= .venv
PY := $(VENV)/bin/python
LOCK := requirements.lock
STAMP := $(VENV)/.lock-$(shell cat $(LOCK) pyproject.toml | sha256sum | cut -c1-16)

.PHONY: setup test lint demo bench clean

setup: $(STAMP)
	@$(PY) -m pip install -q --no-deps --no-build-isolation -e .

$(STAMP): $(LOCK) pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -r $(LOCK)
	rm -f $(VENV)/.lock-* && touch $(STAMP)

lint: setup
	$(PY) -m ruff check .

test: lint
	$(PY) -m pytest -q

demo: setup
	bash scripts/demo.sh $(PY)

bench: setup
	$(PY) benchmarks/bench_shards.py

clean:
	rm -rf demo-out .pytest_cache .ruff_cache
