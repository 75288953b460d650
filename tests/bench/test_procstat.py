"""/proc readings and the server spawner that ``stadium demo`` shares with the harness."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator

import pytest

from stadium._errors import ConfigError
from stadium.bench import procstat
from stadium.bench.arms import spawn_server
from stadium.bench.procstat import ServerSampler, process_tree, process_trees, read_stat

_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.fixture
def parent_and_child() -> Iterator[tuple[int, int]]:
    """A process with one child process, both asleep."""
    cmd = [sys.executable, "-c", _PARENT]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        try:
            yield proc.pid, child
        finally:
            for pid in (child, proc.pid):
                os.kill(pid, 9)
            proc.wait()


def test_read_stat_of_this_process() -> None:
    stat = read_stat(os.getpid())
    assert stat.threads >= threading.active_count()
    assert stat.rss_bytes > 1 << 20
    assert stat.cpu_s > 0
    cpu, rss, threads = stat  # the tuple stadium._cli.demo._proc_stats returned
    assert (cpu, rss, threads) == (stat.cpu_s, stat.rss_bytes, stat.threads)
    with pytest.raises(OSError):
        read_stat(2**22 + 1)  # above pid_max: no such process


def test_read_stat_agrees_with_psutil(parent_and_child: tuple[int, int]) -> None:
    psutil = pytest.importorskip("psutil")
    pid, _ = parent_and_child
    stat, p = read_stat(pid), psutil.Process(pid)
    assert stat.threads == p.num_threads()
    assert stat.rss_bytes == pytest.approx(p.memory_info().rss, abs=1 << 20)
    times = p.cpu_times()
    assert stat.cpu_s == pytest.approx(times.user + times.system, abs=0.05)


def test_the_walk_down_children_finds_what_the_scan_of_every_process_finds(
    parent_and_child: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    pid, child = parent_and_child
    me = os.getpid()
    walked = process_trees([me])
    assert walked[0] == me
    assert walked.index(pid) < walked.index(child)  # a grandchild too, parents first
    assert sorted(walked) == sorted(procstat._scan_trees([me]))
    # A kernel without the children files: the scan answers
    monkeypatch.setattr(procstat, "_children", lambda p: None)
    assert sorted(process_trees([me])) == sorted(walked)


def test_process_tree_and_sampler(parent_and_child: tuple[int, int]) -> None:
    pid, child = parent_and_child
    assert process_tree(pid) == [pid, child]
    assert process_tree(child) == [child]
    assert process_tree(2**22 + 1) == []
    sampler = ServerSampler(pid, interval=0.01)
    sampler.start()
    stats = sampler.stop()
    assert stats.peak_procs == 2
    assert (stats.peak_threads or 0) >= 2
    assert (stats.peak_rss_mb or 0.0) >= (stats.idle_rss_mb or 0.0) > 1.0
    assert (stats.cpu_s or 0.0) >= 0.0
    assert stats.cpu_s is not None
    assert ServerSampler(None).stop().peak_rss_mb is None  # a remote server: nothing known


def test_spawn_server_serves_until_the_block_ends() -> None:
    with spawn_server("echo", "--log-level", "warning") as (proc, url):
        parsed = urllib.parse.urlsplit(url)
        assert (parsed.scheme, parsed.hostname) == ("http", "127.0.0.1")
        conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=5)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
        assert proc.poll() is None
    assert proc.poll() == 0  # stopped with SIGTERM: a clean drain


def test_spawn_server_says_why_it_did_not_start() -> None:
    with pytest.raises(ConfigError) as info:
        with spawn_server("no_such_environment_anywhere", timeout=30.0):
            pytest.fail("the server started")
    assert "exited" in info.value.message
    assert "no_such_environment_anywhere" in info.value.message  # the command and its output


def test_a_sampler_with_interval_0_starts_no_thread_and_still_counts_cpu() -> None:
    # The RL bench's client times replies on its loop: a sampling thread's /proc scans
    # (which hold the GIL) would be timed as the server's latency, so it takes none.
    pid = os.getpid()
    sampler = ServerSampler(pid, interval=0)
    before = threading.active_count()
    sampler.start()
    assert threading.active_count() == before
    end = read_stat(pid).cpu_s + 0.05
    while read_stat(pid).cpu_s < end:  # burn 50 ms of CPU (the clock ticks in 10 ms)
        sum(range(10_000))
    stats = sampler.stop()
    assert (stats.cpu_s or 0.0) >= 0.04
    assert stats.peak_procs == 1
