# Set-up is idempotent: the virtual environment is (re)built only when the pinned
# requirements change; the project itself is always re-installed in editable mode (~2 s).
# `make test` also installs the test-only pins of requirements-dev.lock, under a stamp of its own.
VENV ?= .venv
PY := $(VENV)/bin/python
LOCK := requirements.lock
DEV_LOCK := requirements-dev.lock
NODEPS_LOCK := requirements-nodeps.lock
STAMP := $(VENV)/.lock-$(shell cat $(LOCK) $(NODEPS_LOCK) pyproject.toml | sha256sum | cut -c1-16)
DEV_STAMP := $(VENV)/.dev-$(shell cat $(LOCK) $(NODEPS_LOCK) $(DEV_LOCK) pyproject.toml | sha256sum | cut -c1-16)
# `make demo DATA=/path/to/images` runs the demo on your own folder (class sub-folders, or train/ and val/).
DATA ?=

.PHONY: setup setup-dev test lint demo demo-reduced docs bench rehearsal clean

setup: $(STAMP)
	@$(PY) -m pip install -q --no-deps --no-build-isolation -e .

setup-dev: setup $(DEV_STAMP)

$(STAMP): $(LOCK) $(NODEPS_LOCK) pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -r $(LOCK)
	$(PY) -m pip install -q --no-deps -r $(NODEPS_LOCK)
	rm -f $(VENV)/.lock-* && touch $(STAMP)

$(DEV_STAMP): $(STAMP) $(DEV_LOCK)
	$(PY) -m pip install -q -r $(DEV_LOCK)
	rm -f $(VENV)/.dev-* && touch $(DEV_STAMP)

lint: setup-dev
	$(PY) -m ruff check .

# On every core (pytest-xdist; an idle worker takes tests queued for a busy one, so the long ones do not leave a
# worker waiting at the end); plain `pytest` runs in one process (the reduced demo then runs in the background).
test: lint
	$(PY) -m pytest -q -n auto --dist worksteal

demo: setup
	DEMO_DATA="$(DATA)" bash scripts/demo.sh "$(PY)"

# Every stage shrunk to seconds (what the test suite runs), into demo-out-reduced/.
demo-reduced: setup
	DEMO_REDUCED=1 DEMO_OUT=demo-out-reduced bash scripts/demo.sh "$(PY)"

# Regenerate docs/config.md from the config dataclasses (a test fails when it is stale).
docs: setup
	$(PY) scripts/gen_config_reference.py --out docs/config.md

bench: setup
	$(PY) benchmarks/bench_shards.py

# Every job's bookkeeping on an ImageNet-shaped set of 100,000 tiny images, made once in REHEARSAL_DIR
# (benchmarks/scale_rehearsal.py --samples 1281167 for ImageNet's size).
REHEARSAL_DIR ?= rehearsal-out
rehearsal: setup
	$(PY) benchmarks/scale_rehearsal.py --out $(REHEARSAL_DIR) --quick

clean:
	rm -rf demo-out demo-out-reduced rehearsal-out .pytest_cache .ruff_cache
