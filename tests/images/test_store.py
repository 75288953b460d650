"""The image store: REFs, the cache's layout and permissions, leases and LRU eviction under a
budget (across processes), one extraction when processes prepare at once, the CLI, /metrics.
Hand-made layouts (tests/images/layouts.py): no Podman."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from stadium import ConfigError
from stadium._cli.main import cli
from stadium._server.images import ImageStore, RefKind, parse_ref
from stadium._server.images.collector import ImageStoreCollector
from tests.conftest import UNIT
from tests.images.layouts import Entry, make_archive, make_layout

ROOT = Path(__file__).resolve().parents[2]
as_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="the image store extracts layers as root (owners, whiteouts)"
)
MIB = 1 << 20


# ------------------------------------------------------------------ REFs (no disk)


@pytest.mark.parametrize(
    ("ref", "kind", "key"),
    [
        ("localhost/task-a:v1", RefKind.PODMAN, "podman:localhost/task-a:v1"),
        ("containers-storage:localhost/a", RefKind.PODMAN, "podman:localhost/a"),
        ("oci:/srv/a", RefKind.OCI, "oci:/srv/a"),
        ("oci:/srv/a:v1", RefKind.OCI, "oci:/srv/a:v1"),
        ("oci-archive:/srv/a.tar:v1", RefKind.OCI_ARCHIVE, "oci-archive:/srv/a.tar:v1"),
        ("dir:/srv/rootfs/", RefKind.DIR, "dir:/srv/rootfs"),
        ("/srv/rootfs", RefKind.DIR, "dir:/srv/rootfs"),
    ],
)
def test_refs_parse(ref: str, kind: RefKind, key: str) -> None:
    parsed = parse_ref(ref)
    assert (parsed.kind, parsed.key, parsed.text) == (kind, key, ref)


@pytest.mark.parametrize(
    ("ref", "says"),
    [
        ("", "empty"),
        ("docker://busybox", "not pulled from registries"),
        ("nope:/x", "neither an image name nor a path"),
        ("Upper/Case", "neither an image name nor a path"),
        ("oci:", "names no path"),
        ("a\nb", "one line"),
    ],
)
def test_bad_refs_say_what_to_write(ref: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as info:
        parse_ref(ref)
    assert (
        "localhost/NAME:TAG" in info.value.message
        or "ABSOLUTE" in info.value.message
        or (says == "one line")
    )


@as_root
def test_refs_that_name_nothing_say_so(image_store: ImageStore, tmp_path: Path) -> None:
    two = make_layout(tmp_path / "two", [[Entry("f", data=b"1")]], tag="one")
    make_layout(two, [[Entry("f", data=b"2")]], tag="two")
    (tmp_path / "file").write_text("x")
    (tmp_path / "latin").mkdir()  # an index msgspec reads as UnicodeDecodeError, and
    (tmp_path / "latin/index.json").write_bytes(b'{"mediaType": "\xff"}')
    (tmp_path / "deep").mkdir()  # one it reads as RecursionError: each was a traceback
    (tmp_path / "deep/index.json").write_bytes(b'{"x": ' + b"[" * 99_999 + b"]" * 99_999 + b"}")
    cases = {
        f"oci:{tmp_path / 'latin'}": "is not what an OCI layout holds: a string is not valid UTF-8",
        f"oci:{tmp_path / 'deep'}": "is not what an OCI layout holds: values are nested more",
        f"oci:{tmp_path / 'missing'}": "has no index.json",
        f"oci:{tmp_path}": "has no index.json",
        f"oci:{two}": "holds 2 images; name one with :TAG",
        f"oci:{two}:three": "no image tagged 'three'",
        f"oci-archive:{tmp_path / 'missing.tar'}": "is not a file",
        f"oci-archive:{tmp_path / 'file'}": "not a readable",
        f"dir:{tmp_path / 'missing'}": "cannot be used as a root filesystem",
        f"dir:{tmp_path / 'file'}": "is not a directory",
        str(two): "is an OCI image layout: write oci:",
    }
    for ref, says in cases.items():
        with pytest.raises(ConfigError, match=says):
            image_store.prepare(ref)
    assert image_store.prepare(f"oci:{two}:two").config.env["TASK"] == "x"


def test_a_cache_others_can_write_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)
    with pytest.raises(ConfigError, match="writable by others"):
        ImageStore(str(root)).images()
    os.chmod(root, 0o700)
    assert ImageStore(str(root)).images() == []


# ------------------------------------------------------------------ the cache


def _image(tmp_path: Path, name: str, mib: float = 0.0, files: int = 0) -> str:
    """A layout of a shared small base layer and a layer of its own (``mib`` of data, or
    ``files`` small files)."""
    own = [Entry(f"{name}/blob", data=os.urandom(int(mib * MIB)))] if mib else []
    own += [Entry(f"{name}/f{i}", data=b"x" * 64) for i in range(files)]
    base = [Entry("etc/os-release", data=b"base")]
    return f"oci:{make_layout(tmp_path / name, [base, own or [Entry(name)]])}"


@as_root
def test_prepared_once_then_read_back_without_extracting(
    image_store: ImageStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = _image(tmp_path, "one", files=3)
    first = image_store.prepare(ref)
    assert first.config.workdir == "/work"
    assert first.config.env["TASK"] == "x"
    assert all(Path(p).parent == Path(image_store.root, "layers") for p in first.layers)

    def no_more(*args: object, **kwargs: object) -> None:
        raise AssertionError("extracted again")

    monkeypatch.setattr("stadium._server.images.store.extract_layer", no_more)
    monkeypatch.setattr("stadium._server.images.store.read_image", no_more)
    again = ImageStore(image_store.root).prepare(ref)  # another process's view: the records
    assert again == first
    archive = make_archive(Path(ref.removeprefix("oci:")), tmp_path / "one.tar")
    monkeypatch.undo()
    assert ImageStore(image_store.root).prepare(f"oci-archive:{archive}").layers == first.layers


def _hold_lease(root: str, ref: str) -> subprocess.Popen[str]:
    """A process that prepares and leases ``ref``, says so, and holds it until killed."""
    code = (
        "import sys; from stadium._server.images import ImageStore\n"
        "s = ImageStore(sys.argv[1]); lease = s.lease(s.prepare(sys.argv[2]))\n"
        "print('held', flush=True); sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, root, ref], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(10 * UNIT)
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


@as_root
@pytest.mark.slow
def test_the_budget_evicts_the_least_recently_used_unleased_image(tmp_path: Path) -> None:
    root = str(tmp_path / "cache")
    x, y, z = (_image(tmp_path, n, mib=1) for n in "xyz")
    store = ImageStore(root, budget_bytes=int(2.5 * MIB))
    holder = _hold_lease(root, x)  # x: least recently used, but leased by another process
    try:
        img_y = store.prepare(y)
        store.prepare(z)  # 3 MiB > 2.5: y goes (x is leased, z just came)
        kept = {i.digest for i in store.images()}
        assert img_y.digest not in kept
        assert len(kept) == 2
        assert not Path(img_y.layers[1]).exists()
        assert Path(img_y.layers[0]).exists()  # the base, shared with x and z
        assert [i.leased for i in store.images() if i.digest not in (img_y.digest,)].count(True)
    finally:
        _stop(holder)  # killed: its lease frees itself with the process
    store.prepare(y)  # now x is the least recently used and nobody holds it
    left = {i.refs[0] for i in store.images()}
    assert left == {y, z}
    assert store.stats().bytes <= 2.5 * MIB


@as_root
def test_a_lease_in_this_process_blocks_eviction_until_closed(tmp_path: Path) -> None:
    store = ImageStore(str(tmp_path / "cache"))
    image = store.prepare(_image(tmp_path, "a", files=1))
    with store.lease(image) as lease:
        assert lease.image == image
        assert store.prune() == []
        assert [i.leased for i in store.images()] == [True]
    assert store.prune() == [image.digest]
    assert store.images() == []
    assert list(Path(store.root, "layers").iterdir()) == []
    with store.lease(image) as lease:  # evicted: leasing prepares it again
        assert Path(lease.image.layers[1]).is_dir()


@as_root
@pytest.mark.slow
def test_two_processes_preparing_one_image_extract_it_once(tmp_path: Path) -> None:
    root = str(tmp_path / "cache")
    ref = _image(tmp_path, "big", files=3000)
    code = (
        "import sys; from stadium._server.images import store as m\n"
        "calls = []; real = m.extract_layer\n"
        "def counted(*a, **k):\n    calls.append(1); return real(*a, **k)\n"
        "m.extract_layer = counted; s = m.ImageStore(sys.argv[1])\n"
        "print('ready', flush=True); sys.stdin.readline()\n"
        "img = s.prepare(sys.argv[2]); print(len(calls), img.digest, flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, root, ref],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=60 * UNIT)[0].split() for p in procs]
    finally:
        for p in procs:
            _stop(p)
    assert [p.returncode for p in procs] == [0, 0]
    assert sum(int(o[0]) for o in outs) == 2  # two layers, each extracted by one process
    assert outs[0][1] == outs[1][1]


# ------------------------------------------------------------------ CLI and metrics


@as_root
def test_the_cli(tmp_path: Path) -> None:
    root = str(tmp_path / "cache")
    a, b = _image(tmp_path, "a", files=2), _image(tmp_path, "b", mib=1.5)
    runner = CliRunner()

    def run(*args: str) -> str:
        result = runner.invoke(cli, ["images", *args, "--cache-dir", root])
        assert result.exit_code == 0, result.output
        return result.output

    out = run("prefetch", a, b)
    assert f"{a}: sha256:" in out
    assert "2 layers" in out
    listing = run("list")
    assert a in listing
    assert b in listing
    assert "2 images, 3 layers" in listing
    rows = [json.loads(line) for line in run("list", "--json").splitlines()]
    assert {r["refs"][0] for r in rows} == {a, b}
    body = json.loads(run("inspect", a))
    assert body["config"]["workdir"] == "/work"
    assert len(body["layers"]) == 2
    assert run("prune", "--keep", "1").startswith("evicted sha256:")  # b: used least lately
    assert [i.refs for i in ImageStore(root).images()] == [(a,)]
    assert "0 images" in run("prune")
    bad = runner.invoke(cli, ["images", "inspect", "docker://x", "--cache-dir", root])
    assert bad.exit_code != 0
    assert "not pulled from registries" in str(bad.exception)


@as_root
def test_metrics(image_store: ImageStore, tmp_path: Path) -> None:
    image = image_store.prepare(_image(tmp_path, "m", mib=0.25))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ImageStoreCollector(image_store))
    with image_store.lease(image):
        text = generate_latest(registry).decode()
    assert "stadium_images_prepared 1.0" in text
    assert "stadium_image_cache_layers 2.0" in text
    assert f"stadium_image_cache_bytes {float(image.size_bytes)}" in text
    assert "stadium_images_leased 1.0" in text


@as_root
def test_a_changed_source_is_read_again(image_store: ImageStore, tmp_path: Path) -> None:
    layout = make_layout(tmp_path / "l", [[Entry("f", data=b"1")]])
    first = image_store.prepare(f"oci:{layout}")
    assert image_store.prepare(f"oci:{layout}") == first  # unchanged: the record
    make_layout(layout, [[Entry("f", data=b"2")]], tag="two")  # index.json rewritten
    with pytest.raises(ConfigError, match="holds 2 images"):
        image_store.prepare(f"oci:{layout}")
    assert image_store.prepare(f"oci:{layout}:two").digest != first.digest
