"""An env that uses :class:`stadium.Workspace` as a policy would (the task image tests)."""

from __future__ import annotations

import os
import socket

import msgspec

import stadium


class Act(msgspec.Struct):
    do: str
    arg: str = ""
    data: str = ""


class Obs(msgspec.Struct):
    text: str = ""
    code: int | None = 0
    uid: int = 0
    image: str = ""


class Imaged(stadium.Environment[Act, Obs, stadium.State]):
    """``run`` a shell line, ``py`` a snippet, ``write``/``read``/``ls`` files, ``connect``
    to an address, ``seccomp``: the process's seccomp mode."""

    blocking = True

    def __init__(self) -> None:
        self.ws = stadium.Workspace.current()
        self.image = ""

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> Obs:
        self.image = str((options or {}).get("image", ""))
        return Obs(self.ws.root, 0, os.getuid(), self.image)

    def step(self, action: Act) -> stadium.StepResult[Obs]:
        ws, arg = self.ws, action.arg
        if action.do == "run":
            got = ws.run(arg, timeout=30)
            obs = Obs(got.stdout + got.stderr, got.exit_code)
        elif action.do == "py":
            got = ws.python(arg, timeout=30)
            obs = Obs(got.stdout + got.stderr, got.exit_code)
        elif action.do == "write":
            ws.write_file(arg, action.data)
            obs = Obs("written")
        elif action.do == "read":
            obs = Obs(ws.read_file(arg))
        elif action.do == "ls":
            obs = Obs(" ".join(f"{e.name}:{e.kind}" for e in ws.list_dir(arg or ".")))
        elif action.do == "connect":
            host, port = arg.rsplit(":", 1)
            try:
                socket.create_connection((host, int(port)), timeout=2).close()
                obs = Obs("connected")
            except OSError as exc:
                obs = Obs(f"refused: {exc}", 1)
        else:
            raise ValueError(f"unknown action {action.do!r}")
        obs.uid, obs.image = os.getuid(), self.image
        return stadium.StepResult(obs, reward=0.0)

    def close(self) -> None:
        self.ws.close()
