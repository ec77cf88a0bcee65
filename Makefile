# sglang-fleet: `make test` and `make demo` do all their set-up on a fresh Debian 12 machine.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

VENV := .venv
BIN := $(VENV)/bin
ALL_SCENARIOS := $(sort $(notdir $(patsubst %/molecule.yml,%,$(wildcard molecule/*/molecule.yml))))
# Longest first, so that the parallel slots finish together; any scenario not named here runs last.
LONGEST_FIRST := tuning fleet rollout deploy monitoring gpu_cleanup provision
SCENARIOS ?= $(filter $(ALL_SCENARIOS),$(LONGEST_FIRST)) $(filter-out $(LONGEST_FIRST),$(ALL_SCENARIOS))
export PATH := $(CURDIR)/$(BIN):$(PATH)
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: help test demo lint pytest molecule host image wheelhouse monitoring-debs bench clean
help:
	@echo "make test   - set up, then yamllint, ansible-lint, ruff, pytest and every Molecule scenario"
	@echo "make demo   - set up, then deploy SGLang (GPU-less double) onto a local simulated GPU host"
	@echo "make lint | pytest | molecule [SCENARIOS='deploy'] [MOLECULE_JOBS=3] | bench [BENCHES='fleet_noop'] | clean"

$(BIN)/.stamp: requirements.txt pyproject.toml gpusim/pyproject.toml scripts/find-python.sh
	@echo "==> creating $(VENV) (Python >= 3.12) and installing requirements.txt"
	@py=$$(scripts/find-python.sh); rm -rf $(VENV); "$$py" -m venv $(VENV)
	@$(BIN)/pip install --quiet --disable-pip-version-check -r requirements.txt 2> >(grep -v 'is ignored: it is neither' >&2)
	@touch $@

host:
	@scripts/ensure-host-tools.sh

image: host
	@scripts/build-test-image.sh

wheelhouse: $(BIN)/.stamp
	@scripts/build-wheelhouse.sh

# Debian's Prometheus packages for the monitoring scenario, shipped as an air-gapped site would.
monitoring-debs: image
	@scripts/build-monitoring-debs.sh

lint: $(BIN)/.stamp
	@echo "==> yamllint"; $(BIN)/yamllint --strict .
	@echo "==> ansible-lint (production profile)"; $(BIN)/ansible-lint --profile production
	@echo "==> ruff"; $(BIN)/ruff check . && $(BIN)/ruff format --check .

# No image here: the one test that needs a real systemd builds it on demand (tests/test_flags.py).
# The wheelhouse holds the pinned SGLang wheel that tests/test_ml_env_vars.py reads.
pytest: $(BIN)/.stamp wheelhouse host
	@echo "==> pytest"; $(BIN)/pytest

molecule: $(BIN)/.stamp image wheelhouse monitoring-debs
	@scripts/molecule-all.sh $(SCENARIOS)

test: lint pytest molecule
	@echo "==> all tests passed"

demo: $(BIN)/.stamp image wheelhouse
	@scripts/demo.sh

# Every benchmark in bench/ (bench/README.md); BENCHES=fleet_noop runs one.
BENCHES ?= smoke_vs_bench_serving autotune_vs_grid fleet_noop
bench: $(BIN)/.stamp image wheelhouse
	@for b in $(BENCHES); do echo "==> bench/$$b.py"; $(BIN)/python bench/$$b.py; done

clean:
	rm -rf $(VENV) .cache/wheelhouse reports
