"""Task images (issue 31): sandboxed sessions whose ``/`` is an image (its layers read-only
under a private, size-bounded copy-on-write layer), on real servers.

The image is Debian trixie (``localhost/stadium-test-base:trixie``, which the container
tests build; exported once to a root filesystem directory here, with a tool only it has);
the host is another Debian. Skipped, with the reason, without root, bubblewrap or Podman.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

import stadium
from stadium import ConfigError, ServerConfig
from stadium._server.isolation import sandbox_unavailable
from stadium._server.isolation.sandbox import UID_BASE
from tests.conftest import UNIT, serve
from tests.container.conftest import BASE, CACHE, _image_exists, _locked, _make_base

pytestmark = pytest.mark.slow

TARGET = f"{Path(__file__).with_name('imaged.py')}:Imaged"
TOOL = "/usr/local/bin/only-in-the-image"
WHY_NO_SANDBOX = sandbox_unavailable()


def _podman() -> str:
    if WHY_NO_SANDBOX is not None:
        pytest.skip(f"task images need --isolation sandbox: {WHY_NO_SANDBOX}")
    exe = shutil.which("podman")
    if exe is None:
        pytest.skip("task image tests need Podman (to export the test base image)")
    return exe


def _export(podman: str, image: str, dest: Path) -> None:
    """``image``'s root filesystem into ``dest`` (made beside it, then renamed into place)."""
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cid = subprocess.run([podman, "create", image, "true"], capture_output=True, text=True,
                         check=True, timeout=120 * UNIT).stdout.strip()  # fmt: skip
    try:
        export = subprocess.Popen([podman, "export", cid], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(tmp)], stdin=export.stdout, check=True,
                       timeout=300 * UNIT)  # fmt: skip
        assert export.stdout is not None
        export.stdout.close()
        assert export.wait(60 * UNIT) == 0
    finally:
        subprocess.run([podman, "rm", "-f", cid], capture_output=True, timeout=120 * UNIT)
    (tmp / TOOL.lstrip("/")).write_text("#!/bin/sh\necho image tool\n")
    (tmp / TOOL.lstrip("/")).chmod(0o755)
    (tmp / "etc/image-name").write_text("a\n")
    tmp.rename(dest)


@pytest.fixture(scope="module")
def images() -> tuple[str, str]:
    """Two images' REFs (``dir:``): A, the trixie base with a tool only it has; B, A with
    ``/etc/image-name`` saying ``b`` (a hard-linked copy)."""
    podman = _podman()
    with _locked("base"):
        if not _image_exists(podman, BASE):
            _make_base(podman)
    image_id = subprocess.run([podman, "image", "inspect", "--format", "{{.Id}}", BASE],
                              capture_output=True, text=True, check=True,
                              timeout=60 * UNIT).stdout.strip()[:16]  # fmt: skip
    a = CACHE / f"imgbox-rootfs-{image_id}-a"
    b = CACHE / f"imgbox-rootfs-{image_id}-b"
    with _locked("imgbox-rootfs"):
        if not a.is_dir():
            _export(podman, BASE, a)
        if not b.is_dir():
            tmp = b.with_name(b.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            subprocess.run(["cp", "-al", str(a), str(tmp)], check=True, timeout=120 * UNIT)
            (tmp / "etc/image-name").unlink()
            (tmp / "etc/image-name").write_text("b\n")
            tmp.rename(b)
    return f"dir:{a}", f"dir:{b}"


def _serve(images: tuple[str, str], **config: Any) -> Any:
    config.setdefault("sandbox_disk", 16)
    return serve(TARGET, isolation="sandbox", image=images[0], images=images[1], **config)


async def _do(env: stadium.AsyncClient[Any], do: str, arg: str = "", data: str = "") -> Any:
    return (await env.step({"do": do, "arg": arg, "data": data})).observation


async def test_a_session_sees_its_image_and_not_the_host(images: tuple[str, str]) -> None:
    host_release = Path("/etc/os-release").read_text()
    assert "trixie" not in host_release  # the host is another Debian
    assert not os.path.exists(TOOL)
    async with _serve(images, warm_pool=1) as server, stadium.AsyncClient(server.url) as env:
        first = (await env.reset()).observation
        assert first["text"] == "/sandbox"  # the image names no workdir: its own
        assert "VERSION_CODENAME=trixie" in (await _do(env, "run", "cat /etc/os-release"))["text"]
        assert (await _do(env, "run", "only-in-the-image"))["text"] == "image tool\n"
        image_py = await _do(env, "py", "import sys; print(sys.version_info[:2])")
        assert image_py["text"] == "(3, 13)\n"  # the image's python3, not the server's
        assert (await _do(env, "run", f"test -e {Path.cwd()}"))["code"] == 1  # no host tree
        assert (await _do(env, "run", "echo x > /etc/passwd"))["code"] != 0  # read-only to it
        await _do(env, "write", "notes/a.txt", "hello")
        assert (await _do(env, "read", "/sandbox/notes/a.txt"))["text"] == "hello"
        assert (await _do(env, "ls", "notes"))["text"] == "a.txt:file"
        assert (await _do(env, "run", "cat notes/a.txt"))["text"] == "hello"


async def test_a_session_keeps_its_sandbox_inside_an_image(images: tuple[str, str]) -> None:
    async with _serve(images) as server, stadium.AsyncClient(server.url) as env:
        await env.reset()
        obs = await _do(env, "run", "grep Seccomp: /proc/self/status; ls /proc | grep -c '^[0-9]'")
        seccomp, procs = obs["text"].split("\n")[:2]
        assert seccomp.split() == ["Seccomp:", "2"]  # filtered
        assert int(procs) <= 4  # its own pid namespace: init, env, sh, grep at most
        assert obs["uid"] >= UID_BASE  # its own unprivileged uid
        assert (await _do(env, "run", "id -u"))["text"].strip() == str(obs["uid"])
        server_port = server.url.rsplit(":", 1)[1].split("/")[0]
        assert (await _do(env, "connect", f"127.0.0.1:{server_port}"))["code"] == 1  # no network
        assert (await _do(env, "run", "ls /sys/fs/cgroup"))["code"] != 0  # no cgroup tree


async def test_sessions_are_private_and_a_reset_gives_the_pristine_image(
    images: tuple[str, str],
) -> None:
    async with (
        _serve(images, warm_pool=2) as server,
        stadium.AsyncClient(server.url) as a,
        stadium.AsyncClient(server.url) as b,
    ):
        await a.reset()
        await b.reset()
        await _do(a, "run", "echo secret > /tmp/mine; echo w > work.txt")
        assert (await _do(a, "run", "cat /tmp/mine work.txt"))["text"] == "secret\nw\n"
        assert (await _do(b, "run", "cat /tmp/mine"))["code"] != 0
        assert (await _do(b, "ls"))["text"] == ""
        await a.reset()
        assert (await _do(a, "run", "cat /tmp/mine"))["code"] != 0  # pristine again
        assert (await _do(a, "ls"))["text"] == ""


async def test_two_images_on_one_worker_and_bad_choices(images: tuple[str, str]) -> None:
    async with (
        _serve(images) as server,
        stadium.AsyncClient(server.url) as a,
        stadium.AsyncClient(server.url) as b,
    ):
        await a.reset()
        await b.reset(options={"image": images[1]})
        assert (await _do(a, "read", "/etc/image-name"))["text"] == "a\n"
        assert (await _do(b, "read", "/etc/image-name"))["text"] == "b\n"
        with pytest.raises(stadium.ValidationError, match="not allowed on this server"):
            await b.reset(options={"image": "dir:/"})  # the host's root: never allowed
        assert (await _do(b, "read", "/etc/image-name"))["text"] == "b\n"  # it kept its image
        await b.reset(options={"image": images[0]})
        assert (await _do(b, "read", "/etc/image-name"))["text"] == "a\n"
        assert server.runtime.isolation.pools.starts[images[1]] >= 1


async def test_a_disk_bomb_is_contained_to_its_session(images: tuple[str, str]) -> None:
    async with (
        _serve(images, sandbox_disk=8) as server,
        stadium.AsyncClient(server.url) as bomb,
        stadium.AsyncClient(server.url) as other,
    ):
        await bomb.reset()
        await other.reset()
        got = await _do(bomb, "run", "head -c 64M /dev/zero > /tmp/big; du -sm /tmp/big | cut -f1")
        assert "No space left on device" in got["text"]
        assert 0 < int(got["text"].split("\n")[0]) <= 8
        assert (await _do(other, "run", "head -c 4M /dev/zero > f && echo ok"))["text"] == "ok\n"
        await bomb.reset()  # its layer goes with its process
        assert (await _do(bomb, "run", "head -c 4M /dev/zero > f && echo ok"))["text"] == "ok\n"


async def test_bad_image_settings_are_clear_errors(images: tuple[str, str]) -> None:
    with pytest.raises(ConfigError, match="need --isolation sandbox"):
        ServerConfig(target="shell", isolation="process", image=images[0])
    with pytest.raises(ConfigError, match="no directory"):
        async with serve(TARGET, isolation="sandbox", image="dir:/nonexistent/rootfs"):
            pass
    with pytest.raises(ConfigError, match="only a root filesystem directory"):
        async with serve(TARGET, isolation="sandbox", image="no-such-ref"):
            pass
