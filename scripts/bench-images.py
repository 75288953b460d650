#!/usr/bin/env python3
"""Task images (issue 31): Stadium's image-backed sandboxed sessions side by side with a
Podman container per session, on the same image, in one run (as root, with Podman).

The image: ``localhost/stadium-test-base:trixie`` (``make test``'s container tests build
it), exported once to a root filesystem directory for Stadium (``dir:``; the cache of
``tests/isolation/test_images.py``). Stadium serves ``tests/isolation/imaged.py:Imaged``
in this process (127.0.0.1:0, ``--isolation sandbox --image dir:...``); Podman runs
``podman run -d --network none IMAGE sleep infinity`` per session and ``podman exec`` per
command. Rows (ms unless said): session start p50/p99 from the warm pool (connect to
first observation, one at a time, the pool topped up between), and for the first session
of an image already prepared (no warm process: ``--warm-pool 0``); a reset to the pristine
image; ``true`` and a Python snippet per run (Stadium: timed inside the session, through
``Workspace.run`` / ``Workspace.python``; Podman: ``podman exec`` from outside, as a
harness drives a container); memory and disk per idle session; the most concurrent
sessions opened (bounded: ``--max-sessions``, ``--max-seconds``); distinct images live at
once (hard-linked copies of the rootfs, each its own ``REF``, one session each).

Run: ``flock /tmp/bench.lock .venv/bin/python scripts/bench-images.py [--sessions 100]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import stadium  # noqa: E402
from tests.conftest import serve  # noqa: E402
from tests.container.conftest import BASE, CACHE  # noqa: E402
from tests.isolation.test_images import _export  # noqa: E402

TARGET = f"{ROOT / 'tests' / 'isolation' / 'imaged.py'}:Imaged"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def row(label: str, xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} / {pct(xs, 0.99):.2f}" if xs else "-"


def available_mib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return 0.0


def session_cgroups_mib() -> list[float]:
    """Memory charged to each live session's cgroup of this process's workers (MiB)."""
    out = []
    for path in Path("/sys/fs/cgroup/memory/stadium").glob(f"w{os.getpid()}-*"):
        try:
            if (path / "cgroup.procs").read_text().strip():
                out.append(int((path / "memory.usage_in_bytes").read_text()) / 2**20)
        except OSError:
            continue
    return out


def pss_mib(pid: int) -> float:
    """The process's proportional set size (shared pages split among their users), MiB."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def session_pss_mib() -> list[float]:
    """Per live session: the PSS of its processes and of its family's init (MiB)."""
    out = []
    for path in Path("/sys/fs/cgroup/pids/stadium").glob(f"w{os.getpid()}-*"):
        try:
            pids = [int(x) for x in (path / "cgroup.procs").read_text().split()]
        except OSError:
            continue
        if pids:
            inits = {parent(pid) for pid in pids}
            out.append(sum(pss_mib(p) for p in (*pids, *inits)))
    return out


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _size_mib(text: str) -> float:
    """Podman's human size (``704.5kB``, ``1.2MB``; decimal units) in MiB."""
    text = text.strip()
    for unit, factor in (("kB", 1e3), ("MB", 1e6), ("GB", 1e9), ("B", 1.0)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * factor / 2**20
    return 0.0


def rootfs(podman: str) -> Path:
    image_id = subprocess.run(
        [podman, "image", "inspect", "--format", "{{.Id}}", BASE],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()[:16]
    path = CACHE / f"imgbox-rootfs-{image_id}-a"
    if not path.is_dir():
        _export(podman, BASE, path)
    return path


def copies(base: Path, n: int) -> list[str]:
    """``n`` distinct images: hard-linked copies of ``base`` (as a content-addressed store
    shares files), each with its own ``/etc/image-name``."""
    refs = []
    for i in range(n):
        path = CACHE / f"imgbox-bench-copy-{i}"
        if not path.is_dir():
            tmp = path.with_name(path.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            subprocess.run(["cp", "-al", str(base), str(tmp)], check=True)
            (tmp / "etc/image-name").unlink(missing_ok=True)
            (tmp / "etc/image-name").write_text(f"{i}\n")
            tmp.rename(path)
        refs.append(f"dir:{path}")
    return refs


async def timed_sessions(url: str, n: int, pause: float = 0.0) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        async with stadium.AsyncClient(url) as env:
            await env.reset()
            out.append((time.perf_counter() - start) * 1000)
        await asyncio.sleep(pause)
    return out


async def stadium_arm(image: str, args: argparse.Namespace, images: list[str]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    async with serve(TARGET, isolation="sandbox", image=image, warm_pool=8,
                     max_sessions=args.max_sessions + 16) as server:  # fmt: skip
        await asyncio.sleep(2)  # the pool fills
        res["warm"] = await timed_sessions(server.url, args.sessions, pause=0.02)
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            resets = []
            for _ in range(args.sessions):
                start = time.perf_counter()
                await env.reset()
                resets.append((time.perf_counter() - start) * 1000)
                await asyncio.sleep(0.02)
            res["reset"] = resets
            for what in ("run", "py"):
                obs = (await env.step({"do": "time", "arg": what, "data": "200"})).observation
                res[what] = json.loads(obs["text"])
            du = (await env.step({"do": "run", "arg": "df -k / | tail -1"})).observation
            res["disk_kib"] = int(du["text"].split()[2])
        # The most concurrent sessions, bounded in count and time.
        before = available_mib()
        clients: list[Any] = []
        deadline = time.monotonic() + args.max_seconds
        try:
            while len(clients) < args.max_sessions and time.monotonic() < deadline:
                batch = [stadium.AsyncClient(server.url) for _ in range(50)]
                opened = await asyncio.gather(*(c.__aenter__() for c in batch),
                                              return_exceptions=True)  # fmt: skip
                ok = [c for c, o in zip(batch, opened, strict=True)
                      if not isinstance(o, BaseException)]  # fmt: skip
                resets = await asyncio.gather(*(c.reset() for c in ok), return_exceptions=True)
                clients += ok
                if any(isinstance(r, BaseException) for r in (*opened, *resets)):
                    break
            res["concurrent"] = len(clients)
            res["mem_mib"] = (before - available_mib()) / max(len(clients), 1)
            charged = session_cgroups_mib()
            res["cgroup_mib"] = statistics.mean(charged) if charged else 0.0
            pss = session_pss_mib()
            res["pss_mib"] = statistics.mean(pss) if pss else 0.0
        finally:
            await asyncio.gather(*(c.__aexit__(None, None, None) for c in clients),
                                 return_exceptions=True)  # fmt: skip
    async with serve(TARGET, isolation="sandbox", image=image, warm_pool=0) as server:
        await timed_sessions(server.url, 1)  # the template's start is not the image's
        res["first"] = await timed_sessions(server.url, max(args.sessions // 4, 10))
    # Distinct images live at once: one session each, all open together.
    async with serve(TARGET, isolation="sandbox", image=images[0], images=",".join(images),
                     max_sessions=len(images) + 4) as server:  # fmt: skip
        clients = [stadium.AsyncClient(server.url) for _ in images]
        try:
            for c, ref in zip(clients, images, strict=True):
                await c.__aenter__()
                await c.reset(options={"image": ref})
            names = [(await c.step({"do": "read", "arg": "/etc/image-name"})).observation["text"]
                     for c in clients]  # fmt: skip
            res["images_live"] = len({n.strip() for n in names})
        finally:
            for c in clients:
                await c.__aexit__(None, None, None)
    return res


def podman_arm(podman: str, args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {}

    def run_one() -> tuple[str, float]:
        start = time.perf_counter()
        cid = subprocess.run(
            [podman, "run", "-d", "--network", "none", BASE, "sleep", "infinity"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return cid, (time.perf_counter() - start) * 1000

    def rm(cids: list[str]) -> None:
        if cids:
            subprocess.run([podman, "rm", "-f", "-t", "0", *cids], capture_output=True, check=False)

    n = max(args.sessions // 4, 10)
    starts, cids = [], []
    try:
        for _ in range(n):
            cid, ms = run_one()
            cids.append(cid)
            starts.append(ms)
        res["start"] = starts
        for what, cmd in (("run", ["true"]), ("py", ["python3", "-c", "print(1)"])):
            times = []
            for _ in range(n):
                start = time.perf_counter()
                subprocess.run([podman, "exec", cids[0], *cmd], capture_output=True, check=True)
                times.append((time.perf_counter() - start) * 1000)
            res[what] = times
        resets = []
        for i in range(n):  # a pristine container: remove it, start a new one
            start = time.perf_counter()
            rm([cids[i]])
            cids[i], _ = run_one()
            resets.append((time.perf_counter() - start) * 1000)
        res["reset"] = resets
        rm(cids)
        cids = []
        before = available_mib()
        deadline = time.monotonic() + args.max_seconds
        while len(cids) < args.podman_max and time.monotonic() < deadline:
            cids.append(run_one()[0])
        res["concurrent"] = len(cids)
        res["mem_mib"] = (before - available_mib()) / max(len(cids), 1)
        stats = subprocess.run(
            [podman, "stats", "--no-stream", "--format", "json", *cids],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        usage = [_size_mib(s["mem_usage"].split("/")[0]) for s in json.loads(stats or "[]")]
        conmon = [rss_mib(int(subprocess.run(
            [podman, "inspect", "--format", "{{.State.ConmonPid}}", c], capture_output=True,
            text=True, check=True).stdout.strip() or 0)) for c in cids]  # fmt: skip
        res["cgroup_mib"] = statistics.mean(usage) if usage else 0.0
        pss = []
        for c in cids:
            pids = subprocess.run(
                [podman, "inspect", "--format", "{{.State.Pid}} {{.State.ConmonPid}}", c],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            pss.append(sum(pss_mib(int(p)) for p in pids if p.isdigit() and int(p) > 0))
        res["pss_mib"] = statistics.mean(pss) if pss else 0.0
        res["conmon_mib"] = statistics.mean(conmon) if conmon else 0.0
        diff = subprocess.run(
            [podman, "container", "inspect", "--size", "--format", "{{.SizeRw}}", cids[0]],
            capture_output=True,
            text=True,
        )
        res["disk_kib"] = int(diff.stdout.strip() or 0) // 1024
    finally:
        rm(cids)
    return res


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=100)
    p.add_argument("--max-sessions", type=int, default=1000)
    p.add_argument("--max-seconds", type=float, default=120.0)
    p.add_argument("--podman-max", type=int, default=50)
    p.add_argument("--images", type=int, default=60)
    args = p.parse_args()
    podman = shutil.which("podman")
    if os.geteuid() != 0 or podman is None:
        sys.exit("needs root and Podman")
    base = rootfs(podman)
    images = copies(base, args.images)
    ours = await stadium_arm(f"dir:{base}", args, images)
    theirs = podman_arm(podman, args)
    print(f"\n{BASE}; {os.cpu_count()} cores; {args.sessions} sessions per row\n")
    print("| | Stadium (sandbox, --image) | Podman (container per session) |")
    print("|---|---|---|")
    print(f"| session start, warm pool, p50 / p99 ms | {row('', ours['warm'])} | - |")
    print(
        f"| session start, image prepared, no warm process, p50 / p99 ms | "
        f"{row('', ours['first'])} | {row('', theirs['start'])} (podman run -d) |"
    )
    print(
        f"| reset to the pristine image, p50 / p99 ms | {row('', ours['reset'])} | "
        f"{row('', theirs['reset'])} (rm -f + run -d) |"
    )
    print(f"| `true`, p50 / p99 ms | {row('', ours['run'])} | {row('', theirs['run'])} |")
    print(f"| Python snippet, p50 / p99 ms | {row('', ours['py'])} | {row('', theirs['py'])} |")
    print(
        f"| memory per idle session, MiB: its cgroup | {ours['cgroup_mib']:.2f} | "
        f"{theirs['cgroup_mib']:.2f} (+ conmon {theirs['conmon_mib']:.2f} RSS) |"
    )
    print(
        f"| memory per idle session, MiB: PSS of its processes | {ours['pss_mib']:.2f} "
        f"(env process + init) | {theirs['pss_mib']:.2f} (its process + conmon) |"
    )
    print(
        f"| memory per idle session, MiB: MemAvailable drop / sessions | "
        f"{ours['mem_mib']:.2f} | {theirs['mem_mib']:.2f} |"
    )
    print(
        f"| disk per idle session | 0 (tmpfs; {ours['disk_kib']} KiB of it used) | "
        f"{theirs['disk_kib']} KiB (container layer) |"
    )
    print(
        f"| concurrent sessions opened (bounded) | {ours['concurrent']} "
        f"(limit {args.max_sessions}) | {theirs['concurrent']} (limit {args.podman_max}) |"
    )
    print(f"| distinct images live at once | {ours['images_live']} (of {args.images}) | - |")


if __name__ == "__main__":
    asyncio.run(main())
