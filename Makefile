# The Makefile only wraps set-up, build, test, demo and bench.
# Everything bootstraps itself: a virtual environment in .venv, the Python
# packages from PyPI, the system tools (iproute2, nftables, iperf3) with apt-get.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEPS   := $(VENV)/.deps-stamp
BUILT  := $(VENV)/.build-stamp
PYDEPS := meson-python meson ninja Cython click rich numpy pytest ruff scapy pyroute2 matplotlib
# The torch extra (pyproject's optional-dependencies "torch"), for mrc.torch and its tests.
# Pinned to the CPU wheel the machines have on disk: an unpinned torch downloads GBs of CUDA.
TORCH  := $(VENV)/.torch-stamp
TORCH_PIN := torch==2.13.0

.PHONY: all build demo test test-py test-c asan asan-py fuzz-short lint sysdeps bench gpu-check clean

all: build

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(DEPS): pyproject.toml | $(PY)
	$(PY) -m pip install -q $(PYDEPS)
	touch $@

# Its own stamp, so venvs made before the extra existed get it on their next `make test`.
$(TORCH): pyproject.toml | $(DEPS)
	$(PY) -m pip install -q $(TORCH_PIN)
	touch $@

# Editable install: meson-python rebuilds the C core and the Cython binding
# on import whenever a source changed.
# Other users of a root-built venv import the build as it stands (they cannot
# write the build directory): tools/mrc_shared_build.py.
SITE = $(shell $(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
$(BUILT): $(DEPS) meson.build src_c/meson.build pyproject.toml tools/mrc_shared_build.py
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	cp tools/mrc_shared_build.py $(SITE)/_mrc_shared_build.py
	echo "import _mrc_shared_build; _mrc_shared_build.apply()" > $(SITE)/mrc-shared-build.pth
	touch $@

build: $(BUILT)
	$(PY) -c "import mrc; print('mrc', mrc.__version__, 'built')"

# System tools the namespace fabric, the tests and the benchmarks use.
SYSTOOLS := ip:iproute2 nft:nftables iperf3:iperf3 tc:iproute2 clang:clang tcpdump:tcpdump setpriv:util-linux
sysdeps:
	@missing=""; for t in $(SYSTOOLS); do cmd=$${t%%:*}; pkg=$${t##*:}; \
	  command -v $$cmd >/dev/null 2>&1 || missing="$$missing $$pkg"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing:$$missing"; apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "note: missing system tools:$$missing (namespace tests will skip)"; fi; \
	fi

demo: build sysdeps
	$(PY) tools/demo.py

test: build sysdeps asan fuzz-short lint test-py

test-py: build $(TORCH)
	$(PY) -m pytest -q -ra tests

# The C core on its own, under AddressSanitizer + UndefinedBehaviorSanitizer.
asan:
	$(MAKE) -C src_c asan-test

# The whole Python suite with the binding and the C core it links built under
# AddressSanitizer + UBSan (the interpreter preloads their runtimes, and libstdc++ so that
# C++ extensions' exceptions work under ASan). About 10 minutes on 2 cores, so not part of
# `make test`; the build directory goes back to its plain build afterwards.
PYBUILD = build/cp$(shell $(PY) -c "import sys; print('%d%d' % sys.version_info[:2])")
asan-py: build $(TORCH)
	$(VENV)/bin/meson configure $(PYBUILD) -Db_sanitize=address,undefined -Db_lundef=false
	LD_PRELOAD="$$($(CC) -print-file-name=libasan.so) $$($(CC) -print-file-name=libstdc++.so.6)" \
	  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  $(PY) -m pytest -q -ra tests; rc=$$?; \
	  $(VENV)/bin/meson configure $(PYBUILD) -Db_sanitize=none -Db_lundef=true; exit $$rc

# A short libFuzzer run on the receive path (20 s); `make -C src_c fuzz` runs longer.
fuzz-short:
	$(MAKE) -C src_c fuzz-short

test-c:
	$(MAKE) -C src_c test

lint: $(DEPS)
	$(VENV)/bin/ruff check mrc tests tools benchmarks examples
	$(VENV)/bin/ruff format --check mrc tests tools benchmarks examples

bench: build sysdeps
	$(PY) benchmarks/loopback_bw.py

# On a machine with a CUDA device and torch (a lent GPU machine): builds mrc in-tree
# with meson, runs the GPU tests and the GPU benchmark (tools/gpu_check.sh).
gpu-check:
	tools/gpu_check.sh

clean:
	rm -rf build builddir src_c/build
	$(MAKE) -C src_c clean
