"""The options of ``stadium bench`` as typed values, and the one translation of each.

* :class:`GridOptions` — the options every ``stadium bench`` command shares
  (the grid, the load, the caps, the output);
* :class:`RampOptions` — those of ``stadium bench ramp`` (arms, ``--no-stop``, ...).

Each field is one command-line flag, named after it (``requests_grid`` is
``--requests-grid``; a field's ``flag`` metadata overrides the name) and with
the same default: the command line (:mod:`stadium.bench.bench_commands`) takes its
defaults from here and builds these values from what it parsed
(:meth:`GridOptions.from_cli`). Three translations, one place each:

* :meth:`GridOptions.bench_config` / :meth:`RampOptions.config` — the
  :class:`~stadium.bench.grid.BenchConfig` a command runs;
* :meth:`GridOptions.argv` — the flags that reproduce the value (most
  defaults left out), so ``stadium bench ramp`` + ``argv()`` parses back to an equal
  value; :meth:`RampOptions.command` is that shell command.
"""

from __future__ import annotations

import dataclasses
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from stadium.bench.arms import BATCH_KINDS, Arm, parse_cpus, parse_size
from stadium.bench.grid import BenchConfig, pin_defaults
from stadium.bench.loadspec import ThinkModel

_ALWAYS = {"always": True}
"""Field metadata: render the flag even at its default (what defines the points:
a printed command then means the same under another version's defaults)."""


@dataclass(frozen=True)
class GridOptions:
    """The options every ``stadium bench`` command shares; field = flag, same default."""

    requests_grid: tuple[int, ...] = field(default=(32, 128, 512, 2048), metadata=_ALWAYS)
    wait_grid: tuple[float, ...] = field(default=(1.0,), metadata=_ALWAYS)
    steps: int = field(default=1, metadata=_ALWAYS)
    think_ms: float = 0.0
    think_tokens: int = 0
    think_token_ms: float = 0.0
    state_kb: int = 0
    reps: int = field(default=3, metadata=_ALWAYS)
    mode: str = "ws"
    batch: tuple[int, ...] = ()
    """Also load every Stadium (and url) arm with this many sessions per connection
    (``--batch 64,256``: the arms ``stadium+batch64``, ``stadium+batch256``)."""
    cpus: tuple[int, ...] | None = None
    load_cpus: tuple[int, ...] | None = None
    pin: bool = False
    mem: int | None = None
    """Bytes (``--mem`` takes 2G, 512M, ...)."""
    load_procs: int = 0
    connect_window: int = 0
    server_workers: int = 1
    max_sessions: int = 0
    serve_args: tuple[str, ...] = field(default=(), metadata={"flag": "--serve-arg"})
    """Extra arguments of every started Stadium server (``--serve-arg=--tenants=FILE``)."""
    timeout: float = 30.0
    deadline: float = 3600.0
    cache_dir: Path | None = None
    progress: bool = True
    output_dir: Path | None = None

    @classmethod
    def from_cli(cls, **parsed: Any) -> Self:
        """The value of the keyword arguments click parsed (raw ``--cpus`` and
        ``--mem`` text; grids as lists). Raises ``ConfigError`` for a bad CPU
        list or size."""
        values: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list | tuple) else v for k, v in parsed.items()
        }
        for name in ("cpus", "load_cpus"):
            values[name] = parse_cpus(values[name]) if values[name] else None
        values["mem"] = parse_size(values["mem"]) if values["mem"] else None
        return cls(**values)

    def bench_config(self, arms: list[Arm], stop_at_collapse: bool) -> BenchConfig:
        """The run these options describe, for ``arms``.

        ``pin`` without ``cpus`` or ``load_cpus`` splits this machine's CPUs
        (:func:`~stadium.bench.grid.pin_defaults`); no ``output_dir`` means
        ``bench-results/<timestamp>``.
        """
        arms = [x for arm in arms for x in self._with_batches(arm)]
        cpus, load_cpus = self.cpus, self.load_cpus
        if self.pin and cpus is None and load_cpus is None:
            cpus, load_cpus = pin_defaults()
        out = self.output_dir or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S")
        return BenchConfig(
            arms=arms,
            requests_grid=list(self.requests_grid),
            wait_grid=list(self.wait_grid),
            output_dir=out,
            reps=self.reps,
            steps=self.steps,
            think=ThinkModel(self.think_ms, self.think_tokens, self.think_token_ms),
            state_kb=self.state_kb,
            mode=self.mode,
            stop_at_collapse=stop_at_collapse,
            cpus=cpus,
            load_cpus=load_cpus,
            mem_bytes=self.mem,
            load_procs=self.load_procs,
            connect_window=self.connect_window,
            server_workers=self.server_workers,
            max_sessions=self.max_sessions,
            serve_args=self.serve_args,
            connect_timeout=self.timeout,
            request_timeout=self.timeout,
            deadline_s=self.deadline,
            cache_dir=self.cache_dir,
            progress=self.progress,
        )

    def _with_batches(self, arm: Arm) -> list[Arm]:
        """``arm``, then its batched arms (one per ``batch`` size) where it has batches."""
        if arm.batch or arm.kind not in BATCH_KINDS:
            return [arm]
        return [arm, *(arm.batched(b) for b in self.batch)]

    def argv(self) -> list[str]:
        """The flags that reproduce this value: defaults left out but for the
        fields that define the points (the arms, the grids, steps, repetitions).

        A subclass's own flags (e.g. the arms) come first, then these in field
        order (``--output-dir`` last).
        """
        shared = {f.name for f in dataclasses.fields(GridOptions)}
        fields = dataclasses.fields(self)
        out: list[str] = []
        for f in [
            *(f for f in fields if f.name not in shared),
            *(f for f in fields if f.name in shared),
        ]:
            value = getattr(self, f.name)
            if value == f.default and not f.metadata.get("always"):
                continue
            out += _render(f.metadata.get("flag", "--" + f.name.replace("_", "-")), value)
        return out


def _number(x: float) -> str:
    """``x`` as short as it reads back exactly: 10.0 → ``10``, 0.25 → ``0.25``."""
    if isinstance(x, int):
        return str(x)
    text = f"{x:g}"
    return text if float(text) == x else repr(x)


def _render(flag: str, value: Any) -> list[str]:
    """One field's flags: a switch, a repeated option, a comma list, or a value."""
    if isinstance(value, bool):  # a default True renders as --no-X
        return [flag] if value else ["--no-" + flag.removeprefix("--")]
    if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
        return [x for v in value for x in (flag, v)]
    if isinstance(value, tuple):
        return [flag, ",".join(_number(v) for v in value)]
    if isinstance(value, float):
        return [flag, _number(value)]
    return [flag, str(value)]


@dataclass(frozen=True)
class RampOptions(GridOptions):
    """The options of ``stadium bench ramp``: which arms, and whether to stop at collapse."""

    arms: tuple[str, ...] = field(
        default=("stadium", "floor"), metadata={**_ALWAYS, "flag": "--arm"}
    )
    url: str | None = None
    server_pid: int | None = None
    git_ref: str | None = None
    no_stop: bool = False

    def config(self) -> BenchConfig:
        """The run ``stadium bench ramp`` + :meth:`argv` starts (the ``git_ref`` arm first)."""
        arms = [Arm.parse(a, url=self.url, server_pid=self.server_pid) for a in self.arms]
        if self.git_ref:
            arms.insert(0, Arm.parse(f"stadium@{self.git_ref}"))
        return self.bench_config(arms, not self.no_stop)

    def command(self) -> str:
        """The shell command that runs these options."""
        return "stadium bench ramp " + shlex.join(self.argv())
