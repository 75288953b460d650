"""The ``--record`` writer's usual path (no ``--record-redact`` hook), in bulk: no Python code
per step, only per block of the stream and per episode.

**A block** (:mod:`.wire`): its headers unpacked by ``struct.iter_unpack`` and turned into
columns by ``zip``; each message's bytes are sliced out of the block's bytes at the offsets
the lengths give (``itertools.accumulate``); a group of steps (one encoding) is decoded by
one call: the request frames joined as one JSON array (``b","``) or MessagePack array (a
header before them), and the reply frames likewise, each read as a list of structs whose
observation and info are ``msgspec.Raw`` (a JSON session's observation is stored as the
very bytes the client got). The steps' columns (:data:`STEPS`: the episode's recording id
and the shard's per-step values) become one Arrow record batch, held until their episodes
end (:class:`Pending`).

**Episodes ending.** At most every :data:`~.record.WAKE_S` (or when the stream ends), the
held batches are one table: the steps of the episodes that ended are taken out (Arrow's
``is_in``/``filter``), ordered by episode (``index_in`` then a stable ``sort_indices``:
each episode's steps in their order), and become the list columns of one record batch of
the shard (:meth:`~.rows.Shard.add_batch`); the steps of running episodes stay held. Python
code runs per episode: its scalar columns, its total reward, the filter. Steps that failed
(their reply is the error's text) are columns of their own group, built in Python (rare).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

from stadium._server.ledger import arrow
from stadium._server.ledger.episode import Episode
from stadium._server.ledger.rows import LIST_COLUMNS, Rows, Shard, msgpack_text, reward

_DATA = attrgetter("data")
_OBS = attrgetter("observation")
_REWARD = attrgetter("reward")
_DONE = attrgetter("done")
_TRUNCATED = attrgetter("truncated")
_NUMBERS = {float, int}
_isfinite = math.isfinite
#: Held steps are copied into one batch when they are in more than this many.
_BATCHES = 64


def steps_schema(pa: Any) -> Any:
    """The held steps' columns: the recording id, then :data:`~.rows.LIST_COLUMNS`' items."""
    text, f64, flag = pa.string(), pa.float64(), pa.bool_()
    return pa.schema([
        ("rid", pa.int64()), ("actions", text), ("observations", text), ("rewards", f64),
        ("dones", flag), ("truncateds", flag), ("infos", text), ("step_errors", text),
        ("step_s", f64),
    ])  # fmt: skip


def _array(json: bool, items: list[bytes]) -> bytes:
    """``items`` (frames of one encoding) as one array of that encoding."""
    if json:
        return b"".join((b"[", b",".join(items), b"]"))
    return b"".join((b"\xdd", len(items).to_bytes(4, "big"), *items))


class Pending:
    """Steps of running episodes, as Arrow record batches (module doc)."""

    def __init__(self, rows: Rows) -> None:
        import pyarrow as pa  # only a recording server's writer loads these
        import pyarrow.compute as pc

        self.pa, self.pc = pa, pc
        self.rows = rows
        self.schema = steps_schema(pa)
        self.batches: list[Any] = []

    def add(
        self,
        json: bool,
        rids: Sequence[int],
        requests: list[bytes],
        replies: list[bytes],
        took: Sequence[float],
    ) -> None:
        """Steps of one encoding that did not fail: decoded in two calls, held as columns.

        Raises:
            msgspec.DecodeError, ValueError, TypeError: a frame cannot be read (the caller
                takes the steps one by one).
        """
        rows, pa = self.rows, self.pa
        n = len(rids)
        actions = list(map(_DATA, rows.requests[json](_array(json, requests))))
        datas = list(map(_DATA, rows.replies[json](_array(json, replies))))
        if len(actions) != n or len(datas) != n:
            raise ValueError("a frame held more than one value")
        observations = list(map(_OBS, datas))
        infos = list(map(rows._info, datas))
        if not json:  # MessagePack values as JSON text
            actions = list(map(msgpack_text, actions))
            observations = list(map(msgpack_text, observations))
            infos = list(map(msgpack_text, infos))
        rewards: list[Any] = list(map(_REWARD, datas))
        if not set(map(type, rewards)) <= _NUMBERS:
            rewards = list(map(reward, rewards))
        self.batches.append(
            pa.RecordBatch.from_arrays(
                [
                    arrow.ints(pa, rids),
                    arrow.strings(pa, list(map(len, actions)), b"".join(actions), False),
                    arrow.strings(pa, list(map(len, observations)), b"".join(observations)),
                    arrow.floats(pa, rewards),
                    arrow.bools(pa, list(map(_DONE, datas))),
                    arrow.bools(pa, list(map(_TRUNCATED, datas))),
                    arrow.strings(pa, list(map(len, infos)), b"".join(infos)),
                    arrow.strings(pa, [0] * n, b""),
                    arrow.floats(pa, took, nullable=False),
                ],
                schema=self.schema,
            )
        )

    def add_failed(self, json: bool, rid: int, request: bytes, error: str, took: float) -> None:
        """A step that failed (its reply is the error's text), on its own."""
        action = self.rows._request[json](request).data  # type: ignore[attr-defined]
        text = bytes(action) if json else msgpack_text(action)
        pa = self.pa
        self.batches.append(
            pa.RecordBatch.from_arrays(
                [
                    arrow.ints(pa, [rid]), arrow.strings(pa, [len(text)], text, False),
                    arrow.strings(pa, [0], b""), arrow.floats(pa, [None]),
                    arrow.bools(pa, [False]), arrow.bools(pa, [False]),
                    arrow.strings(pa, [0], b""),
                    arrow.strings(pa, [len(error.encode())], error.encode()),
                    arrow.floats(pa, [took], nullable=False),
                ],
                schema=self.schema,
            )
        )  # fmt: skip

    def take(
        self,
        gone: list[int],
        ended: list[tuple[int, Episode, str | None]],
        shard: Shard,
    ) -> tuple[int, int]:
        """The steps of episodes ``gone`` (ended, dropped) no longer held; those of
        ``ended`` (recording id, episode, its first step error) added to ``shard`` as one
        record batch, through the filter. Returns (episodes added, episodes left out by
        the filter)."""
        pa, pc, rows = self.pa, self.pc, self.rows
        table = pa.Table.from_batches(self.batches, schema=self.schema)
        rid = table.column("rid")
        if gone:
            held = table.filter(pc.invert(pc.is_in(rid, value_set=arrow.ints(pa, gone))))
            self.batches = held.to_batches() if held.num_rows else []
            if len(self.batches) > _BATCHES:
                self.batches = held.combine_chunks().to_batches()
        if not ended:
            return 0, 0
        ids = arrow.ints(pa, [e[0] for e in ended])
        position = pc.index_in(rid, value_set=ids)  # null: a step of an episode still open
        order = pc.array_sort_indices(position, null_placement="at_end")  # stable: step order
        order = order.slice(0, len(position) - position.null_count)
        steps = table.take(order)
        where = position.take(order).to_pylist()
        seen = Counter(where)
        counts = [seen.get(i, 0) for i in range(len(ended))]
        rewards = steps.column("rewards").to_pylist()
        out: list[tuple[Any, ...]] = []
        kept: list[int] = []
        start = 0
        for i, ((_rid, ep, error), n) in enumerate(zip(ended, counts, strict=True)):
            seg = rewards[start : start + n]
            start += n
            total = sum((r for r in seg if r is not None and _isfinite(r)), 0.0)
            row = rows.scalars(ep, total, error, *rows.reset_texts(ep))
            if rows.kept(ep, row):
                out.append(row)
                kept.append(i)
        if not out:
            return 0, len(ended)
        if len(kept) < len(ended):
            keep = pc.is_in(arrow.ints(pa, where), value_set=arrow.ints(pa, kept))
            steps = steps.filter(keep)
            counts = [counts[i] for i in kept]
        batch = steps.combine_chunks().to_batches()
        if not batch:  # no step at all
            batch = [self.schema.empty_table().combine_chunks().to_batches(max_chunksize=1)]
        shard.add_batch(out, counts, [batch[0].column(name) for name in LIST_COLUMNS])
        return len(out), len(ended) - len(out)


def offsets(first: Sequence[int], second: Sequence[int]) -> list[int]:
    """Where each message's two byte strings start and end in a block's bytes:
    ``[start of 1st, end of 1st = start of 2nd, end of 2nd = start of the next 1st, ...]``."""
    pairs = itertools.chain.from_iterable(zip(first, second, strict=True))
    return list(itertools.accumulate(pairs, initial=0))


__all__ = ["Pending", "offsets", "steps_schema"]
