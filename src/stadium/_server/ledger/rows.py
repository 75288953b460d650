"""An ended episode as a row of a ``--record`` shard, and a shard written (the writer
thread's work; docs/RECORDING.md has the schema).

The usual path reads each reply frame once with a decoder whose observation and info are
``msgspec.Raw``: a JSON session's observation is stored as the very bytes the client got,
with no decoding and encoding again; actions are encoded once, in C. Only an episode given
to a ``--record-redact`` hook is built as plain Python values (the hook's record) first.
A shard is built column by column (flat arrays and list offsets), not from row dicts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import msgspec

from stadium._env.codecs import enc_hook_default
from stadium._server.ledger.episode import EndReason, Episode

Summary = dict[str, float | bool]
"""What a filter reads of an episode: ``reward`` (the sum of its rewards), ``steps``,
``wall_s``, ``cpu_s``, ``bytes_in``, ``bytes_out``; ``error``, ``done``, ``truncated``,
``clipped``."""

Row = dict[str, Any]

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


def _json(value: Any) -> str:
    return _ENCODER.encode(value).decode()


class Rows:
    """Turns ended episodes into shard rows for one env (its name, version, ``info_key``),
    through the redaction hook and the filter when given."""

    def __init__(
        self,
        env: tuple[str, str],
        info_key: str,
        keep: Callable[[Summary], bool] | None,
        redact: Callable[[dict[str, Any]], dict[str, Any] | None] | None,
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
                ("done", Any, False),
                ("truncated", Any, False),
                (info_key, msgspec.Raw, _NULL),
            ],
        )
        reply = msgspec.defstruct("Reply", [("data", data | None, None)])
        self._json_reply: Any = msgspec.json.Decoder(reply)
        self._msgpack_reply: Any = msgspec.msgpack.Decoder(reply)
        self._info = info_key

    def row(self, ep: Episode) -> Row | None:
        """The episode's row; ``None``: the hook or the filter left it out."""
        if self.redact is not None:
            return self._redacted(ep)
        decoder = self._json_reply if ep.json else self._msgpack_reply
        text = _raw_text if ep.json else _msgpack_text
        info = self._info
        actions: list[str] = []
        observations: list[str | None] = []
        rewards: list[float | None] = []
        dones: list[bool] = []
        truncateds: list[bool] = []
        infos: list[str | None] = []
        errors: list[str | None] = []
        times: list[float] = []
        total = 0.0
        error = None
        encode = _ENCODER.encode
        for action, reply, took in ep.steps:
            actions.append(encode(action).decode())
            times.append(took)
            if isinstance(reply, str):
                errors.append(reply)
                error = error or reply
                observations.append(None)
                rewards.append(None)
                dones.append(False)
                truncateds.append(False)
                infos.append(None)
                continue
            data: Any = decoder.decode(reply).data
            errors.append(None)
            if data is None:
                observations.append(None)
                rewards.append(None)
                dones.append(False)
                truncateds.append(False)
                infos.append(None)
                continue
            observations.append(text(data.observation))
            reward = _reward(data.reward)
            rewards.append(reward)
            if reward is not None and math.isfinite(reward):
                total += reward
            dones.append(bool(data.done))
            truncateds.append(bool(data.truncated))
            infos.append(text(getattr(data, info)))
        reset: Any = decoder.decode(ep.reset_frame).data
        row = self._base(ep, total, error)
        row.update(
            reset_observation=None if reset is None else text(reset.observation),
            reset_info=None if reset is None else text(getattr(reset, info)),
            actions=actions, observations=observations, rewards=rewards, dones=dones,
            truncateds=truncateds, infos=infos, step_errors=errors, step_s=times,
        )  # fmt: skip
        return row if self._kept(ep, row) else None

    def _base(self, ep: Episode, total: float, error: str | None) -> Row:
        cost = ep.cost
        return {
            "env": self.env_name,
            "env_version": self.env_version,
            "episode_id": ep.episode_id,
            "worker": os.getpid(),
            "started_at": ep.started_at,
            "seed": ep.seed,
            "options": None if ep.options is None else _json(ep.options),
            "end": ep.end.value,
            "error": error,
            "clipped": ep.clipped,
            "total_reward": total,
            "steps": cost.steps,
            "wall_s": cost.wall_s,
            "cpu_s": cost.cpu_s,
            "cpu_source": cost.cpu_source,
            "bytes_in": cost.bytes_in,
            "bytes_out": cost.bytes_out,
            "peak_rss_bytes": cost.peak_rss_bytes,
        }

    def _kept(self, ep: Episode, row: Row) -> bool:
        if self.keep is None:
            return True
        summary: Summary = {
            "reward": row["total_reward"], "steps": row["steps"], "wall_s": row["wall_s"],
            "cpu_s": row["cpu_s"], "bytes_in": row["bytes_in"], "bytes_out": row["bytes_out"],
            "error": row["error"] is not None,
            "done": ep.end in (EndReason.DONE, EndReason.TRUNCATED),
            "truncated": ep.end is EndReason.TRUNCATED, "clipped": ep.clipped,
        }  # fmt: skip
        return self.keep(summary)

    def _redacted(self, ep: Episode) -> Row | None:
        """The slow path: the episode as plain values, given to the hook, then a row."""
        decode = msgspec.json.decode if ep.json else msgspec.msgpack.decode
        info = self.info_key
        reset = decode(ep.reset_frame).get("data") or {}
        steps = []
        for action, reply, took in ep.steps:
            step: dict[str, Any] = {
                "action": msgspec.to_builtins(action, enc_hook=enc_hook_default),
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
        record: dict[str, Any] | None = {
            "env": self.env_name, "env_version": self.env_version,
            "episode_id": ep.episode_id, "worker": os.getpid(), "started_at": ep.started_at,
            "seed": ep.seed, "options": ep.options, "end": ep.end.value,
            "reset_observation": reset.get("observation"), "reset_info": reset.get(info),
            "steps": steps, "cost": msgspec.to_builtins(ep.cost), "clipped": ep.clipped,
        }  # fmt: skip
        assert self.redact is not None
        record = self.redact(record)  # type: ignore[arg-type]
        if record is None:
            return None
        steps = record["steps"]
        rewards = [_reward(s.get("reward")) for s in steps]
        total = sum(r for r in rewards if r is not None and math.isfinite(r))
        errors = [s.get("error") for s in steps]
        row = self._base(ep, total, next((e for e in errors if e), None))
        row["options"] = None if record["options"] is None else _json(record["options"])
        row.update(
            reset_observation=_json(record["reset_observation"]),
            reset_info=None if record["reset_info"] is None else _json(record["reset_info"]),
            actions=[_json(s.get("action")) for s in steps],
            observations=[None if s.get("error") else _json(s.get("observation")) for s in steps],
            rewards=rewards,
            dones=[bool(s.get("done")) for s in steps],
            truncateds=[bool(s.get("truncated")) for s in steps],
            infos=[None if s.get("info") is None else _json(s["info"]) for s in steps],
            step_errors=errors,
            step_s=[float(s.get("step_s") or 0.0) for s in steps],
        )  # fmt: skip
        return row if self._kept(ep, row) else None


def _raw_text(raw: msgspec.Raw) -> str | None:
    """A JSON frame's value as its own text (``None`` when absent)."""
    return bytes(raw).decode() if raw else None


def _msgpack_text(raw: msgspec.Raw) -> str | None:
    """A MessagePack frame's value as JSON text (``None`` when absent)."""
    return _json(msgspec.msgpack.decode(raw)) if raw else None


def _reward(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


_ROW_ENCODER = msgspec.json.Encoder()


def write_shard(rows: list[Row], path: str) -> None:
    """Write ``rows`` as one Parquet file at ``path`` (zstd). The rows go to Arrow as JSON
    Lines read by pyarrow's JSON reader against the schema, in C (``pa.array`` on Python
    lists would import pandas, once per worker: ~1.2 s of CPU and its memory)."""
    import io

    import pyarrow as pa  # only a recording server loads it
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    data = b"\n".join([_ROW_ENCODER.encode(row) for row in rows])
    table = pj.read_json(
        io.BytesIO(data),
        read_options=pj.ReadOptions(use_threads=False, block_size=max(1 << 20, len(data) + 1)),
        parse_options=pj.ParseOptions(explicit_schema=_schema(pa)),
    )
    pq.write_table(table, path, compression="zstd")


def _schema(pa: Any) -> Any:
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


__all__ = ["LIST_COLUMNS", "Row", "Rows", "Summary", "write_shard"]
