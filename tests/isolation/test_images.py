"""Task images (issue 31): sandboxed sessions whose ``/`` is an image (its layers read-only
under a private, size-bounded copy-on-write layer), on real servers.

The image is Debian trixie (``localhost/stadium-test-base:trixie``, which the container
tests build; exported once to a root filesystem directory here, with a tool only it has);
the host is another Debian. Skipped, with the reason, without root, bubblewrap or Podman.
"""

from __future__ import annotations

import asyncio
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
from tests.images.conftest import *  # noqa: F403 (the task images' fixtures)
from tests.test_metrics import scrape, value

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


def _export(exe: str, image: str, dest: Path) -> None:
    """``image``'s root filesystem into ``dest`` (made beside it, then renamed into place)."""
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cid = subprocess.run([exe, "create", image, "true"], capture_output=True, text=True,
                         check=True, timeout=120 * UNIT).stdout.strip()  # fmt: skip
    try:
        export = subprocess.Popen([exe, "export", cid], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(tmp)], stdin=export.stdout, check=True,
                       timeout=300 * UNIT)  # fmt: skip
        assert export.stdout is not None
        export.stdout.close()
        assert export.wait(60 * UNIT) == 0
    finally:
        subprocess.run([exe, "rm", "-f", cid], capture_output=True, timeout=120 * UNIT)
    (tmp / TOOL.lstrip("/")).write_text("#!/bin/sh\necho image tool\n")
    (tmp / TOOL.lstrip("/")).chmod(0o755)
    (tmp / "etc/image-name").write_text("a\n")
    tmp.rename(dest)


@pytest.fixture(scope="module")
def images() -> tuple[str, str]:
    """Two images' REFs (``dir:``): A, the trixie base with a tool only it has; B, A with
    ``/etc/image-name`` saying ``b`` (a hard-linked copy)."""
    exe = _podman()
    with _locked("base"):
        if not _image_exists(exe, BASE):
            _make_base(exe)
    image_id = subprocess.run([exe, "image", "inspect", "--format", "{{.Id}}", BASE],
                              capture_output=True, text=True, check=True,
                              timeout=60 * UNIT).stdout.strip()[:16]  # fmt: skip
    a = CACHE / f"imgbox-rootfs-{image_id}-a"
    b = CACHE / f"imgbox-rootfs-{image_id}-b"
    with _locked("imgbox-rootfs"):
        if not a.is_dir():
            _export(exe, BASE, a)
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
    allowed = f"{images[1]},dir:/var/empty/stadium/*"  # a pattern: what it names may not exist
    return serve(TARGET, isolation="sandbox", image=images[0], images=allowed, **config)


async def _do(env: stadium.AsyncClient[Any], do: str, arg: str = "", data: str = "") -> Any:
    return (await env.step({"do": do, "arg": arg, "data": data})).observation


def _image_file(ref: str, path: str) -> str:
    return (Path(ref.removeprefix("dir:")) / path).read_text()


def _host_is_not_the_image() -> None:
    assert "trixie" not in Path("/etc/os-release").read_text()  # the host is another Debian
    assert not os.path.exists(TOOL)


async def test_a_session_sees_its_image_and_not_the_host(images: tuple[str, str]) -> None:
    _host_is_not_the_image()
    async with _serve(images, warm_pool=1) as server, stadium.AsyncClient(server.url) as env:
        first = (await env.reset()).observation
        assert first["text"] == "/sandbox"  # the image names no workdir: its own
        assert "VERSION_CODENAME=trixie" in (await _do(env, "run", "cat /etc/os-release"))["text"]
        assert (await _do(env, "run", "only-in-the-image"))["text"] == "image tool\n"
        image_py = await _do(env, "py", "import sys; print(sys.version_info[:2])")
        assert image_py["text"] == "(3, 13)\n"  # the image's python3, not the server's
        assert (await _do(env, "run", f"test -e {Path.cwd()}"))["code"] == 1  # no host tree
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


async def test_untrusted_env_code_is_imported_inside_the_image(images: tuple[str, str]) -> None:
    async with (
        _serve(images, untrusted_env_code=True) as server,
        stadium.AsyncClient(server.url) as env,
    ):
        assert (await env.reset()).observation["text"] == "/sandbox"
        assert "trixie" in (await _do(env, "read", "/etc/os-release"))["text"]


async def test_sessions_are_private_and_a_reset_gives_the_pristine_image(
    images: tuple[str, str],
) -> None:
    async with (
        _serve(images, warm_pool=2) as server,
        stadium.AsyncClient(server.url) as a,
        stadium.AsyncClient(server.url) as b,
    ):
        a_uid = (await a.reset()).observation["uid"]
        await b.reset()
        await _do(a, "run", "echo secret > /tmp/mine; echo w > work.txt")
        # The image's root-owned files are the session's (idmapped layers): changed in its
        # own copy-on-write layer only, never in the image nor in another session.
        passwd = (await _do(b, "read", "/etc/passwd"))["text"]
        assert (await _do(a, "run", "echo intruder::0:0::/:/bin/sh >> /etc/passwd"))["code"] == 0
        assert (await _do(a, "run", "stat -c %u /etc/passwd"))["text"].strip() == str(a_uid)
        assert (await _do(b, "read", "/etc/passwd"))["text"] == passwd
        assert (await asyncio.to_thread(_image_file, images[0], "etc/passwd")) == passwd
        assert (await _do(a, "run", "cat /tmp/mine work.txt"))["text"] == "secret\nw\n"
        assert (await _do(b, "run", "cat /tmp/mine"))["code"] != 0
        assert (await _do(b, "ls"))["text"] == ""
        await a.reset()
        assert (await _do(a, "run", "cat /tmp/mine"))["code"] != 0  # pristine again
        assert (await _do(a, "read", "/etc/passwd"))["text"] == passwd
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
        with pytest.raises(stadium.ValidationError, match="cannot be used as a root filesys"):
            await b.reset(options={"image": "dir:/var/empty/stadium/missing"})  # allowed, absent
        assert (await _do(b, "read", "/etc/image-name"))["text"] == "b\n"  # it kept its image
        await b.reset(options={"image": images[0]})
        assert (await _do(b, "read", "/etc/image-name"))["text"] == "a\n"
        samples = await scrape(server.url)
        assert value(samples, "stadium_image_starts_total", image=images[1]) >= 1
        assert value(samples, "stadium_image_starts_total", image=images[0]) >= 2
        assert ("stadium_image_warm_processes", (("image", "other"),)) in samples
        assert value(samples, "stadium_images_leased") >= 0  # the node's store's figures


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
    with pytest.raises(ConfigError, match="cannot be used as a root filesystem"):
        async with serve(TARGET, isolation="sandbox", image="dir:/nonexistent/rootfs"):
            pass
    with pytest.raises(ConfigError, match="no such image in Podman's storage"):
        async with serve(TARGET, isolation="sandbox", image="no-such-ref"):
            pass


async def test_the_shell_and_code_envs_run_inside_the_image(images: tuple[str, str]) -> None:
    async with (
        serve("shell", isolation="sandbox", image=images[0]) as server,
        stadium.AsyncClient(server.url) as shell,
    ):
        await shell.reset()
        got = await shell.step({"command": "only-in-the-image; . /etc/os-release; echo $ID"})
        assert got.observation["stdout"] == "image tool\ndebian\n"
        assert (await shell.step({"command": "pwd"})).observation["stdout"] == "/sandbox\n"
    code = (
        "import sys\ndef add(a, b):\n    return a + b if sys.version_info[:2] == (3, 13) else 0\n"
    )
    async with (
        serve("code", isolation="sandbox", image=images[0]) as server,
        stadium.AsyncClient(server.url) as env,
    ):
        await env.reset(options={"task": "add"})
        step = await env.step({"code": code})  # graded under the image's python3 (3.13)
        assert step.reward == 1.0
        assert step.done


async def test_podman_images_through_the_store_with_their_config(
    task_images: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Podman REFs, prepared by the node's store (a cache kept between runs here): the
    image's WORKDIR and ENV are the session's; a whiteout layer hides what it deleted."""
    monkeypatch.setenv("STADIUM_IMAGE_CACHE_DIR", str(CACHE / "imgbox-store"))
    a, b, wh = task_images["a"], task_images["b"], task_images["wh"]
    async with (
        serve(TARGET, isolation="sandbox", image=a, images=f"{b},{wh}") as server,
        stadium.AsyncClient(server.url) as env,
    ):
        assert (await env.reset()).observation["text"] == "/work/repo"
        got = await _do(env, "run", "echo $STADIUM_TASK; cat /etc/stadium-image; pwd")
        assert got["text"] == "a\na\n/work/repo\n"
        unittest = "PYTHONPATH=. python3 tests/test_calc.py"
        assert (await _do(env, "run", f"{unittest} 2>&1 | tail -1"))["text"] == "OK\n"
        await _do(env, "write", "calc/__init__.py", "def add(a, b):\n    return a - b\n")
        assert (await _do(env, "run", unittest))["code"] == 1  # its files are the session's
        await env.reset(options={"image": wh})
        assert (await _do(env, "ls"))["text"] == "NEW:file"  # an opaque directory
        assert (await _do(env, "run", "test -e /etc/stadium-image"))["code"] == 1  # whiteout
        await env.reset(options={"image": b})
        assert (await _do(env, "run", "echo $STADIUM_TASK; pwd"))["text"] == "b\n/sandbox\n"
