"""``stadium serve --record DIR``: every episode (or a sample, or those a filter keeps) written
as Parquet shards, off the event loop.

**Path of an episode.** The session keeps its episode's reset reply, and per step the
action, the reply frame (or the error's text) and the step's time, by reference (no
encoding on the event loop), up to :attr:`RecordConfig.episode_bytes`. When the episode
ends, :meth:`Recorder.submit` puts it on a queue bounded in bytes
(:attr:`RecordConfig.queue_bytes`): when the queue is full the episode is dropped and
counted (``stadium_record_dropped_episodes_total``), never waited for. The writer
thread decodes the frames, applies the redaction hook and the filter, and gathers rows.

**Shards.** Each worker writes its own files (no cross-process lock), named
``episodes-<env>-<pid>-<start ms>-<n>.parquet``. A shard is written whole, to a
``.tmp`` name, then renamed: a file with the final name is always a complete Parquet file
(its footer written). Parquet cannot be appended to (the footer is at the end), so to
lose at most ~:attr:`RecordConfig.flush_s` of episodes when a worker is killed
(SIGKILL), the writer closes a shard as soon as its first row is that old, or once its
rows reach :attr:`RecordConfig.shard_bytes`: a busy worker writes one shard a second. What a
SIGKILL loses: the rows gathered for the open shard (≤ ``flush_s``), the episodes on the
queue, and the episodes still running. No ``fsync``: a killed process's written pages are
in the kernel's cache; a machine crash may lose more.

**Failures.** A shard write that fails (a full disk, a read-only directory) is logged (at
most every :data:`PAUSE_S`), counted (``stadium_record_write_errors_total``), its rows
dropped and counted, and recording pauses for :data:`PAUSE_S` (episodes ended meanwhile
are dropped and counted, ``stadium_recording`` reads 0); then it tries again. A step
never fails or waits because of the recording. docs/RECORDING.md has the schema.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
import logging
import math
import operator
import os
import random
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from stadium._env.codecs import enc_hook_default
from stadium._errors import ConfigError
from stadium._server.ledger.episode import EndReason, Episode
from stadium._util.throttle import Throttle

log = logging.getLogger("stadium.record")

#: Seconds recording pauses after a failed shard write (then it tries again).
PAUSE_S = 10.0
#: Fields of the ``counts`` row the recorder writes: recorded, dropped, write errors, on.
RECORDED, DROPPED, WRITE_ERRORS, RECORDING = range(4)


@dataclasses.dataclass(frozen=True, slots=True)
class RecordConfig:
    """What ``--record`` and its companions ask for.

    Attributes:
        directory: where the shards go (made if missing).
        sample: the fraction of episodes recorded, chosen at reset (1: all).
        filter: an expression an episode must match to be written
            (:func:`parse_filter`), e.g. ``reward>0.9`` or ``error``; empty: all.
        redact: ``module:function`` called with each episode's record (a dict, in the
            writer thread) before it is stored; it returns the record to store (changed
            as it likes) or ``None`` to store nothing.
        flush_s: the oldest row an open shard holds before it is written and closed.
        shard_bytes: a shard is closed once its episodes' frames reach this size.
        queue_bytes: episodes waiting for the writer, at most (more are dropped).
        episode_bytes: one episode's frames kept, at most (later steps are not kept:
            the row says ``clipped``).
    """

    directory: str
    sample: float = 1.0
    filter: str = ""
    redact: str = ""
    flush_s: float = 1.0
    shard_bytes: int = 64 << 20
    queue_bytes: int = 64 << 20
    episode_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        if not 0.0 < self.sample <= 1.0:
            raise ConfigError("--record-sample must be a fraction in (0, 1]", value=self.sample)
        if self.flush_s <= 0:
            raise ConfigError("the recording's flush interval must be > 0 seconds")
        parse_filter(self.filter)


# -- the filter ------------------------------------------------------------------------------

_FIELDS = ("reward", "steps", "wall_s", "cpu_s", "bytes_in", "bytes_out")
_FLAGS = ("error", "done", "truncated", "clipped")
_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne,
    ">": operator.gt, "<": operator.lt,
}  # fmt: skip
_TERM = re.compile(r"^\s*(not\s+)?([a-z_]+)\s*(?:(>=|<=|==|!=|>|<)\s*(-?[0-9.eE+-]+|inf))?\s*$")

Summary = dict[str, float | bool]
"""What a filter reads of an episode: ``reward`` (the sum of its rewards), ``steps``,
``wall_s``, ``cpu_s``, ``bytes_in``, ``bytes_out``; ``error``, ``done``, ``truncated``,
``clipped``."""


def parse_filter(text: str) -> Callable[[Summary], bool] | None:
    """The predicate of a ``--record-filter`` expression (``None`` for an empty one).

    Terms joined by ``or`` (any) and ``and`` (all; binds tighter); a term is a flag
    (``error``, ``done``, ``truncated``, ``clipped``, optionally ``not``) or a comparison
    ``FIELD OP NUMBER`` with FIELD one of ``reward`` (the episode's total), ``steps``,
    ``wall_s``, ``cpu_s``, ``bytes_in``, ``bytes_out`` and OP one of ``> >= < <= == !=``.

    Raises:
        ConfigError: naming the term that cannot be read.
    """
    if not text.strip():
        return None
    alternatives: list[list[Callable[[Summary], bool]]] = []
    for part in re.split(r"\s+or\s+", text.strip()):
        terms = []
        for raw in re.split(r"\s+and\s+", part):
            terms.append(_term(raw, text))
        alternatives.append(terms)

    def matches(summary: Summary) -> bool:
        return any(all(t(summary) for t in terms) for terms in alternatives)

    return matches


def _term(raw: str, text: str) -> Callable[[Summary], bool]:
    m = _TERM.match(raw)
    hint = (
        f"--record-filter {text!r}: cannot read {raw.strip()!r}; write terms such as "
        f"'reward>0.9', 'steps>=100', 'error', 'not done', joined by 'and' / 'or' "
        f"(fields: {', '.join(_FIELDS)}; flags: {', '.join(_FLAGS)})"
    )
    if m is None:
        raise ConfigError(hint)
    negate, name, op, number = m.groups()
    if op is None:
        if name not in _FLAGS:
            raise ConfigError(hint)
        return (lambda s: not s[name]) if negate else (lambda s: bool(s[name]))
    if negate or name not in _FIELDS:
        raise ConfigError(hint)
    try:
        value = float(number)
    except ValueError:
        raise ConfigError(hint) from None
    compare = _OPS[op]
    return lambda s: compare(float(s[name]), value)


def load_redactor(spec: str) -> Callable[[dict[str, Any]], dict[str, Any] | None] | None:
    """The function ``--record-redact module:function`` names (``None`` for an empty one).

    Raises:
        ConfigError: it cannot be imported or is not callable.
    """
    if not spec:
        return None
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(
            f"--record-redact {spec!r}: give module:function, e.g. mypkg.privacy:redact"
        )
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--record-redact {spec!r}: cannot import it ({exc})") from None
    if not callable(fn):
        raise ConfigError(f"--record-redact {spec!r} is not a function")
    return fn  # type: ignore[no-any-return]


# -- the recorder --------------------------------------------------------------------------


class RecorderState(enum.Enum):
    """The recorder's lifecycle."""

    IDLE = "idle"
    """No episode submitted yet: no thread, no file."""
    RECORDING = "recording"
    PAUSED = "paused"
    """A shard write failed: episodes are dropped (and counted) until :data:`PAUSE_S` passed."""
    CLOSED = "closed"


class Recorder:
    """One worker's recording: the queue, the writer thread, the shards (module doc).

    Args:
        config: what ``--record`` asked for.
        env: the env's name and version (columns of every row).
        info_key: the key of a reply's ``info`` (the env's ``info_key``).
        counts: four float fields of the worker's metrics row: episodes recorded,
            dropped, write failures, and 1 while recording.
    """

    def __init__(
        self,
        config: RecordConfig,
        env: tuple[str, str],
        info_key: str,
        counts: Any,
    ) -> None:
        self.config = config
        self.env_name, self.env_version = env
        self.info_key = info_key
        self.counts = counts
        self._filter = parse_filter(config.filter)
        self._redact = load_redactor(config.redact)
        self.state = RecorderState.IDLE
        self._cond = threading.Condition(threading.Lock())
        self._queue: list[tuple[Episode, int]] = []
        self._queued_bytes = 0
        self._thread: threading.Thread | None = None
        self._paused_until = 0.0
        self._log = Throttle(PAUSE_S)
        self._sample = config.sample
        self._random = random.random
        self._shards = 0
        self._stem = ""
        self.written: list[str] = []
        """Paths of the shards written (the last few hundred), for tests and logs."""

    def wants(self) -> bool:
        """Whether to keep the episode a reset begins (``--record-sample``), on the loop."""
        return self._sample >= 1.0 or self._random() < self._sample

    def submit(self, episode: Episode, size: int) -> None:
        """Hand an ended episode (its frames ``size`` bytes) to the writer; never blocks:
        dropped and counted when the queue is full, recording is paused or closed."""
        counts = self.counts
        with self._cond:
            state = self.state
            if state is RecorderState.IDLE:
                self._start()
            elif state is not RecorderState.RECORDING and not self._resume():
                counts[DROPPED] += 1
                return
            if self._queued_bytes + size > self.config.queue_bytes and self._queue:
                counts[DROPPED] += 1
                return
            self._queue.append((episode, size))
            self._queued_bytes += size
            self._cond.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued and gathered, then stop the thread (waits up to ``timeout``)."""
        with self._cond:
            thread = self._thread
            self.state = RecorderState.CLOSED
            self._cond.notify()
        if thread is not None:
            thread.join(timeout)
        self.counts[RECORDING] = 0

    def _resume(self) -> bool:  # with the lock held
        if self.state is RecorderState.PAUSED and time.monotonic() >= self._paused_until:
            self.state = RecorderState.RECORDING
            self.counts[RECORDING] = 1
            return True
        return False

    def _start(self) -> None:  # with the lock held; in the worker (after any fork)
        self._stem = f"episodes-{_safe(self.env_name)}-{os.getpid()}-{int(time.time() * 1000)}"
        self.state = RecorderState.RECORDING
        self.counts[RECORDING] = 1
        self._thread = threading.Thread(target=self._run, name="stadium-record", daemon=True)
        self._thread.start()

    # -- the writer thread ----------------------------------------------------------

    def _run(self) -> None:
        rows: list[dict[str, Any]] = []
        size = 0
        first = 0.0
        flush_s = self.config.flush_s
        cond = self._cond
        while True:
            with cond:
                if not self._queue and self.state is not RecorderState.CLOSED:
                    cond.wait(max(0.0, first + flush_s - time.monotonic()) if rows else None)
                batch, self._queue = self._queue, []
                self._queued_bytes = 0
                closing = self.state is RecorderState.CLOSED
            for episode, weight in batch:
                try:
                    row = self._row(episode)
                except Exception as exc:  # e.g. a redaction hook that raised
                    self.counts[DROPPED] += 1
                    self._warn("an episode could not be recorded: %r", exc)
                    continue
                if row is None:
                    continue
                if not rows:
                    first = time.monotonic()
                rows.append(row)
                size += weight
            if rows and (closing or size >= self.config.shard_bytes
                         or time.monotonic() - first >= flush_s):  # fmt: skip
                self._write(rows)
                rows, size = [], 0
            if closing:
                return

    def _write(self, rows: list[dict[str, Any]]) -> None:
        """One shard: written to a ``.tmp`` name, renamed when complete."""
        directory = self.config.directory
        self._shards += 1
        path = os.path.join(directory, f"{self._stem}-{self._shards:06d}.parquet")
        tmp = path + ".tmp"
        try:
            os.makedirs(directory, exist_ok=True)
            write_shard(rows, tmp)
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            counts = self.counts
            counts[WRITE_ERRORS] += 1
            counts[DROPPED] += len(rows)
            counts[RECORDING] = 0
            with self._cond:
                if self.state is RecorderState.RECORDING:
                    self.state = RecorderState.PAUSED
                self._paused_until = time.monotonic() + PAUSE_S
            self._warn(
                "--record: writing %s failed (%s): %d episode(s) dropped; not recording for "
                "%gs, then trying again",
                path, exc.strerror or exc, len(rows), PAUSE_S,
            )  # fmt: skip
            return
        self.counts[RECORDED] += len(rows)
        self.written.append(path)
        del self.written[:-256]

    def _warn(self, msg: str, *args: object) -> None:
        held = self._log.report(time.monotonic())
        if held is not None:
            log.warning(msg + (f" ({held} more since the last report)" if held else ""), *args)

    def _row(self, ep: Episode) -> dict[str, Any] | None:
        """The episode as a row of the shard's table; ``None``: redacted or filtered out."""
        decode = msgspec.json.decode if ep.json else msgspec.msgpack.decode
        info_key = self.info_key
        reset = decode(ep.reset_frame).get("data") or {}
        steps = []
        total = 0.0
        errored = False
        for action, reply, took in ep.steps:
            step: dict[str, Any] = {
                "action": msgspec.to_builtins(action, enc_hook=enc_hook_default),
                "observation": None, "reward": None, "done": False, "truncated": False,
                "info": None, "error": None, "step_s": took,
            }  # fmt: skip
            if isinstance(reply, str):
                step["error"] = reply
                errored = True
            else:
                data = decode(reply).get("data") or {}
                reward = data.get("reward")
                step.update(
                    observation=data.get("observation"), reward=reward,
                    done=bool(data.get("done")), truncated=bool(data.get("truncated")),
                    info=data.get(info_key),
                )  # fmt: skip
                if isinstance(reward, int | float) and math.isfinite(reward):
                    total += reward
            steps.append(step)
        cost = ep.cost
        record: dict[str, Any] = {
            "env": self.env_name,
            "env_version": self.env_version,
            "episode_id": ep.episode_id,
            "worker": os.getpid(),
            "started_at": ep.started_at,
            "seed": ep.seed,
            "options": ep.options,
            "end": ep.end.value,
            "reset_observation": reset.get("observation"),
            "reset_info": reset.get(info_key),
            "steps": steps,
            "cost": msgspec.to_builtins(cost),
            "clipped": ep.clipped,
        }
        if self._redact is not None:
            redacted = self._redact(record)
            if redacted is None:
                return None
            record = redacted
        steps = record["steps"]
        error = next((s["error"] for s in steps if s.get("error")), None)
        if self._filter is not None:
            summary: Summary = {
                "reward": total, "steps": cost.steps, "wall_s": cost.wall_s,
                "cpu_s": cost.cpu_s, "bytes_in": cost.bytes_in, "bytes_out": cost.bytes_out,
                "error": errored, "done": ep.end in (EndReason.DONE, EndReason.TRUNCATED),
                "truncated": ep.end is EndReason.TRUNCATED, "clipped": ep.clipped,
            }  # fmt: skip
            if not self._filter(summary):
                return None
        enc = _json
        cost_d = record["cost"]
        return {
            "env": record["env"],
            "env_version": record["env_version"],
            "episode_id": record["episode_id"],
            "worker": record["worker"],
            "started_at": record["started_at"],
            "seed": record["seed"],
            "options": None if record["options"] is None else enc(record["options"]),
            "end": record["end"],
            "error": error,
            "clipped": record["clipped"],
            "total_reward": total,
            "steps": cost_d.get("steps", 0),
            "wall_s": cost_d.get("wall_s", 0.0),
            "cpu_s": cost_d.get("cpu_s", 0.0),
            "cpu_source": cost_d.get("cpu_source", ""),
            "bytes_in": cost_d.get("bytes_in", 0),
            "bytes_out": cost_d.get("bytes_out", 0),
            "peak_rss_bytes": cost_d.get("peak_rss_bytes"),
            "reset_observation": enc(record["reset_observation"]),
            "reset_info": None if record["reset_info"] is None else enc(record["reset_info"]),
            "actions": [enc(s["action"]) for s in steps],
            "observations": [None if s["error"] else enc(s["observation"]) for s in steps],
            "rewards": [_reward(s["reward"]) for s in steps],
            "dones": [bool(s["done"]) for s in steps],
            "truncateds": [bool(s["truncated"]) for s in steps],
            "infos": [None if s["info"] is None else enc(s["info"]) for s in steps],
            "step_errors": [s["error"] for s in steps],
            "step_s": [float(s["step_s"]) for s in steps],
        }


def _reward(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _fallback(value: Any) -> Any:
    if isinstance(value, msgspec.msgpack.Ext):
        return {"ext": value.code, "data": value.data}
    return enc_hook_default(value)


_ENCODER = msgspec.json.Encoder(enc_hook=_fallback)


def _json(value: Any) -> str:
    return _ENCODER.encode(value).decode()


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:64] or "env"


def write_shard(rows: list[dict[str, Any]], path: str) -> None:
    """Write ``rows`` as one Parquet file at ``path`` (pyarrow, loaded on first use)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows, schema=_schema(pa))
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


__all__ = [
    "PAUSE_S",
    "RecordConfig",
    "Recorder",
    "RecorderState",
    "load_redactor",
    "parse_filter",
    "write_shard",
]
