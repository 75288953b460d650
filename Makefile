# Stadium: every target does its own set-up from a fresh clone.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
# Prefer a 3.12 interpreter (eager tasks); any Python >= 3.11 works.
PYTHON ?= $(shell for p in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 python3.13 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && { command -v $$p; break; }; done)

.PHONY: install demo test lint typecheck check bench-goals trainers clean cluster-deps browser-deps k8s-deps container-deps sandbox-deps vm-deps record-deps

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON)" || { echo "error: no Python >= 3.11 found; install one and re-run" >&2; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip uv
	PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 VIRTUAL_ENV=$(VENV) $(VENV)/bin/uv pip install --quiet -e '.[dev]'
	@touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/stadium demo

# Every performance goal, stadium / floor / openenv side by side (~10 minutes).
bench-goals: install
	$(VENV)/bin/stadium bench goals --output-dir bench-results/goals

# Style, then the architecture: the import contracts in pyproject.toml ([tool.importlinter]).
lint: install
	$(VENV)/bin/ruff check src tests examples
	$(VENV)/bin/ruff format --check src tests examples
	$(VENV)/bin/lint-imports --no-logo

typecheck: install
	$(VENV)/bin/mypy

# The inner loop while working (~1 minute on 2 cores): style and contracts, then every test not
# marked slow (no subprocess servers, clusters, containers, browsers, fresh venvs), on two
# processes (pytest-xdist). `make test` runs them all, in one process.
check: lint
	$(PY) -m pytest -q -m "not slow" -x -n 2

# The emulated cluster's packages (SLURM, munge, HAProxy) for tests/cluster: installed when
# root and missing, a no-op otherwise (the cluster tests then skip with the reason).
cluster-deps:
	@bash scripts/install-cluster-deps.sh

# Headless Chromium for the page tests (tests/test_pages.py): Debian's chromium, driven by
# Playwright (dev extra); installed when root and missing, a no-op otherwise (they then skip).
browser-deps:
	@bash scripts/install-browser-deps.sh

# Podman, runc and debootstrap for the container tests (tests/container), and the Podman settings
# these machines need (a drop-in under /etc/containers/containers.conf.d/); installed when root
# and missing, a no-op otherwise (they then skip).
container-deps:
	@bash scripts/install-container-deps.sh

# Go for the Gateway API CRD checks (tests/test_kubernetes.py): Debian's golang-go, installed when
# root and no `go` is on PATH, a no-op otherwise (those checks then skip with the reason).
k8s-deps:
	@bash scripts/install-k8s-deps.sh

# bubblewrap, libseccomp and the network tools for sandboxed sessions (--isolation sandbox;
# tests/isolation): Debian's bubblewrap, libseccomp2 (the seccomp filter's C library; without it
# the sandbox refuses to start), nftables, iproute2, util-linux,
# installed when root and missing, a no-op otherwise (the sandbox tests then skip with the reason).
# Then the sandbox's native init (native/stadium-init: pid 1 of each sandboxed session's pid
# namespace, ~0.1 MiB where a forked interpreter holds ~0.8), built with cargo when there is one
# (without it the sandbox runs the same loop in Python and says so at start).
sandbox-deps:
	@bash scripts/install-debs.sh sandbox-deps tests/isolation bwrap:bubblewrap nft:nftables ip:iproute2 nsenter:util-linux \
		libseccomp.so.2:libseccomp2
	@# execute-only for others: the kernel makes a process executing a file it cannot read
	@# undumpable from the start (the sandbox uses no copy others may read)
	@bash scripts/build-native.sh stadium-init src/stadium/_server/isolation/stadium-init 0711 \
		"sandboxed sessions' pid 1 stays a forked interpreter (~0.8 MiB more)" --offline \
		$(if $(filter test,$(MAKECMDGOALS)),--test)

# The native --record writer (native/stadium-record-writer: reads a worker's recording pipe and
# writes its Parquet shards; arrow-rs from crates.io, 1.5–3 min the first build on 2 cores), built with cargo
# when there is one (without it the Python writer writes the shards and says so once); and the
# recording's step buffer (native/stadium-record-buffer: a CPython extension, PyO3, the stable ABI;
# without it the loop copies steps in Python and says so once).
record-deps:
	@bash scripts/build-native.sh stadium-record-writer src/stadium/_server/ledger/stadium-record-writer 0755 \
		"--record's shards are written by the Python writer" $(if $(filter test,$(MAKECMDGOALS)),--test)
	@PYO3_PYTHON=$(abspath $(PY)) bash scripts/build-native.sh stadium-record-buffer src/stadium/_server/ledger/_recordbuf.abi3.so 0644 \
		"--record's steps are copied in Python (~0.25 µs a step more)"

# QEMU, lz4 and a guest kernel for --isolation vm (tests/isolation/test_vm.py): Debian's
# qemu-system-x86, lz4 and linux-image-cloud-amd64, installed when root and missing.
vm-deps:
	@bash scripts/install-vm-deps.sh

test: install lint typecheck cluster-deps browser-deps k8s-deps container-deps sandbox-deps vm-deps record-deps
	$(PY) -m pytest -q -ra

# The trainers that pull torch (TRL), on CPU, against `stadium serve` (docs/TRAINERS.md):
# their own venv (.venv-trainers-heavy, ~5.7 GB from PyPI, made once), then a short real run;
# then NeMo Gym's resources-server glue in .venv-trainers-nemo (scripts/trainers-nemo-gym.py).
trainers: install
	bash scripts/run-trainers.sh

clean:
	rm -rf $(VENV) .venv-trainers .venv-trainers-heavy .venv-trainers-nemo .pytest_cache .mypy_cache .ruff_cache build dist
