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
operator's terminal.
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
from collections.abc import Callable
from typing import Any

import msgspec

from stadium._env.contract import StepResult
from stadium._env.spec import EnvSpec
from stadium._errors import ConfigError, StadiumError
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


def read_episodes(directory: str) -> list[dict[str, Any]]:
    """Every episode row of the shards under ``directory`` (``.tmp`` files, being written
    or left by a killed worker, are skipped), oldest first.

    Raises:
        ConfigError: no shard there, one that cannot be read, or one that is not a
            recording of ours (a column missing or of another type, step lists of
            different lengths).
    """
    import pyarrow as pa  # loaded only for a replay
    import pyarrow.parquet as pq

    from stadium._server.ledger.rows import schema

    ours = schema(pa)
    paths = sorted(glob.glob(os.path.join(directory, "**", "*.parquet"), recursive=True))
    if not paths:
        raise ConfigError(f"no recorded episodes (*.parquet) under {directory}")
    rows: list[dict[str, Any]] = []
    for path in paths:
        try:
            table = pq.read_table(path)
        except Exception as exc:
            raise ConfigError(f"cannot read the recording {path}: {exc}") from None
        for field in ours:
            found = table.schema.field(field.name) if field.name in table.schema.names else None
            if found is None or found.type != field.type:
                what = "has no column" if found is None else f"has {found.type} in column"
                raise ConfigError(
                    f"{path} is not a Stadium recording: it {what} {field.name!r} "
                    f"({field.type} in docs/RECORDING.md)"
                )
        for row in table.to_pylist():
            lengths = {len(row[column] or ()) for column in _STEP_COLUMNS}
            if len(lengths) > 1:
                raise ConfigError(
                    f"{path} is not a Stadium recording: episode "
                    f"{printable(str(row['episode_id']))} has step lists of different lengths"
                )
            rows.append(row)
    rows.sort(key=lambda r: (r.get("started_at") or 0.0, r.get("episode_id") or ""))
    return rows


#: The per-step columns replay reads: as many items each.
_STEP_COLUMNS = ("actions", "observations", "rewards", "dones", "step_errors")


def replay(
    directory: str,
    target: str | None = None,
    *,
    url: str | None = None,
    jobs: int = 1,
    episodes: list[dict[str, Any]] | None = None,
) -> ReplayReport:
    """Replay the episodes recorded under ``directory`` in process (``target``) or on the
    server at ``url``; ``jobs`` at once. See the module doc."""
    if (target is None) == (url is None):
        raise ConfigError("replay needs one of TARGET (in process) and --url URL (a server)")
    if jobs < 1:
        raise ConfigError("--jobs must be at least 1", value=jobs)
    rows = read_episodes(directory) if episodes is None else episodes
    report = ReplayReport()
    for row in rows:
        version = row.get("env_version") or ""
        report.episodes[version] = report.episodes.get(version, 0) + 1
    start = time.perf_counter()
    if url is not None:
        found = asyncio.run(_on_server(url, rows, jobs))
    else:
        assert target is not None
        from stadium._server.loader import load_target

        spec = EnvSpec.of(load_target(target))
        with concurrent.futures.ThreadPoolExecutor(jobs, "stadium-replay") as pool:
            found = list(pool.map(lambda row: _in_process(spec, row), rows))
    report.seconds = time.perf_counter() - start
    report.divergences = [d for d in found if d is not None]
    return report


# -- one episode -------------------------------------------------------------------------


class _Checker:
    """Compares a replayed episode with its row, step by step."""

    def __init__(self, row: dict[str, Any]) -> None:
        self.row = row

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
            result = run(env.reset, seed=row.get("seed"), options=_load(row.get("options")))
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


async def _on_server(url: str, rows: list[dict[str, Any]], jobs: int) -> list[Divergence | None]:
    from stadium._client.session import AsyncClient

    gate = asyncio.Semaphore(jobs)

    async def one(row: dict[str, Any]) -> Divergence | None:
        env: AsyncClient[Any]
        async with gate, AsyncClient(url) as env:
            check = _Checker(row)
            options = _load(row.get("options")) or {}
            result: StepResult[Any] = await env.reset(seed=row.get("seed"), **options)
            found = check.first(result.observation)
            if found is not None:
                return found
            for i, text in enumerate(row.get("actions") or []):
                try:
                    out: StepResult[Any] = await env.step(_load(text))
                except StadiumError as exc:
                    found = check.step(i, None, None, False, f"{exc.code}: {exc}")
                else:
                    found = check.step(i, out.observation, out.reward, out.done, None)
                if found is not None:
                    return found
            return None

    return list(await asyncio.gather(*(one(row) for row in rows)))


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


def recorded_actions(directory: str, episode: str | None = None) -> list[Any]:
    """The actions of one recorded episode (``episode``: its id; else the first episode),
    as decoded JSON, for ``stadium check --actions-from``."""
    for row in read_episodes(directory):
        if episode is None or row.get("episode_id") == episode:
            return [_load(a) for a in row.get("actions") or []]
    raise ConfigError(f"no recorded episode {episode!r} under {directory}")


__all__ = [
    "Divergence",
    "ReplayReport",
    "read_episodes",
    "recorded_actions",
    "replay",
]
