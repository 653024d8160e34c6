"""What every benchmark records about the machine it ran on, and how busy that machine is.

Numbers are only comparable with numbers from the same kind of machine, so each result file
starts with this description (CPU, cores, Python, load, commit).
"""

from __future__ import annotations

import asyncio
import ctypes
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_REPO = Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
    return subprocess.run(args, capture_output=True, text=True, check=False).stdout.strip()


def machine(**extra: Any) -> dict[str, Any]:
    """CPU, cores, Python, load, date and commit; ``extra`` adds versions of the parts measured."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    git = ("git", "-C", str(_REPO))
    cores = os.cpu_count()
    return {
        "cpu_model": next(
            (ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?"
        ),
        "cores": cores,
        # Older result files call it nproc; kept so their renderers and readers still work.
        "nproc": cores,
        "cores_usable": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": _run(*git, "rev-parse", "HEAD"),
        "git_dirty": bool(_run(*git, "status", "--porcelain")),
        **extra,
    }


def _cpu_ticks() -> list[int]:
    """The machine's CPU time by state, in clock ticks (/proc/stat's first line: user, nice,
    system, idle, iowait, irq, softirq, steal, ...)."""
    with open("/proc/stat", encoding="ascii") as f:
        return [int(x) for x in f.readline().split()[1:]]


def machine_busy_seconds() -> float:
    """CPU-seconds all processes on the machine have used (/proc/stat, minus idle and iowait)."""
    ticks = _cpu_ticks()[:7]
    return (sum(ticks) - ticks[3] - ticks[4]) / _CLK_TCK


def process_stat(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces and parentheses):
    ``[0]`` is field 3 (the state), ``[1]`` the parent's pid, ``[11:15]`` utime, stime, cutime and
    cstime in clock ticks."""
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
        return f.read().rsplit(")", 1)[1].split()


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    return _cpu_seconds(process_stat(pid))


def _cpu_seconds(fields: list[str]) -> float:
    """utime + stime, in seconds, of :func:`process_stat` fields (a process's or one thread's)."""
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


#: ``sched_setscheduler`` policy of idle-class threads (/proc/.../stat field 41).
SCHED_IDLE = 5


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU-seconds of a process's threads in three groups: ``main`` (the first thread: an asyncio
    program's event loop), ``idle_class`` (threads scheduled ``SCHED_IDLE``) and ``other``. Threads
    that ended are missing: their time is only in the process's total."""
    out = {"main": 0.0, "idle_class": 0.0, "other": 0.0}
    for entry in os.scandir(f"/proc/{pid}/task"):
        try:
            fields = process_stat(f"{pid}/task/{entry.name}")
        except OSError:  # the thread ended meanwhile
            continue
        group = (
            "main" if entry.name == str(pid) else "idle_class" if int(fields[38]) == SCHED_IDLE else "other"
        )
        out[group] += _cpu_seconds(fields)
    return out


def tree_cpu_seconds(root: int) -> float:
    """CPU-seconds used by process ``root`` and every process below it, children they have reaped
    included (utime, stime, cutime, cstime of each; all of a process's threads)."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = process_stat(entry.name)
        except OSError:  # it ended meanwhile: its parent's cutime has it once reaped
            continue
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        ticks[pid] = sum(int(x) for x in fields[11:15])
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return total / _CLK_TCK


def machine_stolen_seconds() -> float:
    """CPU-seconds the hypervisor gave other guests while this VM wanted them (/proc/stat ``steal``):
    time a benchmark's processes were ready to run and did not."""
    return _cpu_ticks()[7] / _CLK_TCK


def provenance(m: dict[str, Any]) -> str:
    """Where a report's numbers come from, for its first line: date, commit, CPU, cores, Python."""
    dirty = " (dirty)" if m["git_dirty"] else ""
    where = f"{m['cpu_model']}, {m['cores']} cores; Python {m['python']}"
    return f"{m['date']}, commit {m['git_commit'][:12]}{dirty}; {where}"


def record(out: Path, results: dict[str, Any], report: Callable[[dict[str, Any]], str]) -> None:
    """Write ``results`` to ``out`` (JSON) and its report next to it (``.md``), and print the report."""
    text = report(results)
    out.write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(text)
    print(text)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            *("arena", "ordblks", "smblks", "hblks", "hblkhd"),
            *("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"),
        )
    ]


def malloc_bytes() -> tuple[int, int]:
    """This process's glibc malloc: (bytes in use, bytes free in its arenas), from ``mallinfo2``.

    Native memory (C extensions, and Python objects over 512 bytes) shows here; fragmentation
    shows as free bytes that RSS keeps.
    """
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd), int(info.fordblks)


# -- a child process that reports its malloc bytes in use, for per-stream memory benchmarks --------


def answer_malloc_readings() -> None:
    """The child's side, blocking: for each line on stdin, collect Python garbage, then print the
    malloc bytes in use (so what remains is native)."""
    while sys.stdin.readline():
        gc.collect()
        print(malloc_bytes()[0], flush=True)


async def answer_malloc_readings_async() -> None:
    """:func:`answer_malloc_readings` for a child whose event loop must keep serving meanwhile."""
    loop = asyncio.get_running_loop()
    while await loop.run_in_executor(None, sys.stdin.readline):
        gc.collect()
        print(malloc_bytes()[0], flush=True)


async def read_malloc(child: asyncio.subprocess.Process) -> int:
    """The parent's side: one reading of the child's malloc bytes in use."""
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(b"?\n")
    await child.stdin.drain()
    return int(await child.stdout.readline())


def kept(before: int, after: int, count: int) -> dict[str, float]:
    """Two readings around ``count`` streams: the MiB before and after, and bytes kept per stream."""
    return {
        "in_use_before_mb": round(before / 2**20, 2),
        "in_use_after_mb": round(after / 2**20, 2),
        "bytes_per_stream": round((after - before) / count, 1),
    }


def kept_row(label: str, count: int, result: dict[str, Any]) -> str:
    """A report row for :func:`kept`'s numbers."""
    return (
        f"| {label} | {count:,} | {result['in_use_before_mb']} -> {result['in_use_after_mb']} MB "
        f"| {result['bytes_per_stream']:.0f} B |"
    )
