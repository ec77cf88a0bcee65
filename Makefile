# sglang-fleet: `make test` and `make demo` do all their set-up on a fresh Debian 12 machine.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

VENV := .venv
BIN := $(VENV)/bin
ALL_SCENARIOS := $(sort $(notdir $(patsubst %/molecule.yml,%,$(wildcard molecule/*/molecule.yml))))
# Longest first, so that the parallel slots finish together (each one's time in a fresh-clone
# `make test`: docs/TESTING.md); any scenario not named here runs last.
LONGEST_FIRST := upgrade real_sglang fleet deploy staging rollout tuning monitoring provision gpu_cleanup
# Scenarios left out of `make test` until they have passed a whole run (check, converge,
# idempotence, verify) on these machines; run one by name: make molecule SCENARIOS=<name>.
OPT_IN :=
# Scenarios that start from the provisioned test-host layer (make double-image): their molecule.yml says so.
DOUBLE_LAYER_SCENARIOS := $(notdir $(patsubst %/molecule.yml,%,$(shell grep -l 'image: sglang-fleet-testhost-double' molecule/*/molecule.yml)))
SCENARIOS ?= $(filter-out $(OPT_IN),$(filter $(ALL_SCENARIOS),$(LONGEST_FIRST)) \
  $(filter-out $(LONGEST_FIRST),$(ALL_SCENARIOS)))
export PATH := $(CURDIR)/$(BIN):$(PATH)
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
# Python keeps the bytecode of what it compiles (__pycache__/, ignored by git) even where the
# machine's environment says not to (PYTHONDONTWRITEBYTECODE, as on these machines): every
# Ansible task runs in a fresh worker process that imports its action plugin and sglang_fleet
# again, and every pytest worker rewrites every test module's asserts again, each time from
# source without it (docs/TESTING.md, "Bytecode").
unexport PYTHONDONTWRITEBYTECODE

.PHONY: help check check-pytest ansible-test test test-checks demo lint pytest molecule host image wheelhouse cpu-image double-image monitoring-debs staging-debs driver-debs sglang-ref resolve-gpu-deps bench clean
help:
	@echo "make check  - the quick loop, no containers: yamllint, ansible-lint, ruff, ansible-test and the unit tests"
	@echo "make test   - set up, then yamllint, ansible-lint, ruff, pytest and every Molecule scenario"
	@echo "make demo   - set up, then deploy SGLang (GPU-less double) onto a local simulated GPU host"
	@echo "make lint | pytest | molecule [SCENARIOS='deploy'] [MOLECULE_JOBS=3] | bench [BENCHES='fleet_noop'] | clean"
	@echo "make sglang-ref (SGLang reference venv) | resolve-gpu-deps (dry-run of the pinned GPU set)"

# --no-compile: the `ansible` package alone holds tens of thousands of modules that no run
# imports; Python compiles (and keeps, see below) the bytecode of the few it does. On 2 cores
# the install took 65 s instead of 109 s (2026-12-04).
$(BIN)/.stamp: requirements.txt pyproject.toml gpusim/pyproject.toml scripts/find-python.sh
	@echo "==> creating $(VENV) (Python >= 3.12) and installing requirements.txt"
	@# Not the venv's own interpreter, first on PATH here: a venv copied with its files (not its
	@# links) would be removed below with the only Python named.
	@py=$$(readlink -f "$$(PATH="$${PATH#$(CURDIR)/$(BIN):}" scripts/find-python.sh)"); \
	  rm -rf $(VENV); "$$py" -m venv $(VENV)
	@$(BIN)/pip install --quiet --disable-pip-version-check --no-compile -r requirements.txt 2> >(grep -v 'is ignored: it is neither' >&2)
	@touch $@

host:
	@scripts/ensure-host-tools.sh

image: host
	@scripts/build-test-image.sh

wheelhouse: $(BIN)/.stamp
	@scripts/build-wheelhouse.sh

# The test-host image layer with the real SGLang's CPU set (about 650 MB of wheels) installed by
# the ml_env role: only molecule/real_sglang needs it, so only it builds it, and the set is
# downloaded only when the layer is built (its tag names the set by its lock).
cpu-image: $(BIN)/.stamp image
	@scripts/build-testhost-layer.sh cpu

# The test-host image layer with the double and the ml-env installed (scripts/build-testhost-layer.sh):
# the scenarios that roll out servers start from it; deploy and provision provision from scratch.
double-image: $(BIN)/.stamp image wheelhouse
	@scripts/build-testhost-layer.sh double

# Debian's Prometheus packages for the monitoring scenario, shipped as an air-gapped site would.
monitoring-debs: image
	@scripts/build-debs.sh monitoring-debs prometheus prometheus-alertmanager prometheus-node-exporter

# rsync for the staging scenario's hosts, shipped as an air-gapped site would.
staging-debs: image
	@scripts/build-debs.sh staging-debs rsync

# python3-apt, which Ansible's apt module needs and the test image lacks: the upgrade scenario's
# driver change installs a stand-in branch package with the nvidia_driver role (molecule/upgrade).
driver-debs: image
	@scripts/build-debs.sh driver-debs python3-apt

# ansible-lint is skipped when the very files it reads passed it already (scripts/ansible-lint-cached.sh:
# a fresh clone runs it; ANSIBLE_LINT_CACHE=0 always does).
lint: $(BIN)/.stamp
	@echo "==> ruff"; $(BIN)/ruff check . && $(BIN)/ruff format --check .
	@echo "==> yamllint"; $(BIN)/yamllint --strict .
	@echo "==> antsibull-changelog lint (changelogs/fragments)"; $(BIN)/antsibull-changelog lint
	@echo "==> ansible-lint (production profile)"; scripts/ansible-lint-cached.sh

# The SGLang 0.5.23 reference venv (CPU build, ~2.4 GB, gpusim/tools/sglang-0.5.23-cpu.lock):
# the real parser for tests/double/test_flags_match_real.py and the real server for
# tests/double/test_contract_real.py. Built once per machine in the user's cache, which
# .cache/sglang-ref links to (scripts/sglang-reference-env.sh); a current venv is only checked.
sglang-ref:
	@scripts/sglang-reference-env.sh

# The pinned SGLang's full GPU dependency set, resolved for Python 3.11 without installing it
# (pip --dry-run --report): package count, torch and CUDA versions.
resolve-gpu-deps: $(BIN)/.stamp
	@scripts/resolve-gpu-deps.sh

# No image here: the one test that needs a real systemd builds it on demand (tests/test_flags.py).
# The wheelhouse holds the pinned SGLang wheel that tests/test_ml_env_vars.py reads. Most tests
# wait on processes, sockets and leases rather than compute, so PYTEST_JOBS of them run at once.
PYTEST_JOBS ?= 4
PYTEST := echo "==> pytest"; $(BIN)/pytest -n $(PYTEST_JOBS)
pytest: $(BIN)/.stamp wheelhouse sglang-ref host
	@$(PYTEST)

# The inner loop: everything that needs no container, no image and no dockerd (and no reference
# venv: the tests that need it say so and skip until `make sglang-ref` has built it). The linters
# and pytest share nothing, so they run at once: pytest's workers wait on processes, sockets and
# leases, and the linters (ansible-lint's syntax checks above all) use that time.
check: $(BIN)/.stamp wheelhouse
	@$(MAKE) --no-print-directory -j 2 lint check-pytest ansible-test

# ansible-test sanity and units on the collection as it ships, without Docker (docs/COLLECTION.md,
# "ansible-test"): its sanity venvs are kept in .cache, so only the first run builds them.
ansible-test: $(BIN)/.stamp
	@scripts/ansible-test.sh

# Run by `check` once its set-up is done (the wheelhouse is built once, not once per job).
check-pytest:
	@echo "==> pytest (no containers)"; $(BIN)/pytest -n $(PYTEST_JOBS) -m "not container"

MOLECULE_SETUP := $(BIN)/.stamp image wheelhouse $(if $(filter real_sglang,$(SCENARIOS)),cpu-image) \
  $(if $(filter $(DOUBLE_LAYER_SCENARIOS),$(SCENARIOS)),double-image) \
  $(if $(filter monitoring,$(SCENARIOS)),monitoring-debs) $(if $(filter staging,$(SCENARIOS)),staging-debs) \
  $(if $(filter upgrade,$(SCENARIOS)),driver-debs)
molecule: $(MOLECULE_SETUP)
	@scripts/molecule-all.sh $(SCENARIOS)

# The scenarios are the long pole: `make test` starts them as soon as their own set-up (images,
# wheelhouses, packages) is there, and builds the reference venv, lints and runs pytest beside
# them (docs/TESTING.md, "The suite's order"). One make, so what both need is built once. No
# --output-sync: make would hold each command's output until it ends, and the scenarios' lines
# must show as they come (their runner prints whole lines; each scenario's log is its own file).
test-checks: $(BIN)/.stamp wheelhouse sglang-ref host lint ansible-test
	@$(PYTEST)

test: $(BIN)/.stamp
	@$(MAKE) --no-print-directory -j 3 molecule test-checks
	@echo "==> all tests passed"

demo: $(BIN)/.stamp image wheelhouse
	@scripts/demo.sh

# Every benchmark in bench/ (bench/README.md); BENCHES=fleet_noop runs one.
BENCHES ?= smoke_vs_bench_serving autotune_vs_grid fleet_noop attention_dp_job rollout_overhead planner_accuracy job_runner speculative
bench: $(BIN)/.stamp image wheelhouse sglang-ref
	@for b in $(BENCHES); do echo "==> bench/$$b.py"; $(BIN)/python bench/$$b.py; done
	@echo "==> property tests, long profile (docs/TESTING.md)"
	HYPOTHESIS_PROFILE=long $(BIN)/pytest -q -p no:cacheprovider tests/test_props_*.py

clean:
	rm -rf $(VENV) .cache/wheelhouse .cache/cpu-wheelhouse reports
