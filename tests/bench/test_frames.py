"""The load generators' frames are the core's Structs (:mod:`stadium._core.frames`), and
their bytes are what the bench sent when it built them from dicts: a bench measures every
server (OpenEnv's included) with the same bytes, before and after. The old dict-built
frames are written here as they were built in ``stadium.bench``."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from stadium.bench import batched, opcount, rl, sessions, start
from stadium.bench.loadspec import LoadSpec


def _old(frame: dict[str, Any]) -> bytes:
    return msgspec.json.encode(frame)


@pytest.mark.parametrize(("wait_s", "state_kb"), [(0.0, 0), (1.0, 0), (0.005, 64)])
def test_the_session_load_sends_the_old_bytes(wait_s: float, state_kb: int) -> None:
    spec = LoadSpec(url="ws://127.0.0.1:1/ws", sessions=1, wait_s=wait_s, state_kb=state_kb)
    reset_data = {"state_kb": state_kb} if state_kb else {}
    assert sessions.messages(spec) == (
        _old({"type": "reset", "data": reset_data}),
        _old({"type": "step", "data": {"wait_seconds": wait_s}}),
    )
    assert sessions.CLOSE == b'{"type":"close"}'


def test_the_start_rl_and_opcount_loads_send_the_old_bytes() -> None:
    assert start._RESET == b'{"type":"reset","data":{}}'
    for tool_s in (0.0, 0.25):
        assert rl.frames(rl.RlProfile(tool_s=tool_s)) == (
            _old({"type": "step", "data": {"wait_seconds": tool_s}}),
            _old({"type": "reset", "data": {}}),
        )
    assert opcount._RESET == b'{"type":"reset","data":{}}'
    assert opcount._CLOSE == b'{"type":"close"}'
    for action in (opcount._BENCHMARK_ACTION, {}, {"message": "hi", "n": [1, 2.5, None]}):
        assert opcount.step_frame(action) == _old({"type": "step", "data": action})


@pytest.mark.parametrize("kind", ["reset", "step"])
def test_a_batch_frame_is_the_old_one_in_the_cores_key_order(kind: str) -> None:
    """The one change: each call's keys in the core's order (``type``, ``data``,
    ``session``: what Stadium's own batch client sends), ``session`` first before."""
    data = {"wait_seconds": 0.0}
    body = batched.batch_body(kind, [0, 3, 7], data)
    calls = [{"session": s, "type": kind, "data": data} for s in (0, 3, 7)]
    old = _old({"type": "batch", "id": kind, "calls": calls})
    assert msgspec.json.decode(body) == msgspec.json.decode(old)
    assert len(body) == len(old)
    assert body.startswith(b'{"type":"batch","id":"%s","calls":[{"type":"%s","data":' % (
        kind.encode(), kind.encode()))  # fmt: skip
