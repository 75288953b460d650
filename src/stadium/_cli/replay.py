"""``stadium replay DIR [TARGET | --url URL]``: re-run recorded episodes, report divergences.

Each episode of a ``--record`` directory (docs/RECORDING.md) is reset with its seed and
options and stepped with its actions, in process (TARGET: a fresh env of that class per
episode) or on a server through the client (``--url``). The first place where the reset's
observation, a step's observation, reward or ``done``, or a step's failing, differs from
the recording is the episode's divergence, reported with a diff; the summary counts
episodes and divergences per env version. ``--jobs N`` runs N episodes at once (threads
in process, sessions on a server).

A recording holds what clients and envs chose: a shard of another schema, step lists of
different lengths or a value that is not JSON is a :class:`~stadium.ConfigError` (exit 2,
one line), and what is printed of it (episode ids, env versions, diffs) has its control
characters escaped (:func:`stadium._util.text.printable`): no escape sequence reaches the
operator's terminal. The shards are read a few episodes at a time (:data:`BATCH_ROWS`; at
most ``2 * jobs`` read ahead, off the client's loop with ``--url``), so a recording larger
than memory replays; a replayed reset that raises is the episode's divergence. On a
server, its error replies are divergences, and any other failure of the server (the
session closed, a frame that cannot be read, no reply within ``--timeout``) ends the replay.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import difflib
import glob
import inspect
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import msgspec

from stadium._env.contract import StepResult
from stadium._env.spec import EnvSpec
from stadium._errors import (
    ConfigError,
    ExecutionError,
    ProtocolError,
    StadiumError,
    ValidationError,
)
from stadium._util.text import printable

#: Lines of a divergence's diff shown at most.
DIFF_LINES = 40


@dataclasses.dataclass(frozen=True, slots=True)
class Divergence:
    """Where a replayed episode first differed from its recording.

    Attributes:
        episode_id: the recorded episode's id.
        env_version: the env version that recorded it.
        step: 0 for the reset, else the step's number (1 is the first step).
        field: ``observation``, ``reward``, ``done`` or ``error``.
        recorded, replayed: the two values (decoded JSON; an error's text).
        diff: a unified diff of the two, as JSON (at most :data:`DIFF_LINES` lines).
    """

    episode_id: str
    env_version: str
    step: int
    field: str
    recorded: Any
    replayed: Any
    diff: str


@dataclasses.dataclass(slots=True)
class ReplayReport:
    """The outcome of a replay: episodes per env version, the divergences, the time."""

    episodes: dict[str, int] = dataclasses.field(default_factory=dict)
    divergences: list[Divergence] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.episodes.values())

    def summary(self) -> list[str]:
        """One line per env version, then the total."""
        lines = []
        for version, n in sorted(self.episodes.items()):
            bad = sum(1 for d in self.divergences if d.env_version == version)
            lines.append(f"env version {printable(version) or '?'}: {n} episode(s), {bad} diverged")
        rate = self.total / self.seconds if self.seconds > 0 else 0.0
        lines.append(
            f"{self.total} episode(s) replayed in {self.seconds:.2f} s ({rate:.1f}/s), "
            f"{len(self.divergences)} diverged"
        )
        return lines


def read_episodes(directory: str) -> Iterator[dict[str, Any]]:
    """Every episode row of the shards under ``directory`` (``.tmp`` files, being written
    or left by a killed worker, are skipped), the oldest shard first, each shard's rows in
    the order written. Every shard's schema is checked first; then a few rows at a time
    are read (:data:`BATCH_ROWS`): a recording larger than memory replays.

    Raises:
        ConfigError: no shard there, one that cannot be read, or one that is not a
            recording of ours (a column missing or of another type, step lists of
            different lengths). The ones found reading rows, when that row is reached.
    """
    import pyarrow as pa  # loaded only for a replay
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from stadium._server.ledger.rows import schema

    ours = schema(pa)
    paths = sorted(glob.glob(os.path.join(directory, "**", "*.parquet"), recursive=True))
    if not paths:
        raise ConfigError(f"no recorded episodes (*.parquet) under {directory}")
    shards: list[tuple[float, str, Any]] = []
    for path in paths:
        try:
            shard = pq.ParquetFile(path)
            theirs = shard.schema_arrow
            started = pc.min(shard.read(columns=["started_at"])["started_at"]).as_py()
        except Exception as exc:
            raise ConfigError(f"cannot read the recording {path}: {exc}") from None
        for field in ours:
            found = theirs.field(field.name) if field.name in theirs.names else None
            if found is None or found.type != field.type:
                what = "has no column" if found is None else f"has {found.type} in column"
                raise ConfigError(
                    f"{path} is not a Stadium recording: it {what} {field.name!r} "
                    f"({field.type} in docs/RECORDING.md)"
                )
        shards.append((started if isinstance(started, float) else 0.0, path, shard))
    del paths
    shards.sort(key=lambda s: (s[0], s[1]))
    return _rows(shards, [field.name for field in ours])


def _rows(shards: list[tuple[float, str, Any]], columns: list[str]) -> Iterator[dict[str, Any]]:
    for _, path, shard in shards:
        try:
            batches = shard.iter_batches(batch_size=BATCH_ROWS, columns=columns)
            for batch in batches:
                for row in batch.to_pylist():
                    lengths = {len(row[column] or ()) for column in _STEP_COLUMNS}
                    if len(lengths) > 1:
                        raise ConfigError(
                            f"{path} is not a Stadium recording: episode "
                            f"{printable(str(row['episode_id']))} has step lists of "
                            "different lengths"
                        )
                    yield row
        except StadiumError:
            raise
        except Exception as exc:  # a file cut short, changed since its schema was read
            raise ConfigError(f"cannot read the recording {path}: {exc}") from None


#: Episodes read from a shard at a time (each at most 16 MiB of frames).
BATCH_ROWS = 8
#: The per-step columns replay reads: as many items each.
_STEP_COLUMNS = ("actions", "observations", "rewards", "dones", "step_errors")


def replay(
    directory: str,
    target: str | None = None,
    *,
    url: str | None = None,
    jobs: int = 1,
    episodes: Iterable[dict[str, Any]] | None = None,
    timeout: float = 600.0,
) -> ReplayReport:
    """Replay the episodes recorded under ``directory`` in process (``target``) or on the
    server at ``url``; ``jobs`` at once (and at most ``2 * jobs`` episodes read ahead);
    ``timeout``: seconds for each of the server's replies. See the module doc.

    Raises:
        ConfigError: a bad argument, or a recording that cannot be read (or not ours).
        StadiumError: on a server, one that failed other than by its env's error replies
            (closed the session, sent what cannot be read, no reply within ``timeout``).
    """
    if (target is None) == (url is None):
        raise ConfigError("replay needs one of TARGET (in process) and --url URL (a server)")
    if jobs < 1:
        raise ConfigError("--jobs must be at least 1", value=jobs)
    if not timeout > 0:
        raise ConfigError("--timeout must be a number of seconds above 0", value=timeout)
    rows = read_episodes(directory) if episodes is None else iter(episodes)
    report = ReplayReport()

    def counted() -> Iterator[dict[str, Any]]:
        for row in rows:
            version = row.get("env_version") or ""
            report.episodes[version] = report.episodes.get(version, 0) + 1
            yield row

    start = time.perf_counter()
    if url is not None:
        found = asyncio.run(_on_server(url, counted(), jobs, timeout))
    else:
        assert target is not None
        from stadium._server.loader import load_target

        spec = EnvSpec.of(load_target(target))
        found = _in_threads(spec, counted(), jobs)
    report.seconds = time.perf_counter() - start
    report.divergences = [d for d in found if d is not None]
    return report


def _in_threads(spec: EnvSpec, rows: Iterator[dict[str, Any]], jobs: int) -> list[Divergence]:
    """Each row replayed in process, ``jobs`` at once, ``2 * jobs`` at most submitted; the
    divergences in the rows' order."""
    found: list[tuple[int, Divergence]] = []
    with concurrent.futures.ThreadPoolExecutor(jobs, "stadium-replay") as pool:
        pending: dict[concurrent.futures.Future[Divergence | None], int] = {}

        def collect(futures: Iterable[concurrent.futures.Future[Divergence | None]]) -> None:
            for future in futures:
                number = pending.pop(future)
                divergence = future.result()
                if divergence is not None:
                    found.append((number, divergence))

        for number, row in enumerate(rows):
            if len(pending) >= 2 * jobs:
                done, _ = concurrent.futures.wait(pending, return_when="FIRST_COMPLETED")
                collect(done)
            pending[pool.submit(_in_process, spec, row)] = number
        collect(list(pending))
    return [d for _, d in sorted(found, key=lambda item: item[0])]


# -- one episode -------------------------------------------------------------------------


class _Checker:
    """Compares a replayed episode with its row, step by step."""

    def __init__(self, row: dict[str, Any]) -> None:
        self.row = row

    def reset_failed(self, error: str) -> Divergence:
        """The replayed reset raised (the recorded one answered an observation)."""
        return self._divergence(0, "error", None, error)

    def first(self, obs: Any) -> Divergence | None:
        return self._compare(0, "observation", _load(self.row.get("reset_observation")), obs)

    def step(
        self, i: int, obs: Any, reward: Any, done: bool, error: str | None
    ) -> Divergence | None:
        row = self.row
        recorded_error = (row.get("step_errors") or [None] * (i + 1))[i]
        if (recorded_error is None) != (error is None):
            return self._divergence(i + 1, "error", recorded_error, error)
        if error is not None:
            return None
        checks = (
            ("observation", _load(row["observations"][i]), obs),
            ("reward", row["rewards"][i], None if reward is None else float(reward)),
            ("done", bool(row["dones"][i]), bool(done)),
        )
        for field, recorded, replayed in checks:
            found = self._compare(i + 1, field, recorded, replayed)
            if found is not None:
                return found
        return None

    def _compare(self, step: int, field: str, recorded: Any, replayed: Any) -> Divergence | None:
        if _same(recorded, replayed):
            return None
        return self._divergence(step, field, recorded, replayed)

    def _divergence(self, step: int, field: str, recorded: Any, replayed: Any) -> Divergence:
        a = json.dumps(recorded, indent=1, sort_keys=True, default=repr).splitlines()
        b = json.dumps(replayed, indent=1, sort_keys=True, default=repr).splitlines()
        diff = list(difflib.unified_diff(a, b, "recorded", "replayed", lineterm="", n=2))
        if len(diff) > DIFF_LINES:
            diff = [*diff[:DIFF_LINES], f"... ({len(diff) - DIFF_LINES} more lines)"]
        return Divergence(
            self.row.get("episode_id") or "?", self.row.get("env_version") or "", step, field,
            recorded, replayed, "\n".join(diff),
        )  # fmt: skip


def _in_process(spec: EnvSpec, row: dict[str, Any]) -> Divergence | None:
    """Replay one episode on a fresh env of ``spec`` (in this thread, its own loop)."""
    loop = asyncio.new_event_loop()
    try:

        def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            return loop.run_until_complete(out) if inspect.isawaitable(out) else out

        encode = spec.json_encoder.encode
        env = run(spec.factory)
        try:
            check = _Checker(row)
            options = _options(row, keywords=False) if row.get("options") is not None else None
            try:
                result = run(env.reset, seed=row.get("seed"), options=options)
            except Exception as exc:
                return check.reset_failed(f"{type(exc).__name__}: {exc}")
            obs = result.observation if isinstance(result, StepResult) else result
            found = check.first(msgspec.json.decode(encode(obs)))
            if found is not None:
                return found
            for i, text in enumerate(row.get("actions") or []):
                try:
                    action = spec.action.convert(_load(text), "action")
                    out = run(env.step, action)
                except Exception as exc:
                    found = check.step(i, None, None, False, f"{type(exc).__name__}: {exc}")
                else:
                    if isinstance(out, StepResult):
                        obs, reward, done = out.observation, out.reward, out.done
                    else:
                        obs, reward, done = out, None, False
                    found = check.step(i, msgspec.json.decode(encode(obs)), reward, done, None)
                if found is not None:
                    return found
            return None
        finally:
            if spec.has_close:
                run(env.close)
    finally:
        loop.close()


#: The errors a server answers for its env (or for a request it refused): a replayed
#: episode's divergence. Any other (the session closed, no reply within ``--timeout``, a
#: frame that cannot be read, capacity) ends the replay: the server failed, not the env.
_ANSWERED = (ExecutionError, ValidationError, ProtocolError)


async def _on_server(
    url: str, rows: Iterator[dict[str, Any]], jobs: int, reply_s: float
) -> list[Divergence]:
    """Each row replayed on the server at ``url``, ``jobs`` sessions at once (``reply_s``:
    seconds for each reply); the rows read off the loop, ``jobs`` ahead at most; the
    divergences in the rows' order."""
    from stadium._client.session import AsyncClient

    async def one(row: dict[str, Any]) -> Divergence | None:
        env: AsyncClient[Any]
        async with AsyncClient(url, request_timeout=reply_s) as env:
            check = _Checker(row)
            options = _options(row, keywords=True)
            try:
                result: StepResult[Any] = await env.reset(seed=row.get("seed"), **options)
            except _ANSWERED as exc:
                return check.reset_failed(f"{exc.code}: {exc}")
            found = check.first(result.observation)
            if found is not None:
                return found
            for i, text in enumerate(row.get("actions") or []):
                try:
                    out: StepResult[Any] = await env.step(_load(text))
                except _ANSWERED as exc:
                    found = check.step(i, None, None, False, f"{exc.code}: {exc}")
                else:
                    found = check.step(i, out.observation, out.reward, out.done, None)
                if found is not None:
                    return found
            return None

    running: dict[asyncio.Task[Divergence | None], int] = {}
    found: list[tuple[int, Divergence]] = []

    async def collect(tasks: Iterable[asyncio.Task[Divergence | None]]) -> None:
        for task in tasks:
            number = running.pop(task)
            divergence = await task
            if divergence is not None:
                found.append((number, divergence))

    try:
        number = 0
        while True:
            if len(running) >= jobs:
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                await collect(done)
            row = await asyncio.to_thread(next, rows, None)  # a shard's read: off the loop
            if row is None:
                break
            running[asyncio.create_task(one(row))] = number
            number += 1
        await collect(list(running))
    finally:
        for task in running:
            task.cancel()
    return [d for _, d in sorted(found, key=lambda item: item[0])]


def _load(text: Any) -> Any:
    """A recorded JSON text's value.

    Raises:
        ConfigError: the text is not JSON (a recording altered or not written by Stadium).
    """
    if text is None:
        return None
    try:
        return json.loads(text)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"a recorded value is not JSON ({exc}): {printable(str(text)[:80])}"
        ) from None


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON values (``true`` is not ``1``; NaN equals NaN)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def _options(row: dict[str, Any], *, keywords: bool) -> dict[str, Any]:
    """The recorded reset's options: a JSON object (not naming ``seed`` when they are
    to be the client's reset keywords)."""
    options = _load(row.get("options"))
    if options is None:
        return {}
    if not isinstance(options, dict) or (keywords and "seed" in options):
        raise ConfigError(
            f"episode {printable(str(row.get('episode_id')))}'s options are not a JSON "
            "object of options (a recording not written by Stadium?)"
        )
    return options


def recorded_actions(directory: str, episode: str | None = None) -> list[Any]:
    """The actions of one recorded episode (``episode``: its id; else the first episode
    started), as decoded JSON, for ``stadium check --actions-from``. The shards are read a
    few rows at a time, one row kept."""
    first: dict[str, Any] | None = None
    for row in read_episodes(directory):
        if episode is not None and row.get("episode_id") == episode:
            first = row
            break
        if episode is None and (
            first is None or (row.get("started_at") or 0.0) < (first.get("started_at") or 0.0)
        ):
            first = row
    if first is None:
        raise ConfigError(f"no recorded episode {printable(repr(episode))} under {directory}")
    return [_load(a) for a in first.get("actions") or []]


__all__ = [
    "Divergence",
    "ReplayReport",
    "read_episodes",
    "recorded_actions",
    "replay",
]
