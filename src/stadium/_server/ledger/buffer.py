"""The buffer a worker's event loop copies its recorded episodes' messages into (:mod:`.pipe`'s
stream), for its ``--record`` writer process: :class:`StepBuffer`.

A recorded step is copied on the loop, inside the step's reply: its header and both frames.
In Python that is a method call, a ``struct`` pack and three ``bytearray`` appends, ~0.35 µs
a step, a quarter of what ``--record`` costs the whole server per step (BENCHMARKS.md,
"Episode ledger cost"). So the usual case has a native twin: ``_recordbuf.StepBuffer``
(``native/stadium-record-buffer``, a CPython extension in Rust, PyO3, the stable ABI of
Python ≥ 3.11; built by ``make record-deps`` and into the wheel) does the same in ~0.1 µs.
Without it (no cargo where Stadium was installed) :class:`PyStepBuffer` below does it,
byte for byte the same, and the server says so once when it starts recording.

Both: ``step(rid, request, reply, took)`` appends a STEP message when both frames are
``bytes`` and fit under :attr:`room` with what is buffered, else calls ``slow`` with the same
arguments (the recorder's own path: bounds, broken episodes, the flush timer); ``+=`` appends
bytes; ``len()``; :meth:`clear`; :meth:`write` writes what is buffered to a file
descriptor (one non-blocking ``write(2)``) and drops what was written. Nothing here is
across a trust boundary: the frames are the worker's own (the request as the client sent it
is only copied).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Protocol

from stadium._server.ledger import pipe

_PACK = pipe.HEAD.pack
_STEP = pipe.STEP


class StepBufferType(Protocol):
    """What the recorder uses of a step buffer (either implementation)."""

    room: int

    def step(self, rid: int, request: bytes | str, reply: bytes | str, took: float) -> None: ...

    def __iadd__(self, other: bytes) -> StepBufferType: ...

    def __len__(self) -> int: ...

    def clear(self) -> None: ...

    def write(self, fd: int) -> int: ...


Slow = Callable[[int, bytes | str, bytes | str, float], None]


class PyStepBuffer(bytearray):
    """:class:`StepBuffer` in Python (module doc)."""

    __slots__ = ("_slow", "room")

    def __init__(self, room: int, slow: Slow) -> None:
        super().__init__()
        self.room = room
        self._slow = slow

    def step(self, rid: int, request: bytes | str, reply: bytes | str, took: float) -> None:
        if (
            len(self) + len(request) + len(reply) < self.room
            and type(request) is bytes
            and type(reply) is bytes
        ):
            self += _PACK(_STEP, rid, False, took, len(request), len(reply))
            self += request
            self += reply
            return
        self._slow(rid, request, reply, took)

    def write(self, fd: int) -> int:
        if not self:
            return 0
        n = os.write(fd, self)
        del self[:n]
        return n


def native() -> Callable[[int, Slow], StepBufferType] | None:
    """The native :class:`StepBuffer`, or ``None`` when it was not built."""
    try:  # (by name: a compiled module, which the import contracts' graph does not see)
        module = importlib.import_module("stadium._server.ledger._recordbuf")
    except ImportError:
        return None
    made: Callable[[int, Slow], StepBufferType] = module.StepBuffer
    return made


StepBuffer: Callable[[int, Slow], StepBufferType] = native() or PyStepBuffer
"""The step buffer the recorder uses: the native one when built (module doc)."""
NATIVE = StepBuffer is not PyStepBuffer

__all__ = ["NATIVE", "PyStepBuffer", "StepBuffer", "StepBufferType", "native"]
