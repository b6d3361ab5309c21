"""How busy the (possibly shared) machine is: the benchmark waits for a quiet moment before
starting each server and records what it saw, since other work on 2 cores moves every number."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

PROC_STAT = Path("/proc/stat")


def cpu_times(stat_text: str) -> tuple[int, int]:
    """(idle, total) jiffies of all CPUs from /proc/stat's text (idle includes iowait)."""
    fields = [int(x) for x in stat_text.splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return idle, sum(fields[:8])  # user .. steal; guest time is already in user


def wait_for_quiet(
    max_busy: float,
    timeout_s: float,
    measure: Callable[[], float],
    say: Callable[[str], None] = print,
) -> float:
    """Wait until `measure()` (a busy share, 0..1) is at most `max_busy`, or `timeout_s`
    passes, then go on; returns the last share seen."""
    deadline = time.monotonic() + timeout_s
    busy = measure()
    if busy <= max_busy:
        return busy
    say(
        f"    others keep the machine {busy:.0%} busy: waiting up to {timeout_s:.0f} s for <= {max_busy:.0%}"
    )
    while busy > max_busy and time.monotonic() < deadline:
        busy = measure()
    if busy > max_busy:
        say(f"    still {busy:.0%} busy after {timeout_s:.0f} s: measuring anyway")
    return busy


def process_cpu_ticks(stat_text: str) -> tuple[int, int]:
    """(process group id, user + system clock ticks) from one /proc/PID/stat line."""
    fields = stat_text.rsplit(")", 1)[1].split()  # the command name may hold spaces
    return int(fields[2]), int(fields[11]) + int(fields[12])


def ticks_of(pgid: int) -> int:
    """CPU ticks used so far by the live processes of group `pgid`, plus this process."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            group, ticks = process_cpu_ticks(stat.read_text())
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked
        total += ticks if group == pgid else 0
    _, own = process_cpu_ticks(Path("/proc/self/stat").read_text())
    return total + own


class OthersMeter:
    """Share of the machine's CPU time that went to anything but the server's process group
    and this client between start and `others_share()`: interference on a shared machine."""

    def __init__(self, pgid: int) -> None:
        self._pgid = pgid
        self._idle, self._total = cpu_times(PROC_STAT.read_text())
        self._ours = ticks_of(pgid)

    def others_share(self) -> float:
        idle, total = cpu_times(PROC_STAT.read_text())
        elapsed = total - self._total
        if elapsed <= 0:
            return 0.0
        busy = elapsed - (idle - self._idle)
        ours = ticks_of(self._pgid) - self._ours
        return min(1.0, max(0.0, (busy - ours) / elapsed))


def others_busy_share(pgid: int | None, interval_s: float = 2.0) -> float:
    """The CPU share other processes (not group `pgid`, not this one) take over `interval_s`
    seconds. An idle server can still poll (vLLM's engine core keeps ~1/4 of this machine
    busy), so its own group is left out."""
    meter = OthersMeter(-1 if pgid is None else pgid)
    time.sleep(interval_s)
    return meter.others_share()
