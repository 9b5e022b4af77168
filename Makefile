# Two entry points: `make serve` and `make test`. Both set up .venv from scratch when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8080
MODEL ?= smollm2-135m
AARCH64_TOOLS := g++-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
export DEBIAN_FRONTEND := noninteractive

.PHONY: serve test test-tools setup clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[test,ray]'
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/stratum pull $(MODEL)
	$(VENV)/bin/stratum serve --model $(MODEL) --host $(HOST) --port $(PORT)

test: $(STAMP) test-tools
	$(VENV)/bin/ruff check .
	$(VENV)/bin/stratum pull $(MODEL)
	$(PY) -m pytest -q

# What some tests need from apt, installed when missing and make runs as root; otherwise those tests
# skip and say why. qemu runs the aarch64 build directly, so qemu-user's binfmt registration is not needed;
# SIMDe's headers run the AVX-512 kernels on a CPU without AVX-512 (tests/csrc/avx512_emulated.h).
test-tools:
	@command -v chromium >/dev/null || [ "$$(id -u)" != 0 ] || (apt-get install -y -q chromium >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1)) || \
		echo "no chromium: the console's browser tests will be skipped"
	@{ command -v aarch64-linux-gnu-g++ && command -v qemu-aarch64; } >/dev/null || [ "$$(id -u)" != 0 ] || \
		(apt-get install -y -q --no-install-recommends $(AARCH64_TOOLS) >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends $(AARCH64_TOOLS) >/dev/null 2>&1)) || \
		echo "no aarch64 cross compiler or qemu: the NEON kernel test will be skipped"
	@[ -f /usr/include/simde/x86/avx512.h ] || [ "$$(id -u)" != 0 ] || \
		(apt-get install -y -q --no-install-recommends libsimde-dev >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends libsimde-dev >/dev/null 2>&1)) || \
		echo "no SIMDe: the AVX-512 kernels will not be run on this CPU without AVX-512"

clean:
	rm -rf $(VENV) build *.egg-info
