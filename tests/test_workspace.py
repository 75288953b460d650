"""``Workspace`` without an image: a temporary work directory per env, on the host's tools."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

import stadium
from stadium import DirEntry, RunResult, Workspace
from stadium._env import workspace as workspace_module
from tests.conftest import UNIT, proc_alive, wait_until


@pytest.fixture
def ws() -> Iterator[Workspace]:
    with Workspace.current() as space:
        yield space


def test_each_current_is_a_fresh_directory_removed_on_close() -> None:
    a, b = Workspace.current(), Workspace.current()
    assert a.root != b.root
    assert os.path.isdir(a.root)
    assert os.path.isdir(b.root)
    a.close()
    assert not os.path.exists(a.root)
    b.close()
    assert stadium.Workspace is Workspace


def test_run_a_shell_line_and_an_argv(ws: Workspace) -> None:
    got = ws.run("echo out; echo err >&2; exit 3")
    assert isinstance(got, RunResult)
    assert (got.exit_code, got.stdout, got.stderr) == (3, "out\n", "err\n")
    assert not got.truncated
    assert not got.timed_out
    assert got.duration_s > 0
    assert ws.run(["printf", "%s", "a b"]).stdout == "a b"
    assert ws.run(["cat"], stdin="fed").stdout == "fed"
    assert ws.run(["cat"], stdin=b"\x00\x01").stdout == "\x00\x01"


def test_run_in_cwd_with_env(ws: Workspace) -> None:
    ws.write_file("sub/x", "")
    got = ws.run("pwd; echo $GREETING", cwd="sub", env={"GREETING": "hi"})
    assert got.stdout == f"{os.path.join(ws.root, 'sub')}\nhi\n"
    assert ws.run("pwd").stdout.strip() == ws.root


def test_a_missing_program_is_exit_127(ws: Workspace) -> None:
    got = ws.run(["/nonexistent/tool"])
    assert got.exit_code == 127
    assert "/nonexistent/tool" in got.stderr
    assert ws.run("nonexistent-tool-xyz").exit_code == 127


async def test_the_timeout_kills_the_whole_group(ws: Workspace) -> None:
    got = ws.run("sleep 60 & echo $! > pid; sleep 60", timeout=0.3 * UNIT)
    assert got.timed_out
    assert got.exit_code is None
    assert got.duration_s < 10 * UNIT
    pid = int(ws.read_file("pid"))
    await wait_until(lambda: not proc_alive(pid), 5 * UNIT, "the background sleep killed")


def test_background_jobs_do_not_hold_the_call(ws: Workspace) -> None:
    got = ws.run("sleep 60 & echo started", timeout=30 * UNIT)
    assert got.stdout == "started\n"
    assert got.exit_code == 0
    assert got.duration_s < 10 * UNIT


def test_output_is_bounded_with_a_visible_marker(ws: Workspace) -> None:
    got = ws.run("head -c 100000 /dev/zero | tr '\\0' a", max_output=10)
    assert got.truncated
    assert got.stdout.startswith("a" * 10)
    assert got.stdout.endswith("[... output truncated: 99990 more bytes]")
    assert ws.run(["printf", "ééé"], max_output=3).stdout == "é" * 3


def test_python_snippets(ws: Workspace) -> None:
    got = ws.python("import os, sys; print(os.getcwd()); print('e', file=sys.stderr)")
    assert (got.exit_code, got.stdout, got.stderr) == (0, f"{ws.root}\n", "e\n")
    assert ws.python("import sys; sys.exit(4)").exit_code == 4
    assert ws.python("input()").exit_code == 1  # stdin is at EOF
    failed = ws.python("raise ValueError('boom')")
    assert failed.exit_code == 1
    assert failed.stderr.endswith("ValueError: boom\n")
    assert '"<python>", line 1' in failed.stderr
    assert "in run" not in failed.stderr
    assert ws.python("print(__name__)").stdout == "__main__\n"
    assert ws.python("x = 1").stdout == ""  # no state kept between snippets
    assert ws.python("print('x' in dir())").stdout == "False\n"


def test_a_python_timeout_kills_the_snippet_and_the_server_goes_on(ws: Workspace) -> None:
    got = ws.python("import subprocess; subprocess.Popen(['sleep', '60'])\nwhile True: pass",
                    timeout=0.5 * UNIT)  # fmt: skip
    assert got.timed_out
    assert got.exit_code is None
    assert ws.python("print(2)").stdout == "2\n"
    big = ws.python("print('y' * 100000)", max_output=5)
    assert big.truncated
    assert big.stdout.startswith("yyyyy\n[... output truncated")


def test_a_dead_fork_server_is_started_again(ws: Workspace) -> None:
    assert ws.python("print(1)").exit_code == 0
    server = ws._server
    assert server is not None
    server.kill()  # through the supervisor, which reaps it
    server.wait(time.monotonic() + 10 * UNIT)
    assert ws.python("print(2)").stdout == "2\n"  # found dead: a new one
    with pytest.raises(stadium.ExecutionError, match="fork server exited"):
        ws.python("import os, signal; os.kill(os.getppid(), signal.SIGKILL); input()")
    assert ws.python("print(3)").stdout == "3\n"


#: A daemon that escapes the command's group and session (setsid, then a double fork).
DAEMON = (
    "setsid sh -c 'echo $$ > pid; while :; do echo x > tick; sleep 0.01; done' >/dev/null 2>&1 &"
    " while [ ! -s pid ]; do sleep 0.01; done"
)


def _pid(ws: Workspace, name: str = "pid") -> int:
    return int(ws.read_file(name))


def test_stop_others_ends_daemons_that_escaped_and_the_workspace_goes_on(ws: Workspace) -> None:
    assert ws.run(DAEMON).exit_code == 0
    daemon = _pid(ws)
    snippet = (
        "import subprocess as s; print(s.Popen(['sleep', '60'], start_new_session=True, "
        "stdout=s.DEVNULL).pid)"
    )
    sleeper = int(ws.python(snippet).stdout)
    assert proc_alive(daemon)  # they outlived their command and its group
    assert proc_alive(sleeper)
    assert ws.stop_others() >= 4  # the two, the fork server and its spare
    assert not proc_alive(daemon)
    assert not proc_alive(sleeper)
    os.remove(os.path.join(ws.root, "tick"))
    time.sleep(0.1 * UNIT)
    assert not os.path.exists(os.path.join(ws.root, "tick"))  # nothing rewrites it
    assert ws.run("echo ok").stdout == "ok\n"  # commands and snippets still work
    assert ws.python("print(7)").stdout == "7\n"
    assert ws.stop_others() >= 1  # the new fork server
    assert proc_alive(os.getpid())


def test_a_killed_supervisor_makes_stop_others_refuse(ws: Workspace) -> None:
    assert ws.run("true").exit_code == 0
    supervisor = ws._sup
    assert supervisor is not None
    with pytest.raises(stadium.ExecutionError, match="supervisor is gone"):
        ws.run(f"kill -9 {supervisor.pid}")  # its status is lost with it
    killed = r"process supervisor \(pid \d+\) was killed"
    for _ in range(2):  # and from then on
        with pytest.raises(stadium.ExecutionError, match=killed):
            ws.stop_others()
    assert ws.run("echo still").stdout == "still\n"  # commands go on (a new supervisor)
    with pytest.raises(stadium.ExecutionError, match="was killed"):
        ws.stop_others()


def test_files(ws: Workspace) -> None:
    ws.write_file("a/b/c.txt", "héllo")
    ws.write_file("bin.dat", b"\x00\xff")
    os.symlink("bin.dat", os.path.join(ws.root, "link"))
    assert ws.read_file("a/b/c.txt") == "héllo"
    assert ws.read_bytes(os.path.join(ws.root, "bin.dat")) == b"\x00\xff"
    assert ws.list_dir() == [
        DirEntry("a", "dir", os.stat(os.path.join(ws.root, "a")).st_size),
        DirEntry("bin.dat", "file", 2),
        DirEntry("link", "link", len("bin.dat")),
    ]
    with pytest.raises(stadium.ExecutionError, match="over 3 bytes"):
        ws.read_file("a/b/c.txt", max_bytes=3)
    with pytest.raises(FileNotFoundError):
        ws.read_file("nope")


def test_an_image_context_gives_its_env_and_workdir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.setattr(workspace_module, "_image", None)
    workspace_module.bind_image({"ANSWER": "42"}, str(tmp_path))
    space = Workspace.current()
    assert space.root == str(tmp_path)
    assert space.env["ANSWER"] == "42"
    assert space.env["PATH"] == workspace_module.DEFAULT_PATH
    assert space.run("echo $ANSWER").stdout == "42\n"
    space.close()
    assert os.path.isdir(str(tmp_path))  # the image's directory is not the workspace's to remove
    assert space._python is None  # the image's python3 (on its PATH), not this interpreter
