# dcp_datastates — set-up, build, demo and tests on a fresh Debian machine (run as root, or with sudo).
PYTHON ?= python3
TORCH ?= torch==2.13.0
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT_PACKAGES := cmake gcc make liburing-dev openmpi-bin libopenmpi-dev
STAMP := build/.setup-done
MPIRUN := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 600 mpirun --oversubscribe
MPI_TESTS := tests/test_mpi.py tests/test_torchtitan_integration.py

.PHONY: setup native demo test test-mpi lint bench clean

## setup: install system packages, PyTorch (CPU wheel, pinned) and the package with its test tools
setup: $(STAMP)
$(STAMP): pyproject.toml
	@if ! dpkg -s $(APT_PACKAGES) >/dev/null 2>&1; then \
		$(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q $(APT_PACKAGES); fi
	$(PYTHON) -m pip install -q "$(TORCH)"
	$(PYTHON) -m pip install -q -e ".[test,bench]"
	$(PYTHON) -m pip install -q --no-deps torchtitan==0.3.0 spmd_types==0.2.3
	$(PYTHON) -m pip install -q tyro
	@mkdir -p build && touch $@

## native: build the io_uring shim (dcp_datastates/_lib/libdcp_uring.so), liburing linked statically
native: setup
	cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
	cmake --build build -j 2

## demo: train a small model with async checkpoints, resume from the last one and verify
demo: native
	$(PYTHON) examples/train_demo.py

## test: the whole suite (single-process tests, then multi-rank tests under mpirun -n 2 and -n 4)
test: native lint
	$(PYTHON) -m pytest -q tests
	$(MAKE) --no-print-directory test-mpi

test-mpi: native
	$(MPIRUN) -n 2 $(PYTHON) -m pytest -q --color=no -p no:cacheprovider --with-mpi $(MPI_TESTS)
	$(MPIRUN) -n 4 $(PYTHON) -m pytest -q --color=no -p no:cacheprovider --with-mpi $(MPI_TESTS)

lint: setup
	$(PYTHON) -m ruff check .

## bench: CPU benchmark against DCP's FileSystemWriter/Reader (writes benchmarks/out/)
bench: native
	$(PYTHON) benchmarks/bench_cpu.py

clean:
	rm -rf build dcp_datastates/_lib benchmarks/out .pytest_cache
