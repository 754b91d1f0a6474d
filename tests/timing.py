"""Where the suite's time goes: with ``VITKIT_TEST_TIMES=FILE`` each test process appends one JSON line per test
(its phase, worker, start and end, wall seconds, and CPU seconds of the process and of the children it waited for)
to ``FILE``. ``python -m tests.timing FILE`` sums them by file and by kind, and shows each worker's idle tail.

    VITKIT_TEST_TIMES=/tmp/times.jsonl make test
    .venv/bin/python -m tests.timing /tmp/times.jsonl [--write tests/durations.json]
"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest

OUT = os.environ.get("VITKIT_TEST_TIMES")


def measured_id(nodeid: str) -> str:
    """A node id without the "@group" pytest-xdist's loadgroup appends (a parameter may hold "@" itself): the id
    the durations are kept under."""
    while nodeid.rfind("@") > nodeid.rfind("]"):
        nodeid = nodeid.rpartition("@")[0]
    return nodeid


def _machine() -> tuple[float, float]:
    """Seconds the machine's CPUs have been idle, and in the kernel, since boot, summed over CPUs (Linux; 0
    elsewhere): the report tells from them how much of the run's CPU time went unused (processes waiting, a
    worker alone at the end) and how much the kernel took (page faults of fresh memory, system calls), the
    processes the fork server starts included."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
        tick = os.sysconf("SC_CLK_TCK")
        return (fields[3] + fields[4]) / tick, (fields[2] + fields[5] + fields[6]) / tick  # idle + iowait; system
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0


def _cpu() -> tuple[float, float]:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not OUT:
        yield
        return
    t0, (c0, k0), (i0, s0) = time.time(), _cpu(), _machine()
    yield
    t1, (c1, k1), (i1, s1) = time.time(), _cpu(), _machine()
    with open(OUT, "a") as f:
        f.write(json.dumps({"test": measured_id(item.nodeid), "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                            "start": t0, "end": t1, "wall": t1 - t0, "cpu": c1 - c0, "children": k1 - k0,
                            "idle_start": i0, "idle_end": i1, "system_start": s0, "system_end": s1}) + "\n")


KINDS = [  # (kind, substrings of a test id), the first that matches
    ("multi-process runs", ("test_sharded", "test_distributed", "test_faults", "test_streaming.py", "two_nodes",
                            "ddp", "test_sharded_memory")),
    ("torch.compile builds", ("compile", "flex", "every_backend", "backends_agree", "script_and_trace")),
    ("learning curves", ("learn", "beats", "test_headless", "test_streaming_mix")),
    ("full-size parity", ("large_presets", "every_timm_tag", "every_preset", "full_size", "224_matches")),
    ("command-line processes", ("test_cli", "installed_wheel", "from_the_shell", "test_pretrained")),
]


def kind_of(test: str) -> str:
    return next((k for k, keys in KINDS if any(s in test for s in keys)), "other")


def report(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    start, end = min(r["start"] for r in rows), max(r["end"] for r in rows)
    print(f"{len(rows)} tests, {end - start:.0f} s from the first start to the last end")
    if all(r.get("idle_end") for r in rows):
        idle = max(r["idle_end"] for r in rows) - min(r["idle_start"] for r in rows)
        print(f"  the machine's {os.cpu_count()} CPUs idle {idle:.0f} s of {os.cpu_count() * (end - start):.0f} "
              f"({idle / (os.cpu_count() * (end - start)):.0%}; read on the machine that ran it)")
    if all(r.get("system_end") for r in rows):
        system = max(r["system_end"] for r in rows) - min(r["system_start"] for r in rows)
        print(f"  in the kernel {system:.0f} s of {os.cpu_count() * (end - start):.0f} "
              f"({system / (os.cpu_count() * (end - start)):.0%}: page faults, system calls)")
    by_worker = collections.defaultdict(list)
    for r in rows:
        by_worker[r["worker"]].append(r)
    for w, rs in sorted(by_worker.items()):
        busy, last = sum(r["wall"] for r in rs), max(r["end"] for r in rs)
        print(f"  worker {w}: {len(rs)} tests, busy {busy:.0f} s, done {end - last:.0f} s before the end")
    for title, key in (("kind", lambda r: kind_of(r["test"])), ("file", lambda r: r["test"].split("::")[0])):
        sums = collections.defaultdict(lambda: [0.0, 0.0, 0])
        for r in rows:
            s = sums[key(r)]
            s[0] += r["wall"]
            s[1] += r["cpu"] + r["children"]
            s[2] += 1
        print(f"\nby {title}: wall s, CPU s (with children), tests")
        for k, (wall, cpu, n) in sorted(sums.items(), key=lambda kv: -kv[1][0])[:30]:
            print(f"  {wall:7.1f} {cpu:7.1f} {n:5d}  {k}")


def write_durations(path: str, out: str) -> None:
    """Each test's seconds (the last run's, rounded), which tests/conftest.py orders the work by."""
    durations = {}
    for line in open(path):
        r = json.loads(line)
        durations[r["test"]] = round(r["wall"], 2)
    Path(out).write_text(json.dumps(dict(sorted(durations.items())), indent=0) + "\n")


if __name__ == "__main__":
    report(sys.argv[1])
    if "--write" in sys.argv:
        write_durations(sys.argv[1], sys.argv[sys.argv.index("--write") + 1])
