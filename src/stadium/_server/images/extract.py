"""One layer blob (a tar, gzip- or zstd-compressed or not) into a directory overlayfs can use.

:func:`extract_layer` reads the blob once, as a stream: it checks the blob's ``sha256``
against the manifest's digest and the uncompressed tar's against the config's ``diff_id``
(a mismatch refuses the layer), and writes each entry below ``dest`` with ``*at`` calls from
directory descriptors opened with ``O_NOFOLLOW``, so that nothing a tar says can write outside:

* ``..`` in a name or a hard link's target: the layer is refused;
* absolute names (``/etc/x``): contained, taken relative to the layer's root (as OCI says);
* a parent that is a symlink (``a -> /etc`` then ``a/passwd``): refused (never followed);
* a hard link to a file not earlier in this layer (``/etc/shadow``): refused;
* device nodes: skipped (a layer cannot hand a session a device); FIFOs are made;
* extended attributes: only ``user.*`` and ``security.capability``; ``trusted.*`` (overlayfs'
  own: opaque, redirect, metacopy) never comes from a tar;
* a name over 255 bytes or a path over 4095 (Linux's limits): refused;
* a NUL byte in a name, a link's target or an attribute's name: refused;
* a tar header (PAX records, a GNU long name, a sparse map) over :data:`MAX_HEADER_BYTES`:
  refused before it is read whole (a few KiB of gzip would otherwise make GiB of memory),
  and so is more than :data:`MAX_TRAILING_BYTES` of data after the tar's end;
* setuid/setgid bits are kept (the image as built; the cache root is 0700 and sessions run
  with ``no_new_privs``, under which they grant nothing);
* owners, modes and times as the tar says (the store runs as root).

OCI whiteouts become overlayfs': ``.wh.NAME`` a 0/0 character device ``NAME`` (unless this
layer has ``NAME`` itself), ``.wh..wh..opq`` the ``trusted.overlay.opaque=y`` attribute on its
directory. Directories' modes and times are set last, deepest first.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import stat
import tarfile
import zlib
from collections.abc import Callable
from typing import IO, NamedTuple, Protocol

from stadium._errors import ConfigError

__all__ = ["LayerFacts", "extract_layer"]

CHUNK = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_FD_CACHE = 256
MAX_DEPTH = 128
"""The deepest entry a layer may have (each level is a descriptor while it is written)."""
MAX_HEADER_BYTES = 1 << 20
"""The most a layer's tar may read between one entry's data and the next entry (its PAX
records, GNU long names, sparse maps): tarfile holds all of it in memory."""
MAX_TRAILING_BYTES = 1 << 20
"""The most a layer may hold after its tar's end-of-archive (padding is a few KiB)."""
_NAME_MAX, _PATH_MAX = 255, 4095
_ENTRY_BYTES = 512
"""What an entry costs beside its data in the size accounting (its inode, roughly)."""
_KEPT_XATTRS = ("user.", "security.capability")
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class LayerFacts:
    """What extracting a layer found: its size and entry counts."""

    __slots__ = ("entries", "size_bytes", "skipped_devices")

    def __init__(self) -> None:
        self.size_bytes = 0
        self.entries = 0
        self.skipped_devices = 0


class _Reader(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


class _Hashing:
    """Reads through ``source`` and hashes what passes (``sha256`` of every byte read);
    counts the bytes, and refuses to read past ``stop`` (``stopped`` says why)."""

    def __init__(self, source: _Reader) -> None:
        self._source = source
        self.hash = hashlib.sha256()
        self.count = 0
        self.stop: int | None = None
        self.stopped = ""

    def read(self, n: int = -1, /) -> bytes:
        data = self._source.read(n)
        self.hash.update(data)
        self.count += len(data)
        if self.stop is not None and self.count > self.stop:
            raise ConfigError(self.stopped)
        return data

    def drain(self) -> None:
        while self.read(CHUNK):
            pass


class _Gunzip:
    """A gzip stream (one or several members), decompressed as read."""

    def __init__(self, source: _Reader) -> None:
        self._source = source
        self._z = zlib.decompressobj(wbits=31)
        self._buf = b""
        self._eof = False

    def read(self, n: int = -1, /) -> bytes:
        want = CHUNK if n < 0 else n
        while len(self._buf) < want and not self._eof:
            data = self._z.unconsumed_tail or self._source.read(CHUNK)
            if not data:
                self._eof = True
                break
            self._buf += self._z.decompress(data, CHUNK)
            if self._z.eof:
                rest = self._z.unused_data
                self._z = zlib.decompressobj(wbits=31)
                if rest:
                    self._buf += self._z.decompress(rest, CHUNK)
        out, self._buf = self._buf[:want], self._buf[want:]
        return out


def _zstd_reader(source: _Reader, what: str) -> _Reader:
    """A zstd stream decompressed as read, with an installed library (``compression.zstd``
    of Python 3.14, or ``zstandard``); without one, a ConfigError."""
    for module in ("compression.zstd", "zstandard"):
        try:
            lib = importlib.import_module(module)
        except ImportError:
            continue
        if module == "zstandard":
            reader: _Reader = lib.ZstdDecompressor().stream_reader(source)
        else:
            reader = lib.ZstdFile(source)
        return reader
    raise ConfigError(
        f"{what} is zstd-compressed and no zstd library is installed: install one "
        f"(pip install zstandard) or save the image with gzip or uncompressed layers "
        f"(podman save --format oci-dir writes uncompressed ones)"
    )


def extract_layer(
    blob: IO[bytes],
    dest: str,
    *,
    blob_digest: str,
    diff_id: str,
    what: str,
    limit_bytes: int | None = None,
    over_limit: str = "the image cache's budget: raise --image-cache-mib",
    limit_entries: int | None = None,
) -> LayerFacts:
    """Extract the layer ``blob`` into the new, empty directory ``dest``.

    Args:
        blob: the layer blob, as stored (compressed or not: told by its first bytes).
        dest: an existing empty directory (the caller's temporary one).
        blob_digest: the manifest's digest of the blob; diff_id: the config's digest of the
            uncompressed tar. Either not matching: a ConfigError.
        what: names the layer and the REF in errors.
        limit_bytes: refuse the layer past this many bytes (the cache's budget, or its
            disk's free space); over_limit: what that limit is and what to do, for the error;
            limit_entries: refuse the layer past this many entries (the disk's free inodes).

    Raises:
        ConfigError: a corrupt, unreadable or hostile layer (``dest`` is then left for the
            caller to remove).
    """
    raw = _Hashing(blob)
    head = raw.read(4)
    source: _Reader = _Unhashed(raw, head)  # the sniffed bytes given back, hashed once
    if head.startswith(_GZIP_MAGIC):
        tar_stream: _Reader = _Gunzip(source)
    elif head.startswith(_ZSTD_MAGIC):
        tar_stream = _zstd_reader(source, what)
    else:
        tar_stream = source
    tar_bytes = _Hashing(tar_stream)
    facts = LayerFacts()
    writer = _Writer(dest, what, facts, (limit_bytes, over_limit, limit_entries))
    tar_bytes.stop = MAX_HEADER_BYTES
    tar_bytes.stopped = (
        f"{what}: a tar header (PAX records, a long name or a sparse map) is over "
        f"{MAX_HEADER_BYTES >> 10} KiB: refused (a hostile or broken layer; rebuild the image)"
    )
    try:
        with tarfile.open(fileobj=tar_bytes, mode="r|") as tar:  # type: ignore[call-overload]
            while (member := tar.next()) is not None:
                tar.members.clear()  # tarfile keeps every entry read (its PAX records too)
                # its data, then at most MAX_HEADER_BYTES up to the next entry
                tar_bytes.stop = tar_bytes.count + max(0, member.size) + MAX_HEADER_BYTES
                writer.entry(member, tar.extractfile)
        tar_bytes.stop = tar_bytes.count + MAX_TRAILING_BYTES
        tar_bytes.stopped = (
            f"{what}: over {MAX_TRAILING_BYTES >> 10} KiB of data after the tar's end: "
            f"refused (a hostile or broken layer; rebuild the image)"
        )
        tar_bytes.drain()
        raw.drain()
        writer.finish()
    except (tarfile.TarError, zlib.error, EOFError) as exc:
        raise ConfigError(f"{what} is not a readable tar layer: {exc}") from None
    except OSError as exc:
        raise ConfigError(
            f"{what} cannot be extracted: {exc} (the store runs as root; is the cache's disk full?)"
        ) from None
    finally:
        writer.close()
    for name, want, got in (
        ("blob", blob_digest, raw.hash.hexdigest()),
        ("uncompressed tar (diff_id)", diff_id, tar_bytes.hash.hexdigest()),
    ):
        if want != f"sha256:{got}":
            raise ConfigError(
                f"{what}: its {name} has sha256:{got}, not {want} as the image says: the image "
                f"is corrupt or was changed; rebuild or re-save it"
            )
    return facts


class _Unhashed:
    """``raw``'s remaining bytes after ``head`` was read, ``head`` given back first."""

    def __init__(self, raw: _Hashing, head: bytes) -> None:
        self._raw = raw
        self._head = head

    def read(self, n: int = -1, /) -> bytes:
        if self._head:
            data, self._head = (self._head, b"") if n < 0 else (self._head[:n], self._head[n:])
            return data
        return self._raw.read(n)


def _no_nul(text: str, kind: str, what: str) -> str:
    if "\0" in text:
        raise ConfigError(f"{what}: {kind} {text[:200]!r} holds a NUL byte: refused")
    return text


def _parts(name: str, what: str) -> tuple[str, ...]:
    """A tar name as path components below the layer's root ("/" and "." dropped)."""
    _no_nul(name, "the entry", what)
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if len(name.encode("utf-8", "surrogateescape")) > _PATH_MAX or any(
        len(p.encode("utf-8", "surrogateescape")) > _NAME_MAX for p in parts
    ):
        raise ConfigError(
            f"{what}: the entry {name[:200]!r}... is longer than Linux allows ({_NAME_MAX} "
            f"bytes a name, {_PATH_MAX} a path): refused"
        )
    if len(parts) > MAX_DEPTH:
        raise ConfigError(f"{what}: the entry {name[:200]!r}... is over {MAX_DEPTH} deep: refused")
    if ".." in parts:
        raise ConfigError(f"{what}: the entry {name[:200]!r} escapes the layer (..): refused")
    return parts


class _Writer:
    """Writes entries below ``dest`` through cached directory descriptors (never following
    a symlink), then applies the directories' metadata."""

    def __init__(
        self, dest: str, what: str, facts: LayerFacts, limits: tuple[int | None, str, int | None]
    ) -> None:
        self._what = what
        self._facts = facts
        self._limit, self._over, self._max_entries = limits
        self._root = os.open(dest, _DIR_FLAGS)
        self._fds: dict[tuple[str, ...], int] = {}
        self._dirs: dict[tuple[str, ...], _DirMeta] = {}
        """Directories' metadata to set at the end (an entry removed since: skipped then)."""

    def close(self) -> None:
        self._drop_fds()
        os.close(self._root)

    def _drop_fds(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _dir(self, parts: tuple[str, ...], create: bool = True) -> int:
        """A descriptor of the directory ``parts`` (made, 0755 root, if missing and
        ``create``); a symlink or a file on the way refuses the layer."""
        if not parts:
            return self._root
        fd = self._fds.get(parts)
        if fd is not None:
            return fd
        parent = self._dir(parts[:-1], create)
        try:
            fd = os.open(parts[-1], _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise
            os.mkdir(parts[-1], 0o755, dir_fd=parent)
            fd = os.open(parts[-1], _DIR_FLAGS, dir_fd=parent)
        except OSError:
            raise ConfigError(
                f"{self._what}: {'/'.join(parts)[:200]!r} is used as a directory but is a "
                f"symlink or a file in this layer: refused"
            ) from None
        self._fds[parts] = fd
        return fd

    def _count(self, data_bytes: int) -> None:
        facts = self._facts
        facts.entries += 1
        facts.size_bytes += data_bytes + _ENTRY_BYTES
        if self._max_entries is not None and facts.entries > self._max_entries:
            raise ConfigError(
                f"{self._what} has more than {self._max_entries} entries, more than the "
                f"image cache's disk has inodes free (keeping 5% of them): free some, or prune "
                f"the cache (stadium images prune)"
            )
        if self._limit is not None and facts.size_bytes > self._limit:
            raise ConfigError(
                f"{self._what} takes more than {self._limit >> 20} MiB, {self._over} "
                f"(a decompression bomb stops here)"
            )

    def _clear(self, parent: int, parts: tuple[str, ...]) -> None:
        """Remove ``parts`` (what a later entry of the same name replaces)."""
        try:
            st = os.lstat(parts[-1], dir_fd=parent)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            n = len(parts)  # what was below it goes: its descriptors (few); its metadata
            for below in [p for p in self._fds if p[:n] == parts]:  # is skipped at the end
                os.close(self._fds.pop(below))
            shutil.rmtree(parts[-1], dir_fd=parent)
        else:
            os.unlink(parts[-1], dir_fd=parent)

    def entry(
        self, m: tarfile.TarInfo, extractfile: Callable[[tarfile.TarInfo], IO[bytes] | None]
    ) -> None:
        if len(self._fds) > _FD_CACHE:
            self._drop_fds()
        parts = _parts(m.name, self._what)
        if not parts:  # the layer's root ("./")
            if m.isdir():
                self._dirs[()] = _DirMeta.of(m, os.fstat(self._root).st_ino)
            return
        base = parts[-1]
        parent = self._dir(parts[:-1])
        if base == ".wh..wh..opq":
            os.setxattr(parent, "trusted.overlay.opaque", b"y")
            self._count(0)
            return
        if base.startswith(".wh."):
            self._whiteout(parent, base[4:], m.name)
            return
        if m.isdir():
            try:
                st = os.lstat(base, dir_fd=parent)
                if not stat.S_ISDIR(st.st_mode):
                    self._clear(parent, parts)
                    os.mkdir(base, 0o700, dir_fd=parent)
            except FileNotFoundError:
                os.mkdir(base, 0o700, dir_fd=parent)
            fd = self._dir(parts)
            self._dirs[parts] = _DirMeta.of(m, os.fstat(fd).st_ino)
            self._xattrs(fd, m)
            self._count(0)
        elif m.isreg():
            self._file(parent, parts, m, extractfile)
        elif m.issym():
            self._clear(parent, parts)
            os.symlink(_no_nul(m.linkname, "the symlink's target", self._what), base, dir_fd=parent)
            os.chown(base, m.uid, m.gid, dir_fd=parent, follow_symlinks=False)
            _utime(base, m, parent)
            self._count(len(m.linkname))
        elif m.islnk():
            self._hardlink(parent, parts, m)
        elif m.isfifo():
            self._clear(parent, parts)
            os.mkfifo(base, 0o600, dir_fd=parent)
            os.chown(base, m.uid, m.gid, dir_fd=parent, follow_symlinks=False)
            os.chmod(base, m.mode & 0o7777, dir_fd=parent, follow_symlinks=False)
            self._count(0)
        else:  # character and block devices (and anything stranger): never from a layer
            self._facts.skipped_devices += 1

    def _whiteout(self, parent: int, name: str, entry: str) -> None:
        if name in ("", ".", "..") or name.startswith(".wh."):
            raise ConfigError(f"{self._what}: the whiteout {entry[:200]!r} is malformed: refused")
        try:
            os.lstat(name, dir_fd=parent)
            return  # this layer has NAME itself: the whiteout is for lower layers, hidden anyway
        except FileNotFoundError:
            pass
        os.mknod(name, stat.S_IFCHR | 0o600, os.makedev(0, 0), dir_fd=parent)
        self._count(0)

    def _file(
        self,
        parent: int,
        parts: tuple[str, ...],
        m: tarfile.TarInfo,
        extractfile: Callable[[tarfile.TarInfo], IO[bytes] | None],
    ) -> None:
        self._count(m.size)
        self._clear(parent, parts)
        fd = os.open(parts[-1], _FILE_FLAGS, 0o600, dir_fd=parent)
        try:
            src = extractfile(m)
            if src is not None:
                while chunk := src.read(CHUNK):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view) :]
            os.fchown(fd, m.uid, m.gid)
            os.fchmod(fd, m.mode & 0o7777)  # after chown, which clears setuid bits
            self._xattrs(fd, m)
            os.utime(fd, ns=_ns(m))
        finally:
            os.close(fd)

    def _hardlink(self, parent: int, parts: tuple[str, ...], m: tarfile.TarInfo) -> None:
        target = _parts(m.linkname, self._what)
        base = parts[-1]
        refused = ConfigError(
            f"{self._what}: the hard link {m.name[:200]!r} points at {m.linkname[:200]!r}, "
            f"which is not a file earlier in this layer: refused"
        )
        if not target:
            raise refused
        try:
            tdir = self._dir(target[:-1], create=False)
            st = os.lstat(target[-1], dir_fd=tdir)
        except (FileNotFoundError, NotADirectoryError, ConfigError):
            raise refused from None
        if stat.S_ISDIR(st.st_mode) or (stat.S_ISCHR(st.st_mode) and st.st_rdev == 0):
            raise refused
        if target == parts:
            return
        self._clear(parent, parts)
        tdir = self._dir(target[:-1], create=False)
        os.link(target[-1], base, src_dir_fd=tdir, dst_dir_fd=parent, follow_symlinks=False)
        self._count(0)

    def _xattrs(self, fd: int, m: tarfile.TarInfo) -> None:
        for key, value in m.pax_headers.items():
            if not key.startswith("SCHILY.xattr."):
                continue
            name = _no_nul(key[len("SCHILY.xattr.") :], "the attribute", self._what)
            if name.startswith(_KEPT_XATTRS):
                data = value.encode("utf-8", "surrogateescape")
                os.setxattr(fd, name, data)

    def finish(self) -> None:
        """Directories' owners, modes and times, deepest first (their entries are written)."""
        for parts in sorted(self._dirs, key=len, reverse=True):
            m = self._dirs[parts]
            try:
                fd = self._dir(parts, create=False)
            except (FileNotFoundError, NotADirectoryError, ConfigError):
                continue  # replaced by a later entry: removed, or no longer a directory
            if os.fstat(fd).st_ino != m.ino:
                continue  # removed, then made again as another entry's parent
            os.fchown(fd, m.uid, m.gid)
            os.fchmod(fd, m.mode)
            os.utime(fd, ns=(m.mtime_ns, m.mtime_ns))
        if () not in self._dirs:
            os.fchmod(self._root, 0o755)


class _DirMeta(NamedTuple):
    """What is kept of a directory's entry until the end (not its TarInfo: its PAX records
    could be a MiB each)."""

    uid: int
    gid: int
    mode: int
    mtime_ns: int
    ino: int

    @classmethod
    def of(cls, m: tarfile.TarInfo, ino: int) -> _DirMeta:
        return cls(m.uid, m.gid, m.mode & 0o7777, _ns(m)[0], ino)


def _ns(m: tarfile.TarInfo) -> tuple[int, int]:
    t = max(0, min(int(m.mtime * 1_000_000_000), 2**62))
    return t, t


def _utime(name: str, m: tarfile.TarInfo, parent: int) -> None:
    os.utime(name, ns=_ns(m), dir_fd=parent, follow_symlinks=False)
