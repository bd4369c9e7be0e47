"""The AllReduce cost model, the planner, the bandwidth helpers and `mrc-perf model` (issue 13).

Pure computations: no datapath, no fabric. Every closed form is checked against an
independent numeric computation written here from the definitions, not from model.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
from click.testing import CliRunner

from mrc.collectives import bandwidth as bw
from mrc.collectives import model as m
from mrc.errors import UsageError
from mrc.perf.cli import main as perf_main

RANKS = (3, 4, 5, 8, 16, 64, 1024)
FRACTIONS = (0.05, 0.25, 0.4, 0.5, 0.75, 0.9)
REL = 1e-9


def close(a: float, b: float, rel: float = REL) -> bool:
    return abs(a - b) <= rel * max(1.0, abs(a), abs(b))


# R2CC's split, from the issue's definition, independently of model.py ---------------------


def r2cc_t(n: int, x: float, y: np.ndarray) -> np.ndarray:
    """T(Y) = max(T_main, T_sub) + T_back for one rank at (1-X)B, in D/B."""
    t_main = 2 * (n - 1) / n * (1 - y) / (1 - x)  # all n ranks, at the degraded pace
    t_sub = 2 * (n - 2) / (n - 1) * y / x  # n-1 healthy ranks in their leftover XB
    t_back = y / (1 - x)  # the YD result through the degraded rank
    return np.maximum(t_main, t_sub) + t_back


def numeric_argmin(f, lo: float = 0.0, hi: float = 1.0) -> tuple[float, float]:
    """Dense grid, then golden-section search in the bracket around the grid minimum."""
    ys = np.linspace(lo, hi, 20001)
    i = int(np.argmin(f(ys)))
    a, b = ys[max(0, i - 1)], ys[min(len(ys) - 1, i + 1)]
    g = (np.sqrt(5) - 1) / 2
    for _ in range(200):
        c, d = b - g * (b - a), a + g * (b - a)
        if f(np.array([c]))[0] < f(np.array([d]))[0]:
            b = d
        else:
            a = c
    y = (a + b) / 2
    return float(y), float(f(np.array([y]))[0])


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("x", FRACTIONS)
def test_r2cc_closed_forms_match_numeric_minimisation(n: int, x: float) -> None:
    y_num, t_num = numeric_argmin(lambda y: r2cc_t(n, x, y))
    cf = m.closed_forms(n, x)
    assert abs(cf["y_opt"] - y_num) < 1e-7, (cf["y_opt"], y_num)
    assert close(cf["split_opt"], t_num, 1e-9), (cf["split_opt"], t_num)
    assert close(cf["split_x"], float(r2cc_t(n, x, np.array([x]))[0]))
    # The general per-rank functions (what the CLI and the planner use) agree too.
    s = m.summary(n, x)
    assert abs(s["y_opt"] - y_num) < 1e-7
    assert close(s["split_opt"], t_num, 1e-9)
    assert close(s["split_x"], cf["split_x"])
    rates = m.degraded_rates(n, x)
    for y in (0.0, 0.1, x, 0.5, 1.0):
        assert close(m.r2cc_time(rates, rates, y), float(r2cc_t(n, x, np.array([y]))[0]))


def test_issue_numbers_at_4_ranks_quarter_lost() -> None:
    """The issue quotes: bound +6.7%, R2CC Y* +21%, ring +33% over healthy (n=4, X=1/4)."""
    s = m.summary(4, 0.25)
    over = {k: s[k] / s["healthy"] - 1 for k in ("lower_bound", "split_opt", "ring", "mrc")}
    assert round(over["lower_bound"], 3) == 0.067
    assert round(over["split_opt"], 2) == 0.21
    assert round(over["ring"], 2) == 0.33
    assert close(s["mrc"], s["lower_bound"])
    assert abs(s["y_opt"] - 3 / 11) < 1e-12  # a X / (a X + c (1-X)) = 0.375 / 1.375
    assert m.resilient_shares_closed(4, 0.25) == pytest.approx((0.1, 0.3), abs=1e-15)


@pytest.mark.parametrize("n", (1, 2))
def test_degenerate_rank_counts(n: int) -> None:
    for x in (0.0, 0.5):
        s, cf = m.summary(n, x), m.closed_forms(n, x)
        for k in m.KEYS:
            assert close(s[k], cf[k]), (n, x, k)
        assert s["y_opt"] == 0.0
        assert close(s["split_opt"], s["ring"]) and close(s["lower_bound"], s["ring"])


# The lower bound ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", (2, 3, 4, 7, 16, 64, 1024))
def test_bound_is_the_healthy_ring_without_failure(n: int) -> None:
    healthy = [1.0] * n
    assert close(m.lower_bound(healthy, healthy), 2 * (n - 1) / n)
    assert close(m.lower_bound(healthy, healthy), m.ring_time(healthy, healthy))
    assert close(m.summary(n, 0.0)["lower_bound"], m.summary(n, 0.0)["healthy"])
    # Scaled: D bytes at B bytes/s.
    assert close(m.lower_bound([4e8] * n, [4e8] * n, 64 << 20), 2 * (n - 1) / n * (64 << 20) / 4e8)


def every_candidate(s: list[float], g: list[float], rng: np.random.Generator) -> list[float]:
    n = len(s)
    times = [m.ring_time(s, g), m.share_time([1 / n] * n, s, g)]
    times += [m.r2cc_time(s, g, y) for y in np.linspace(0, 1, 21)]
    times += [m.r2cc_time(s, g, m.r2cc_y_opt(s, g))]
    for sh in rng.dirichlet(np.ones(n), size=50):
        sh = sh / sh.sum()
        times.append(m.share_time(list(sh), s, g))
        times.append(m.share_time(list(sh), s, g, overlap=False))
    for d in range(n):
        for y in (0.25, 0.5):
            times.append(m.share_time(m.r2cc_shares(n, d, y), s, g))
    times.append(m.share_time(m.shares(s, g), s, g))
    return times


@pytest.mark.parametrize("n", (2, 3, 4, 5, 8))
def test_bound_below_every_candidate(n: int) -> None:
    rng = np.random.default_rng(n)
    cases = [m.degraded_rates(n, x) for x in (0.0, *FRACTIONS)]
    cases += [list(rng.uniform(0.1, 1.0, n)) for _ in range(20)]
    for rates in cases:
        bound = m.lower_bound(rates, rates)
        assert min(every_candidate(rates, rates, rng)) >= bound * (1 - 1e-12)
    for _ in range(20):  # send and receive rates differ
        s, g = list(rng.uniform(0.1, 1.0, n)), list(rng.uniform(0.1, 1.0, n))
        assert min(every_candidate(s, g, rng)) >= m.lower_bound(s, g) * (1 - 1e-12)


# The mrc schedule ---------------------------------------------------------------------------


def test_direct_bytes_per_rank() -> None:
    """(1 - s_r) + (n-1) s_r each way: equal shares give the ring's 2(n-1)/n."""
    assert m.direct_bytes([0.25] * 4) == [(1.5, 1.5)] * 4
    got = [v for pair in m.direct_bytes([0.1, 0.3, 0.3, 0.3]) for v in pair]
    assert got == pytest.approx([1.2, 1.2] + [1.6] * 6)


LAYOUTS = (
    "abcd", "aabb", "aabbccdd", "aaaabbbb", "abab", "aaab", "aabbbccd", "aaaaaaaa", "abcdefgh",
)  # fmt: skip


@pytest.mark.parametrize("hosts", LAYOUTS)
@pytest.mark.parametrize("algo", ("direct", "chain", "hier"))
def test_host_bytes_are_what_the_schedules_send(hosts: str, algo: str) -> None:
    """model.host_bytes against the real schedules: every rank's SEND and RECV steps to a
    rank on another host, summed per host (equal shares, and shares 1:2:3:...)."""
    from mrc.collectives import schedule as S

    n, count = len(hosts), 7 * 64 * 9 * 5  # divides by every share sum below
    for shares in (None, [float(r + 1) for r in range(n)]):
        if shares is not None and algo != "direct":
            continue
        norm = None if shares is None else [v / sum(shares) for v in shares]
        sent = dict.fromkeys(hosts, 0)
        recv = dict.fromkeys(hosts, 0)
        for r in range(n):
            groups = S.host_groups(hosts)
            sch = S.all_reduce(r, n, count, 1, shares=norm, algo=algo, groups=groups)
            for st in sch.steps:
                if st.kind in (S.SEND, S.RECV) and hosts[st.peer] != hosts[r]:
                    (sent if st.kind == S.SEND else recv)[hosts[r]] += st.length
        want = m.host_bytes(list(hosts), algo, norm)
        for h in set(hosts):
            assert sent[h] / count == pytest.approx(want[h][0], abs=0.01), (h, algo, shares)
            assert recv[h] / count == pytest.approx(want[h][1], abs=0.01), (h, algo, shares)


def test_layout_picks_the_chain_where_hosts_carry_less() -> None:
    """all_reduce "auto" past gather's sizes: the chain of hosts ("hier") where ranks
    share hosts in runs (its busiest host link <= CHAIN_GAIN of direct's), direct with
    one rank per host, with ranks interleaved across hosts, with 2 ranks, and past
    CHAIN_MAX_RANKS runs of hosts; on one host the plain chain from CHAIN_ONE_HOST_RANKS
    ranks to CHAIN_MAX_RANKS. A lost plane moves it by the links' rates."""
    pick = {h: m.layout_algo(list(h))[0] for h in LAYOUTS + ("ab", "aa")}
    assert pick == {
        "abcd": "direct", "aabb": "hier", "aabbccdd": "hier", "aaaabbbb": "hier",
        "abab": "direct", "aaab": "hier", "aabbbccd": "hier", "aaaaaaaa": "chain",
        "abcdefgh": "direct", "ab": "direct", "aa": "direct",
    }  # fmt: skip
    assert m.layout_algo(list("aaaaaaa"))[0] == "direct"  # 7 < CHAIN_ONE_HOST_RANKS
    top = m.CHAIN_MAX_RANKS
    assert m.layout_algo(["h"] * top)[0] == "chain"
    assert m.layout_algo(["h"] * (top + 1))[0] == "direct"
    runs = [f"h{r // 2}" for r in range(2 * top + 2)]  # top + 1 hosts, 2 ranks each
    assert m.layout_algo(runs[: 2 * top])[0] == "hier"
    assert m.layout_algo(runs) == ("direct", f"{top + 1} runs of hosts: more than {top} hops")
    # 2 of 4 planes lost on host b: the chain waits on b (1 D at half rate) and direct,
    # even with shares that spare b, still has 2 D to cross somewhere.
    rates = [4.0, 4.0, 2.0, 2.0]
    algo, why = m.layout_algo(list("aabb"), None, rates, rates)
    assert algo == "hier" and "0.50 x direct's" in why
    # One rank per host with one rank's plane lost: direct (and its shares) stays.
    rates = [4.0, 3.0, 4.0, 4.0]
    shares = m.shares(rates, rates)
    assert m.layout_algo(list("abcd"), shares, rates, rates)[0] == "direct"
    with pytest.raises(UsageError, match="direct, chain or hier"):
        m.host_bytes(list("ab"), "ring")
    with pytest.raises(UsageError, match="3 rates for 4 ranks"):
        m.host_link_time(list("aabb"), "chain", None, [1.0] * 3)


@pytest.mark.parametrize("n", (3, 4, 5, 8, 16, 64, 1024))
def test_resilient_schedule_meets_the_bound(n: int) -> None:
    rng = np.random.default_rng(1000 + n)
    cases = [m.degraded_rates(n, x) for x in (0.0, *FRACTIONS)]
    cases += [list(rng.uniform(0.05, 1.0, n)) for _ in range(10)]
    # Two degraded ranks, and one rank faster than the rest.
    cases += [[0.5, 0.75] + [1.0] * (n - 2), [2.0] + [1.0] * (n - 1)]
    for rates in cases:
        sh = m.shares(rates, rates)
        assert min(sh) >= 0 and abs(sum(sh) - 1) < 1e-12
        t = m.share_time(sh, rates, rates)
        assert close(t, m.lower_bound(rates, rates), 1e-12), rates
        assert close(t, m.share_time_opt(rates, rates), 1e-12)


@pytest.mark.parametrize("n", (3, 4, 6))
def test_resilient_schedule_within_stated_gap_when_directions_differ(n: int) -> None:
    rng = np.random.default_rng(2000 + n)
    for _ in range(50):
        s, g = list(rng.uniform(0.1, 1.0, n)), list(rng.uniform(0.1, 1.0, n))
        t = m.share_time(m.shares(s, g), s, g)
        bound = m.lower_bound(s, g)
        assert bound * (1 - 1e-12) <= t <= bound * m.share_gap(s, g) * (1 + 1e-12)
        assert close(t, m.share_time_opt(s, g), 1e-12)


def simplex_grid(n: int, steps: int) -> np.ndarray:
    """Every share vector with entries in multiples of 1/steps, one per row."""
    free = np.array(list(itertools.product(range(steps + 1), repeat=n - 1)))
    free = free[free.sum(axis=1) <= steps]
    return np.column_stack([free, steps - free.sum(axis=1)]) / steps


def grid_time(grid: np.ndarray, s: list[float], g: list[float]) -> np.ndarray:
    """The overlapped direct schedule's time for every row of shares, from the definition:
    rank r sends every other owner its piece of that owner's share and every other rank
    its own reduced share; it receives the same the other way round."""
    n = grid.shape[1]
    others = grid.sum(axis=1, keepdims=True) - grid  # sum of the other owners' shares
    sent = others + (n - 1) * grid
    recv = (n - 1) * grid + others
    return np.max(np.maximum(sent / np.array(s), recv / np.array(g)), axis=1)


@pytest.mark.parametrize("n", (3, 4))
def test_shares_are_optimal_against_a_simplex_grid(n: int) -> None:
    """No share vector on a 1/100 grid of the simplex beats shares()."""
    rng = np.random.default_rng(3000 + n)
    grid = simplex_grid(n, 100)
    cases = [m.degraded_rates(n, 0.25), m.degraded_rates(n, 0.6), list(rng.uniform(0.2, 1, n))]
    cases.append(list(rng.uniform(0.2, 1, n)))
    for rates in cases:
        for row in grid[rng.integers(0, len(grid), 20)]:  # the two definitions agree
            got = float(grid_time(row[None, :], rates, rates)[0])
            assert close(got, m.share_time(list(row / row.sum()), rates, rates), 1e-12)
        best = m.share_time(m.shares(rates, rates), rates, rates)
        brute = float(grid_time(grid, rates, rates).min())
        assert best <= brute * (1 + 1e-12)
        assert brute <= best * 1.05  # and the grid gets close: the optimum is real
    s, g = list(rng.uniform(0.2, 1, n)), list(rng.uniform(0.2, 1, n))
    assert m.share_time(m.shares(s, g), s, g) <= float(grid_time(grid, s, g).min()) * (1 + 1e-12)


def grid_time_host(grid: np.ndarray, s: list[float], g: list[float], h: float) -> np.ndarray:
    """grid_time plus the hosts' own cost, from its definition: (sent + received) / h."""
    n = grid.shape[1]
    others = grid.sum(axis=1, keepdims=True) - grid
    sent = others + (n - 1) * grid
    recv = (n - 1) * grid + others
    wire = np.maximum(sent / np.array(s), recv / np.array(g))
    return np.max(wire + (sent + recv) / h, axis=1)


@pytest.mark.parametrize("n", (3, 4))
def test_host_rate_model_against_its_definition(n: int) -> None:
    """With a host rate: share_time on host_limited rates is the definition's time, the
    resilient shares are optimal on a simplex grid, and the lower bound (proved for any
    AllReduce) is below everything and met when each rank's directions are equal."""
    rng = np.random.default_rng(4000 + n)
    grid = simplex_grid(n, 100)
    for rates, h in [
        (m.degraded_rates(n, 0.25), 2.5),  # the shaped fabric's case: h 5x one plane
        (m.degraded_rates(n, 0.5), 0.7),  # the host slower than the links
        (list(rng.uniform(0.2, 1, n)), float(rng.uniform(0.5, 5))),
    ]:
        hs, hg = m.host_limited(rates, rates, h)
        for row in grid[rng.integers(0, len(grid), 20)]:
            got = float(grid_time_host(row[None, :], rates, rates, h)[0])
            assert close(got, m.share_time(list(row / row.sum()), hs, hg), 1e-12)
        best = m.share_time(m.shares(hs, hg), hs, hg)
        brute = float(grid_time_host(grid, rates, rates, h).min())
        bound = m.lower_bound(rates, rates, 1.0, h)
        assert bound * (1 - 1e-12) <= best <= brute * (1 + 1e-12)
        assert close(best, bound, 1e-12)
        assert bound > m.lower_bound(rates, rates)  # the host only ever adds time
    for _ in range(20):  # directions differ: the bound still holds against the grid
        s, g = list(rng.uniform(0.2, 1, n)), list(rng.uniform(0.2, 1, n))
        h = float(rng.uniform(0.5, 5))
        assert m.lower_bound(s, g, 1.0, h) <= float(grid_time_host(grid, s, g, h).min()) * (
            1 + 1e-12
        )


def test_fit_host_rate_round_trip_and_refusals() -> None:
    b, h, n, d = 5e8, 2.5e9, 4, 64 << 20
    rates = [b] * n
    hs, hg = m.host_limited(rates, rates, h)
    measured = m.share_time([1 / n] * n, hs, hg, d)
    wire = m.share_time([1 / n] * n, rates, rates, d)
    assert close(m.fit_host_rate(n, d, measured, wire), h, 1e-12)
    # Healthy with the host: the ring's 2(n-1)/n D (1/B + 2/H).
    assert close(measured, 1.5 * d * (1 / b + 2 / h), 1e-12)
    for bad in ((n, d, wire, wire), (n, d, wire * 0.9, wire), (1, d, 2.0, 1.0), (n, 0, 2.0, 1.0)):
        with pytest.raises(UsageError, match="no host cost to fit"):
            m.fit_host_rate(*bad)
    for bad_h in (0, -1.0, float("nan"), float("inf"), "fast", True):
        with pytest.raises(UsageError, match="host_rate"):
            m.host_limited(rates, rates, bad_h)  # type: ignore[arg-type]


def test_fit_host_rate_shares_inverts_the_host_model() -> None:
    """Any shares, any rates: the H that makes share_time at host_limited's rates equal
    the measured time. Equal shares and rates give fit_host_rate's closed form; at or below
    the wire's time, inf."""
    d = 64 << 20
    degraded = [5e8, 3.75e8, 5e8, 5e8]
    for shares in ([0.25] * 4, list(m.plan(degraded, d).shares), [0.4, 0.1, 0.25, 0.25]):
        for h in (3e8, 1.6e9, 2e10):
            mh, _ = m.host_limited(degraded, degraded, h)
            t = m.share_time(shares, mh, mh, d)
            assert m.fit_host_rate_shares(shares, degraded, degraded, d, t) == pytest.approx(h)
    # Against a bisection on log H of the model itself, for measured times of every size.
    for shares in ([0.25] * 4, [0.4, 0.1, 0.25, 0.25], [0.3, 0.0, 0.3, 0.4]):
        wire = m.share_time(shares, degraded, degraded, d)
        for factor in (1.0001, 1.05, 1.7, 30.0):
            t = factor * wire

            def slow(h: float, sh: list[float] = shares, t: float = t) -> bool:
                mh, _ = m.host_limited(degraded, degraded, h)
                return m.share_time(sh, mh, mh, d) > t

            lo, hi = 1.0, 1e15
            for _ in range(200):
                mid = math.sqrt(lo * hi)
                lo, hi = (mid, hi) if slow(mid) else (lo, mid)
            got = m.fit_host_rate_shares(shares, degraded, degraded, d, t)
            assert got == pytest.approx(math.sqrt(lo * hi), rel=1e-9)
    healthy = [5e8] * 4
    wire = m.share_time([0.25] * 4, healthy, healthy, d)
    assert m.fit_host_rate_shares([0.25] * 4, healthy, healthy, d, 1.3 * wire) == pytest.approx(
        m.fit_host_rate(4, d, 1.3 * wire, wire)
    )
    assert m.fit_host_rate_shares([0.25] * 4, healthy, healthy, d, wire) == math.inf
    with pytest.raises(UsageError, match="measured time"):
        m.fit_host_rate_shares([0.25] * 4, healthy, healthy, d, 0.0)


def test_host_fit_counts_only_when_the_host_had_no_cpu_to_spare() -> None:
    """resilient.HostGate: the time above the link model is the host's only when its CPUs
    were busy over the window (or one datapath thread ran all along): then the fits count;
    with CPU to spare they are inf (the excess is the wire's: it scales every link alike
    and must not move the shares); no counters: the fits stand."""
    from mrc.collectives import resilient as rs

    class Kernel:
        def __init__(self) -> None:
            self.t, self.busy, self.all = 0.0, 0, 0

        def run(self, secs: float, busy: float, cpus: int = 2) -> None:
            ticks = round(secs * 100 * cpus)
            self.t += secs
            self.all += ticks
            self.busy += round(ticks * busy)

    def fresh() -> tuple[Kernel, rs.HostGate]:
        k = Kernel()
        return k, rs.HostGate(lambda: (k.busy, k.all), lambda: k.t)

    # A saturated thread: the fit counts at once, whatever the window says.
    k, gate = fresh()
    gate.start()
    k.run(0.03, 0.2)
    assert gate.offer(5e8, 0.97) == [5e8] and gate.busy == 0.97
    # Busy CPUs: the window's fits wait until it holds 0.1 s and 20 ticks, then count.
    k, gate = fresh()
    gate.start()
    k.run(0.03, 0.9)
    assert gate.offer(6e8, 0.3) == []  # 0.03 s, 6 ticks: too early
    gate.start()  # the window is open: not reset
    k.run(0.05, 0.9)
    assert gate.offer(7e8, 0.3) == []
    k.run(0.05, 0.9)
    assert gate.offer(8e8, 0.3) == [6e8, 7e8, 8e8] and gate.busy == pytest.approx(0.9, abs=0.02)
    # Spare CPU (a link-bound fabric): the window's fits are the wire's pace; then the
    # next window opens at the next start().
    gate.start()
    k.run(0.06, 0.6)
    assert gate.offer(5e8, 0.25) == []
    k.run(0.06, 0.6)
    assert gate.offer(5e8, 0.25) == [math.inf, math.inf] and gate.busy == pytest.approx(
        0.6, abs=0.02
    )
    # One CPU: 0.1 s is 10 ticks, the window waits for 20.
    k, gate = fresh()
    gate.start()
    k.run(0.15, 0.5, cpus=1)
    assert gate.offer(5e8, 0.5) == []
    k.run(0.06, 0.5, cpus=1)
    assert gate.offer(5e8, 0.5) == [math.inf, math.inf]
    # No counters: the fits stand.
    blind = rs.HostGate(lambda: None, lambda: 0.0)
    blind.start()
    assert blind.offer(5e8, 0.1) == [5e8] and blind.busy is None
    assert rs.thread_ran({"a": 0, "b": 5}, {"a": 9 * 10**8, "b": 6, "c": 10**12}, 1.0) == 0.9


def test_cpu_ticks_count_a_busy_thread() -> None:
    """The CPU counters HostGate reads (/proc/stat, the CPUs this process may run on)
    count a thread that runs 0.2 s as busy ticks (20 of them at 100 per second)."""
    import time

    from mrc.collectives import resilient as rs

    t0 = rs.cpu_ticks()
    assert t0 is not None and 0 < t0[0] <= t0[1]
    cpu0 = time.thread_time_ns()
    while time.thread_time_ns() - cpu0 < 2 * 10**8:
        pass  # this thread runs 0.2 s
    t1 = rs.cpu_ticks()
    assert t1 is not None and t1[1] - t0[1] >= t1[0] - t0[0] >= 15


def test_planner_with_host_rate_moves_shares_towards_equal() -> None:
    """The host's cost is the same at every rank, so it dilutes the degraded rank's
    handicap: its share grows towards 1/n as the host gets slower; a host far faster than
    the links changes nothing; equal links still give equal shares."""
    dr = m.degraded_rates(4, 0.25)
    k = dr.index(min(dr))
    wire = m.plan(dr, 1.0)
    assert wire.name == "resilient" and close(wire.shares[k], 0.1)
    fast = m.plan(dr, 1.0, host_rate=1e12)
    assert all(close(a, b, 1e-9) for a, b in zip(fast.shares, wire.shares, strict=True))
    d_share = [m.plan(dr, 1.0, host_rate=h).shares[k] for h in (20.0, 5.0, 2.0)]
    assert 0.1 < d_share[0] < d_share[1] < d_share[2] < 0.25
    # The shaped fabric's fit (host 5x the 4-plane rate): 0.136, as measured shares go.
    assert m.plan(dr, 1.0, host_rate=5.0).shares[k] == pytest.approx(0.1363, abs=1e-4)
    assert m.plan([1.0] * 4, 1.0, host_rate=2.0).shares == (0.25,) * 4


def test_resilient_shares_closed_form() -> None:
    for n in (3, 4, 16, 64):
        for x in FRACTIONS:
            d, h = m.resilient_shares_closed(n, x)
            rates = m.degraded_rates(n, x)
            got = m.shares(rates, rates)
            assert got[0] == pytest.approx(d, abs=1e-12)
            assert got[1:] == pytest.approx([h] * (n - 1), abs=1e-12)
    assert m.crossover(4) == pytest.approx(0.4)


def test_phases_without_overlap_never_beat_the_ring() -> None:
    """With a barrier between reduce-scatter and all-gather, the degraded rank sends and
    receives max(1 - s, (n-1) s) >= (n-1)/n in each phase: no shares beat the ring."""
    rng = np.random.default_rng(7)
    for n in (3, 4, 8):
        for x in (0.25, 0.5):
            rates = m.degraded_rates(n, x)
            ring = m.ring_time(rates, rates)
            for sh in rng.dirichlet(np.ones(n), size=200):
                sh = list(sh / sh.sum())
                assert m.share_time(sh, rates, rates, overlap=False) >= ring * (1 - 1e-12)
            # Healthy, equal shares: the same time with or without the overlap.
            eq, ones = [1 / n] * n, [1.0] * n
            assert close(m.share_time(eq, ones, ones, overlap=False), m.share_time(eq, ones, ones))


def test_r2cc_split_as_shares() -> None:
    """R2CC's split as a direct schedule keeps the fixed order; never below resilient;
    equal to R2CC's own T(Y*) when the degraded rank is its bottleneck (n=4, X=1/4)."""
    rates = m.degraded_rates(4, 0.25)
    y = m.r2cc_y_opt(rates, rates)
    sh = m.r2cc_shares(4, 0, y)
    assert sum(sh) == pytest.approx(1.0) and sh[0] == pytest.approx((1 - y) / 4)
    t = m.share_time(sh, rates, rates)
    assert close(t, m.r2cc_time(rates, rates, y))
    assert t >= m.share_time(m.shares(rates, rates), rates, rates)


def test_share_counts() -> None:
    sh = m.shares(m.degraded_rates(4, 0.25), m.degraded_rates(4, 0.25))
    for count in (0, 1, 3, 7, 1001, 16 << 20, 10**12 + 3):
        c = m.share_counts(sh, count)
        assert sum(c) == count and min(c) >= 0
        assert all(abs(c[r] - sh[r] * count) <= 1 for r in range(4))
    assert m.share_counts([0.0, 0.5, 0.5], 5) == [0, 3, 2]
    assert m.share_counts([0.25] * 4, 6) == [2, 2, 1, 1]


# The planner --------------------------------------------------------------------------------


@pytest.mark.parametrize("n", (2, 3, 4, 16))
def test_planner_equal_bandwidths_equal_shares(n: int) -> None:
    for nbytes in (8, 1 << 20, 256 << 20):
        p = m.plan([5e8] * n, nbytes, alpha=30e-6)
        assert p.name == "equal" and p.shares == (1 / n,) * n
        assert close(p.predicted, 2 * 30e-6 + 2 * (n - 1) / n * nbytes / 5e8)


def test_planner_lost_plane_takes_resilient_shares() -> None:
    rates = [5e8, 3.75e8, 5e8, 5e8]  # rank 1 lost one plane of four
    nbytes = 64 << 20
    p = m.plan(rates, nbytes, alpha=30e-6)
    assert p.name == "resilient"
    assert p.shares == pytest.approx((0.3, 0.1, 0.3, 0.3), abs=1e-12)
    assert close(p.predicted, 2 * 30e-6 + m.lower_bound(rates, rates, nbytes))
    table = {c.name: c for c in m.candidates(rates, nbytes, 30e-6)}
    assert p.predicted < table["equal"].predicted < table["ring"].predicted + 1e-12
    assert table["r2cc"].predicted > p.predicted and not table["ring"].runnable
    assert "resilient" in m.format_table(list(table.values()))


def test_planner_small_messages_keep_equal_shares() -> None:
    """8 bytes: 2 alpha is everything, the resilient shares gain nothing worth a switch."""
    rates = [5e8, 3.75e8, 5e8, 5e8]
    assert m.plan(rates, 8, alpha=30e-6).name == "equal"
    assert m.plan(rates, 512, alpha=30e-6).name == "equal"
    # From a few KiB (4 KiB: 76 us equal, 73 us resilient) the bandwidth term counts.
    assert m.plan(rates, 4096, alpha=30e-6).name == "resilient"
    assert m.plan(rates, 8 << 20, alpha=30e-6).name == "resilient"
    # Without latency even small messages are bandwidth-bound.
    assert m.plan(rates, 8, alpha=0.0).name == "resilient"


def test_planner_without_phase_overlap_keeps_equal_shares() -> None:
    rates = [5e8, 3.75e8, 5e8, 5e8]
    p = m.plan(rates, 64 << 20, alpha=30e-6, overlap=False)
    assert p.name == "equal"
    assert close(p.predicted, 2 * 30e-6 + m.ring_time(rates, rates, 64 << 20))


def test_planner_takes_pairs_and_agreed_vectors() -> None:
    pairs = [(5e8, 5e8), (3.75e8, 3.75e8), (5e8, 5e8), (5e8, 5e8)]
    assert m.plan(pairs, 64 << 20).shares == m.plan([p[0] for p in pairs], 64 << 20).shares
    assert m.plan(np.array(pairs), 64 << 20).name == "resilient"


def test_model_rejects_bad_input_naming_it() -> None:
    with pytest.raises(UsageError, match=r"bw_send\[1\] = 0.0"):
        m.lower_bound([1.0, 0.0], [1.0, 1.0])
    with pytest.raises(UsageError, match="3 ranks but bw_recv has 2"):
        m.ring_time([1, 1, 1], [1, 1])
    with pytest.raises(UsageError, match="sum to"):
        m.share_time([0.5, 0.6], [1, 1], [1, 1])
    with pytest.raises(UsageError, match=r"3 shares for 2 ranks"):
        m.share_time([0.2, 0.3, 0.5], [1, 1], [1, 1])
    with pytest.raises(UsageError, match=r"must be in \[0, 1\).*got 1"):
        m.summary(4, 1)
    with pytest.raises(UsageError, match="ranks must be an integer >= 1, got 0"):
        m.summary(0, 0.25)
    with pytest.raises(UsageError, match="nan"):
        m.plan([1.0, float("nan")], 10)
    with pytest.raises(UsageError, match="alpha"):
        m.plan([1.0, 1.0], 10, alpha=-1)
    with pytest.raises(UsageError, match=r"bw_send\[1\] = 'fast' is not a number"):
        m.plan([1.0, "fast"], 10)
    with pytest.raises(UsageError, match="degraded rank 4"):
        m.r2cc_shares(4, 4, 0.5)


# mrc-perf model -------------------------------------------------------------------------------


def test_cli_json_has_exactly_the_keys() -> None:
    res = CliRunner().invoke(
        perf_main, ["model", "--ranks", "4", "--lost-fraction", "1/4", "--json"]
    )
    assert res.exit_code == 0, res.output
    obj = json.loads(res.output)
    assert list(obj) == list(m.KEYS)
    assert set(obj) == {"ring", "split_opt", "split_x", "lower_bound", "mrc", "healthy", "y_opt"}
    assert obj == pytest.approx(m.closed_forms(4, 0.25), rel=1e-14)
    assert obj["mrc"] == obj["lower_bound"] == 1.6  # printed to 15 digits: no 1.6000000000000003


def test_cli_json_with_a_host_rate() -> None:
    """--host-rate 5 (hosts handle 5 B of traffic): the same keys; healthy is the ring's
    1.5 (1 + 2/5); mrc meets the bound with the host; R2CC as shares on host-limited rates
    at the wire model's Y*; a host far faster than the links gives the wire's numbers."""

    def run(*extra: str) -> dict:
        res = CliRunner().invoke(perf_main, ["model", "-n", "4", "-x", "1/4", "--json", *extra])
        assert res.exit_code == 0, res.output
        return json.loads(res.output)

    obj = run("--host-rate", "5")
    assert list(obj) == list(m.KEYS)
    rates = m.degraded_rates(4, 0.25)
    hs, _ = m.host_limited(rates, rates, 5.0)
    assert obj["healthy"] == pytest.approx(1.5 * (1 + 2 / 5), rel=1e-14)
    assert obj["mrc"] == pytest.approx(obj["lower_bound"], rel=1e-14)
    assert obj["lower_bound"] == pytest.approx(m.lower_bound(rates, rates, 1.0, 5.0), rel=1e-14)
    assert obj["y_opt"] == pytest.approx(3 / 11, rel=1e-14)  # the wire's Y*
    shares = m.r2cc_shares(4, rates.index(min(rates)), 3 / 11)
    assert obj["split_opt"] == pytest.approx(m.share_time(shares, hs, hs), rel=1e-14)
    assert obj["lower_bound"] < obj["split_opt"] < obj["ring"]
    assert run("--host-rate", "1e12") == pytest.approx(run(), rel=1e-9)


def test_cli_entry_point_json() -> None:
    """The installed command line (a real process), 0.5 written as a decimal."""
    out = subprocess.run(
        [sys.executable, "-m", "mrc.perf.cli", "model", "-n", "16", "-x", "0.5", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    obj = json.loads(out)
    assert list(obj) == list(m.KEYS)
    assert obj["healthy"] == pytest.approx(1.875) and obj["mrc"] == pytest.approx(2.0)


def test_cli_table_at_scale_and_plot(tmp_path) -> None:
    png = tmp_path / "overhead.png"
    res = CliRunner().invoke(
        perf_main,
        ["model", "--ranks", "16,64,1024", "--lost-fraction", "1/4,1/2,3/4", "--plot", str(png)],
    )
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    rows = [i for i, line in enumerate(lines) if re.match(r" *(16|64|1024) +0\.\d+ ", line)]
    assert len(rows) == 9  # each row two lines: times, then overheads
    assert "+33.3%" in lines[rows[0] + 1] and "+1.6%" in lines[rows[0] + 1]  # n=16, X=1/4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-n", "4,5", "-x", "0.25", "--json"], "one --ranks and one --lost-fraction"),
        (["-n", "4", "-x", "1"], "X = 1: must be in [0, 1)"),
        (["-n", "0", "-x", "0.1"], "0 ranks: must be >= 1"),
        (["-n", "4", "-x", "half"], "'half' is not a fraction"),
        (["-x", "0.1"], "Missing option '-n' / '--ranks'"),
        (["-n", "4", "-x", "0.1", "--host-rate", "0"], "0: must be > 0"),
        (["-n", "4", "-x", "0.1", "--host-rate", "fast"], "'fast' is not a number"),
    ],
)
def test_cli_bad_input(args: list[str], message: str) -> None:
    res = CliRunner().invoke(perf_main, ["model", *args])
    assert res.exit_code == 2
    assert message in res.output


# Bandwidth helpers on synthetic stats ---------------------------------------------------------


def fake_stats(
    states: dict[tuple[int, int], str] | None = None,
    *,
    peers: int = 3,
    nplanes: int = 4,
    spines: int = 2,
    nbytes: dict[int, int] | None = None,
) -> dict:
    """What Endpoint.stats() returns on a fabric host: per peer connection, one path per
    (plane, spine). states: (peer, plane) -> state of that plane's paths to that peer
    ((-1, plane): to every peer). nbytes: plane -> tx and rx bytes on each of its paths."""
    states = states or {}
    nbytes = nbytes or {}
    paths = []
    for c in range(peers):
        for p in range(nplanes):
            st = states.get((c, p), states.get((-1, p), "good"))
            for sp in range(spines):
                b = nbytes.get(p, 0)
                paths.append(
                    {"conn": c, "conn_id": 100 + c, "path": p * spines + sp, "plane": p,
                     "state": st, "tx_bytes": b, "rx_bytes": b}
                )  # fmt: skip
    return {"paths": paths}


RATES_1G = [125e6] * 4  # routing/4host-4plane-1g.toml: 1 Gbit/s per plane


def test_fabric_plane_rates_from_files() -> None:
    assert bw.fabric_plane_rates("routing/4host-4plane-1g.toml", "h1") == RATES_1G
    assert bw.fabric_plane_rates("routing/4host-4plane-unequal.toml", "h0") == [
        250e6, 125e6, 125e6, 62.5e6
    ]  # fmt: skip
    with pytest.raises(UsageError, match="no host 'h9'"):
        bw.fabric_plane_rates("routing/4host-4plane-1g.toml", "h9")


def test_rank_bandwidth_excludes_failed_planes_only() -> None:
    healthy = bw.rank_bandwidth(fake_stats(), plane_rates=RATES_1G)
    assert (healthy.send, healthy.recv, healthy.source) == (500e6, 500e6, "fabric")
    # This rank's plane 1 cable: its paths on plane 1 to every peer failed.
    lost = bw.rank_bandwidth(fake_stats({(-1, 1): "failed"}), plane_rates=RATES_1G)
    assert (lost.send, lost.planes_up, lost.planes_down) == (375e6, (0, 2, 3), (1,))
    # A peer's plane 1 cable: only the paths to that peer failed; this rank keeps plane 1.
    peer = bw.rank_bandwidth(fake_stats({(2, 1): "failed"}), plane_rates=RATES_1G)
    assert peer.send == 500e6 and peer.planes_down == ()
    # Suspect and probing paths are one probe from carrying data: they count.
    flaky = bw.rank_bandwidth(
        fake_stats({(-1, 2): "suspect", (-1, 3): "probing"}), plane_rates=RATES_1G
    )
    assert flaky.send == 500e6
    # No fabric rates, no measurement: count usable planes.
    assert bw.rank_bandwidth(fake_stats({(-1, 0): "failed"})).send == 3.0
    # No connection yet: nothing says a plane is broken.
    assert bw.rank_bandwidth({"paths": []}, nplanes=4).up_mask == 0b1111
    # Nor do paths that never sent: plane 1 failed on the connections in use (peer 0)
    # and looks good on the idle ones (peers 1 and 2): lost.
    idle = fake_stats({(0, 1): "failed"})
    for p in idle["paths"]:
        p["tx_pkts"] = 0 if p["conn"] > 0 else 5
    assert bw.plane_usable(idle) == [True, False, True, True]
    for p in idle["paths"]:
        p["tx_pkts"] = 5
    assert bw.plane_usable(idle) == [True] * 4  # peer 1's plane-1 paths carry data


def test_plane_loss_is_attributed_by_the_peers_hosts() -> None:
    """conn_hosts (connection id -> peer host, the connections over this host's cables):
    failed paths towards one host only are that host's loss, unless it is the only other
    host; towards two or more, this rank's own; connections left out of the map (ranks on
    this host) do not count either way."""
    hosts = {100: "b", 101: "c", 102: "d"}
    one = fake_stats({(0, 1): "failed"})
    for p in one["paths"]:
        p["tx_pkts"] = 0 if p["conn"] > 0 else 5  # a chain: one neighbour in use
    assert bw.plane_usable(one, 4, hosts) == [True] * 4  # b's cable, maybe
    assert bw.plane_usable(one, 4, {100: "b"}) == [True, False, True, True]  # the only other
    mine = fake_stats({(-1, 1): "failed"})
    assert bw.plane_usable(mine, 4, hosts) == [True, False, True, True]
    # Two peers on host b (conns 100, 101) and one on this host (102, left out): b only.
    assert bw.plane_usable(mine, 4, {100: "b", 101: "b", 103: "c"}) == [True] * 4
    assert bw.plane_usable(mine, 4, {100: "b", 101: "b"}) == [True, False, True, True]
    # A same-host connection's good paths do not hide the loss.
    inside = fake_stats({(0, 1): "failed", (1, 1): "failed"})
    assert bw.plane_usable(inside, 4, {100: "b", 101: "c"}) == [True, False, True, True]
    assert bw.plane_usable(inside, 4) == [True] * 4  # without the map, peer 2's paths count


def test_one_spine_down_keeps_the_plane() -> None:
    stats = fake_stats()
    for p in stats["paths"]:
        if p["plane"] == 1 and p["path"] % 2 == 0:
            p["state"] = "failed"
    assert bw.plane_usable(stats) == [True, True, True, True]


def test_rank_bandwidth_measured_and_idle_fallback() -> None:
    prev = fake_stats(nbytes={})
    cur = fake_stats({(-1, 1): "failed"}, nbytes={0: 10_000_000, 1: 4_000_000, 2: 10_000_000})
    got = bw.rank_bandwidth(cur, prev=prev, interval=0.5)
    # 3 peers x 2 spines x 10 MB on planes 0 and 2, in 0.5 s; plane 1 failed: left out.
    assert got.source == "measured" and got.send == got.recv == 2 * 6 * 10e6 / 0.5
    per_plane = bw.measured_plane_rates(prev, cur, 0.5, 4)
    assert per_plane[1] == (6 * 4e6 / 0.5,) * 2 and per_plane[3] == (0.0, 0.0)
    idle = bw.rank_bandwidth(fake_stats(nbytes={0: 1000}), prev=prev, interval=0.5)
    assert idle.source == "planes" and idle.send == 4.0
    with pytest.raises(UsageError, match="prev and interval go together"):
        bw.rank_bandwidth(cur, prev=prev)


def test_rank_bandwidth_bad_stats() -> None:
    with pytest.raises(UsageError, match="state 'gone'"):
        bw.rank_bandwidth(fake_stats({(0, 0): "gone"}))
    with pytest.raises(UsageError, match="no 'paths' list"):
        bw.rank_bandwidth({})
    with pytest.raises(UsageError, match="a path is on plane 2, but there are 2 planes"):
        bw.rank_bandwidth(fake_stats(), plane_rates=[1e8, 1e8])
    with pytest.raises(UsageError, match=r"plane_rates\[1\] = 0"):
        bw.rank_bandwidth(fake_stats(), plane_rates=[1e8, 0, 1e8, 1e8])


def test_record_round_trip_and_malformed() -> None:
    rec = bw.RankBandwidth(375e6, 370e6, 0b1101, 4, "fabric", host=1.6e9)
    assert bw.unpack(bw.pack(rec)) == rec and len(bw.pack(rec)) == bw.RECORD_SIZE == 40
    recs = [rec, bw.RankBandwidth(3.0, 3.0, 0b0111, 4, "planes", host=float("inf"))]
    assert bw.unpack_all(b"".join(bw.pack(r) for r in recs), 2) == recs
    with pytest.raises(UsageError, match="not a bandwidth record"):
        bw.unpack(b"X" * bw.RECORD_SIZE)
    with pytest.raises(UsageError, match="record of 5 bytes"):
        bw.unpack(b"12345")
    with pytest.raises(UsageError, match="80 bytes for 3 bandwidth records"):
        bw.unpack_all(b"".join(bw.pack(r) for r in recs), 3)
    with pytest.raises(UsageError, match="planes beyond the 4"):
        bw.RankBandwidth(1.0, 1.0, 0b10000, 4, "planes")
    with pytest.raises(UsageError, match="host rate nan"):
        bw.RankBandwidth(1.0, 1.0, 1, 4, "planes", host=float("nan"))


def test_agree_takes_the_fastest_hosts_rate_in_steps_with_hysteresis() -> None:
    """Every rank's record says what its host moved in healthy all_reduces; the agreement
    takes the fastest (the least inflated by waits), in steps of 2^(1/16), holds a level
    against a change of 2 steps, and knows none while nobody measured or one ran at the
    wire's pace. The plan then takes it (model.plan's host_rate)."""
    base = records_for({1: (1,)})

    def with_host(hosts: list[float]) -> list[bw.RankBandwidth]:
        return [dataclasses.replace(r, host=h) for r, h in zip(base, hosts, strict=True)]

    assert bw.agree(base).host_rate is None  # nobody measured
    a = bw.agree(with_host([1.2e9, 1.5e9, 0.0, 1.4e9]))  # rank 2 not yet: the others count
    assert a.host_level == round(16 * math.log2(1.5e9))
    assert a.host_rate == pytest.approx(1.5e9, rel=0.022)
    assert "hosts: 1" in a.describe().splitlines()[-1]
    assert bw.agree(with_host([1.2e9, float("inf"), 1e9, 1e9])).host_rate is None
    held = bw.agree(with_host([1.58e9] * 4), a)  # within 2 steps (about 9%): held
    assert held.host_level == a.host_level and not bw.changed(a, held)
    moved = bw.agree(with_host([2.0**31] * 4), a)
    assert moved.host_level == 16 * 31 and bw.changed(a, moved)
    assert a.scaled(2.0).host_rate == a.host_rate  # bytes/s either way
    # The plan with the agreed host rate is model.plan's with it: towards equal shares.
    p_host = m.plan(a, 64 << 20, alpha=30e-6, host_rate=a.host_rate)
    p_wire = m.plan(a, 64 << 20, alpha=30e-6)
    assert p_host.shares[1] > p_wire.shares[1]


def records_for(failed: dict[int, tuple[int, ...]], n: int = 4) -> list[bw.RankBandwidth]:
    """Each rank's record as its own stats give it (rank -> its failed planes)."""
    return [
        bw.rank_bandwidth(
            fake_stats({(-1, p): "failed" for p in failed.get(r, ())}, peers=n - 1),
            plane_rates=RATES_1G,
        )
        for r in range(n)
    ]


def test_agree_end_to_end_to_the_plan() -> None:
    """h1's plane 1 failed: every rank's records, exchanged as bytes, agree to 48/64 for
    rank 1, and the plan is the resilient one with rank 1 owning least."""
    wire = b"".join(bw.pack(r) for r in records_for({1: (1,)}))
    agreed = [bw.agree(bw.unpack_all(wire, 4)) for _ in range(4)]  # what each rank computes
    assert all(a == agreed[0] for a in agreed)
    a = agreed[0]
    assert a.levels == ((64, 64), (48, 48), (64, 64), (64, 64)) and a.source == "fabric"
    assert a.send == (500e6, 375e6, 500e6, 500e6)
    assert "planes up [0, 2, 3] of 4" in a.describe().splitlines()[1]
    p = m.plan(a, 64 << 20, alpha=30e-6)
    assert p.name == "resilient" and p.shares == pytest.approx((0.3, 0.1, 0.3, 0.3))
    healthy = bw.agree(records_for({}))
    assert m.plan(healthy, 64 << 20, alpha=30e-6) == m.Plan(
        "equal", (0.25,) * 4, m.plan([5e8] * 4, 64 << 20, alpha=30e-6).predicted
    )


def test_agree_quantises_noise_away() -> None:
    rng = np.random.default_rng(11)
    for _ in range(20):
        noisy = [
            bw.RankBandwidth(v, v * rng.uniform(0.995, 1.005), 15, 4, "measured")
            for v in 4.7e8 * rng.uniform(0.994, 1.0, 4)
        ]
        a = bw.agree(noisy)
        assert {lv for pair in a.levels for lv in pair} <= {63, 64}
        assert m.plan(a, 256 << 20, alpha=30e-6).name == "equal"


def test_agree_hysteresis_holds_small_moves_not_plane_losses() -> None:
    first = bw.agree([bw.RankBandwidth(v, v, 15, 4, "measured") for v in (4.7e8, 4.6e8, 4.7e8)])
    assert first.levels[1] == (63, 63)
    # Rank 1 drifts 2 steps lower (3%): held at the previous step.
    drift = [bw.RankBandwidth(v, v, 15, 4, "measured") for v in (4.7e8, 4.45e8, 4.7e8)]
    assert bw.agree(drift).levels[1] == (61, 61)
    held = bw.agree(drift, first)
    assert held.levels == first.levels and not bw.changed(first, held)
    # Rank 1 loses a plane: 48 steps, far past the hysteresis.
    lost = [
        bw.RankBandwidth(v, v, m_, 4, "measured")
        for v, m_ in ((4.7e8, 15), (3.5e8, 13), (4.7e8, 15))
    ]
    now = bw.agree(lost, held)
    assert now.levels[1] == (48, 48) and bw.changed(held, now)
    # ... and heals: back to the healthy steps, and to equal shares.
    healed = bw.agree(drift[:1] * 3, now)
    assert healed.levels == ((64, 64),) * 3 and bw.changed(now, healed)
    assert m.plan(healed, 64 << 20).name == "equal"


def test_agree_mixed_sources_count_planes_and_dead_rank_is_named() -> None:
    mixed = [
        bw.RankBandwidth(5e8, 5e8, 15, 4, "fabric"),
        bw.RankBandwidth(3.6e8, 3.6e8, 13, 4, "measured"),
        bw.RankBandwidth(4.0, 4.0, 15, 4, "planes"),
    ]
    a = bw.agree(mixed)
    assert a.source == "planes" and a.send == (4.0, 3.0, 4.0) and a.levels[1] == (48, 48)
    in_bytes = a.scaled(125e6)  # one 1 Gbit/s plane
    assert in_bytes.send == (500e6, 375e6, 500e6) and in_bytes.levels == a.levels
    assert m.plan(in_bytes, 512, alpha=30e-6).name == "equal"
    assert m.plan(in_bytes, 64 << 20, alpha=30e-6).name == "resilient"
    dead = [bw.RankBandwidth(5e8, 5e8, 15, 4, "fabric"), bw.RankBandwidth(0.0, 0.0, 0, 4, "fabric")]
    with pytest.raises(UsageError, match=r"no usable bandwidth on rank\(s\) 1 \(send 0, recv 0\)"):
        bw.agree(dead)
    with pytest.raises(UsageError, match="no bandwidth records"):
        bw.agree([])


def test_tracker_reports_plane_changes() -> None:
    t = bw.Tracker(plane_rates=RATES_1G)
    assert not t.needs_agreement()
    with pytest.raises(UsageError, match="before any observe"):
        t.reported()
    t.observe(fake_stats(), 0.0)
    assert t.needs_agreement()
    assert bw.unpack(t.reported()).send == 500e6 and not t.needs_agreement()
    t.observe(fake_stats({(0, 2): "suspect"}), 1.0)  # still usable: nothing to agree
    assert not t.needs_agreement()
    t.observe(fake_stats({(-1, 2): "failed"}), 2.0)
    assert t.needs_agreement() and bw.unpack(t.reported()).planes_down == (2,)
    t.observe(fake_stats(), 3.0)  # healed
    assert t.needs_agreement()


def test_tracker_measures_between_snapshots() -> None:
    t = bw.Tracker(nplanes=4)
    assert t.observe(fake_stats(), 10.0).source == "planes"  # nothing to compare with yet
    got = t.observe(fake_stats(nbytes=dict.fromkeys(range(4), 5_000_000)), 10.5)
    assert got.source == "measured" and got.send == 4 * 6 * 5e6 / 0.5


def test_docs_table_is_the_model() -> None:
    """docs/collectives-model.md's table of numbers is what the model computes now."""
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "collectives-model.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| ") and line[2].isdigit()]
    seen = 0
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != 8:
            continue
        n, x = int(cells[0]), float(Fraction(cells[1]))
        s = m.summary(n, x)
        first = [float(c.split()[0]) for c in cells[2:7]]
        want = [s["healthy"], s["ring"], s["split_x"], s["split_opt"], s["mrc"]]
        assert first == pytest.approx(want, abs=6e-5), line
        assert float(cells[5].split("(")[2].rstrip(")")) == pytest.approx(s["y_opt"], abs=6e-5)
        shares = [float(v) for v in cells[7].split(",")]
        assert shares == pytest.approx(m.resilient_shares_closed(n, x), abs=6e-5)
        seen += 1
    assert seen == 12
