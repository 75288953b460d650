"""``stadium bench rl``: one RL step's worth of agent episodes against a server.

The OpenEnv scaling study measures connect + reset + one step. An RL step looks like
OpenEnv's own stress test instead (``examples/agent_world_model/example_stress_test.py``):
N environments reset with a bounded number of resets at once, each then runs an episode
of a random number of tool turns with a random "LLM think" time before each turn, then
closes. This module is that workload, seeded so that two arms get the very same episodes:

* :class:`RlProfile` — the workload (sessions, concurrent resets, turns and think range,
  the env's own time per turn, seed); :data:`PRESETS` names some, ``openenv-stress``
  being the stress test's defaults (2,000 envs, 256 concurrent resets, 3-20 turns,
  1-20 s of think time);
* :func:`episodes` — the seeded plan: turns and think times of every episode;
* :func:`run_profile` — the episodes run on the current event loop with the bench's
  picows client (one connection per session);
* :func:`summarize` — the figures: per-turn server overhead (reply latency minus the
  env's own time per turn), its p50/p99, connect and reset latency, sessions and turns
  per second per server core, server CPU per turn, failures by kind;
* :func:`run_rl` — each arm (stadium, floor, openenv ...) started in turn, pinned to
  its CPUs, loaded with the same episodes, sampled; ``rl.json`` and ``rl.md``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from stadium._core.frames import Request
from stadium._errors import ConfigError
from stadium.bench.clientwatch import ClientStats, ClientWatch, quiet_collector
from stadium.bench.stats import ErrorKind, percentile


@dataclass(frozen=True, slots=True)
class RlProfile:
    """One RL step's workload. Times in seconds; ranges inclusive ``(low, high)``.

    ``tool_s`` is the env's own time per turn (the benchmark env's ``wait_seconds``):
    what a reply would take on a server with no overhead at all.
    """

    sessions: int = 2000
    concurrent_resets: int = 256
    turns: tuple[int, int] = (3, 20)
    think_s: tuple[float, float] = (1.0, 20.0)
    tool_s: float = 0.0
    seed: int = 0
    connect_timeout: float = 60.0
    request_timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.sessions < 1:
            raise ConfigError(f"--sessions must be at least 1, not {self.sessions}")
        if self.concurrent_resets < 1:
            raise ConfigError(
                f"--concurrent-resets must be at least 1, not {self.concurrent_resets}"
            )
        low, high = self.turns
        if not 0 <= low <= high:
            raise ConfigError(f"--turns must be LOW-HIGH with 0 <= LOW <= HIGH, not {low}-{high}")
        t_low, t_high = self.think_s
        if not 0 <= t_low <= t_high:
            raise ConfigError(
                f"--think must be LOW-HIGH seconds with 0 <= LOW <= HIGH, not {t_low}-{t_high}"
            )
        if self.tool_s < 0:
            raise ConfigError(f"--tool-ms must be >= 0, not {self.tool_s * 1000:g}")

    def describe(self) -> str:
        """One line: what the workload is."""
        return (
            f"{self.sessions} sessions, {self.concurrent_resets} concurrent resets, "
            f"{self.turns[0]}-{self.turns[1]} turns, {self.think_s[0]:g}-{self.think_s[1]:g} s "
            f"think, {self.tool_s * 1000:g} ms env time per turn, seed {self.seed}"
        )


PRESETS: dict[str, RlProfile] = {
    # OpenEnv's examples/agent_world_model/example_stress_test.py defaults.
    "openenv-stress": RlProfile(),
    # The same shape in about a minute: short think, fewer turns.
    "short": RlProfile(sessions=2000, concurrent_resets=256, turns=(3, 20), think_s=(0.5, 2.0)),
}


@dataclass(frozen=True, slots=True)
class RlEpisode:
    """One session's plan: the think time before each of its turns."""

    index: int
    thinks: tuple[float, ...]

    @property
    def turns(self) -> int:
        return len(self.thinks)


def episodes(profile: RlProfile) -> list[RlEpisode]:
    """Every session's turns and think times, drawn from ``profile.seed`` (uniform, as the
    stress test draws them): the same profile always gives the same episodes."""
    rng = random.Random(profile.seed)
    low, high = profile.turns
    t_low, t_high = profile.think_s
    out = []
    for i in range(profile.sessions):
        n = rng.randint(low, high)
        out.append(RlEpisode(i, tuple(rng.uniform(t_low, t_high) for _ in range(n))))
    return out


@dataclass(slots=True)
class EpisodeRecord:
    """What happened to one episode; latencies in seconds."""

    index: int
    planned_turns: int
    ok: bool = False
    error: str = ""
    detail: str = ""
    connect_s: float | None = None
    reset_s: float | None = None
    turn_s: list[float] = field(default_factory=list)
    turn_at: list[float] = field(default_factory=list)


ConnectionFactory = Callable[[str, str | None], Any]


async def run_episode(
    ep: RlEpisode,
    conn: Any,
    profile: RlProfile,
    resets: asyncio.Semaphore,
    rec: EpisodeRecord,
    step_body: bytes,
    reset_body: bytes,
    t0: float = 0.0,
) -> None:
    """Connect and reset (holding one of the ``resets`` slots, as the stress test does),
    then each turn: think, step, time the reply (and note when it was sent, seconds after
    ``t0``); then close. Never raises (but on cancel): a failure is recorded in ``rec``."""
    from stadium.bench.sessions import Fail

    now = time.monotonic
    try:
        async with resets:
            t = now()
            await conn.connect(profile.connect_timeout)
            rec.connect_s = now() - t
            t = now()
            await conn.request("reset", reset_body, profile.request_timeout)
            rec.reset_s = now() - t
        limit = profile.tool_s + profile.request_timeout
        for think in ep.thinks:
            await asyncio.sleep(think)
            t = now()
            await conn.request("step", step_body, limit)
            # The reply's time is when its frame came off the socket (the transport's
            # callback notes it), not when this task resumed after it.
            done = getattr(conn, "replied_at", 0.0)
            rec.turn_s.append((done if done >= t else now()) - t)
            rec.turn_at.append(t - t0)
        conn.close()
        rec.ok = True
        rec.detail = await conn.closed(5.0)
    except Fail as exc:
        rec.error, rec.detail = exc.kind.value, exc.detail
    except TimeoutError as exc:
        rec.error, rec.detail = ErrorKind.TIMEOUT.value, str(exc)[:200]
    except OSError as exc:
        rec.error, rec.detail = ErrorKind.REFUSED.value, f"{type(exc).__name__}: {exc}"[:200]
    except Exception as exc:  # a bug in a reply's handling must not end the run
        rec.error, rec.detail = ErrorKind.PROTOCOL.value, f"{type(exc).__name__}: {exc}"[:200]
    finally:
        conn.abort()


def frames(profile: RlProfile) -> tuple[bytes, bytes]:
    """The step and reset frames every episode of ``profile`` sends, encoded once."""
    step = msgspec.json.encode(Request("step", {"wait_seconds": profile.tool_s}))
    return step, msgspec.json.encode(Request("reset", {}))


async def run_profile(
    profile: RlProfile,
    url: str,
    connection: ConnectionFactory | None = None,
    plan: Sequence[RlEpisode] | None = None,
    watch: list[ClientStats] | None = None,
) -> list[EpisodeRecord]:
    """Run every episode of ``profile`` against ``url`` (a WebSocket URL) on this loop;
    one record per episode, in order. ``connection`` defaults to the bench's picows
    client. The client's cyclic collector runs as a Stadium server's does meanwhile
    (:func:`~stadium.bench.clientwatch.quiet_collector`), so that its collections of
    the connections' objects are not timed as the server's latency. With ``watch`` (a
    list), the client's own loop lag and collections are watched during the run
    (:class:`~stadium.bench.clientwatch.ClientWatch`) and their :class:`ClientStats`
    appended to it."""
    if connection is None:
        from stadium.bench.sessions import ws_connection_class

        connection = ws_connection_class()
    plan = list(plan) if plan is not None else episodes(profile)
    resets = asyncio.Semaphore(profile.concurrent_resets)
    step, reset = frames(profile)
    records = [EpisodeRecord(ep.index, ep.turns) for ep in plan]
    t0 = time.monotonic()
    watcher = ClientWatch(t0) if watch is not None else None
    with quiet_collector():
        if watcher is not None:
            watcher.start()
        try:
            await asyncio.gather(
                *(
                    run_episode(ep, connection(url, None), profile, resets, rec, step, reset, t0)
                    for ep, rec in zip(plan, records, strict=True)
                )
            )
        finally:
            if watcher is not None and watch is not None:
                watch.append(await watcher.stop())
    return records


@dataclass(frozen=True, slots=True)
class RlSummary:
    """One arm's figures (milliseconds for latencies; ``None`` where nothing was measured)."""

    arm: str
    sessions: int
    ok: int
    failed: int
    errors: dict[str, int]
    turns: int
    planned_turns: int
    wall_s: float
    server_cpu_s: float | None
    server_cores: float
    overhead_p50_ms: float | None
    overhead_p99_ms: float | None
    overhead_max_ms: float | None
    connect_p50_ms: float | None
    connect_p99_ms: float | None
    reset_p50_ms: float | None
    reset_p99_ms: float | None
    sessions_per_s_per_core: float
    turns_per_s_per_core: float
    server_cpu_per_turn_us: float | None


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000.0


def summarize(
    arm: str,
    profile: RlProfile,
    records: Sequence[EpisodeRecord],
    wall_s: float,
    server_cpu_s: float | None,
    server_cores: float,
) -> RlSummary:
    """The figures of one arm's run (see the module docstring). The per-turn overhead is
    each turn's reply latency minus ``profile.tool_s``; server CPU per turn counts all the
    server did (connects, resets and closes too) over the turns served."""
    turns = [t - profile.tool_s for r in records for t in r.turn_s]
    connects = [r.connect_s for r in records if r.connect_s is not None]
    resets = [r.reset_s for r in records if r.reset_s is not None]
    ok = sum(r.ok for r in records)
    errors = collections.Counter(r.error for r in records if not r.ok)
    cores = max(server_cores, 1e-9)
    wall = max(wall_s, 1e-9)
    return RlSummary(
        arm=arm,
        sessions=len(records),
        ok=ok,
        failed=len(records) - ok,
        errors=dict(sorted(errors.items())),
        turns=len(turns),
        planned_turns=sum(r.planned_turns for r in records),
        wall_s=wall_s,
        server_cpu_s=server_cpu_s,
        server_cores=server_cores,
        overhead_p50_ms=_ms(percentile(turns, 50)),
        overhead_p99_ms=_ms(percentile(turns, 99)),
        overhead_max_ms=_ms(max(turns)) if turns else None,
        connect_p50_ms=_ms(percentile(connects, 50)),
        connect_p99_ms=_ms(percentile(connects, 99)),
        reset_p50_ms=_ms(percentile(resets, 50)),
        reset_p99_ms=_ms(percentile(resets, 99)),
        sessions_per_s_per_core=ok / wall / cores,
        turns_per_s_per_core=len(turns) / wall / cores,
        server_cpu_per_turn_us=(
            server_cpu_s / len(turns) * 1e6 if server_cpu_s is not None and turns else None
        ),
    )


def _f(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def table(summaries: Sequence[RlSummary]) -> str:
    """The arms side by side, as a Markdown table."""
    head = (
        "| arm | ok / sessions | turns | overhead p50 ms | overhead p99 ms | connect p50 / p99 ms "
        "| reset p50 / p99 ms | sessions/s per core | turns/s per core | server CPU per turn µs "
        "| failures |"
    )
    rows = [head, "|" + "---|" * 11]
    for s in summaries:
        fails = ", ".join(f"{k} {v}" for k, v in s.errors.items()) or "0"
        rows.append(
            f"| {s.arm} | {s.ok} / {s.sessions} | {s.turns} | {_f(s.overhead_p50_ms)} "
            f"| {_f(s.overhead_p99_ms)} | {_f(s.connect_p50_ms, 1)} / {_f(s.connect_p99_ms, 1)} "
            f"| {_f(s.reset_p50_ms, 1)} / {_f(s.reset_p99_ms, 1)} "
            f"| {s.sessions_per_s_per_core:.1f} | {s.turns_per_s_per_core:.1f} "
            f"| {_f(s.server_cpu_per_turn_us, 1)} | {fails} |"
        )
    return "\n".join(rows) + "\n"


def client_note(arm: str, client: ClientStats) -> str:
    """One line: how much the client's own loop lagged and collected during ``arm``'s run
    (a stall of the client is timed as the server's latency)."""
    lag = client.lag_ms
    return (
        f"{arm}: client loop lag p50 {_f(lag['p50'])} / p99 {_f(lag['p99'])} / max "
        f"{_f(lag['max'], 1)} ms over {client.probes} probes; {len(client.gcs)} collections, "
        f"{client.gc_ms:.1f} ms"
    )


def _event_loop_runner() -> Callable[[Any], Any]:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a bench dependency
        return asyncio.run
    return uvloop.run


def run_arm(
    arm_name: str,
    profile: RlProfile,
    out_dir: Path,
    *,
    server_cpus: tuple[int, ...] | None,
    client_cpus: tuple[int, ...] | None,
    url: str | None = None,
    openenv_py: str | None = None,
) -> tuple[RlSummary, list[EpisodeRecord], ClientStats | None]:
    """Start ``arm_name``'s server (pinned to ``server_cpus``), run the profile against it
    from this process (pinned to ``client_cpus``) watching the client itself, sample the
    server's CPU; stop it."""
    from stadium.bench.arms import Arm, Caps, ServerSettings, start_server
    from stadium.bench.procstat import ServerSampler

    arm = Arm.parse(arm_name, url=url)
    settings = ServerSettings(max_sessions=max(100_000, 2 * profile.sessions))
    server, _report = start_server(
        arm, settings, Caps(cpus=server_cpus), out_dir / "logs", f"rl-{arm.name}",
        openenv_py=openenv_py,
    )  # fmt: skip
    before = os.sched_getaffinity(0)
    try:
        if client_cpus is not None:
            os.sched_setaffinity(0, client_cpus)
        # No sampling thread: its scans of /proc would stall this loop, which times the
        # turns (ServerSampler); the server's CPU is read at the start and at the end.
        sampler = ServerSampler(server.pids or server.pid, interval=0)
        sampler.start()
        t0 = time.monotonic()
        watch: list[ClientStats] = []
        records: list[EpisodeRecord] = _event_loop_runner()(
            run_profile(profile, server.url, watch=watch)
        )
        wall = time.monotonic() - t0
        stats = sampler.stop()
    finally:
        os.sched_setaffinity(0, before)
        server.stop()
    cores = float(len(server_cpus)) if server_cpus else float(os.cpu_count() or 1)
    cpu = stats.cpu_s if sampler.pid is not None else None
    client = watch[0] if watch else None
    return summarize(arm.name, profile, records, wall, cpu, cores), records, client


def run_rl(
    profile: RlProfile,
    arms: Sequence[str],
    out_dir: Path,
    *,
    server_cpus: tuple[int, ...] | None = None,
    client_cpus: tuple[int, ...] | None = None,
    url: str | None = None,
    echo: Callable[[str], None] = print,
) -> list[RlSummary]:
    """Each arm in turn, the same episodes; writes ``rl.json`` (the figures and each
    episode's record) and ``rl.md`` (the table) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    openenv_py = None
    if "openenv" in arms:
        from stadium.bench.arms import ServerSettings, openenv_python

        openenv_py = openenv_python(ServerSettings().cache_dir)
    summaries = []
    notes = []
    raw: dict[str, Any] = {"profile": asdict(profile), "arms": {}}
    for name in arms:
        echo(f"rl: {name}: {profile.describe()}")
        summary, records, client = run_arm(
            name, profile, out_dir, server_cpus=server_cpus, client_cpus=client_cpus,
            url=url, openenv_py=openenv_py,
        )  # fmt: skip
        summaries.append(summary)
        raw["arms"][summary.arm] = {
            "summary": asdict(summary),
            "episodes": [asdict(r) for r in records],
            "client": asdict(client) if client is not None else None,
        }
        echo(table([summary]).splitlines()[-1])
        if client is not None:
            notes.append(client_note(summary.arm, client))
            echo(notes[-1])
    (out_dir / "rl.json").write_text(json.dumps(raw))
    text = f"# RL step: {profile.describe()}\n\n{table(summaries)}"
    if notes:
        text += "\nThe client itself (it times the turns):\n\n" + "".join(f"- {n}\n" for n in notes)
    (out_dir / "rl.md").write_text(text)
    echo(text)
    return summaries


def parse_range(text: str, kind: type[int] | type[float]) -> tuple[Any, Any]:
    """``LOW-HIGH`` (or one value: ``LOW-LOW``) as a pair of ``kind``; :class:`ConfigError`
    saying the expected form."""
    low, sep, high = text.partition("-")
    try:
        a = kind(low)
        b = kind(high) if sep else a
    except ValueError:
        raise ConfigError(f"expected LOW-HIGH (e.g. 3-20), not {text!r}") from None
    return a, b


__all__ = [
    "PRESETS",
    "ClientStats",
    "EpisodeRecord",
    "RlEpisode",
    "RlProfile",
    "RlSummary",
    "client_note",
    "episodes",
    "frames",
    "parse_range",
    "run_arm",
    "run_episode",
    "run_profile",
    "run_rl",
    "summarize",
    "table",
]
