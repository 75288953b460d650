"""Ended episodes gathered as the columns of a ``--record`` shard, and a shard written (the
writer process's work; docs/RECORDING.md has the schema).

The writer takes the episodes that ended since it last woke as one batch, and the usual
path handles the batch column by column, with no Python code per step: each reply frame
read once by a decoder whose observation and info are ``msgspec.Raw`` (a JSON session's
observation is stored as the very bytes the client got, neither decoded nor encoded
again), each field taken with ``map(attrgetter)``, each action encoded by the encoder's
own C method, and the Arrow arrays made from those lists by :mod:`.arrow` (no JSON round
trip, no pandas). Python code per step runs only for an episode with a failed step, one
given to a ``--record-redact`` hook (built as plain Python values first: the hook's
record), or a MessagePack session's values (turned into JSON text).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import time
from collections.abc import Callable
from operator import attrgetter
from typing import Any

import msgspec

from stadium._env.codecs import enc_hook_default
from stadium._server.ledger import arrow
from stadium._server.ledger.episode import EndReason, Episode

Summary = dict[str, float | bool]
"""What a filter reads of an episode: ``reward`` (the sum of its rewards), ``steps``,
``wall_s``, ``cpu_s``, ``bytes_in``, ``bytes_out``; ``error``, ``done``, ``truncated``,
``clipped``."""

#: The columns holding one value per step (lists), and those holding one per episode.
LIST_COLUMNS = (
    "actions", "observations", "rewards", "dones", "truncateds", "infos", "step_errors",
    "step_s",
)  # fmt: skip


def _fallback(value: Any) -> Any:
    if isinstance(value, msgspec.msgpack.Ext):
        return {"ext": value.code, "data": value.data}
    return enc_hook_default(value)


_ENCODER = msgspec.json.Encoder(enc_hook=_fallback)
_NULL = msgspec.Raw(b"")
_DATA = attrgetter("data")
_OBS = attrgetter("observation")
_REWARD = attrgetter("reward")
_DONE = attrgetter("done")
_TRUNCATED = attrgetter("truncated")
_NUMBERS = {float, int}
_isfinite = math.isfinite


def _json(value: Any) -> str:
    return _ENCODER.encode(value).decode()


def _text(value: Any) -> bytes:
    """A value as stored: JSON text, ``b""`` (a null) for ``None``."""
    return b"" if value is None else _ENCODER.encode(value)


class Texts:
    """A string column being gathered: each batch's items joined at once (a bounded
    ``bytes.join`` per batch, not one over the whole shard with the GIL held), their
    lengths kept; an empty item is a null."""

    __slots__ = ("chunks", "lengths")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.lengths: list[int] = []

    def add(self, items: list[Any]) -> None:
        self.lengths += map(len, items)
        self.chunks.append(b"".join(items))

    def add_nulls(self, n: int) -> None:
        self.lengths += itertools.repeat(0, n)

    def array(self, pa: Any, nullable: bool = True) -> Any:
        return arrow.strings(pa, self.lengths, b"".join(self.chunks), nullable)


class Shard:
    """One shard while its episodes are gathered: Arrow record batches, one per chunk the
    writer took (:meth:`seal`: a bounded piece of work with the GIL held, not one over the
    whole shard), and the open chunk's columns: a tuple of per-episode values each, and the
    steps' values flat."""

    def __init__(self) -> None:
        self.batches: list[Any] = []
        self.sealed = 0
        """Episodes in :attr:`batches`."""
        self._open()

    def _open(self) -> None:
        self.episodes: list[tuple[Any, ...]] = []
        """Per episode: its scalar columns, in :data:`_SCALARS` order."""
        self.counts: list[int] = []
        self.actions = Texts()
        self.observations = Texts()
        self.rewards: list[float | None] = []
        self.dones: list[bool] = []
        self.truncateds: list[bool] = []
        self.infos = Texts()
        self.step_errors = Texts()
        self.step_s: list[float] = []

    def __len__(self) -> int:
        return self.sealed + len(self.episodes)

    def seal(self, pause: float = 0.0) -> None:
        """The open chunk's episodes as one Arrow record batch; ``pause``: seconds to
        sleep between its columns (the GIL let go: a loop waiting for it takes it then)."""
        if not self.episodes:
            return
        import pyarrow as pa  # only a recording server loads it

        columns = list(zip(*self.episodes, strict=True))
        out: list[Any] = []
        for (_name, kind), values in zip(_SCALARS, columns, strict=True):
            if kind == "json":
                out.append(arrow.strings(pa, list(map(len, values)), b"".join(values)))
            else:
                out.append(_BUILD[kind](pa, values))
        counts = self.counts
        children: list[Callable[[], Any]] = [
            lambda: self.actions.array(pa, nullable=False),
            lambda: self.observations.array(pa),
            lambda: arrow.floats(pa, self.rewards),
            lambda: arrow.bools(pa, self.dones),
            lambda: arrow.bools(pa, self.truncateds),
            lambda: self.infos.array(pa),
            lambda: self.step_errors.array(pa),
            lambda: arrow.floats(pa, self.step_s, nullable=False),
        ]
        for child in children:
            if pause:
                time.sleep(pause)
            out.append(arrow.lists(pa, counts, child()))
        self.batches.append(pa.RecordBatch.from_arrays(out, schema=schema(pa)))
        self.sealed += len(self.episodes)
        self._open()

    def table(self) -> Any:
        """The shard as a ``pyarrow.Table`` of :func:`schema`'s columns (its batches, not
        copied)."""
        import pyarrow as pa

        self.seal()
        return pa.Table.from_batches(self.batches, schema=schema(pa))


_SCALARS = (
    ("env", "text"), ("env_version", "text"), ("episode_id", "text"), ("worker", "int"),
    ("started_at", "float"), ("seed", "int"), ("options", "json"), ("end", "text"),
    ("error", "text"), ("clipped", "bool"), ("total_reward", "float"), ("steps", "int"),
    ("wall_s", "float"), ("cpu_s", "float"), ("cpu_source", "text"), ("bytes_in", "int"),
    ("bytes_out", "int"), ("peak_rss_bytes", "int"), ("reset_observation", "json"),
    ("reset_info", "json"),
)  # fmt: skip
_BUILD: dict[str, Callable[[Any, Any], Any]] = {
    "text": arrow.texts, "int": arrow.ints, "float": arrow.floats, "bool": arrow.bools,
}  # fmt: skip


class Rows:
    """Turns ended episodes into a shard's columns for one env (its name, version,
    ``info_key``), through the redaction hook and the filter when given."""

    def __init__(
        self,
        env: tuple[str, str],
        info_key: str,
        keep: Callable[[Summary], bool] | None,
        redact: Callable[[dict[str, Any]], dict[str, Any] | None] | None,
        worker: int | None = None,
    ) -> None:
        self.env_name, self.env_version = env
        self.info_key = info_key
        self.keep = keep
        self.redact = redact
        data = msgspec.defstruct(
            "ReplyData",
            [
                ("observation", msgspec.Raw, _NULL),
                ("reward", Any, None),
                ("done", bool, False),
                ("truncated", bool, False),
                (info_key, msgspec.Raw, _NULL),
            ],
            gc=False,  # decoded trees hold no cycle: never the collector's to walk
        )
        reply = msgspec.defstruct("Reply", [("data", data)], gc=False)
        self._decode = {
            True: msgspec.json.Decoder(reply).decode,
            False: msgspec.msgpack.Decoder(reply).decode,
        }
        request = msgspec.defstruct("Request", [("data", msgspec.Raw, _NULL)], gc=False)
        self._request = {
            True: msgspec.json.Decoder(request).decode,
            False: msgspec.msgpack.Decoder(request).decode,
        }
        self._info = attrgetter(info_key)
        self._pid = os.getpid() if worker is None else worker
        """The ``worker`` column: the worker's pid (this process's when not given)."""

    def add(self, episodes: list[Episode], shard: Shard) -> tuple[int, list[str]]:
        """Add ``episodes`` (a batch) to ``shard``. Returns how many were added (the hook
        and the filter may leave some out) and, for each episode that could not be (a
        hook that raised, a frame that cannot be read), its id and the error."""
        plain: dict[bool, list[Episode]] = {True: [], False: []}
        added = 0
        failed: list[str] = []
        if self.redact is None and str not in set(
            itertools.chain.from_iterable(map(type, ep.steps[1::3]) for ep in episodes)
        ):  # no step failed (the usual case): one test for the batch
            for ep in episodes:
                plain[ep.json].append(ep)
        else:
            for ep in episodes:
                if self.redact is None and str not in set(map(type, ep.steps[1::3])):
                    plain[ep.json].append(ep)
                else:
                    added += self._add_one(ep, shard, failed)
        for json, group in plain.items():
            if not group:
                continue
            try:
                added += self._add_plain(group, json, shard)
            except (msgspec.DecodeError, ValueError, TypeError, OverflowError):
                for ep in group:  # one of them is odd: each on its own, the slow way
                    added += self._add_one(ep, shard, failed)
        return added, failed

    # -- the usual path: a batch, column by column -------------------------------------

    def _add_plain(self, group: list[Episode], json: bool, shard: Shard) -> int:
        decode = self._decode[json]
        actions: list[Any] = []
        replies: list[Any] = []
        times: list[float] = []
        counts: list[int] = []
        for ep in group:
            steps = ep.steps
            actions += steps[0::3]
            replies += steps[1::3]
            times += steps[2::3]
            counts.append(len(steps) // 3)
        datas = list(map(_DATA, map(decode, replies)))
        encoded = list(map(_DATA, map(self._request[json], actions)))  # the action's text
        resets = list(map(_DATA, map(decode, [ep.reset_frame for ep in group])))
        observations = list(map(_OBS, datas))
        infos = list(map(self._info, datas))
        reset_obs = list(map(_OBS, resets))
        reset_infos = list(map(self._info, resets))
        if not json:  # MessagePack values as JSON text
            observations, infos, reset_obs, reset_infos, encoded = (
                list(map(_msgpack_text, observations)), list(map(_msgpack_text, infos)),
                list(map(_msgpack_text, reset_obs)), list(map(_msgpack_text, reset_infos)),
                list(map(_msgpack_text, encoded)),
            )  # fmt: skip
        rewards: list[Any] = list(map(_REWARD, datas))
        clean = set(map(type, rewards)) <= _NUMBERS
        rewards = list(map(float, rewards)) if clean else list(map(_reward, rewards))
        dones = list(map(_DONE, datas))
        truncateds = list(map(_TRUNCATED, datas))
        # per episode: its total, the filter, its scalar columns
        rows: list[tuple[Any, ...]] = []
        kept: list[int] = []
        start = 0
        for i, (ep, n) in enumerate(zip(group, counts, strict=True)):
            seg = rewards[start : start + n]
            start += n
            if clean:
                total = sum(filter(_isfinite, seg), 0.0)
            else:
                total = sum((r for r in seg if r is not None and _isfinite(r)), 0.0)
            row = self._scalars(ep, total, None, reset_obs[i], reset_infos[i])
            if self._kept(ep, row):
                rows.append(row)
                kept.append(i)
        if len(kept) == len(group):
            shard.episodes += rows
            shard.counts += counts
            _extend(shard, encoded, observations, rewards, dones, truncateds, infos, None, times)
            return len(rows)
        offsets = list(itertools.accumulate(counts, initial=0))
        for row, i in zip(rows, kept, strict=True):
            a, b = offsets[i], offsets[i + 1]
            shard.episodes.append(row)
            shard.counts.append(b - a)
            _extend(shard, encoded[a:b], observations[a:b], rewards[a:b], dones[a:b],
                    truncateds[a:b], infos[a:b], None, times[a:b])  # fmt: skip
        return len(rows)

    def _scalars(
        self, ep: Episode, total: float, error: str | None, reset_obs: Any, reset_info: Any
    ) -> tuple[Any, ...]:
        """The episode's values of the per-episode columns (:data:`_SCALARS`' order)."""
        cost = ep.cost
        return (
            self.env_name, self.env_version, ep.episode_id, self._pid, ep.started_at,
            ep.seed, _text(ep.options), ep.end._value_, error, ep.clipped, total,
            cost.steps, cost.wall_s, cost.cpu_s, cost.cpu_source, cost.bytes_in,
            cost.bytes_out, cost.peak_rss_bytes, reset_obs, reset_info,
        )  # fmt: skip

    def _kept(self, ep: Episode, row: tuple[Any, ...]) -> bool:
        if self.keep is None:
            return True
        cost = ep.cost
        summary: Summary = {
            "reward": row[10], "steps": cost.steps, "wall_s": cost.wall_s,
            "cpu_s": cost.cpu_s, "bytes_in": cost.bytes_in, "bytes_out": cost.bytes_out,
            "error": row[8] is not None,
            "done": ep.end in (EndReason.DONE, EndReason.TRUNCATED),
            "truncated": ep.end is EndReason.TRUNCATED, "clipped": ep.clipped,
        }  # fmt: skip
        return self.keep(summary)

    # -- the slow path: one episode, step by step ----------------------------------------

    def _add_one(self, ep: Episode, shard: Shard, failed: list[str]) -> int:
        """An episode with a failed step, or for the redaction hook: as plain values."""
        try:
            plain: dict[str, Any] | None = self._record(ep)
            if self.redact is not None:
                plain = self.redact(plain)  # type: ignore[arg-type]
            if plain is None:
                return 0
            record = plain
            steps = record["steps"]
            rewards = [_reward(s.get("reward")) for s in steps]
            total = sum((r for r in rewards if r is not None and _isfinite(r)), 0.0)
            errors = [s.get("error") for s in steps]
            error = next((e for e in errors if e), None)
            row = self._scalars(
                ep, total, error, _text(record["reset_observation"]), _text(record["reset_info"])
            )
            row = (*row[:6], _text(record["options"]), *row[7:])
            if not self._kept(ep, row):
                return 0
            columns = (
                [_ENCODER.encode(s.get("action")) for s in steps],
                [b"" if s.get("error") else _ENCODER.encode(s.get("observation")) for s in steps],
                rewards,
                [bool(s.get("done")) for s in steps],
                [bool(s.get("truncated")) for s in steps],
                [_text(s.get("info")) for s in steps],
                [str(e).encode() if e else b"" for e in errors],
                [float(s.get("step_s") or 0.0) for s in steps],
            )
        except Exception as exc:  # a hook that raised, a frame that cannot be read
            failed.append(f"{ep.episode_id}: {exc!r}")
            return 0
        shard.episodes.append(row)
        shard.counts.append(len(steps))
        _extend(shard, *columns)
        return 1

    def _record(self, ep: Episode) -> dict[str, Any]:
        """The episode as plain values: the redaction hook's record (docs/RECORDING.md)."""
        decode = msgspec.json.decode if ep.json else msgspec.msgpack.decode
        info = self.info_key
        reset = decode(ep.reset_frame).get("data") or {}
        steps = []
        log = ep.steps
        for j in range(0, len(log), 3):
            action, reply, took = log[j], log[j + 1], log[j + 2]  # (action: its request)
            raw = self._request[ep.json](action).data  # type: ignore[attr-defined]
            step: dict[str, Any] = {
                "action": decode(raw) if raw else None,
                "observation": None, "reward": None, "done": False, "truncated": False,
                "info": None, "error": None, "step_s": took,
            }  # fmt: skip
            if isinstance(reply, str):
                step["error"] = reply
            else:
                data = decode(reply).get("data") or {}
                step.update(
                    observation=data.get("observation"), reward=data.get("reward"),
                    done=bool(data.get("done")), truncated=bool(data.get("truncated")),
                    info=data.get(info),
                )  # fmt: skip
            steps.append(step)
        return {
            "env": self.env_name, "env_version": self.env_version,
            "episode_id": ep.episode_id, "worker": self._pid, "started_at": ep.started_at,
            "seed": ep.seed, "options": ep.options, "end": ep.end.value,
            "reset_observation": reset.get("observation"), "reset_info": reset.get(info),
            "steps": steps, "cost": msgspec.to_builtins(ep.cost), "clipped": ep.clipped,
        }  # fmt: skip


def _extend(shard: Shard, *columns: Any) -> None:
    """Add steps' values to ``shard``; ``errors`` ``None``: no step failed."""
    actions, observations, rewards, dones, truncateds, infos, errors, times = columns
    shard.actions.add(actions)
    shard.observations.add(observations)
    shard.rewards += rewards
    shard.dones += dones
    shard.truncateds += truncateds
    shard.infos.add(infos)
    if errors is None:
        shard.step_errors.add_nulls(len(times))
    else:
        shard.step_errors.add(errors)
    shard.step_s += times


def _msgpack_text(raw: msgspec.Raw) -> bytes:
    """A MessagePack frame's value as JSON text (``b""``, a null, when absent)."""
    return _ENCODER.encode(msgspec.msgpack.decode(raw)) if raw else b""


def _reward(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


#: Columns worth a dictionary (few distinct values); others' values are mostly distinct
#: (Parquet would build a dictionary, then fall back: measured, half the write's CPU).
_DICTIONARY = ["env", "env_version", "worker", "end", "error", "cpu_source"]
#: Columns with min/max statistics (readers skip files by them): the per-episode ones.
_STATISTICS = [name for name, kind in _SCALARS if kind != "json"]


def write_shard(shard: Shard, path: str) -> None:
    """Write ``shard`` as one Parquet file at ``path`` (zstd; pyarrow lets go of the GIL
    while it encodes, compresses and writes)."""
    import pyarrow.parquet as pq  # only a recording server loads it

    pq.write_table(
        shard.table(), path, compression="zstd", use_dictionary=_DICTIONARY,
        write_statistics=_STATISTICS,
    )  # fmt: skip


@functools.cache
def schema(pa: Any) -> Any:
    """The schema of a shard (docs/RECORDING.md)."""
    text, f64, i64 = pa.string(), pa.float64(), pa.int64()
    return pa.schema([
        ("env", text), ("env_version", text), ("episode_id", text), ("worker", i64),
        ("started_at", f64), ("seed", i64), ("options", text), ("end", text),
        ("error", text), ("clipped", pa.bool_()), ("total_reward", f64), ("steps", i64),
        ("wall_s", f64), ("cpu_s", f64), ("cpu_source", text), ("bytes_in", i64),
        ("bytes_out", i64), ("peak_rss_bytes", i64), ("reset_observation", text),
        ("reset_info", text), ("actions", pa.list_(text)), ("observations", pa.list_(text)),
        ("rewards", pa.list_(f64)), ("dones", pa.list_(pa.bool_())),
        ("truncateds", pa.list_(pa.bool_())), ("infos", pa.list_(text)),
        ("step_errors", pa.list_(text)), ("step_s", pa.list_(f64)),
    ])  # fmt: skip


__all__ = ["LIST_COLUMNS", "Rows", "Shard", "Summary", "Texts", "schema", "write_shard"]
