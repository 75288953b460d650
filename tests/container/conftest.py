"""Fixtures of the container tests: Podman, a base image made here, wheels, Stadium's image.

There is no container registry on the test machines, so the base image is made here, once, and
kept in Podman's storage (`localhost/stadium-test-base:SUITE`, rebuilt only when missing):
`debootstrap --variant=minbase --include=python3,python3-venv SUITE` + `podman import`.
Stadium goes into images from wheels built on the host: the working tree's (uv, each session)
and its dependencies' for the base's Python and glibc (pip download, cached under
/var/cache/stadium-tests/wheels-KEY, KEY = the dependency list and the base's Python). A warm
run builds only Stadium's image; it and every container a test starts are removed afterwards.

The suite is Debian's stable (trixie, Python 3.13) by default; STADIUM_TEST_BASE_SUITE=bookworm
tests Python 3.11. Skips, with the reason (`pytest -ra`): not root, no Podman or debootstrap
after `scripts/install-container-deps.sh`, or Podman unable to run a container here.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from stadium.deploy.podman import build_image
from tests.conftest import UNIT

ROOT = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = ROOT / "scripts" / "install-container-deps.sh"
SUITE = os.environ.get("STADIUM_TEST_BASE_SUITE", "trixie")
MIRROR = os.environ.get("STADIUM_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE = f"localhost/stadium-test-base:{SUITE}"
CACHE = Path(os.environ.get("STADIUM_TEST_CACHE", "/var/cache/stadium-tests"))
#: The images a run builds, tagged with its pid (removed afterwards, or by the next run).
TEST_IMAGE = "localhost/stadium-test"
INIT_IMAGE = "localhost/stadium-test-init"
#: What a `stadium init` project's build needs beside Stadium's dependencies (its backend).
BUILD_BACKEND = ("hatchling>=1.24",)


def _run(cmd: list[str], limit: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=limit * UNIT, check=False)


def _must(cmd: list[str], limit: float) -> str:
    out = _run(cmd, limit)
    if out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{(out.stdout + out.stderr)[-3000:]}")
    return out.stdout


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """One test run at a time builds a cached thing (another waits, then reuses it)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / f"{name}.lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _image_exists(podman: str, image: str) -> bool:
    return _run([podman, "image", "exists", image], 60).returncode == 0


def _make_base(podman: str) -> None:
    """debootstrap a minimal Debian with Python into a temporary directory, import it."""
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        pytest.skip(f"debootstrap is missing (needed once for {BASE}); see {INSTALL_SCRIPT}")
    with tempfile.TemporaryDirectory(prefix="stadium-base-", dir="/var/tmp") as tmp:
        rootfs = Path(tmp) / "rootfs"
        cmd = [
            debootstrap, "--variant=minbase", "--include=python3,python3-venv",
            SUITE, str(rootfs), MIRROR,
        ]  # fmt: skip
        out = _run(cmd, 600)
        if out.returncode != 0:
            log = (out.stdout + out.stderr)[-1500:]
            pytest.skip(f"debootstrap {SUITE} failed (mirror {MIRROR}):\n{log}")
        tar = subprocess.Popen(
            ["tar", "-C", str(rootfs), "--exclude=./var/cache/apt/archives/*.deb",
             "--exclude=./var/lib/apt/lists/*", "-c", "."],
            stdout=subprocess.PIPE,
        )  # fmt: skip
        try:
            imported = subprocess.run(
                [podman, "import", "--change", 'CMD ["/bin/bash"]', "-", BASE],
                stdin=tar.stdout, capture_output=True, text=True, timeout=300 * UNIT, check=False,
            )  # fmt: skip
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            tar.wait(60 * UNIT)
        if imported.returncode != 0:
            raise AssertionError(f"podman import failed:\n{imported.stderr[-2000:]}")


@pytest.fixture(scope="session")
def podman() -> str:
    """Podman's path, once it is known to run containers here."""
    if os.geteuid() != 0:
        pytest.skip("the container tests need root (Podman's storage and networking)")
    _run(["bash", str(INSTALL_SCRIPT)], 600)  # quick when done: installs, writes the drop-in
    exe = shutil.which("podman")
    if exe is None:
        pytest.skip(f"Podman is not installed; see {INSTALL_SCRIPT}")
    info = _run([exe, "info", "--format", "json"], 60)
    if info.returncode != 0:
        pytest.skip(f"podman info failed: {info.stderr.strip()[-500:]}")
    _remove_stale(exe)
    return exe


def _remove_stale(podman: str) -> None:
    """Images a crashed run left (tagged with its pid, now dead), and their containers."""
    out = _run([podman, "images", "--format", "{{.Repository}}:{{.Tag}}"], 60).stdout
    for image in out.split():
        repo, _, tag = image.rpartition(":")
        if repo in (TEST_IMAGE, INIT_IMAGE) and tag.isdigit() and not _alive(int(tag)):
            _run([podman, "rmi", "--force", "--ignore", image], 120)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@pytest.fixture(scope="session")
def base_image(podman: str) -> str:
    """The cached base image (made on first use), checked to run a container."""
    if not _image_exists(podman, BASE):
        with _locked("base"):
            if not _image_exists(podman, BASE):
                _make_base(podman)
    probe = _run([podman, "run", "--rm", "--network", "none", BASE, "python3", "-c", "1"], 120)
    if probe.returncode != 0:
        pytest.skip(f"Podman cannot run a container here: {probe.stderr.strip()[-800:]}")
    return BASE


def _base_python(podman: str, base: str) -> tuple[str, str, str]:
    """The base's Python version (3.13), glibc version (2.41) and machine (x86_64)."""
    code = (
        "import json, platform, sys; print(json.dumps(['%d.%d' % sys.version_info[:2], "
        "platform.libc_ver()[1], platform.machine()]))"
    )
    py, libc, machine = json.loads(
        _must([podman, "run", "--rm", "--network", "none", base, "python3", "-c", code], 120)
    )
    return str(py), str(libc), str(machine)


def _platforms(libc: str, machine: str) -> list[str]:
    """Every manylinux tag a glibc of this version runs (pip download does not expand them)."""
    major, minor = (int(x) for x in libc.split(".")[:2])
    tags = [f"manylinux_{major}_{m}_{machine}" for m in range(minor, 16, -1)]
    return [*tags, f"manylinux2014_{machine}"]


def _dependency_wheels(podman: str, base: str) -> Path:
    """Wheels of Stadium's dependencies (and a project's build backend) for the base's Python:
    downloaded once per dependency list and Python, then reused."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    py, libc, machine = _base_python(podman, base)
    key_text = json.dumps([sorted(deps), BUILD_BACKEND, py, libc, machine])
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    final = CACHE / f"wheels-{key}"
    if final.is_dir():
        return final
    with _locked("wheels"):
        if final.is_dir():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".wheels-{key}-", dir=CACHE))
        abi = "cp" + py.replace(".", "")
        cmd = [
            sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
            "--dest", str(tmp), "--only-binary=:all:", "--python-version", py,
            "--implementation", "cp", "--abi", abi,
            *(f"--platform={p}" for p in _platforms(libc, machine)),
            *deps, *BUILD_BACKEND,
        ]  # fmt: skip
        out = _run(cmd, 600)
        if out.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            text = out.stdout + out.stderr
            if "Could not fetch" in text or "NewConnectionError" in text:
                pytest.skip(f"the package index is unreachable: {text[-300:]}")
            raise AssertionError(f"pip download failed:\n{text[-3000:]}")
        (tmp / "KEY.json").write_text(key_text)
        os.replace(tmp, final)
    return final


@pytest.fixture(scope="session")
def wheels_dir(podman: str, base_image: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of wheels: the working tree's stadium-rl and every dependency's."""
    deps = _dependency_wheels(podman, base_image)
    out = tmp_path_factory.mktemp("wheels")
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv is None:
        pytest.skip("needs uv (the dev extra) to build the working tree's wheel")
    _must([uv, "build", "--wheel", "--out-dir", str(out), str(ROOT)], 300)
    for whl in deps.glob("*.whl"):
        os.link(whl, out / whl.name)
    assert len(list(out.glob("stadium_rl-*.whl"))) == 1
    return out


@pytest.fixture(scope="session")
def stadium_image(podman: str, base_image: str, wheels_dir: Path) -> Iterator[str]:
    """Stadium's image (the repository's Containerfile) from the working tree's wheels."""
    tag = f"{TEST_IMAGE}:{os.getpid()}"
    try:
        yield build_image(tag, base=base_image, wheels_dir=wheels_dir, pull="never", layers=False)
    finally:
        _run([podman, "rmi", "--force", "--ignore", tag], 120)
