"""perftest's result arithmetic, from the timestamps a run collected.

Units follow perftest: MB/sec is 2^20 bytes per second, Gb/sec is 10^9 bits per second,
MsgRate is 10^6 messages per second. Latency is half the measured round trip (perftest's
*_lat tests report one-way time the same way); t_typical is the median. CPU_Util (perftest's
--cpu_util) is the whole machine's, from /proc/stat, over the measured loop.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

MB = float(1 << 20)


@dataclass
class BwResult:
    bytes: int
    iterations: int
    bw_peak: float  # in `units`
    bw_avg: float
    msg_rate_mpps: float
    units: str  # "Gb/sec" or "MB/sec"
    seconds: float
    # --cpu_util: the machine's busy share (%), the share stolen by the hypervisor (%),
    # and the measured loop's wall-clock window [start, end] in Unix seconds.
    cpu_util: float | None = None
    cpu_steal: float | None = None
    cpu_window: tuple[float, float] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LatResult:
    bytes: int
    iterations: int
    t_min: float  # microseconds
    t_max: float
    t_typical: float
    t_avg: float
    t_stdev: float
    p99: float
    p999: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def machine_jiffies() -> tuple[int, int, int]:
    """The whole machine's CPU time since boot in jiffies, from /proc/stat's first line:
    (all, busy, stolen). Busy is neither idle, iowait nor stolen by the hypervisor (guest
    time is inside user), so it holds the kernel's softirq work too: on a namespace
    fabric, the forwarding of every packet."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    total = sum(fields[:8])
    return total, total - fields[3] - fields[4] - fields[7], fields[7]


class CpuUtil:
    """perftest's --cpu_util: the machine's CPU use between start() and stop()."""

    def start(self) -> None:
        self._t0, self._j0 = time.time(), machine_jiffies()

    def stop(self) -> tuple[float, float, tuple[float, float]]:
        """(busy %, stolen %, (start, end) in Unix seconds)."""
        total, busy, steal = machine_jiffies()
        d = total - self._j0[0]
        if d <= 0:
            return 0.0, 0.0, (self._t0, time.time())
        return (
            100.0 * (busy - self._j0[1]) / d,
            100.0 * (steal - self._j0[2]) / d,
            (self._t0, time.time()),
        )


def rate(nbytes: float, seconds: float, gbits: bool) -> float:
    if seconds <= 0:
        return 0.0
    return nbytes * 8 / seconds / 1e9 if gbits else nbytes / seconds / MB


def bw_result(
    size: int,
    t_start: float,
    completions: list[float],
    gbits: bool,
    inflight: int = 1,
    cpu: tuple[float, float, tuple[float, float]] | None = None,
) -> BwResult:
    """`completions`: perf_counter() at which each operation was seen complete, in order.

    Peak is the best rate over any window of at least a tenth of the run and at least
    twice the operations kept in flight: completions are reaped in bursts of up to
    `inflight`, so shorter windows would time a burst of reaping, not of the network.
    """
    n = len(completions)
    seconds = (completions[-1] - t_start) if n else 0.0
    avg = rate(size * n, seconds, gbits)
    peak = avg
    w = max(16, 2 * inflight, n // 10)
    if n > 2 * w:
        best = max(
            (size * w) / (completions[i + w] - completions[i])
            for i in range(0, n - w, max(1, w // 4))
            if completions[i + w] > completions[i]
        )
        peak = max(avg, best * 8 / 1e9 if gbits else best / MB)
    mpps = n / seconds / 1e6 if seconds > 0 else 0.0
    units = "Gb/sec" if gbits else "MB/sec"
    return BwResult(size, n, peak, avg, mpps, units, seconds, *(cpu or (None, None, None)))


def percentile(sorted_us: list[float], q: float) -> float:
    """perftest's: the sample at index ceil(q * n) - 1 of the sorted samples."""
    i = max(0, min(len(sorted_us) - 1, math.ceil(q * len(sorted_us)) - 1))
    return sorted_us[i]


def lat_result(size: int, rtts_ns: list[int]) -> LatResult:
    """One-way latency (half of each round trip) statistics in microseconds."""
    us = sorted(r / 2000.0 for r in rtts_ns)
    n = len(us)
    if n == 0:
        return LatResult(size, 0, 0, 0, 0, 0, 0, 0, 0)
    avg = sum(us) / n
    var = sum((x - avg) ** 2 for x in us) / n
    return LatResult(
        bytes=size,
        iterations=n,
        t_min=us[0],
        t_max=us[-1],
        t_typical=us[n // 2],
        t_avg=avg,
        t_stdev=math.sqrt(var),
        p99=percentile(us, 0.99),
        p999=percentile(us, 0.999),
    )
