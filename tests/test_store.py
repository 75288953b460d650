"""The session store (``stadium._server.durability.session_store``): atomic writes, safe keys,
sweep, permissions."""

from __future__ import annotations

import os
import stat
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from stadium._errors import ConfigError
from stadium._server import config as config_module
from stadium._server.config import default_session_store
from stadium._server.durability.session_store import (
    DirectoryStore,
    SessionStore,
    acl_grants_write,
    check_key,
    store_from_url,
)


@pytest.fixture(params=[False, True], ids=["plain", "fsync"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> DirectoryStore:
    return DirectoryStore(tmp_path / "sessions", fsync=request.param)


def test_put_get_delete_keys(store: DirectoryStore) -> None:
    assert isinstance(store, SessionStore)
    assert store.get("s1") is None
    assert list(store.keys()) == []
    store.put("s1", b"one")
    store.put("s-2_x.y", b"")
    store.put("s1", b"uno")  # replaces
    assert store.get("s1") == b"uno"
    assert store.get("s-2_x.y") == b""
    assert sorted(store.keys()) == ["s-2_x.y", "s1"]
    store.delete("s1")
    store.delete("s1")  # missing: nothing happens
    assert store.get("s1") is None
    assert list(store.keys()) == ["s-2_x.y"]
    # No temporary file is left behind.
    assert sorted(os.listdir(store.path)) == ["s-2_x.y"]


@pytest.mark.parametrize(
    "key", ["", ".hidden", "..", "../etc", "a/b", "/abs", "a\\b", "a\x00b", "é", "a b", "x" * 129]
)
def test_bad_keys_are_refused_by_name(store: DirectoryStore, key: str) -> None:
    with pytest.raises(ValueError, match="not a valid session store key") as info:
        store.put(key, b"x")
    assert repr(key) in str(info.value)
    with pytest.raises(ValueError, match="not a valid session store key"):
        store.get(key)
    with pytest.raises(ValueError, match="not a valid session store key"):
        store.delete(key)
    assert os.listdir(store.path) == []
    assert not (store.path.parent / "etc").exists()


def test_good_keys() -> None:
    for key in ("a", "0f3c9e2b-1d4a-4f51-9b8e-2a7c6d5e4f10", "A_b-c.d", "x" * 128):
        assert check_key(key) == key


def test_permissions(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "new" / "sessions")
    store.put("s", b"secret")
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.path / "s").st_mode) == 0o600
    # An existing directory keeps the mode its owner gave it.
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o750)
    os.chmod(shared, 0o750)
    DirectoryStore(shared).put("s", b"x")
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o750
    assert stat.S_IMODE(os.stat(shared / "s").st_mode) == 0o600


def test_an_unusable_directory_is_a_config_error(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_bytes(b"")
    with pytest.raises(ConfigError, match="not usable") as info:
        DirectoryStore(a_file / "sessions")
    assert str(a_file / "sessions") in info.value.message
    with pytest.raises(ConfigError, match="not usable"):
        DirectoryStore(a_file)  # a file, not a directory


def test_a_directory_every_user_can_write_is_refused(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o1777)  # like /tmp
    with pytest.raises(ConfigError, match="writable by every user"):
        DirectoryStore(open_dir)


needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="giving a directory to another uid needs root (chown)"
)


@needs_root
def test_a_directory_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    """A co-tenant pre-creates the directory (0700, his): he could plant records in it."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ConfigError, match="owned by uid 65534") as info:
        DirectoryStore(theirs)
    assert "only it can write" in info.value.message


def test_a_directory_its_group_can_write_is_refused(tmp_path: Path) -> None:
    group = tmp_path / "group"
    group.mkdir()
    os.chmod(group, 0o770)
    with pytest.raises(ConfigError, match="writable by its group"):
        DirectoryStore(group)


def _acl(*entries: tuple[int, int, int]) -> bytes:
    """A ``system.posix_acl_access`` value (version 2, then tag/perm/id entries)."""
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


_NO_ID = 0xFFFFFFFF


def test_a_directory_whose_acl_grants_write_is_refused(tmp_path: Path) -> None:
    acl_dir = tmp_path / "acl"
    acl_dir.mkdir(mode=0o700)
    # user::rwx, user:65534:rwx, group::---, mask::rwx, other::--- (like setfacl -m u:nobody:rwx)
    granting = _acl(
        (0x01, 7, _NO_ID), (0x02, 7, 65534), (0x04, 0, _NO_ID), (0x10, 7, _NO_ID), (0x20, 0, _NO_ID)
    )
    try:
        os.setxattr(acl_dir, "system.posix_acl_access", granting)
    except OSError as exc:
        pytest.skip(f"this filesystem takes no POSIX ACLs: {exc.strerror}")
    assert acl_grants_write(acl_dir)
    with pytest.raises(ConfigError, match="ACL granting write"):
        DirectoryStore(acl_dir)
    # An entry whose write the mask takes away grants nothing (and the mode stays private).
    masked = _acl(
        (0x01, 7, _NO_ID), (0x02, 7, 65534), (0x04, 0, _NO_ID), (0x10, 5, _NO_ID), (0x20, 0, _NO_ID)
    )
    os.setxattr(acl_dir, "system.posix_acl_access", masked)
    os.chmod(acl_dir, 0o750)
    assert not acl_grants_write(acl_dir)
    DirectoryStore(acl_dir).put("s", b"x")


def test_the_default_store_is_a_private_directory_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a predictable name a co-tenant can pre-create: made by the server, 0700, its own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(config_module, "_DEFAULT_STORE", [])
    if os.geteuid() == 0:  # the old predictable name, pre-created by another user
        planted = tmp_path / f"stadium-sessions-{os.getuid()}"
        planted.mkdir(mode=0o700)
        os.chown(planted, 65534, 65534)
    path = default_session_store()
    assert default_session_store() == path  # one per server: its workers share it
    info = os.stat(path)
    assert info.st_uid == os.getuid()
    assert stat.S_IMODE(info.st_mode) == 0o700
    assert Path(path).parent == tmp_path
    assert Path(path).name.startswith("stadium-sessions-")
    assert Path(path).name != f"stadium-sessions-{os.getuid()}"
    DirectoryStore(path).put("s", b"x")
    # Under $XDG_RUNTIME_DIR when that is the user's own and private.
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setattr(config_module, "_DEFAULT_STORE", [])
    assert Path(default_session_store()).parent == runtime


def test_store_errors_name_the_key_not_the_directory(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "hidden-path")
    store.put("s", b"x")
    with open(store.path / "s", "r+b") as file:
        file.write(b"XXXX")  # not a store entry any more
    with pytest.raises(ValueError) as info:
        store.get("s")
    assert "hidden-path" not in str(info.value)


def test_a_read_only_directory_is_a_config_error(tmp_path: Path) -> None:
    """Mode 0500 for a user; for root (who writes through modes) a read-only mount."""
    locked = tmp_path / "locked"
    locked.mkdir()
    as_root = os.geteuid() == 0
    if as_root:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "stadium-ro", str(locked)], check=True
        )
    else:
        os.chmod(locked, 0o500)
    try:
        with pytest.raises(ConfigError, match="not usable"):
            DirectoryStore(locked)
    finally:
        if as_root:
            subprocess.run(["umount", str(locked)], check=True)
        else:
            os.chmod(locked, 0o700)


def test_writes_are_atomic_under_a_concurrent_reader(store: DirectoryStore) -> None:
    """A reader never sees a partial file: every read is a whole blob of one writer's put."""
    size, writes = 256 * 1024, (60 if store.fsync else 1000)
    blobs = [bytes([i]) * size for i in range(4)]
    done = threading.Event()
    seen: list[bytes | None] = []
    bad: list[str] = []
    raised: list[BaseException] = []

    def reader() -> None:
        deadline = time.monotonic() + 30
        try:
            for _ in range(100_000):
                if done.is_set() or time.monotonic() > deadline:
                    break
                data = store.get("s")
                if data is not None and data not in blobs:
                    bad.append(f"read {len(data)} bytes starting {data[:4]!r}")
                seen.append(data if data is None else data[:1])
        except BaseException as exc:  # the test fails on it (a thread's error only warns)
            raised.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(writes):
            store.put("s", blobs[i % len(blobs)])
    finally:
        done.set()
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert raised == []
    assert bad == []
    assert store.get("s") == blobs[(writes - 1) % len(blobs)]
    assert [n for n in os.listdir(store.path) if n != "s"] == []  # no temp file left


def test_concurrent_writers_leave_one_whole_blob(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    blobs = [bytes([i]) * 65536 for i in range(4)]

    def writer(blob: bytes) -> None:
        for _ in range(25):
            store.put("k", blob)

    threads = [threading.Thread(target=writer, args=(b,)) for b in blobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert store.get("k") in blobs
    assert os.listdir(tmp_path) == ["k"]


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_sweep_by_age(store: DirectoryStore) -> None:
    for key in ("old1", "old2", "new"):
        store.put(key, key.encode())
    age(store.path / "old1", 3600)
    age(store.path / "old2", 600)
    # A crashed writer's temporary file, old: swept too (not counted).
    stale = store.path / ".old1.abcdef.tmp"
    stale.write_bytes(b"partial")
    age(stale, 3600)
    fresh_temp = store.path / ".new.123456.tmp"  # a write in progress: kept
    fresh_temp.write_bytes(b"partial")
    # Files that are not keys are left alone.
    (store.path / "README").mkdir()
    assert store.sweep(older_than_s=1800) == 1
    assert sorted(store.keys()) == ["new", "old2"]
    assert not stale.exists()
    assert fresh_temp.exists()
    assert store.sweep(older_than_s=300) == 1
    assert list(store.keys()) == ["new"]
    assert store.sweep(older_than_s=300) == 0
    assert store.get("new") == b"new"


def test_sweep_keeps_an_entry_rewritten_while_it_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race: an entry found old is rewritten before the sweep moves it aside."""
    store = DirectoryStore(tmp_path)
    store.put("s", b"old")
    age(tmp_path / "s", 3600)
    real_rename = os.rename

    def rename_after_a_put(src: str, dst: str) -> None:
        if src.endswith(os.sep + "s"):
            store.put("s", b"new")  # lands between the age check and the move
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename_after_a_put)
    assert store.sweep(older_than_s=60) == 0
    monkeypatch.undo()
    assert store.get("s") == b"new"
    assert os.listdir(tmp_path) == ["s"]


def test_store_from_url(tmp_path: Path) -> None:
    by_scheme = store_from_url(f"dir:{tmp_path / 'a'}")
    assert isinstance(by_scheme, DirectoryStore)
    assert by_scheme.path == tmp_path / "a"
    plain = store_from_url(str(tmp_path / "b"), fsync=True)
    assert isinstance(plain, DirectoryStore)
    assert plain.fsync
    with pytest.raises(ConfigError, match=r"unknown session store scheme 'redis:'.*dir:"):
        store_from_url("redis://localhost:6379/0")
    with pytest.raises(ConfigError, match="names no location"):
        store_from_url("dir:")
