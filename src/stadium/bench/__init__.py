"""``stadium bench``: the scaling benchmark harness for any environment server.

Public API (imported lazily, so ``import stadium.bench`` stays cheap)::

    from stadium.bench import run_ramp
    report_md = run_ramp(["stadium", "floor"], [32, 128, 512, 2048], [1.0], reps=1,
                         output_dir="bench-demo")

* :func:`run_ramp` — start each arm's server per point and ramp until collapse;
* :func:`run` with a :class:`BenchConfig` — every knob of the command line;
* :func:`compare` — two result directories side by side.

Modules: ``metrics`` (pure arithmetic, the error kinds), ``results`` (records
and summaries), ``loadspec`` (what a point's load is), ``sessions`` (one
session over WebSocket or HTTP, timed and classified), ``loadgen`` (the load
generator's worker processes), ``batch`` (a batched load: B sessions per
connection, one batch frame per round), ``procstat`` (/proc readings and sampling),
``arms`` (servers, how they start, caps), ``runner`` (a run: every point, then
the outputs), ``report`` (files and figures), ``compare``, ``options`` (the
command line's options as typed values), ``floor`` (the floor server),
``openenv_server`` (the OpenEnv arm), ``opcount`` (calls per step counted
in-process: the CI regression check), ``goals`` (every performance goal, one
ramp each, in ``goals.md``), ``main`` (``stadium bench``; nothing here
imports it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stadium.bench.compare import compare
    from stadium.bench.grid import BenchConfig, run, run_ramp

__all__ = ["BenchConfig", "compare", "run", "run_ramp"]

_WHERE = {
    "BenchConfig": "stadium.bench.grid",
    "run": "stadium.bench.grid",
    "run_ramp": "stadium.bench.grid",
    "compare": "stadium.bench.compare",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'stadium.bench' has no attribute {name!r}")
