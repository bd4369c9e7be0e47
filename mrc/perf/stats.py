"""perftest's result arithmetic, from the timestamps a run collected.

Units follow perftest: MB/sec is 2^20 bytes per second, Gb/sec is 10^9 bits per second,
MsgRate is 10^6 messages per second. Latency is half the measured round trip (perftest's
*_lat tests report one-way time the same way); t_typical is the median.
"""

from __future__ import annotations

import math
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


def rate(nbytes: float, seconds: float, gbits: bool) -> float:
    if seconds <= 0:
        return 0.0
    return nbytes * 8 / seconds / 1e9 if gbits else nbytes / seconds / MB


def bw_result(
    size: int, t_start: float, completions: list[float], gbits: bool, inflight: int = 1
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
    return BwResult(size, n, peak, avg, mpps, "Gb/sec" if gbits else "MB/sec", seconds)


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
