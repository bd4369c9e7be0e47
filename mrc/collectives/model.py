"""The AllReduce cost model, the lower bound, the resilient shares and the planner (issue 13).

docs/collectives-model.md derives every formula in this module and proves the bound; the
names below follow it.

The model: n ranks, D bytes per rank to AllReduce. Rank r has a full-duplex NIC that sends
at s_r and receives at g_r bytes per second (the sum of its usable planes); the fabric core
never limits (a non-blocking Clos). A message of b bytes costs b / rate on both of its
ends, and a rank's concurrent transfers share its rate. alpha is the latency of one
dependent hop (post, cross the fabric, complete). The degraded case of the issue is one
rank at (1-X)B and n-1 at B; then times are quoted in units of D/B with alpha = 0.

Every function here is pure Python arithmetic (+ - * / max min on floats), so every rank
that feeds it the same agreed bandwidths gets bit-identical shares and the same plan: the
planner's choice can never differ between ranks (mrc.collectives.bandwidth.agree makes
the inputs equal).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from mrc.collectives.schedule import host_groups
from mrc.errors import UsageError

# The keys of `mrc-perf model --json`, in this order.
KEYS = ("ring", "split_opt", "split_x", "lower_bound", "mrc", "healthy", "y_opt")

# The planner keeps the equal-share schedule unless another is predicted faster by at
# least this fraction of its time. Small messages are latency-bound (both direct schedules
# pay the same 2 alpha), so their gain falls under it and they keep equal shares; it also
# keeps a schedule from flapping on a bandwidth that is barely lower.
MIN_GAIN = 0.02

# Dependent hops per algorithm, for the alpha term. A direct schedule is two: every rank's
# piece to its owner, the owner's reduced piece to everyone (chunks pipeline behind it).
# A ring is 2(n-1) steps; R2CC adds the pass-back behind its rings.
DIRECT_HOPS = 2

Rates = Sequence[float]


# Validation ---------------------------------------------------------------------------------


def _check_ranks(n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UsageError(f"ranks must be an integer >= 1, got {n!r}")
    return n


def _check_fraction(x: object, what: str = "lost fraction X") -> float:
    if isinstance(x, bool) or not isinstance(x, int | float) or not 0.0 <= float(x) < 1.0:
        raise UsageError(
            f"{what} must be in [0, 1) (1 would cut the rank off: no AllReduce can finish), "
            f"got {x!r}"
        )
    return float(x)


def _floats(values: Sequence[float], name: str) -> list[float]:
    out = []
    for r, v in enumerate(values):
        try:
            out.append(float(v))
        except (TypeError, ValueError):
            raise UsageError(f"{name}[{r}] = {v!r} is not a number") from None
    return out


def _check_rates(bw_send: Rates, bw_recv: Rates) -> tuple[list[float], list[float]]:
    s = _floats(bw_send, "bw_send")
    g = _floats(bw_recv, "bw_recv")
    if len(s) != len(g):
        raise UsageError(
            f"bw_send has {len(s)} ranks but bw_recv has {len(g)}: one rate per rank each"
        )
    if not s:
        raise UsageError("no ranks: bw_send and bw_recv are empty")
    for name, rates in (("bw_send", s), ("bw_recv", g)):
        for r, v in enumerate(rates):
            if not math.isfinite(v) or v <= 0.0:
                raise UsageError(
                    f"{name}[{r}] = {v!r}: every rank needs a finite rate > 0 "
                    f"(a rank with no usable plane cannot take part in an AllReduce)"
                )
    return s, g


def _check_shares(shares: Sequence[float], n: int) -> list[float]:
    sh = _floats(shares, "shares")
    if len(sh) != n:
        raise UsageError(f"{len(sh)} shares for {n} ranks: one share per rank")
    for r, v in enumerate(sh):
        if not math.isfinite(v) or v < 0.0:
            raise UsageError(f"shares[{r}] = {v!r}: shares must be finite and >= 0")
    total = math.fsum(sh)
    if abs(total - 1.0) > 1e-9:
        raise UsageError(f"shares sum to {total!r}, not 1: {sh}")
    return sh


def _check_nbytes(nbytes: float) -> float:
    v = float(nbytes)
    if not math.isfinite(v) or v < 0.0:
        raise UsageError(f"nbytes must be finite and >= 0, got {nbytes!r}")
    return v


def split_bandwidths(bandwidths: Any) -> tuple[list[float], list[float]]:
    """(bw_send, bw_recv) from what a caller has: an object with .send and .recv (such as
    mrc.collectives.bandwidth.AgreedBandwidths), a sequence of (send, recv) pairs, or a
    sequence of symmetric rates."""
    if hasattr(bandwidths, "send") and hasattr(bandwidths, "recv"):
        return _check_rates(bandwidths.send, bandwidths.recv)
    items = list(bandwidths)
    if items and all(isinstance(v, Sequence) or getattr(v, "ndim", 0) == 1 for v in items):
        for r, v in enumerate(items):
            if len(v) != 2:
                raise UsageError(f"bandwidths[{r}] = {v!r}: want (send, recv) or one rate")
        return _check_rates([v[0] for v in items], [v[1] for v in items])
    return _check_rates(items, items)


# The host's own cost -----------------------------------------------------------------------


def _check_host_rate(host_rate: object) -> float:
    if isinstance(host_rate, bool) or not isinstance(host_rate, int | float):
        raise UsageError(f"host_rate must be a number of bytes/s, got {host_rate!r}")
    h = float(host_rate)
    if not math.isfinite(h) or h <= 0.0:
        raise UsageError(f"host_rate must be finite and > 0 bytes/s, got {host_rate!r}")
    return h


def host_limited(
    bw_send: Rates, bw_recv: Rates, host_rate: float
) -> tuple[list[float], list[float]]:
    """Per-rank rates once the host's own cost per byte counts too (docs/collectives-model.md,
    section 7). A host that handles H bytes/s of traffic (sent plus received: copies,
    system calls, and on a namespace fabric the forwarding, all on the same cores) adds
    (sent + received) / H to a rank's wire time. Every schedule of this model has each rank
    receive what it sends, so that is bytes * (1/min(s_r, g_r) + 2/H): the time at the rate
    m'_r = 1 / (1/min(s_r, g_r) + 2/H), returned for both directions."""
    s, g = _check_rates(bw_send, bw_recv)
    h = _check_host_rate(host_rate)
    m = [1.0 / (1.0 / min(a, b) + 2.0 / h) for a, b in zip(s, g, strict=True)]
    return m, list(m)


def fit_host_rate(n: int, nbytes: float, measured_s: float, wire_s: float) -> float:
    """The host rate H that makes the model's healthy (equal rates) AllReduce take
    `measured_s`: the time above the wire's, measured_s - wire_s, is each rank's
    2 * 2(n-1)/n * nbytes bytes (sent and received) at H. UsageError when the measurement
    is not above the wire time (then nothing is the host's)."""
    n = _check_ranks(n)
    d = _check_nbytes(nbytes)
    extra = float(measured_s) - float(wire_s)
    if n == 1 or d == 0.0 or not extra > 0.0 or not math.isfinite(extra):
        raise UsageError(
            f"no host cost to fit: measured {measured_s!r} s is not above the wire's "
            f"{wire_s!r} s for {n} ranks x {nbytes!r} bytes"
        )
    return 2.0 * healthy_ring_factor(n) * d / extra


def fit_host_rate_shares(
    shares: Sequence[float], bw_send: Rates, bw_recv: Rates, nbytes: float, measured_s: float
) -> float:
    """The host rate H under which the direct schedule with these shares takes
    `measured_s` (share_time at host_limited's rates; fit_host_rate is the closed form for
    equal shares and rates): any operation of known shares, healthy or degraded, says what
    the hosts can move. inf when the measurement is not above the time at the wire's
    rates (nothing is the host's).

    Closed form: rank r carries b_r = 1 + (n-2) f_r units of D each way (direct_bytes) at
    m_r = min(s_r, g_r), so the model's time is D * max_r (b_r / m_r + 2 b_r u) with
    u = 1/H: a maximum of increasing lines in u, which reaches t exactly at the smallest
    u_r = (t/D - b_r/m_r) / (2 b_r). (A bisection on log H, which this replaced, took
    about 1 ms of the caller's CPU after every all_reduce of 4 MiB or more.)"""
    s, g = _check_rates(bw_send, bw_recv)
    d = _check_nbytes(nbytes)
    t = float(measured_s)
    if not math.isfinite(t) or t <= 0.0:
        raise UsageError(f"measured time must be finite and > 0 s, got {measured_s!r}")
    sh = _check_shares(shares, len(s))
    if len(s) == 1 or d == 0.0:
        return math.inf
    per = t / d
    m = [min(a, b) for a, b in zip(s, g, strict=True)]
    loads = [max(sent, recv) for sent, recv in direct_bytes(sh)]
    if per <= max(b / mr for b, mr in zip(loads, m, strict=True)):
        return math.inf
    u = min((per - b / mr) / (2.0 * b) for b, mr in zip(loads, m, strict=True))
    return 1.0 / u


# Candidate times, general per-rank rates ----------------------------------------------------


def healthy_ring_factor(n: int) -> float:
    """2(n-1)/n: the bytes every rank sends (and receives) in a ring or an equal-share
    direct AllReduce, in units of D."""
    n = _check_ranks(n)
    return 2.0 * (n - 1) / n


def _ring_pace(s: list[float], g: list[float], order: Sequence[int]) -> float:
    """The slowest link of a ring in `order`: rank order[i] sends to order[i+1]."""
    k = len(order)
    return min(min(s[order[i]], g[order[(i + 1) % k]]) for i in range(k))


def ring_time(bw_send: Rates, bw_recv: Rates, nbytes: float = 1.0) -> float:
    """The ring AllReduce in rank order: 2(n-1) steps of D/n on every link at once, each
    step as slow as the slowest link (the degraded rank's). Seconds, or D/B units."""
    s, g = _check_rates(bw_send, bw_recv)
    n = len(s)
    if n == 1:
        return 0.0
    return healthy_ring_factor(n) * _check_nbytes(nbytes) / _ring_pace(s, g, range(n))


def direct_bytes(shares: Sequence[float]) -> list[tuple[float, float]]:
    """(sent, received) per rank of the direct reduce-scatter + all-gather, in units of D.

    Rank r owns f_r = shares[r] of the elements. Reduce-scatter: r sends every other owner o its
    slice of o's share, (1 - f_r) D in all, and receives n-1 slices of its own, (n-1) f_r D.
    All-gather: r sends its reduced share to the n-1 others, (n-1) f_r D, and receives the
    rest, (1 - f_r) D. Both directions carry (1 + (n-2) f_r) D.
    """
    n = len(shares)
    sh = _check_shares(shares, n)
    out = []
    for f_r in sh:
        rs_send, rs_recv = 1.0 - f_r, (n - 1) * f_r
        ag_send, ag_recv = (n - 1) * f_r, 1.0 - f_r
        out.append((rs_send + ag_send, rs_recv + ag_recv))
    return out


def share_time(
    shares: Sequence[float],
    bw_send: Rates,
    bw_recv: Rates,
    nbytes: float = 1.0,
    *,
    overlap: bool = True,
) -> float:
    """Time of the direct schedule with these shares.

    overlap=True (what the bound needs): the all-gather of a chunk runs while later chunks
    are still being reduce-scattered, so each rank's link carries both phases' bytes at once
    and the time is max over ranks of max(sent / s_r, received / g_r).
    overlap=False: a barrier between the phases; each phase takes its slowest rank. With a
    degraded rank this can never beat the ring (docs/collectives-model.md, "Why the phases
    must overlap").
    """
    s, g = _check_rates(bw_send, bw_recv)
    n = len(s)
    sh = _check_shares(shares, n)
    d = _check_nbytes(nbytes)
    if n == 1:
        return 0.0
    if overlap:
        return d * max(
            max(sent / s[r], recv / g[r]) for r, (sent, recv) in enumerate(direct_bytes(sh))
        )
    rs = max(max((1.0 - sh[r]) / s[r], (n - 1) * sh[r] / g[r]) for r in range(n))
    ag = max(max((n - 1) * sh[r] / s[r], (1.0 - sh[r]) / g[r]) for r in range(n))
    return d * (rs + ag)


def lower_bound(
    bw_send: Rates, bw_recv: Rates, nbytes: float = 1.0, host_rate: float | None = None
) -> float:
    """No AllReduce can finish faster (docs/collectives-model.md, "The lower bound"):

        T >= D * max( max_r 1/s_r, max_r 1/g_r, 2(n-1)/sum(s), 2(n-1)/sum(g) )

    Every rank must send and receive at least D (a cut around one rank), and all ranks
    together must send (and receive) at least 2(n-1) D (each element needs 2(n-1)
    transmissions, as in one-way gossip). With every rate B it is the healthy ring's
    2(n-1)/n D/B.

    host_rate H (section 7): a rank's time is at least max(sent/s_r, recv/g_r) +
    (sent + recv)/H, so the cut becomes max(1/s_r, 1/g_r) + 2/H and, as max(a/s, b/g) >=
    (a+b)/(s+g), the total 4(n-1) D / sum_r 1/(1/(s_r+g_r) + 1/H); with s_r = g_r = B
    everywhere it is the healthy ring's 2(n-1)/n D (1/B + 2/H).
    """
    s, g = _check_rates(bw_send, bw_recv)
    n = len(s)
    if n == 1:
        return 0.0
    d = _check_nbytes(nbytes)
    total = 2.0 * (n - 1)
    if host_rate is not None:
        h = _check_host_rate(host_rate)
        per_rank = math.fsum(1.0 / (1.0 / (a + b) + 1.0 / h) for a, b in zip(s, g, strict=True))
        return d * max(
            max(max(1.0 / a, 1.0 / b) + 2.0 / h for a, b in zip(s, g, strict=True)),
            2.0 * total / per_rank,
        )
    return d * max(
        max(1.0 / v for v in s),
        max(1.0 / v for v in g),
        total / math.fsum(s),
        total / math.fsum(g),
    )


def shares(bw_send: Rates, bw_recv: Rates) -> list[float]:
    """The shares that minimise share_time (overlapped): the resilient schedule.

    With m_r = min(s_r, g_r) (a rank sends and receives the same bytes, so the slower
    direction binds), the optimum time is T0 = max(max_r 1/m_r, 2(n-1)/sum(m)) and every
    rank reaches it with share f_r = (T0 m_r - 1)/(n-2): affine in the rank's rate, not
    proportional. When one rank is so slow that 1/m_r dominates, these sum to more than 1;
    scaling them down to 1 leaves the slow rank at 0 and everyone else under T0.
    Equal rates give exactly 1/n each. With n <= 2 every share costs the same; equal then.
    """
    s, g = _check_rates(bw_send, bw_recv)
    n = len(s)
    m = [min(a, b) for a, b in zip(s, g, strict=True)]
    if n <= 2 or all(v == m[0] for v in m):
        return [1.0 / n] * n
    t0 = max(max(1.0 / v for v in m), 2.0 * (n - 1) / math.fsum(m))
    # max(0, ...): the bottleneck rank's t0 * m_r - 1 is 0, give or take a rounding.
    raw = [max(0.0, (t0 * v - 1.0) / (n - 2)) for v in m]
    total = math.fsum(raw)
    return [v / total for v in raw]


def share_time_opt(bw_send: Rates, bw_recv: Rates, nbytes: float = 1.0) -> float:
    """Closed form of share_time(shares(...)): D * max(max_r 1/m_r, 2(n-1)/sum(m))."""
    s, g = _check_rates(bw_send, bw_recv)
    n = len(s)
    if n == 1:
        return 0.0
    m = [min(a, b) for a, b in zip(s, g, strict=True)]
    return _check_nbytes(nbytes) * max(max(1.0 / v for v in m), 2.0 * (n - 1) / math.fsum(m))


def share_gap(bw_send: Rates, bw_recv: Rates) -> float:
    """How far the resilient schedule can be above the bound: it is within a factor
    max(1, min(sum s, sum g) / sum m). 1 (it meets the bound) whenever every rank sends as
    fast as it receives, which a lost plane keeps (a plane is a full-duplex link)."""
    s, g = _check_rates(bw_send, bw_recv)
    m = [min(a, b) for a, b in zip(s, g, strict=True)]
    return max(1.0, min(math.fsum(s), math.fsum(g)) / math.fsum(m))


# R2CC-AllReduce -----------------------------------------------------------------------------


def _degraded(s: list[float], g: list[float]) -> int:
    m = [min(a, b) for a, b in zip(s, g, strict=True)]
    return m.index(min(m))


def r2cc_phases(
    bw_send: Rates, bw_recv: Rates, y: float, nbytes: float = 1.0
) -> tuple[float, float, float]:
    """(T_main, T_sub, T_back) of R2CC-AllReduce with a split Y, as the issue defines it.

    The degraded rank d is the slowest (min over ranks of min(s_r, g_r)).
      main ring: all n ranks on (1-Y)D at the pace p of the ring's slowest link (d's):
                 T_main = 2(n-1)/n (1-Y) D / p
      sub-ring:  the n-1 others on Y D in what the main ring leaves them, q = the slowest
                 sub-ring link's rate minus p (XB in the degraded case):
                 T_sub = 2(n-2)/(n-1) Y D / q
      back:      the Y D result through d's link, pipelined: T_back = Y D / m_d
    T(Y) = max(T_main, T_sub) + T_back.
    """
    s, g = _check_rates(bw_send, bw_recv)
    y = _check_unit(y, "split Y")
    n = len(s)
    dbytes = _check_nbytes(nbytes)
    if n == 1:
        return 0.0, 0.0, 0.0
    d = _degraded(s, g)
    p = _ring_pace(s, g, range(n))
    t_main = healthy_ring_factor(n) * (1.0 - y) * dbytes / p
    c = 2.0 * (n - 2) / (n - 1)
    if c == 0.0 or y == 0.0:
        t_sub = 0.0
    else:
        q = _sub_ring_leftover(s, g, d, p)
        t_sub = math.inf if q <= 0.0 else c * y * dbytes / q
    t_back = y * dbytes / min(s[d], g[d])
    return t_main, t_sub, t_back


def _sub_ring_leftover(s: list[float], g: list[float], d: int, p: float) -> float:
    others = [r for r in range(len(s)) if r != d]
    k = len(others)
    return min(min(s[others[i]] - p, g[others[(i + 1) % k]] - p) for i in range(k))


def _check_unit(y: object, what: str) -> float:
    if isinstance(y, bool) or not isinstance(y, int | float) or not 0.0 <= float(y) <= 1.0:
        raise UsageError(f"{what} must be in [0, 1], got {y!r}")
    return float(y)


def r2cc_time(bw_send: Rates, bw_recv: Rates, y: float, nbytes: float = 1.0) -> float:
    """R2CC-AllReduce's T(Y) = max(T_main, T_sub) + T_back."""
    t_main, t_sub, t_back = r2cc_phases(bw_send, bw_recv, y, nbytes)
    return max(t_main, t_sub) + t_back


def r2cc_y_opt(bw_send: Rates, bw_recv: Rates) -> float:
    """The Y that minimises T(Y): where T_main = T_sub, Y* = a q / (a q + c p) with
    a = 2(n-1)/n, c = 2(n-2)/(n-1). Below it T falls (slope (1 - a)/p < 0 for n > 2),
    above it T rises. 0 when there is no leftover bandwidth (all rates equal) or n <= 2
    (no sub-ring: every Y costs the same)."""
    s, g = _check_rates(bw_send, bw_recv)
    n = len(s)
    if n <= 2:
        return 0.0
    d = _degraded(s, g)
    p = _ring_pace(s, g, range(n))
    q = _sub_ring_leftover(s, g, d, p)
    if q <= 0.0:
        return 0.0
    a = healthy_ring_factor(n)
    c = 2.0 * (n - 2) / (n - 1)
    return a * q / (a * q + c * p)


def r2cc_shares(n: int, degraded: int, y: float) -> list[float]:
    """R2CC's split written as shares of the direct schedule, so it keeps the fixed
    reduction order: (1-Y) of the elements shared equally by all n ranks, Y shared by the
    n-1 others. Its time as a direct schedule is share_time(r2cc_shares(...)); the
    resilient shares are never slower (they are optimal among all shares)."""
    n = _check_ranks(n)
    y = _check_unit(y, "split Y")
    if not 0 <= degraded < n:
        raise UsageError(f"degraded rank {degraded!r} is not a rank (0..{n - 1})")
    if n == 1:
        return [1.0]
    return [(1.0 - y) / n + (0.0 if r == degraded else y / (n - 1)) for r in range(n)]


# One degraded rank, D/B units: closed forms ------------------------------------------------


def degraded_rates(n: int, x: float) -> list[float]:
    """Rank 0 at 1-X, the others at 1 (B = 1): the case of the issue."""
    n = _check_ranks(n)
    x = _check_fraction(x)
    return [1.0 - x] + [1.0] * (n - 1)


def crossover(n: int) -> float:
    """The X above which the degraded rank's own D in and D out (1/(1-X)) set the bound,
    rather than the total 2(n-1)/(n-X): X_c = (n-2)/(2n-3). 2/5 at n=4, -> 1/2 as n grows.
    """
    n = _check_ranks(n)
    if n <= 2:
        return 0.0
    return (n - 2) / (2 * n - 3)


def closed_forms(n: int, x: float) -> dict[str, float]:
    """Every candidate in closed form for one rank at (1-X)B, in D/B units.

    a = 2(n-1)/n, c = 2(n-2)/(n-1):
      healthy     = a
      ring        = a / (1-X)
      y_opt       = a X / (a X + c (1-X))
      split_opt   = a (c (1-X) + X) / ((a X + c (1-X)) (1-X))
      split_x     = a + X / (1-X)                 (max(a, c) = a: a - c = 2/(n(n-1)) > 0)
      lower_bound = max(1/(1-X), 2(n-1)/(n-X))
      mrc         = lower_bound (the resilient shares meet it)
    n = 1: all 0. n = 2: no sub-ring, every Y costs 1/(1-X); y_opt = 0.
    """
    n = _check_ranks(n)
    x = _check_fraction(x)
    if n == 1:
        return dict.fromkeys(KEYS, 0.0)
    a = 2.0 * (n - 1) / n
    c = 2.0 * (n - 2) / (n - 1)
    ring = a / (1.0 - x)
    if n == 2 or x == 0.0:
        y_opt, split_opt = 0.0, ring
    else:
        y_opt = a * x / (a * x + c * (1.0 - x))
        split_opt = a * (c * (1.0 - x) + x) / ((a * x + c * (1.0 - x)) * (1.0 - x))
    split_x = a + x / (1.0 - x)
    bound = max(1.0 / (1.0 - x), 2.0 * (n - 1) / (n - x))
    return {
        "ring": ring,
        "split_opt": split_opt,
        "split_x": split_x,
        "lower_bound": bound,
        "mrc": bound,
        "healthy": a,
        "y_opt": y_opt,
    }


def resilient_shares_closed(n: int, x: float) -> tuple[float, float]:
    """(degraded rank's share, each other rank's share) of the resilient schedule:
    below the crossover ((n-2-(2n-3)X), (n-2+X)) / ((n-X)(n-2)); above it (0, 1/(n-1)).
    n=4, X=1/4: (0.1, 0.3)."""
    n = _check_ranks(n)
    x = _check_fraction(x)
    if n <= 2 or x == 0.0:
        return 1.0 / n, 1.0 / n
    if x >= crossover(n):
        return 0.0, 1.0 / (n - 1)
    den = (n - x) * (n - 2)
    return (n - 2 - (2 * n - 3) * x) / den, (n - 2 + x) / den


def r2cc_split_time(
    bw_send: Rates, bw_recv: Rates, y: float, nbytes: float = 1.0, host_rate: float | None = None
) -> float:
    """R2CC's T(Y) on the wire; with a host rate (section 7), R2CC's rings have no form
    (their sub-ring runs in leftover wire bandwidth, the host is shared), so the split is
    timed as mrc runs it: as shares of the direct schedule (r2cc_shares) at host_limited
    rates, which that model times exactly."""
    if host_rate is None:
        return r2cc_time(bw_send, bw_recv, y, nbytes)
    s, g = _check_rates(bw_send, bw_recv)
    hs, hg = host_limited(s, g, host_rate)
    return share_time(r2cc_shares(len(s), _degraded(s, g), y), hs, hg, nbytes)


def summary(n: int, x: float, host_rate: float | None = None) -> dict[str, float]:
    """The model of `mrc-perf model`: each key of KEYS, computed from the general
    per-rank functions (not the closed forms, which the tests check against this), in
    units of D/B with no latency term. `mrc` is what plan() picks.

    host_rate (in units of B) adds the hosts' own cost (section 7): ring, healthy and mrc
    at host_limited rates, the bound with the host, R2CC's splits (at the wire model's Y*
    and at Y = X) as r2cc_split_time gives them."""
    link = degraded_rates(n, x)
    healthy = [1.0] * len(link)
    y_opt = r2cc_y_opt(link, link)
    picked = plan(link, 1.0, 0.0, host_rate=host_rate)
    rates = link
    if host_rate is not None:
        rates, _ = host_limited(link, link, host_rate)
        healthy, _ = host_limited(healthy, healthy, host_rate)
    return {
        "ring": ring_time(rates, rates),
        "split_opt": r2cc_split_time(link, link, y_opt, 1.0, host_rate),
        "split_x": r2cc_split_time(link, link, x, 1.0, host_rate),
        "lower_bound": lower_bound(link, link, 1.0, host_rate),
        "mrc": picked.predicted,
        "healthy": ring_time(healthy, healthy),
        "y_opt": y_opt,
    }


# The planner --------------------------------------------------------------------------------


# Ranks that share a host: the direct schedule, the chain, or the chain of hosts -------------

# all_reduce "auto", past gather's sizes, runs "hier" (schedule._all_reduce_hier: the chain
# over the hosts' runs of consecutive ranks, direct inside each) instead of the direct
# schedule where the chain's busiest host link carries at most CHAIN_GAIN of direct's time
# (docs/collectives-model.md, section 8). A chain crosses a host boundary once per
# direction per pair of neighbouring hosts, so ranks placed host by host (mrc-run --hosts
# h0,h0,h1,h1) keep most of the work inside their host, where direct sends each rank's
# pieces to every rank elsewhere: at 2 ranks per host on 4 hosts the busiest host carries
# 2 D against direct's 3 D, on 2 hosts D against 2 D; "hier" carries the chain's bytes in
# 2(m-1) dependent hops for m hosts instead of 2(n-1). With one rank per host the chain
# carries 2 D against 2(n-1)/n D, so direct stays. All ranks on one host: no link
# decides, hier would be direct; there the plain chain's two neighbours per rank cost less
# CPU than direct's n-1 from CHAIN_ONE_HOST_RANKS ranks on (measured on loopback: equal or
# faster at 8 and 16 ranks at every size from 64 KiB to 64 MiB; at 3 and 4 direct was
# faster at 16 MiB and 64 MiB). The margin pays for the dependent hops before the first
# chunk is back; past CHAIN_MAX_RANKS of them (the most measured here: 32 ranks) that
# fill is unmeasured and direct stays.
CHAIN_GAIN = 0.75
CHAIN_ONE_HOST_RANKS = 8
CHAIN_MAX_RANKS = 32
ALL_REDUCE_LAYOUT_ALGOS = ("direct", "chain", "hier")


def host_bytes(
    hosts: Sequence[str], algo: str, shares: Sequence[float] | None = None
) -> dict[str, tuple[float, float]]:
    """(sent, received) over each host's links, in units of D, of an all_reduce by ranks on
    `hosts` (rank r on hosts[r]); traffic between two ranks of one host stays off its links.

    "chain": the partial sum goes from rank i to i+1 and the result back from i+1 to i, D
    each way, so a host boundary between neighbours costs each side D out and D in.
    "hier": the same (its groups are the runs of one host's ranks; a boundary between
    two runs carries every share's partial up and its result down: D each way).
    "direct" with shares f: rank i sends every rank j its slice of j's share (f_j D) and
    its own reduced share (f_i D), and receives f_i D + f_j D from j; summed over the
    pairs that cross the host's links (equal shares, one rank per host: 2(n-1)/n D).
    """
    n = len(hosts)
    if algo not in ALL_REDUCE_LAYOUT_ALGOS:
        raise UsageError(f"algo must be direct, chain or hier, got {algo!r}")
    out: dict[str, list[float]] = {h: [0.0, 0.0] for h in hosts}
    if algo != "direct":
        for i in range(n - 1):
            a, b = hosts[i], hosts[i + 1]
            if a != b:
                for h in (a, b):
                    out[h][0] += 1.0
                    out[h][1] += 1.0
    else:
        f = [1.0 / n] * n if shares is None else _check_shares(shares, n)
        for i in range(n):
            for j in range(n):
                if hosts[i] != hosts[j]:
                    out[hosts[i]][0] += f[i] + f[j]
                    out[hosts[i]][1] += f[i] + f[j]
    return {h: (v[0], v[1]) for h, v in out.items()}


def host_link_time(
    hosts: Sequence[str],
    algo: str,
    shares: Sequence[float] | None = None,
    bw_send: Rates | None = None,
    bw_recv: Rates | None = None,
) -> float:
    """The busiest host link's time for host_bytes, in units of D / rate: a host's rate
    is the lowest its ranks report (they share its NICs); rates None: every host 1."""
    n = len(hosts)
    s, g = ([1.0] * n, [1.0] * n) if bw_send is None else _check_rates(bw_send, bw_recv or bw_send)
    if len(s) != n:
        raise UsageError(f"{len(s)} rates for {n} ranks: one rate per rank")
    rate: dict[str, tuple[float, float]] = {}
    for r, h in enumerate(hosts):
        a, b = rate.get(h, (math.inf, math.inf))
        rate[h] = (min(a, s[r]), min(b, g[r]))
    return max(
        max(sent / rate[h][0], recv / rate[h][1])
        for h, (sent, recv) in host_bytes(hosts, algo, shares).items()
    )


def layout_algo(
    hosts: Sequence[str],
    shares: Sequence[float] | None = None,
    bw_send: Rates | None = None,
    bw_recv: Rates | None = None,
) -> tuple[str, str]:
    """("hier", "chain" or "direct", why) for an all_reduce past gather's sizes by ranks
    on `hosts`: the rule above. shares: the direct schedule's (the resilient planner's)."""
    n = len(hosts)
    if n < 3:
        return "direct", "2 ranks: the same two transfers"
    runs = len(host_groups(hosts))
    if runs == 1:
        if n > CHAIN_MAX_RANKS:
            return "direct", f"{n} ranks on one host: more than {CHAIN_MAX_RANKS}"
        if n >= CHAIN_ONE_HOST_RANKS:
            return "chain", f"{n} ranks on one host: two neighbours each instead of {n - 1}"
        return "direct", f"{n} ranks on one host (chain from {CHAIN_ONE_HOST_RANKS})"
    if runs > CHAIN_MAX_RANKS:
        return "direct", f"{runs} runs of hosts: more than {CHAIN_MAX_RANKS} hops"
    tc = host_link_time(hosts, "hier", None, bw_send, bw_recv)
    td = host_link_time(hosts, "direct", shares, bw_send, bw_recv)
    algo = "hier" if tc <= CHAIN_GAIN * td else "direct"
    return algo, f"the busiest host link's time: hier {tc / td:.2f} x direct's"


class Candidate(NamedTuple):
    """One row of the planner's table. shares is None for what mrc does not run."""

    name: str
    shares: tuple[float, ...] | None
    predicted: float  # seconds (or D/B units with nbytes=1, alpha=0)
    runnable: bool
    note: str


class Plan(NamedTuple):
    name: str  # "equal" or "resilient"
    shares: tuple[float, ...]
    predicted: float


def candidates(
    bandwidths: Any,
    nbytes: float,
    alpha: float = 0.0,
    *,
    overlap: bool = True,
    host_rate: float | None = None,
) -> list[Candidate]:
    """Every modelled AllReduce for these per-rank bandwidths (bytes/s; see
    split_bandwidths), nbytes per rank and alpha seconds per dependent hop. overlap: the
    executor runs a chunk's all-gather while later chunks reduce-scatter (share_time).
    host_rate: the hosts' own bytes/s (host_limited); None: the wire alone."""
    link_s, link_g = split_bandwidths(bandwidths)
    s, g = (link_s, link_g) if host_rate is None else host_limited(link_s, link_g, host_rate)
    d = _check_nbytes(nbytes)
    alpha = float(alpha)
    if not math.isfinite(alpha) or alpha < 0.0:
        raise UsageError(f"alpha must be finite and >= 0 seconds, got {alpha!r}")
    n = len(s)
    if n == 1:
        return [Candidate("equal", (1.0,), 0.0, True, "one rank: nothing to send")]
    equal = (1.0 / n,) * n
    best = tuple(shares(s, g))
    y = r2cc_y_opt(link_s, link_g)
    lat_direct = DIRECT_HOPS * alpha
    lat_ring = 2 * (n - 1) * alpha
    return [
        Candidate(
            "equal", equal, lat_direct + share_time(equal, s, g, d, overlap=overlap), True,
            "direct RS+AG, equal shares: the healthy schedule (a ring's bytes)",
        ),
        Candidate(
            "resilient", best, lat_direct + share_time(best, s, g, d, overlap=overlap), True,
            "direct RS+AG, shares (T0 m_r - 1)/(n-2): meets the bound when s_r = g_r",
        ),
        Candidate(
            "ring", None, lat_ring + ring_time(s, g, d), False,
            "rotating partial sums: no fixed reduction order",
        ),
        Candidate(
            "r2cc", None, lat_ring + alpha + r2cc_split_time(link_s, link_g, y, d, host_rate),
            False,
            f"R2CC at Y*={y:.4f} (rings; as shares with a host rate): as shares it is never "
            "below resilient",
        ),
        Candidate(
            "lower_bound", None, lat_direct + lower_bound(link_s, link_g, d, host_rate), False,
            "no AllReduce is faster (alpha: a direct schedule's 2 hops)",
        ),
    ]  # fmt: skip


def plan(
    bandwidths: Any,
    nbytes: float,
    alpha: float = 0.0,
    *,
    min_gain: float = MIN_GAIN,
    overlap: bool = True,
    host_rate: float | None = None,
) -> Plan:
    """The schedule to run: the fastest runnable candidate, except that equal shares stay
    unless the other is predicted at least `min_gain` (a fraction) faster. Equal bandwidths
    give equal shares; a rank that lost a plane gives the resilient shares for large
    messages; small ones, where 2 alpha dwarfs the bytes, keep equal shares. With
    overlap=False (an executor with a barrier between the phases) no shares beat equal
    ones when the ranks' two directions match, so the plan stays equal. host_rate: the
    hosts' own bytes/s (host_limited), which can move the best shares towards equal ones."""
    if not 0.0 <= min_gain < 1.0:
        raise UsageError(f"min_gain must be a fraction in [0, 1), got {min_gain!r}")
    table = [
        c
        for c in candidates(bandwidths, nbytes, alpha, overlap=overlap, host_rate=host_rate)
        if c.runnable
    ]
    base = table[0]
    assert base.name == "equal" and base.shares is not None
    pick = base
    for c in table[1:]:
        if c.predicted < pick.predicted and c.predicted <= base.predicted * (1.0 - min_gain):
            pick = c
    assert pick.shares is not None
    return Plan(pick.name, pick.shares, pick.predicted)


def format_table(rows: Sequence[Candidate]) -> str:
    """The planner's table for a debug log, one candidate per line."""
    out = []
    for c in rows:
        sh = "-" if c.shares is None else "[" + ", ".join(f"{v:.4f}" for v in c.shares) + "]"
        tag = "" if c.runnable else " (modelled only)"
        out.append(f"{c.name:<12} {c.predicted:12.6g}  shares {sh}{tag}: {c.note}")
    return "\n".join(out)


def share_counts(shares: Sequence[float], count: int) -> list[int]:
    """Elements per rank for `count` elements: floor(share * count), the leftover elements
    to the largest fractional parts (lowest rank first on ties). Integer results every rank
    computes alike; they sum to count, and a share of 0 gets 0 elements."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise UsageError(f"count must be an integer >= 0, got {count!r}")
    sh = _check_shares(shares, len(shares))
    exact = [v * count for v in sh]
    counts = [min(count, int(math.floor(v))) for v in exact]
    left = count - sum(counts)
    order = sorted(
        (r for r in range(len(sh)) if sh[r] > 0.0), key=lambda r: (-(exact[r] - counts[r]), r)
    )
    for i in range(max(0, left)):
        counts[order[i % len(order)]] += 1
    # Shares may sum to 1 + 1e-9: the floors can then overshoot a huge count by a few.
    for i in range(max(0, -left)):
        counts[order[-1 - i % len(order)]] -= 1
    return counts
