# dcp_datastates — set-up, build, demo and tests on a fresh Debian machine (run as root, or with sudo).
# Everything is installed into the project's .venv (made with $(PYTHON)), never into the system.
PYTHON ?= python3
TORCH ?= torch==2.13.0
# the package's extras that the suite needs
EXTRAS := test,bench
VENV := .venv
PY := $(VENV)/bin/python
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT_PACKAGES := cmake gcc make liburing-dev libxxhash-dev
MPI_APT_PACKAGES := openmpi-bin libopenmpi-dev  # only the multi-rank tests need them
# apt-get waits up to 10 minutes for the dpkg lock that another apt (unattended-upgrades)
# holds; `apt-get update` ignores that option for the lock of its lists, so WAIT_APT_LISTS
# waits for that one first (the fcntl lock apt takes; still held after 10 minutes, update
# fails naming its holder)
APT_GET := DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get -q -o DPkg::Lock::Timeout=600
APT_LISTS_LOCK := /var/lib/apt/lists/lock
WAIT_APT_LISTS := $(SUDO) timeout 600 $(PYTHON) -c 'import fcntl; \
	fcntl.lockf(open("$(APT_LISTS_LOCK)", "a"), fcntl.LOCK_EX)' || true
SHIM := dcp_datastates/_lib/libdcp_uring.so
MPI_ENV := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MPIRUN := $(MPI_ENV) timeout 600 mpirun --oversubscribe
MPI_TESTS := tests/mpi/test_mpi.py tests/integrations/test_torchtitan_integration.py \
             tests/mpi/test_tiers_mpi.py tests/mpi/test_budget_mpi.py \
             tests/mpi/test_dcp_oracle_mpi.py
# make fuzz: the DCP-oracle tests over seeds FUZZ_SEEDS (DCP_ORACLE_SEEDS's form: "0-999" or
# "3,8"), on one rank and under mpirun -n 2 and -n 4, each run stopped after FUZZ_TIMEOUT s
FUZZ_SEEDS ?= 0-499
FUZZ_TIMEOUT ?= 14400
FUZZ_PYTEST := $(PY) -m pytest -q --color=no -p no:cacheprovider -p no:logging
# torchtitan 0.2.x (pure Python, pinned, with the one package its checkpointer and trainer import
# that .venv lacks): installed beside torchtitan 0.3.0, put first on PYTHONPATH by a second run
# of the torchtitan tests
TITAN02 := $(VENV)/torchtitan-0.2.2
TITAN02_PACKAGES := torchtitan==0.2.2 torchdata==0.11.0
TITAN_TESTS := tests/integrations/test_torchtitan_integration.py \
               tests/integrations/test_torchtitan_trainer.py
WITH_TITAN02 := PYTHONPATH=$(abspath $(TITAN02))
# make test-newest-torch: the single-process suite again under NEWEST_TORCH, in a venv of its own
# that takes the package from this tree (its native libraries are those `make native` built)
# and its dependencies and EXTRAS from pyproject.toml; pip's `constraint` setting, by which a
# machine may cap torch below the newest release, is lifted for that venv only
NEWEST_TORCH ?= torch==2.15.0
NEWEST_VENV := .venv-newest
NEWEST_PY := $(NEWEST_VENV)/bin/python
NEWEST_PIP := PIP_CONSTRAINT=/dev/null $(NEWEST_PY) -m pip install -q
PROJECT_REQUIREMENTS := import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	print(*p["dependencies"], *(r for e in "$(EXTRAS)".split(",") \
	for r in p["optional-dependencies"][e]), sep="\n")

.PHONY: setup mpi native demo test test-long test-mpi test-newest-torch fuzz test-package lint bench faults clean distclean FORCE

## setup: system packages, then in .venv PyTorch (CPU wheel, pinned, first so that pip never
## picks a CUDA build) and the package (editable, which builds the shim) with its test tools,
## torchtitan 0.3.0, and torchtitan 0.2.2 in $(TITAN02); done again only when pyproject.toml,
## this Makefile or the package's directories change
## (Open MPI, which only the multi-rank tests need, is the target mpi)
setup: $(VENV)/.setup-done
$(VENV)/.setup-done: pyproject.toml Makefile $(VENV)/.layout
	@pkgs="$(APT_PACKAGES)"; $(PYTHON) -c 'import ensurepip' 2>/dev/null || pkgs="$$pkgs python3-venv"; \
	if ! dpkg -s $$pkgs >/dev/null 2>&1; then \
		$(WAIT_APT_LISTS); $(APT_GET) update && $(APT_GET) install -y $$pkgs; fi
	[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]" tyro
	$(PY) -m pip install -q --no-deps torchtitan==0.3.0 spmd_types==0.2.3
	$(PY) -m pip install -q --no-deps --upgrade --target $(TITAN02) $(TITAN02_PACKAGES)
	touch $@

## mpi: Open MPI (mpirun, and the library mpi4py's wheel loads), for test-mpi only
mpi:
	@dpkg -s $(MPI_APT_PACKAGES) >/dev/null 2>&1 || { $(WAIT_APT_LISTS); \
		$(APT_GET) update && $(APT_GET) install -y $(MPI_APT_PACKAGES); }

# $(NEWEST_VENV) (after setup, for its system packages): NEWEST_TORCH first, then what
# pyproject.toml lists; done again when NEWEST_TORCH, pyproject.toml or this Makefile change
$(NEWEST_VENV)/.setup-done: pyproject.toml Makefile $(NEWEST_VENV)/.torch | setup
	[ -x $(NEWEST_PY) ] || $(PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_PIP) "$(NEWEST_TORCH)"
	$(NEWEST_PY) -c '$(PROJECT_REQUIREMENTS)' >$(NEWEST_VENV)/requirements.txt
	$(NEWEST_PIP) -r $(NEWEST_VENV)/requirements.txt
	touch $@
$(NEWEST_VENV)/.torch: FORCE
	@mkdir -p $(NEWEST_VENV); echo '$(NEWEST_TORCH)' | cmp -s - $@ || echo '$(NEWEST_TORCH)' >$@

# The editable install maps the package's directories as they are when it is made (a directory
# made later, or given an __init__.py later, is not seen): this file changes when they do.
LAYOUT := $(filter-out %/__pycache__/ %/_lib/,$(wildcard dcp_datastates/*/ dcp_datastates/*/*/)) \
	$(wildcard dcp_datastates/*/__init__.py dcp_datastates/*/*/__init__.py)
$(VENV)/.layout: FORCE
	@mkdir -p $(VENV); echo '$(strip $(LAYOUT))' | cmp -s - $@ || echo '$(strip $(LAYOUT))' >$@
FORCE:

## native: rebuild the native libraries after native/ changes: the io_uring shim ($(SHIM),
## liburing linked statically) and libdcp_hash.so (checksums without the GIL)
native: $(SHIM)
$(SHIM): native/dcp_uring.c native/dcp_uring.h native/dcp_hash.c CMakeLists.txt | setup
	cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
	cmake --build build -j 2
	@[ ! -f $@ ] || touch $@  # without liburing there is no shim: the thread backend is used

## demo: train a small model with async checkpoints, resume from the last one and verify
demo: native
	$(PY) examples/train_demo.py

## test: ruff, mypy, the single-process suite, then the multi-rank tests under mpirun -n 2
## (about 10 minutes on two cores; CI runs test-long after it)
test: native lint
	timeout 1800 $(PY) -m pytest -q tests  # a hang fails the run rather than holding CI
	$(MAKE) --no-print-directory test-mpi MPI_RANKS=2

## test-long: what `make test` leaves to CI: the torchtitan tests again with torchtitan 0.2.2
## (one and two ranks) and the multi-rank tests under mpirun -n 4
test-long: native mpi
	$(WITH_TITAN02) timeout 900 $(PY) -m pytest -q -p no:cacheprovider $(TITAN_TESTS)
	$(WITH_TITAN02) $(MPIRUN) -x PYTHONPATH -n 2 $(PY) -m pytest -q --color=no -p no:cacheprovider \
		--with-mpi tests/integrations/test_torchtitan_integration.py
	$(MAKE) --no-print-directory test-mpi MPI_RANKS=4

## test-newest-torch: the single-process suite under NEWEST_TORCH (default the newest release) in
## $(NEWEST_VENV), with the package of this tree (CI runs it after `make test`)
test-newest-torch: native $(NEWEST_VENV)/.setup-done
	$(NEWEST_PY) -c 'import torch; print("torch", torch.__version__)'
	PYTHONPATH=$(CURDIR) timeout 1500 $(NEWEST_PY) -m pytest -q tests

## test-mpi: the multi-rank tests under mpirun with each of MPI_RANKS ranks (default 2 and 4)
MPI_RANKS ?= 2 4
test-mpi: native mpi
	for n in $(MPI_RANKS); do $(MPIRUN) -n $$n $(PY) -m pytest -q --color=no -p no:cacheprovider \
		--with-mpi $(MPI_TESTS) || exit 1; done

## fuzz: a long campaign of the differential test against DCP (tests/helpers/oracle.py):
## FUZZ_SEEDS seeds through every save path, on 1, 2 and 4 ranks; a failure names its seed
fuzz: native mpi
	DCP_ORACLE_SEEDS=$(FUZZ_SEEDS) timeout $(FUZZ_TIMEOUT) $(FUZZ_PYTEST) tests/jobs/test_dcp_oracle.py
	for n in 2 4; do DCP_ORACLE_SEEDS=$(FUZZ_SEEDS) $(MPI_ENV) timeout $(FUZZ_TIMEOUT) \
		mpirun --oversubscribe -x DCP_ORACLE_SEEDS -n $$n $(FUZZ_PYTEST) --with-mpi \
		tests/mpi/test_dcp_oracle_mpi.py || exit 1; done

## test-package: build the sdist and wheel, install them (and `pip install .`) into fresh venvs
## and save and load through io_uring with each (CI runs it after `make test`)
test-package: setup
	PYTHON=$(PYTHON) TORCH="$(TORCH)" BUILD_PYTHON=$(abspath $(PY)) .ci/check_package.sh

## lint: ruff, and mypy over the package ([tool.mypy] in pyproject.toml): a type error fails
## `make test`
lint: setup
	$(PY) -m ruff check .
	$(PY) -m mypy dcp_datastates

## bench: CPU benchmark against DCP's FileSystemWriter/Reader (writes benchmarks/out/)
bench: native
	$(PY) benchmarks/bench_cpu.py

## faults: the fault campaign, 50 trials of each kind (saves, persists, exports and two-rank
## replication killed with SIGKILL at random points; full memory and durable tiers on a small
## tmpfs: root only); prints its table, fails on any failure (tens of minutes on 2 cores)
FAULT_TRIALS ?= 50
faults: native
	timeout 7200 $(PY) benchmarks/fault_campaign.py --trials $(FAULT_TRIALS)

clean:
	rm -rf build dist dcp_datastates/_lib benchmarks/out .pytest_cache

distclean: clean
	rm -rf $(VENV) $(NEWEST_VENV)
