"""The env side of an ``--isolation vm`` guest, once :mod:`.vmguest` has set ``sys.path``.

It imports the env's code (as a template does, :mod:`.child`), answers ``Ready`` (or
``Failed``), waits for the worker's ``go`` (the point a snapshot is taken at: each
restored copy continues from here), mixes the ``go``'s fresh entropy into the guest
kernel's pool and Python's ``random``, then serves one session with the same loop as a
sandboxed process (:func:`~stadium._server.isolation.template.env_process.session_main`), on the
virtio-serial port in place of a socket.
"""

from __future__ import annotations

import gc
import os
import random
import socket
from collections.abc import Callable
from typing import Any, cast

import msgspec

from stadium._env.spec import EnvSpec
from stadium._server.isolation import wire
from stadium._server.isolation.template import env_process
from stadium._server.loader import load_target

#: The largest ``go`` frame read.
GO_MAX = 4096
GO = msgspec.msgpack.Decoder(wire.Go)


def serve(port: Any, settings: dict[str, Any], recv: Callable[[Any, int], bytes]) -> None:
    """Import the target, say ``Ready``, wait for ``go``, serve the session (never returns)."""
    env_kwargs = settings.get("env_kwargs") or {}
    try:
        env_process._Ctx.spec = EnvSpec.of(load_target(settings["target"], env_kwargs=env_kwargs))
    except Exception as exc:
        port.sendall(wire.frame(wire.encode(wire.Failed(f"{type(exc).__name__}: {exc}"))))
        os._exit(3)
    env_process._Ctx.env_kwargs = env_kwargs
    env_process._Ctx.sandbox = False
    gc.collect()
    gc.freeze()
    port.sendall(wire.frame(wire.encode(wire.Ready(os.getpid(), None, None))))
    go = GO.decode(recv(port, GO_MAX))
    with open("/dev/urandom", "wb") as pool:  # mixed in: restored copies diverge
        pool.write(go.seed)
    random.seed(go.seed + os.urandom(16))
    env_process.session_main(cast(socket.socket, port))
