"""The recorded episodes, browsed from ``GET /web/episodes`` (``stadium/web/episodes.html``).

When the server records (``--record DIR``), two JSON endpoints read its shards:

* ``POST /web/episodes`` with filters (``env``, ``min_reward``, ``max_reward``, ``error``:
  ``true``/``false``, ``min_cpu_s``, ``max_cpu_s``, ``min_wall_s``, ``max_wall_s``) and a
  page (``offset``, ``limit`` ≤ :data:`PAGE_MAX`): the matching episodes' per-episode
  columns, newest first, their count, the envs seen, and the distribution of their cost
  (``cpu_s``, ``wall_s``: :data:`BINS` bins each, per env);
* ``POST /web/episodes/one`` with ``file``, ``row`` and a window of steps
  (``step_offset``, ``step_limit`` ≤ :data:`STEPS_MAX`): one episode, its reset and those
  steps.

Both read Parquet with pyarrow in the loop's executor, never on the loop. A shard is read
once (its per-episode columns; a closed shard never changes) and kept, for the newest
:data:`FILES_MAX` shards and at most :data:`ROWS_MAX` episodes; older ones are not
browsed. Any other worker's shards of the same directory are read too (they are files
there). Every answer is bounded: a page of
episodes, a window of steps, each text value cut at :data:`TEXT_MAX` characters. Without
``--record``: ``404`` saying so. The routes pass the same access checks as every HTTP
endpoint (``--auth-token``).
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from stadium._server.http.endpoints import ExtraRoutes, HttpEndpoints, HttpResponse, error_response

#: Episodes per page, at most.
PAGE_MAX = 200
#: Steps of one episode per answer, at most.
STEPS_MAX = 500
#: Shards browsed: the newest this many, and no older ones once ROWS_MAX episodes are read.
FILES_MAX = 500
ROWS_MAX = 200_000
#: A text value (an observation, an action) longer than this is cut (and says so).
TEXT_MAX = 20_000
#: Bins of each cost distribution.
BINS = 20
SUMMARY = (
    "env", "env_version", "episode_id", "worker", "started_at", "seed", "end", "error",
    "clipped", "total_reward", "steps", "wall_s", "cpu_s", "cpu_source", "bytes_in",
    "bytes_out", "peak_rss_bytes",
)  # fmt: skip
_SHARD = re.compile(r"^episodes-[A-Za-z0-9_.-]+\.parquet$")
_NUMBER_FILTERS = {
    "min_reward": ("total_reward", 1), "max_reward": ("total_reward", -1),
    "min_cpu_s": ("cpu_s", 1), "max_cpu_s": ("cpu_s", -1),
    "min_wall_s": ("wall_s", 1), "max_wall_s": ("wall_s", -1),
}  # fmt: skip


class RecordingIndex:
    """The per-episode columns of a recording directory's shards, read once each."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._rows: dict[str, list[dict[str, Any]]] = {}
        self._lock = threading.Lock()  # executor threads

    def episodes(self) -> list[dict[str, Any]]:
        """Every episode of the newest :data:`FILES_MAX` shards (each with its ``file``
        and ``row``), newest first."""
        import pyarrow.parquet as pq  # only a recording server loads it

        try:
            names = [n for n in os.listdir(self.directory) if _SHARD.match(n)]
        except OSError:
            names = []
        names.sort(key=_written_at, reverse=True)
        names = names[:FILES_MAX]
        out: list[dict[str, Any]] = []
        with self._lock:
            for name in names:
                if len(out) >= ROWS_MAX:
                    break
                rows = self._rows.get(name)
                if rows is None:
                    try:
                        table = pq.ParquetFile(os.path.join(self.directory, name)).read(
                            columns=list(SUMMARY)
                        )
                    except (OSError, ValueError):  # gone, or not a shard of ours
                        continue
                    rows = table.to_pylist()
                    for i, row in enumerate(rows):
                        row["file"], row["row"] = name, i
                    self._rows[name] = rows
                out += rows
            kept = {r["file"] for r in out}
            for name in set(self._rows) - kept:  # older shards are forgotten
                del self._rows[name]
        out.sort(key=lambda r: r["started_at"] or 0.0, reverse=True)
        return out

    def one(self, name: str, row: int, first: int, count: int) -> dict[str, Any] | None:
        """Episode ``row`` of shard ``name`` with steps ``first`` .. ``first + count``."""
        import pyarrow.parquet as pq

        if not _SHARD.match(name):
            return None
        try:
            table = pq.ParquetFile(os.path.join(self.directory, name)).read()
        except (OSError, ValueError):
            return None
        if not 0 <= row < table.num_rows:
            return None
        episode: dict[str, Any] = table.slice(row, 1).to_pylist()[0]
        steps = len(episode.get("actions") or [])  # kept steps: a failed one is not counted
        window: dict[str, Any] = {}
        for column in ("actions", "observations", "rewards", "dones", "truncateds", "infos",
                       "step_errors", "step_s"):  # fmt: skip
            values = (episode.pop(column, None) or [])[first : first + count]
            window[column] = [_cut(v) for v in values]
        episode.update(
            file=name, row=row, step_offset=first, step_count=len(window["actions"]),
            steps_total=steps, window=window,
            reset_observation=_cut(episode.get("reset_observation")),
            reset_info=_cut(episode.get("reset_info")),
        )  # fmt: skip
        return episode


def _written_at(name: str) -> tuple[int, int]:
    """A shard's worker start (ms) and number, from its name, for newest-first order."""
    parts = name[: -len(".parquet")].rsplit("-", 2)
    try:
        return int(parts[-2]), int(parts[-1])
    except (IndexError, ValueError):
        return 0, 0


def _cut(value: Any) -> Any:
    if isinstance(value, str) and len(value) > TEXT_MAX:
        return value[:TEXT_MAX] + f"… ({len(value) - TEXT_MAX} more characters)"
    return value


def select(episodes: list[dict[str, Any]], filters: dict[str, Any]) -> list[dict[str, Any]]:
    """The episodes matching ``filters`` (see the module doc)."""
    env = filters.get("env")
    error = filters.get("error")
    bounds = []
    for key, (column, sign) in _NUMBER_FILTERS.items():
        value = filters.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            bounds.append((column, sign, float(value)))
    out = []
    for ep in episodes:
        if env and ep["env"] != env:
            continue
        if error is not None and (ep["error"] is not None) != bool(error):
            continue
        if any(
            ep[column] is None or (ep[column] - value) * sign < 0 for column, sign, value in bounds
        ):
            continue
        out.append(ep)
    return out


def histogram(values: list[float]) -> list[list[float]]:
    """``[low, high, count]`` for :data:`BINS` equal bins over ``values``' range."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return []
    low, high = min(values), max(values)
    if high <= low:
        return [[low, high, len(values)]]
    width = (high - low) / BINS
    counts = [0] * BINS
    for v in values:
        counts[min(BINS - 1, int((v - low) / width))] += 1
    return [[low + i * width, low + (i + 1) * width, c] for i, c in enumerate(counts)]


class RecordingsRoutes:
    """``POST /web/episodes`` and ``POST /web/episodes/one`` (module doc), before
    ``inner``'s routes (OpenEnv's web JSON endpoints and Task API)."""

    def __init__(self, endpoints: HttpEndpoints, inner: ExtraRoutes) -> None:
        self.endpoints = endpoints
        self.inner = inner
        self.web = inner.web
        recorder = endpoints.runtime.ledger.recorder
        self.index = None if recorder is None else RecordingIndex(recorder.config.directory)

    def async_get(self, path: str) -> bool:
        return self.inner.async_get(path)

    def route(self, method: str, path: str) -> Callable[[bytes], Awaitable[HttpResponse]] | None:
        if method == "POST" and path == "/web/episodes":
            return self._list
        if method == "POST" and path == "/web/episodes/one":
            return self._one
        return self.inner.route(method, path)

    async def _list(self, body: bytes) -> HttpResponse:
        index, filters = self.index, _body(body)
        if index is None:
            return _not_recording()
        if filters is None:
            return error_response(422, "the body must be a JSON object", "VALIDATION_ERROR")
        loop = asyncio.get_running_loop()
        offset = _int(filters.get("offset"), 0, 0, 1 << 40)
        limit = _int(filters.get("limit"), 50, 1, PAGE_MAX)

        def answer() -> bytes:
            episodes = index.episodes()
            chosen = select(episodes, filters)
            envs = sorted({ep["env"] for ep in episodes})
            costs = {
                env: {
                    "cpu_s": histogram([e["cpu_s"] for e in chosen if e["env"] == env]),
                    "wall_s": histogram([e["wall_s"] for e in chosen if e["env"] == env]),
                }
                for env in sorted({e["env"] for e in chosen})
            }
            return msgspec.json.encode({
                "total": len(chosen), "offset": offset, "limit": limit, "envs": envs,
                "episodes": chosen[offset : offset + limit], "costs": costs,
            })  # fmt: skip

        return HttpResponse(200, await loop.run_in_executor(None, answer))

    async def _one(self, body: bytes) -> HttpResponse:
        index, data = self.index, _body(body)
        if index is None:
            return _not_recording()
        if data is None or not isinstance(data.get("file"), str):
            return error_response(
                422, 'give {"file": NAME, "row": N} of an episode of POST /web/episodes',
                "VALIDATION_ERROR",
            )  # fmt: skip
        name = data["file"]
        row = _int(data.get("row"), 0, 0, 1 << 40)
        first = _int(data.get("step_offset"), 0, 0, 1 << 40)
        count = _int(data.get("step_limit"), 100, 1, STEPS_MAX)
        loop = asyncio.get_running_loop()
        episode = await loop.run_in_executor(None, index.one, name, row, first, count)
        if episode is None:
            return error_response(404, f"no episode {row} in {name!r}", "NOT_FOUND")
        return HttpResponse(200, msgspec.json.encode(episode))


def _not_recording() -> HttpResponse:
    return error_response(
        404, "this server records no episodes: start it with --record DIR", "NOT_RECORDING"
    )


def _body(body: bytes) -> dict[str, Any] | None:
    if not body.strip():
        return {}
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    return data if isinstance(data, dict) else None


def _int(value: Any, default: int, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        return default
    return max(low, min(high, value))


__all__ = ["RecordingIndex", "RecordingsRoutes", "histogram", "select"]
