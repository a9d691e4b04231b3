# Every target bootstraps .venv when it is missing; `make install` is idempotent.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev
PYTEST_ARGS ?=

.PHONY: install run test lint bench faults faults-sweep fuzz load soak chaos clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The main job: one session (router, node, fly-a, fly-b, arena) to completion (flyd run).
run: $(STAMP)
	$(BIN)/flyd run

# The parallel part first; then the wall-time measurements (marker `serial`) alone, so that the
# tier-1 sweep's < 60 s bound is measured on an otherwise idle machine. Workers are handed
# tests one or two at a time, so none queues behind a long run (tests/conftest.py).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --maxschedchunk 1 -m "not serial" $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q -m serial $(PYTEST_ARGS)

# ruff, mypy, and the layers of docs/layout.md (import-linter's contracts in pyproject.toml).
lint: $(STAMP)
	$(BIN)/ruff check bus workers flyd tests bench examples
	$(BIN)/mypy
	$(BIN)/lint-imports

bench: $(STAMP)
	uptime >&2
	$(BIN)/python bench/bus.py
	$(BIN)/python bench/step_rate.py
	$(BIN)/python -P bench/step_cpu.py
	$(BIN)/python -P bench/step_cpu.py --agents 2 8 32 --cadence 0 --agents-per-process 8
	$(BIN)/python -P bench/request_cpu.py
	$(BIN)/python -P bench/peers.py
	$(BIN)/python -P bench/peers.py --agents 8 32 --agents-per-process 8
	$(BIN)/python -P bench/media.py
	$(BIN)/python -P bench/real_envs.py
	$(BIN)/python -P bench/agent_scaling.py --intervals 1
	$(BIN)/python -P bench/checkpoints.py
	$(BIN)/python -P bench/claims.py --claims 300
	$(BIN)/python -P bench/leases.py
	$(BIN)/python -P bench/failover.py
	$(BIN)/python -P bench/memory.py --steps 1500
	$(BIN)/python -P bench/launch.py --rounds 3
	$(BIN)/python -P bench/watch.py

# As `test`: the sweep's < 60 s bound (marker `serial`) is measured alone, after the rest.
faults: $(STAMP)
	$(BIN)/python -m pytest tests/distribution -q -n auto -m "not serial"
	$(BIN)/python -m pytest tests/distribution -q -m serial

faults-sweep: $(STAMP)
	FLYD_SIM_SEEDS=10000 FLYD_RECOVERY_SEEDS=10 $(BIN)/python -m pytest tests/distribution \
		tests/state/test_recovery.py -q

fuzz: $(STAMP)
	$(BIN)/python -m pytest -q tests/bus/test_fuzz.py --hypothesis-profile=fuzz

# 64 clients x 10000 calls through one router with random cancels and service restarts.
load: $(STAMP)
	$(BIN)/python -P bench/load.py

# 300 + 100 consecutive sessions on one node: no growth, no leftovers; then a 10^5-step
# `flyd run` at cadence 0 and at cadence 1 in flat memory (scripts/soak.py, scripts/long_run.py).
soak: $(STAMP)
	$(BIN)/python scripts/soak.py --long-steps 100000 $(SOAK_ARGS)

# 100 runs, each with a SIGKILL of a random process: each ends succeeded, once (scripts/chaos.py).
chaos: $(STAMP)
	$(BIN)/python scripts/chaos.py $(CHAOS_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
