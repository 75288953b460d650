"""Where durable sessions keep their snapshots: :class:`SessionStore` and :class:`DirectoryStore`.

A store maps a key (a session id: letters, digits, ``_``, ``-``, ``.``, at most
128 characters, not starting with ``.``) to bytes. :class:`DirectoryStore`, the
default, keeps one file per key in a directory; on a cluster, a shared
filesystem makes it reachable from every node. :func:`store_from_url` builds a
store from ``stadium serve --durable``'s URL: ``dir:/path`` or a plain path; a
new kind of store (redis, S3) plugs in with :func:`register_store` under its
own scheme.

Each entry is framed (a magic number, the length and a CRC-32 of the bytes), and a
reader sees the old bytes or the new ones, never a part. :class:`DirectoryStore`
creates a key's file whole (a temporary file in the same directory renamed over
it, ``os.replace``) and then rewrites it in place (one ``pwrite`` at offset 0 per
``put``, then ``close``: ~5 µs, against ~200 µs for a rename on ext4 here). A
writer holds an exclusive ``flock`` on the file while it writes and a reader a
shared one while it reads, so a read never meets a write in progress (before the
locks, a reader under load could read a torn entry several times over and give
up on an entry that was fine); a process killed during a ``put`` leaves the old
entry or the new one (the CRC tells a write cut by a power loss). With ``fsync=True``
every ``put`` goes through a synced temporary file, a rename and a synced directory,
so a snapshot survives a power loss too (measured costs: ``scripts/bench-snapshot.py``).

Security: snapshots are pickles (see ``stadium._env.snapshot``): whoever can write
the store could make the server run code, were records not signed (``durable``
signs and checks every record with a key only the server holds). The store's
directory must be the server's own: :class:`DirectoryStore` refuses one owned by
another user, writable by its group or by others, or whose POSIX ACL grants
write to anyone else; files are created ``0600`` and a directory it creates ``0700``.
Errors of :meth:`DirectoryStore.get` name the key, never the directory; the
``OSError`` of a failed read or write names its file, and is for the log only
(``durable`` answers clients without it; ``stadium serve`` logs the directory at start).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

from stadium._errors import ConfigError

#: What a key may be: a session id, safe as a file name on every filesystem.
KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
_TEMP_SUFFIX = ".tmp"


@runtime_checkable
class SessionStore(Protocol):
    """Bytes by key, shared by every worker (and node) that may resume a session.

    ``put`` replaces atomically; ``get`` returns ``None`` for a missing key;
    ``delete`` of a missing key does nothing; ``sweep`` removes entries not
    written for ``older_than_s`` seconds and returns how many it removed. A bad
    key is a :class:`ValueError` naming it.
    """

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes | None: ...

    def delete(self, key: str) -> None: ...

    def keys(self) -> Iterator[str]: ...

    def sweep(self, older_than_s: float) -> int: ...


def check_key(key: str) -> str:
    """``key`` if it is a valid store key, else :class:`ValueError` naming it."""
    if not isinstance(key, str) or KEY.fullmatch(key) is None:
        raise ValueError(
            f"{key!r} is not a valid session store key: use 1 to 128 letters, digits, "
            "'_', '-' or '.', not starting with '.'"
        )
    return key


class DirectoryStore:
    """One file per key in ``path`` (created ``0700`` if missing), written atomically.

    Args:
        path: the directory; on a cluster, one on a filesystem every node mounts.
        fsync: also ``fsync`` each file and the directory (durable across a power
            loss; a crashed process never loses a finished ``put`` either way).

    Raises:
        ConfigError: ``path`` cannot be created, is not a directory, is not writable,
            or is not private to the server's user (:func:`why_not_private`: owned by
            another user, writable by its group or others, or an ACL grants write).
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.path = Path(path)
        self.fsync = fsync
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            probe = self.path / f".probe-{os.getpid()}-{os.urandom(4).hex()}{_TEMP_SUFFIX}"
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)
            probe.unlink()
        except OSError as exc:
            raise ConfigError(
                f"the session store directory {str(self.path)!r} is not usable: "
                f"{exc.strerror or exc}; give a writable directory (on a cluster, one every "
                "node mounts) or create it with write permission for the server's user",
                path=str(self.path),
            ) from exc
        why = why_not_private(self.path)
        if why is not None:
            raise ConfigError(
                f"the session store directory {str(self.path)!r} {why}: another user could "
                "plant or alter records there; give a directory owned by the server's user "
                "that only it can write (chmod 700), or leave --session-store out for a "
                "private one",
                path=str(self.path),
            )
        self._dir = str(self.path)

    def __repr__(self) -> str:
        return f"DirectoryStore({self._dir!r}, fsync={self.fsync})"

    def _file(self, key: str) -> str:
        return os.path.join(self._dir, check_key(key))

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, replacing what was there (see the module docstring)."""
        final = self._file(key)
        framed = _frame(data)
        if not self.fsync:
            try:
                fd = os.open(final, os.O_WRONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                pass  # the first put: the file is made whole, below
            else:
                try:
                    _lock(fd, fcntl.LOCK_EX)
                    view = memoryview(framed)
                    offset = 0
                    while offset < len(view):
                        offset += os.pwrite(fd, view[offset:], offset)
                finally:
                    os.close(fd)  # and the lock with it
                return
        temp = os.path.join(self._dir, f".{key}.{os.urandom(6).hex()}{_TEMP_SUFFIX}")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            with open(fd, "wb", closefd=True) as file:
                file.write(framed)
                if self.fsync:
                    file.flush()
                    os.fsync(fd)
            os.replace(temp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        if self.fsync:
            self._sync_dir()

    def _sync_dir(self) -> None:
        fd = os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def get(self, key: str) -> bytes | None:
        """The bytes stored under ``key``, or ``None``.

        Raises:
            ValueError: the entry is not one this store wrote, or stays torn (a write
                cut by a power loss: its CRC does not match).
        """
        path = self._file(key)
        for _ in range(_READ_TRIES):
            try:
                with open(path, "rb") as file:
                    _lock(file.fileno(), fcntl.LOCK_SH)
                    raw = file.read()
            except FileNotFoundError:
                return None
            data = _unframe(raw)
            if data is not None:
                return data
        raise ValueError(f"session store entry {key!r} is damaged (its checksum does not match)")

    def delete(self, key: str) -> None:
        """Remove ``key`` (nothing happens if it is missing)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._file(key))
        if self.fsync:
            self._sync_dir()

    def keys(self) -> Iterator[str]:
        """The stored keys, in no particular order."""
        with os.scandir(self._dir) as entries:
            names = [e.name for e in entries if KEY.fullmatch(e.name) and e.is_file()]
        yield from names

    def sweep(self, older_than_s: float) -> int:
        """Remove the entries not written for ``older_than_s`` seconds; how many were removed.

        Leftover temporary files of crashed writers that old go too (not counted).
        An entry rewritten while the sweep looks at it is kept: the sweep moves an
        old entry aside, checks its age again and puts it back if a ``put`` came in
        between (a ``get`` in that instant finds nothing, as for a removed entry).
        """
        cutoff = time.time() - older_than_s
        removed = 0
        with os.scandir(self._dir) as scan:
            entries = list(scan)
        for entry in entries:
            name = entry.name
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(info.st_mode) or info.st_mtime >= cutoff:
                continue
            if KEY.fullmatch(name):
                removed += self._sweep_one(name, cutoff)
            elif name.startswith(".") and name.endswith(_TEMP_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
        if removed and self.fsync:
            self._sync_dir()
        return removed

    def _sweep_one(self, name: str, cutoff: float) -> int:
        path = os.path.join(self._dir, name)
        aside = os.path.join(self._dir, f".{name}.{os.urandom(6).hex()}.sweep{_TEMP_SUFFIX}")
        try:
            os.rename(path, aside)  # the file we hold now is the one we judge
        except FileNotFoundError:
            return 0
        try:
            if os.stat(aside).st_mtime < cutoff:
                return 1
            with contextlib.suppress(FileExistsError):  # a newer put already took its place
                os.link(aside, path)
            return 0
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(aside)


def _lock(fd: int, how: int) -> None:
    """``flock`` ``fd``; where the filesystem has no locks (an NFS mount without lockd),
    go on without (a reader that meets a write in progress then reads again)."""
    try:
        fcntl.flock(fd, how)
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            raise


#: ``system.posix_acl_access``: a 4-byte header, then (tag u16, perm u16, id u32) entries.
_ACL_HEAD = struct.Struct("<I")
_ACL_ENTRY = struct.Struct("<HHI")
_ACL_USER, _ACL_GROUP, _ACL_MASK = 0x02, 0x08, 0x10
_ACL_WRITE = 0x02


def acl_grants_write(path: str | os.PathLike[str]) -> bool:
    """Whether ``path``'s POSIX access ACL grants write to a named user or group
    (beyond the owner and the mode bits, which :func:`why_not_private` checks)."""
    try:
        raw = os.getxattr(path, "system.posix_acl_access")
    except OSError:  # no ACL, or a filesystem without them
        return False
    entries = [
        _ACL_ENTRY.unpack_from(raw, offset)
        for offset in range(_ACL_HEAD.size, len(raw) - _ACL_ENTRY.size + 1, _ACL_ENTRY.size)
    ]
    mask = next((perm for tag, perm, _ in entries if tag == _ACL_MASK), 0x7)
    own = os.getuid()
    return any(
        perm & mask & _ACL_WRITE and (tag == _ACL_GROUP or (tag == _ACL_USER and ident != own))
        for tag, perm, ident in entries
    )


def why_not_private(path: str | os.PathLike[str]) -> str | None:
    """Why only the server's user could not write directory ``path`` (``None``: it is
    private): owned by another user, writable by its group or others, or an ACL grants
    write to someone else."""
    info = os.stat(path)
    if info.st_uid != os.getuid():
        return f"is owned by uid {info.st_uid}, not the server's ({os.getuid()})"
    if info.st_mode & stat.S_IWOTH:
        return f"is writable by every user (mode {stat.S_IMODE(info.st_mode):o})"
    if acl_grants_write(path):  # before the group bits: with an ACL, they show its mask
        return "has an ACL granting write to another user or group"
    if info.st_mode & stat.S_IWGRP:
        return f"is writable by its group (mode {stat.S_IMODE(info.st_mode):o})"
    return None


_MAGIC = b"STS1"
_HEAD = struct.Struct("<4sII")  # magic, length, CRC-32
_READ_TRIES = 8


def _frame(data: bytes) -> bytes:
    return _HEAD.pack(_MAGIC, len(data), zlib.crc32(data)) + data


def _unframe(raw: bytes) -> bytes | None:
    """The bytes of a framed entry, ``None`` if it is torn (a write in progress)."""
    if len(raw) < _HEAD.size:
        return None
    magic, size, crc = _HEAD.unpack_from(raw)
    if magic != _MAGIC:
        raise ValueError("not a session store entry (no Stadium frame)")
    data = raw[_HEAD.size : _HEAD.size + size]
    if len(data) != size or zlib.crc32(data) != crc:
        return None
    return data


StoreFactory = Callable[..., SessionStore]
_STORES: dict[str, StoreFactory] = {"dir": DirectoryStore}
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):(.*)", re.DOTALL)


def register_store(scheme: str, factory: StoreFactory) -> None:
    """Make ``scheme:LOCATION`` URLs build stores with ``factory(LOCATION, fsync=...)``."""
    _STORES[scheme.lower()] = factory


def store_from_url(url: str, *, fsync: bool = False) -> SessionStore:
    """The store a URL names: ``dir:/path`` or a plain path (a directory), or a registered scheme.

    Raises:
        ConfigError: an empty URL or an unknown scheme (the message lists the known ones),
            or the store cannot be opened.
    """
    match = _SCHEME.fullmatch(url)
    if match is None:  # no scheme (one letter before ':' is a Windows drive): a path
        scheme, location = "dir", url
    else:
        scheme, location = match.group(1).lower(), match.group(2)
    if not location:
        raise ConfigError(
            f"the session store {url!r} names no location; give a directory (dir:/path)",
            store=url,
        )
    factory = _STORES.get(scheme)
    if factory is None:
        known = ", ".join(f"{s}:" for s in sorted(_STORES))
        raise ConfigError(
            f"unknown session store scheme {scheme + ':'!r} in {url!r}; the known ones are: "
            f"{known} (or a plain directory path)",
            store=url,
        )
    return factory(location, fsync=fsync)


__all__ = [
    "KEY",
    "DirectoryStore",
    "SessionStore",
    "acl_grants_write",
    "check_key",
    "register_store",
    "store_from_url",
    "why_not_private",
]
