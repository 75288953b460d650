"""The guest of ``--isolation vm``: its kernel and its root filesystem, built on the host.

The guest boots Debian's cloud kernel (``linux-image-cloud-amd64``, ``make vm-deps``) with
an initramfs built here, in Python, from the host's own files: no registry, no root
filesystem to download. The initramfs holds, at their host paths (so the worker's
``sys.path`` and the env's target mean the same inside):

- the interpreter the worker runs (its binary, the standard library without its tests,
  the shared libraries the worker has mapped, the dynamic loader);
- from every folder on the worker's ``sys.path``, the top-level packages the env's code
  and the guest's session loop import: listed by a clean interpreter of its own that
  imports them as the guest will (:func:`imported_files`: ``-P -S``, the worker's
  ``sys.path``, the target loaded), never from what the worker itself happens to have
  imported (a ``site-packages`` of 1 GiB gives the guest only what the env and Stadium
  use; a server embedded in a bigger program packs no more). A package the env imports
  only later, in a call, is not packed: its ``import`` fails in the guest;
- the four kernel modules the guest loads (``virtio``, ``virtio_ring``, ``virtio_mmio``,
  ``virtio_console``: the channel to the worker) and the guest's init
  (:mod:`.vmguest`).

The image is built once per set of files (a hash of their paths, sizes and mtimes names
it) into a cache folder only root reads (``0700``), and reused by every VM: restored
VMs share its pages through the snapshot's memory file (:mod:`.vm`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any, cast

from stadium._errors import ConfigError

#: Where built images are kept (one file per set of inputs).
CACHE_DIR = "/var/cache/stadium-vm"
#: Where the guest finds its init and its kernel modules.
GUEST_DIR = "/.stadium-vm"
#: The kernel modules the guest loads, in order (the channel to the worker).
MODULES = (
    "kernel/drivers/virtio/virtio_ring.ko",
    "kernel/drivers/virtio/virtio.ko",
    "kernel/drivers/virtio/virtio_mmio.ko",
    "kernel/drivers/char/virtio_console.ko",
)
#: Standard-library folders never packed (tests, GUI, build support).
_STDLIB_SKIP = frozenset(
    {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "site-packages",
     "pydoc_data", "unittest/test", "__phello__"}
)  # fmt: skip
#: The guest's init (:mod:`..template.vmguest`), copied into each image.
_GUEST = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "template", "vmguest.py"
)
#: Images kept in the cache (the newest; an older one is rebuilt if asked again).
KEEP_IMAGES = 4
#: The largest image built (MiB): past it, the env imports too much to pack.
MAX_IMAGE_MIB = 768
#: Seconds the clean interpreter listing the env's imports may take (:func:`imported_files`).
LIST_S = 120.0
#: The most bytes of its answer (a JSON list of files) or of its errors read.
LIST_MAX = 16 << 20
#: What that interpreter runs: the guest's own imports (:mod:`.vmguest`, :mod:`.vmchild`),
#: then the env's class loaded as :mod:`.vmchild` loads it; it prints every module's file.
_LIST_IMPORTS = """
import json, sys
settings = json.loads(sys.stdin.read())
sys.path[:] = settings["sys_path"]
from stadium._server.isolation.template import vmchild
vmchild.EnvSpec.of(vmchild.load_target(settings["target"], env_kwargs=settings["env_kwargs"]))
files = (getattr(m, "__file__", None) for m in list(sys.modules.values()))
files = sorted({f for f in files if isinstance(f, str)})
sys.stdout.write(json.dumps({"files": files, "path": sys.path}))
"""


def guest_kernel() -> tuple[str, str] | None:
    """The guest kernel's image and its modules' folder (``None``: not installed)."""
    for path in sorted(glob.glob("/boot/vmlinuz-*-cloud-amd64"), reverse=True):
        version = os.path.basename(path)[len("vmlinuz-") :]
        modules = f"/lib/modules/{version}"
        if all(os.path.isfile(os.path.join(modules, m)) for m in MODULES):
            return path, modules
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class GuestImage:
    """A built guest: its kernel, its initramfs, and the command line that runs the init."""

    kernel: str
    initrd: str
    python: str
    initrd_mib: int = 0
    """The initramfs's size: the guest's RAM holds it unpacked (added to its memory)."""

    def cmdline(self, extra: str = "") -> str:
        """The guest kernel's command line: quiet, a panic ends the VM (``panic=-1`` with
        QEMU's ``-no-reboot``), the init is the interpreter running :mod:`.vmguest`."""
        return (
            "console=hvc0 quiet loglevel=1 panic=-1 oops=panic nomodeset init_on_alloc=0 "
            "tsc=reliable no_timer_check random.trust_cpu=on nokaslr "
            f"{extra} rdinit={self.python} -- -P -S {GUEST_DIR}/vmguest.py"
        )


def vmlinux(kernel: str, cache_dir: str) -> str:
    """The uncompressed kernel (an ELF QEMU boots directly, PVH: no firmware, no real mode)
    from Debian's ``vmlinuz`` (LZ4 inside), made once in ``cache_dir``; the ``vmlinuz``
    itself when ``lz4`` is missing or finds no payload."""
    out = os.path.join(cache_dir, os.path.basename(kernel).replace("vmlinuz", "vmlinux"))
    if os.path.exists(out):
        return out
    with open(kernel, "rb") as f:
        data = f.read()
    start = data.find(b"\x02\x21\x4c\x18")  # the legacy LZ4 frame the kernel uses
    if start < 0 or shutil.which("lz4") is None:
        return kernel
    try:
        done = subprocess.run(
            ["lz4", "-dc"], input=data[start:], capture_output=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return kernel
    if not done.stdout.startswith(b"\x7fELF"):
        return kernel
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".vmlinux-")
    with os.fdopen(fd, "wb") as f:
        f.write(done.stdout)
    os.replace(tmp, out)
    return out


def _shared_libraries() -> list[str]:
    """The shared objects this process has mapped (libpython, libc, extensions' libraries)."""
    found: set[str] = set()
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/") and ".so" in parts[5]:
                found.add(parts[5].strip())
    return sorted(p for p in found if os.path.isfile(p))


def _needed(objects: list[str]) -> set[str]:
    """The shared libraries ``objects`` (extension modules) load (``ldd``'s answer)."""
    found: set[str] = set()
    for start in range(0, len(objects), 200):
        try:
            out = subprocess.run(
                ["ldd", *objects[start : start + 200]], capture_output=True, text=True,
                timeout=60, check=False,
            ).stdout  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            continue
        for line in out.splitlines():
            _name, arrow, rest = line.partition("=>")
            path = rest.split("(")[0].strip() if arrow else ""
            if path.startswith("/") and os.path.isfile(path):
                found.add(path)
    return found


def imported_files(
    sys_path: list[str], target: str, env_kwargs: dict[str, Any] | None
) -> tuple[list[str], list[str]]:
    """The files of every module the guest imports before its session: those a clean
    interpreter (the worker's, ``-P -S``, ``sys.path`` set to ``sys_path`` as the guest
    sets it) has imported once it has loaded ``target`` as :mod:`.vmchild` loads it; and
    its ``sys.path`` then (a file target's folder added to it, as the guest's will be).

    Raises:
        ConfigError: the target does not load that way (the end of its error said).
    """
    settings = json.dumps({"sys_path": sys_path, "target": target, "env_kwargs": env_kwargs})
    argv = [sys.executable, "-P", "-S", "-c", _LIST_IMPORTS]
    try:
        done = subprocess.run(
            argv, input=settings.encode(), capture_output=True, timeout=LIST_S, check=False,
            cwd="/",
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"loading the env's code to list its imports took over {LIST_S:g} s"
        ) from None
    if done.returncode != 0 or len(done.stdout) > LIST_MAX:
        said = done.stderr[-2048:].decode("utf-8", "backslashreplace").strip()
        raise ConfigError(
            f"the env's code does not load as an --isolation vm guest loads it (a clean "
            f"interpreter, the worker's sys.path; exit {done.returncode}): {said}"
        )
    said = json.loads(done.stdout)
    lists = [said.get(k) if isinstance(said, dict) else None for k in ("files", "path")]
    if not all(isinstance(x, list) and all(isinstance(f, str) for f in x) for x in lists):
        raise ConfigError("the list of the env's imports is not two lists of paths")
    files, path = cast(list[list[str]], lists)
    return files, [os.path.abspath(p) for p in path if p]


def _package_roots(sys_path: list[str], modules: list[str]) -> list[str]:
    """The files and folders to pack from ``sys_path``: for each of ``modules`` (files)
    in one of its folders, that module's top-level package (or file)."""
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    folders = sorted({os.path.realpath(p) for p in sys_path if os.path.isdir(p)}, key=len)
    roots: set[str] = set()
    for file in modules:
        real = os.path.realpath(file)
        for folder in reversed(folders):  # the deepest folder holding it
            if real.startswith(folder + os.sep):
                if folder == stdlib:
                    break  # packed whole
                top = real[len(folder) + 1 :].split(os.sep)[0]
                roots.add(os.path.join(folder, top))
                break
    return sorted(roots)


def _walk(root: str, skip: frozenset[str] = frozenset()) -> Iterator[str]:
    if os.path.isfile(root):
        yield root
        return
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        dirnames[:] = [d for d in dirnames if os.path.normpath(os.path.join(rel, d)) not in skip]
        for name in filenames:
            if not name.endswith((".pyi", ".a", ".exe")):
                yield os.path.join(dirpath, name)


def image_files(sys_path: list[str], modules: list[str]) -> list[str]:
    """Every host file the guest's initramfs holds (see the module docstring); ``modules``:
    the files of the modules the guest imports, ``sys_path`` its path once it has
    (:func:`imported_files`)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files: set[str] = set(_walk(stdlib, _STDLIB_SKIP))
    files.update(f for f in _walk(stdlib) if "/config-" in f and f.endswith("Makefile"))
    dynload = os.path.join(stdlib, "lib-dynload")
    files.update(_walk(dynload))
    for root in _package_roots(sys_path, modules):
        files.update(_walk(root))
    files.update(_shared_libraries())
    files.update(_needed([f for f in files if ".so" in os.path.basename(f)]))
    files.add(os.path.realpath(sys.executable))
    files.update(glob.glob("/lib64/ld-linux-x86-64.so.*"))
    return sorted(files)


class _Cpio:
    """An initramfs being written (the ``newc`` cpio format the kernel unpacks)."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.ino = 1
        self.dirs: set[str] = set()

    def _entry(self, name: str, mode: int, data: bytes, mtime: int = 0) -> None:
        name_b = name.lstrip("/").encode() + b"\0"
        self.ino += 1
        header = "070701" + "".join(
            f"{v:08X}"
            for v in (self.ino, mode, 0, 0, 1, mtime, len(data), 0, 0, 0, 0, len(name_b), 0)
        )
        self.out.write(header.encode() + name_b)
        self.out.write(b"\0" * ((4 - (110 + len(name_b)) % 4) % 4))
        self.out.write(data)
        self.out.write(b"\0" * ((4 - len(data) % 4) % 4))

    def folder(self, path: str) -> str:
        """Make the folder ``path`` as the host has it: a component that is a symbolic link
        on the host (``/lib64`` -> ``usr/lib64``) is that link here too, and the folder is
        made where it points. Returns where it is."""
        here = ""
        for part in path.strip("/").split("/"):
            if not part:
                continue
            there = f"{here}/{part}"
            if os.path.islink(there):
                if there not in self.dirs:
                    self.dirs.add(there)
                    self._entry(there, stat.S_IFLNK | 0o777, os.readlink(there).encode())
                there = self.folder(os.path.realpath(there))
            elif there not in self.dirs:
                self.dirs.add(there)
                self._entry(there, stat.S_IFDIR | 0o755, b"")
            here = there
        return here

    def file(self, path: str, data: bytes, mode: int = 0o644, mtime: int = 0) -> None:
        where = self.folder(os.path.dirname(path))
        self._entry(f"{where}/{os.path.basename(path)}", stat.S_IFREG | mode, data, mtime)

    def link(self, path: str, target: str) -> None:
        where = self.folder(os.path.dirname(path))
        self._entry(f"{where}/{os.path.basename(path)}", stat.S_IFLNK | 0o777, target.encode())

    def end(self) -> None:
        self._entry("TRAILER!!!", 0, b"")


def _inputs_key(files: Iterable[str], kernel: str) -> str:
    digest = hashlib.sha256(kernel.encode())
    here = _GUEST
    for path in [*files, here]:
        try:
            st = os.stat(path)
        except OSError:
            continue
        digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:24]


def build_image(
    sys_path: list[str],
    target: str,
    env_kwargs: dict[str, Any] | None = None,
    cache_dir: str = CACHE_DIR,
) -> GuestImage:
    """The guest image for this process's interpreter and the code ``target`` imports
    (built now, or found in ``cache_dir``).

    Raises:
        ConfigError: no guest kernel installed, the target does not load in a clean
            interpreter, or the image would be too large.
    """
    found = guest_kernel()
    if found is None:
        raise ConfigError(
            "--isolation vm needs a guest kernel: make vm-deps (apt-get install "
            "linux-image-cloud-amd64)"
        )
    kernel, modules = found
    imported, guest_path = imported_files(sys_path, target, env_kwargs)
    files = image_files(guest_path, imported)
    key = _inputs_key(files, kernel)
    os.makedirs(cache_dir, mode=0o700, exist_ok=True)
    os.chmod(cache_dir, 0o700)
    initrd = os.path.join(cache_dir, f"initrd-{key}.cpio")
    python = os.path.realpath(sys.executable)
    if os.path.exists(initrd):
        return GuestImage(vmlinux(kernel, cache_dir), initrd, python, _mib(initrd))
    total = sum(os.path.getsize(f) for f in files)
    if total > MAX_IMAGE_MIB << 20:
        raise ConfigError(
            f"the guest image would hold {total >> 20} MiB of the worker's files (at most "
            f"{MAX_IMAGE_MIB}): the env imports too much for --isolation vm"
        )
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".initrd-")
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as out:
            cpio = _Cpio(out)
            done: set[str] = set()
            for folder in ("/dev", "/proc", "/sys", "/tmp", "/run", "/root", "/etc"):
                cpio.folder(folder)
            cpio.file("/etc/passwd", b"root:x:0:0:root:/root:/bin/false\n")
            cpio.file("/etc/hosts", b"127.0.0.1 localhost\n")
            for path in files:
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode):  # the link, the folders it names, its file
                    target = os.readlink(path)
                    cpio.link(path, target)
                    cpio.folder(os.path.dirname(os.path.join(os.path.dirname(path), target)))
                    path = os.path.realpath(path)
                    st = os.stat(path)
                if path in done:
                    continue
                done.add(path)
                with open(path, "rb") as f:
                    cpio.file(path, f.read(), st.st_mode & 0o755, int(st.st_mtime))
            for module in MODULES:
                with open(os.path.join(modules, module), "rb") as f:
                    cpio.file(f"{GUEST_DIR}/{os.path.basename(module)}", f.read())
            with open(_GUEST, "rb") as f:
                cpio.file(f"{GUEST_DIR}/vmguest.py", f.read())
            cpio.file(f"{GUEST_DIR}/image.json", json.dumps({"files": len(files)}).encode())
            cpio.end()
        os.replace(tmp, initrd)
    except BaseException:
        os.unlink(tmp)
        raise
    _prune(cache_dir, keep=KEEP_IMAGES)
    return GuestImage(vmlinux(kernel, cache_dir), initrd, python, _mib(initrd))


def _prune(cache_dir: str, keep: int) -> None:
    """Remove all but the ``keep`` newest images (a VM that maps one keeps it open)."""
    images = sorted(
        glob.glob(os.path.join(cache_dir, "initrd-*.cpio")), key=os.path.getmtime, reverse=True
    )
    for old in images[keep:]:
        with contextlib.suppress(OSError):
            os.unlink(old)


def _mib(path: str) -> int:
    return -(-os.path.getsize(path) // (1 << 20))
