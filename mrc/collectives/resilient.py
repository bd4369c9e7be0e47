"""The resilient AllReduce (issue 13): agree on every rank's bandwidth, plan the shares.

The pieces: bandwidth.py turns this rank's path states into its usable rate and a 40-byte
record; model.plan() picks the schedule (equal shares, or the shares that meet the lower
bound) for the agreed rates and the message size; the executor runs the direct
all_reduce with those shares, which keep the fixed reduction order, so a switch changes
no bit of any result. This module joins them, per communicator:

- At an exchange point (an all_reduce that brings the bytes all-reduced since the last
  exchange, its own included, to `exchange_bytes`: every one of that size or more; the
  first EARLY_EXCHANGES; and every `exchange_every`-th of any size; every rank calls the
  same collectives with the same sizes, so every rank reaches the same points) each rank
  reads its endpoint's path states, all-gathers the records through the executor (the
  same ordered, signature-checked path as any collective: a rank that skipped the exchange
  gets a mismatch error, not a wrong plan) and applies bandwidth.agree(), a pure rule:
  every rank holds the same agreement after the same operation.
- Every all_reduce, exchange point or not, plans from the latest agreement (cached per
  size), so small ones cost nothing extra and still use the schedule the last agreement
  gave. A plane that fails in the middle of an operation: that operation completes on the
  remaining paths (the transport keeps it lossless); the next exchange point sees the
  failed paths and every rank switches at that same operation. A heal is seen the same way.
- The rates: the fabric file's per-plane link rates when the communicator is on a fabric
  (every rank's own host links); else the count of usable planes times `plane_rate`.
  Measured delivered rates (bandwidth.rank_bandwidth with prev=) are not used: what a rank
  delivers follows the shares it was given, so planning on it would feed back on itself.
- The hosts' own rate (model.host_limited): where the cores, not the links, set the pace
  (a software datapath on a busy host), each rank fits it to every all_reduce of at least
  HOST_FIT_BYTES it planned (model.fit_host_rate_shares: the H under which the model's
  time for the shares and agreed rates it ran with is the measured one; inf at the
  wire's pace) and sends the median of its last HOST_FITS fits in its record; agreement
  takes the fastest rank's (bandwidth.agree_host_rate: the last rank to arrive at an
  operation times only the operation, the others also their wait for it) and plan()
  takes it into account. A job that starts with a plane already down learns it from its
  degraded runs. The shares do not move H (it is the hosts' constant in the model), but
  where the model is off the fit absorbs it, in steps of 4.4% with hysteresis.
  The time above the link model's is the host's only if the host had no CPU to spare:
  a fit counts when the CPUs this process may run on were busy for HOST_BUSY of the time
  (/proc/stat, read once per window of operations of at least 0.1 s and 20 clock ticks),
  or the endpoint's progress thread or the caller's ran for HOST_BUSY of the operation
  (HostGate). Otherwise the excess is the wire's (headers, ACKs, drops and
  retransmissions), which scales every link alike and must not move the shares, and the
  fit is inf (the wire's pace). Where the kernel does not say, the fit counts.
  MRC_RESILIENT_HOST=0 (host_aware=False) plans on the link rates alone.

comm.stats()["resilient"] shows the agreed vector and the chosen schedule; the logger
"mrc.collectives.resilient" says (INFO) each change of agreement or schedule, naming the
schedule and the bandwidths agreed, with the planner's table at DEBUG.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import math
import os
import statistics
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from mrc.collectives import bandwidth, model
from mrc.collectives import schedule as S
from mrc.errors import UsageError

log = logging.getLogger("mrc.collectives.resilient")

# An exchange is an all_gather of 40 bytes per rank: about one round trip (a few hundred
# microseconds on a quiet fabric; 1-1.5 ms of each 4 MiB all_reduce on the shaped fabric of
# the 2-core machine, 4 ranks, where every rank's CPU is the time). One per 16 MiB of
# all_reduce data: every all_reduce of 16 MiB or more (over 50 ms at 4 x 1 Gbit/s, so a
# few percent at most), every 4th of 4 MiB; a failed plane is planned around within 16 MiB.
DEFAULT_EXCHANGE_BYTES = 16 << 20
# Smaller all_reduces refresh the agreement every this many all_reduces, so a job of only
# small ones still sees a failed plane (and pays 1/64 of an exchange per operation).
DEFAULT_EXCHANGE_EVERY = 64
# The first all_reduces of a communicator are all exchange points: its fresh endpoint learns
# of a cable that was down before it opened only from the first packets lost on it, so the
# first agreement may not know yet.
EARLY_EXCHANGES = 8
# One dependent hop (post, wire, completion) for plan()'s alpha term.
DEFAULT_ALPHA = 50e-6
# A plane's rate when no fabric file says it (loopback): only ratios matter for the shares,
# this only sets where small messages stop paying for a resilient plan.
DEFAULT_PLANE_RATE = 10e9 / 8
_PLAN_CACHE = 64
# The host rate is fitted to all_reduces of at least this size (where the per-byte cost,
# not the alpha of a few hops, is what the time says); the median of the last HOST_FITS.
HOST_FIT_BYTES = 4 << 20
HOST_FITS = 8
# A fit counts only when the host had no CPU to spare: the CPUs this process may run on
# were busy for at least this fraction of the time, or one of the datapath's threads (the
# endpoint's progress thread, the caller's that runs the executor) ran for that fraction
# of the operation (a saturated thread on a host of many cores). Measured on two cores,
# 4 ranks, 64 MiB all_reduce: at 4 x 1 Gbit/s (CPU-bound) the CPUs were 0.97-0.99 busy;
# at 4 x 50 Mbit/s (link-bound) 0.55-0.71, the busiest thread ran 0.22-0.30 of the time.
HOST_BUSY = 0.85
# The CPUs' busy fraction is read over windows of at least this many clock ticks
# (/proc/stat's unit, 10 ms per CPU; a 4 MiB all_reduce of 30 ms on two CPUs counts 6)
# and HOST_WINDOW_S: the operations' fits wait for their window's answer.
MIN_BUSY_TICKS = 20
HOST_WINDOW_S = 0.1
_PENDING_FITS = 64


def cpu_ticks() -> tuple[int, int] | None:
    """(busy, all) clock ticks so far of the CPUs this process may run on (/proc/stat);
    None where the kernel does not say."""
    try:
        cpus = {f"cpu{c}" for c in os.sched_getaffinity(0)}
        busy = total = 0
        with open("/proc/stat", "rb") as f:
            for line in f:
                name, _, rest = line.decode().partition(" ")
                if name in cpus:
                    # user nice system idle iowait irq softirq steal (guest is in user)
                    v = [int(x) for x in rest.split()[:8]]
                    busy += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
                    total += sum(v)
    except (OSError, ValueError, IndexError):
        return None
    return (busy, total) if total else None


def thread_ran(before: Mapping[str, int], after: Mapping[str, int], wall_s: float) -> float:
    """The largest fraction of wall_s that one of the threads ran (ns counters by name)."""
    if not wall_s > 0.0:
        return 0.0
    return max((after[t] - before[t] for t in after.keys() & before.keys()), default=0) / (
        wall_s * 1e9
    )


class HostGate:
    """Whether each operation's host-rate fit counts: at once when one of the datapath's
    threads ran for HOST_BUSY of it; otherwise when the window it fell in closes (at least
    MIN_BUSY_TICKS and HOST_WINDOW_S): its fit if the CPUs were busy for HOST_BUSY of the
    window, inf (the wire's pace) if not. Where the kernel gives no ticks, fits stand.
    ticks and clock are the kernel's (cpu_ticks, time.monotonic) unless a test says."""

    def __init__(
        self,
        ticks: Callable[[], tuple[int, int] | None] = cpu_ticks,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ticks, self._clock = ticks, clock
        self._window: tuple[float, tuple[int, int] | None] | None = None
        self._pending: deque[float] = deque(maxlen=_PENDING_FITS)
        self.busy: float | None = None  # the last answer: a thread's or a window's

    def start(self) -> None:
        """Before an operation: opens a window unless one is open (one /proc/stat read)."""
        if self._window is None:
            self._window = (self._clock(), self._ticks())

    def offer(self, fit: float, ran: float) -> list[float]:
        """An operation's fit and its busiest thread's run fraction; returns the fits that
        count now (this one, or those of a window that closed, maybe none)."""
        if ran >= HOST_BUSY:
            self.busy = ran
            return [fit]
        self._pending.append(fit)
        if self._window is None or self._window[1] is None:
            self._window = None
            return self._release(None)
        t0, (b0, a0) = self._window
        if self._clock() - t0 < HOST_WINDOW_S:
            return []
        now = self._ticks()
        if now is None:
            self._window = None
            return self._release(None)
        if now[1] - a0 < MIN_BUSY_TICKS:
            return []
        self._window = None
        self.busy = (now[0] - b0) / (now[1] - a0)
        return self._release(self.busy)

    def _release(self, busy: float | None) -> list[float]:
        spare = busy is not None and busy < HOST_BUSY
        out = [math.inf if spare else f for f in self._pending]
        self._pending.clear()
        return out


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    if value not in ("0", "1"):
        raise UsageError(f"{name}={value!r}: want 0 or 1")
    return value == "1"


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        v = int(value)
    except ValueError:
        raise UsageError(f"{name}={value!r} is not an integer") from None
    if v < 0:
        raise UsageError(f"{name}={v}: must be >= 0")
    return v


class Resilience:
    """One communicator's bandwidth agreement and AllReduce planner.

    comm: the Collectives mixin's object (rank, size, endpoint, fabric_info, _run).
    enabled: plan at all (MRC_RESILIENT=0 turns it off: equal shares always).
    exchange_bytes: an all_reduce is an exchange point once the bytes all-reduced since
    the last exchange, its own included, reach this (MRC_RESILIENT_EXCHANGE_BYTES; 0: every
    all_reduce).
    exchange_every: smaller ones are one every this many all_reduces
    (MRC_RESILIENT_EXCHANGE_EVERY).
    host_aware: fit the hosts' own rate to the all_reduces it plans (4 MiB and more) and
    plan with it (MRC_RESILIENT_HOST=0 turns it off).
    """

    def __init__(
        self,
        comm: Any,
        *,
        enabled: bool | None = None,
        exchange_bytes: int | None = None,
        exchange_every: int | None = None,
        alpha: float = DEFAULT_ALPHA,
        plane_rate: float = DEFAULT_PLANE_RATE,
        host_aware: bool | None = None,
    ) -> None:
        self.comm = comm
        self.enabled = _env_flag("MRC_RESILIENT", True) if enabled is None else enabled
        self.host_aware = (
            _env_flag("MRC_RESILIENT_HOST", True) if host_aware is None else host_aware
        )
        self._host_fits: deque[float] = deque(maxlen=HOST_FITS)
        self._gate = HostGate()
        self.exchange_bytes = (
            env_int("MRC_RESILIENT_EXCHANGE_BYTES", DEFAULT_EXCHANGE_BYTES)
            if exchange_bytes is None
            else exchange_bytes
        )
        if self.exchange_bytes < 0:
            raise UsageError(f"exchange_bytes = {self.exchange_bytes}: must be >= 0")
        self.exchange_every = (
            env_int("MRC_RESILIENT_EXCHANGE_EVERY", DEFAULT_EXCHANGE_EVERY)
            if exchange_every is None
            else exchange_every
        )
        if self.exchange_every < 1:
            raise UsageError(f"exchange_every = {self.exchange_every}: must be >= 1")
        self._last_exchange = 0  # self.ops at the last exchange
        self._bytes_since = 0  # all_reduce bytes since then, this operation's included
        self.alpha = alpha
        self.plane_rate = plane_rate
        self.nplanes = len(comm.endpoint.planes)
        info = getattr(comm, "fabric_info", None)
        rates = None if info is None else info.get("rates_bps")
        self.plane_rates = None if rates is None else [float(r) / 8.0 for r in rates]
        self.agreed: bandwidth.AgreedBandwidths | None = None
        self.current: bandwidth.RankBandwidth | None = None
        self.epoch = 0  # agreements that changed the vector
        self.exchanges = 0
        self.ops = 0
        self.schedules: Counter[str] = Counter()
        self.last: dict[str, Any] | None = None
        self.switches: list[dict[str, Any]] = []
        self._plans: dict[int, model.Plan] = {}
        self._packed: dict[tuple[Any, ...], Any] = {}
        self._exchange_plan: tuple[Any, int] | None = None
        self._lock = threading.Lock()
        self._down_before: list[bool] = [False] * self.nplanes
        self._conn_hosts = _conn_hosts(comm)

    # --- what this rank can use ----------------------------------------------------------

    def local(self) -> bandwidth.RankBandwidth:
        """This rank's usable rates from its endpoint's path states: a plane counts as
        lost once two snapshots in a row (two exchange points) find every path of it
        failed. A CPU-starved host can time out all paths of a plane at once for a few
        milliseconds (late ACKs of one plane socket's burst), and probes heal them; a
        schedule switch on that would cost more than it saves. A healed plane counts
        at once."""
        stats = self.comm.endpoint.stats()
        usable = bandwidth.plane_usable(stats, self.nplanes, self._conn_hosts)
        down = [not u for u in usable]
        lost = [d and b for d, b in zip(down, self._down_before, strict=True)]
        self._down_before = down
        bw = bandwidth.rank_bandwidth(
            stats, nplanes=self.nplanes, plane_rates=self.plane_rates,
            usable=[not x for x in lost],
        )  # fmt: skip
        return dataclasses.replace(bw, host=self.host_rate())

    def host_rate(self) -> float:
        """This rank's estimate for its record: the median of its recent fits (0.0: none
        yet), robust to one slow operation (a wait for a late rank, a busy moment) and to
        one fast one alike."""
        if not self.host_aware or not self._host_fits:
            return 0.0
        return float(statistics.median(self._host_fits))

    def _threads(self) -> dict[str, int]:
        """ns the datapath's threads have run: the endpoint's progress thread and this one
        (which runs the executor); two clock reads."""
        return {
            "progress": self.comm.endpoint.progress_cpu_ns(),
            "caller": time.thread_time_ns(),
        }

    def host_before(self, nbytes: int) -> dict[str, int] | None:
        """Before an all_reduce: the threads' CPU times, for observed(); only where a fit
        may follow (HOST_FIT_BYTES or more)."""
        if not self.host_aware or not self.enabled or nbytes < HOST_FIT_BYTES:
            return None
        self._gate.start()
        return self._threads()

    def observed(self, nbytes: int, seconds: float, before: dict[str, int] | None = None) -> None:
        """After an all_reduce this planner chose the shares of: fit the host rate to its
        time, its shares and the rates agreed for it; the fit counts unless the host had
        CPU to spare (HostGate; before: host_before()'s answer)."""
        ran = 0.0 if before is None else thread_ran(before, self._threads(), seconds)
        with self._lock:
            last, agreed = self.last, self.agreed
            if (
                not self.host_aware
                or not self.enabled
                or self.comm.size < 3
                or nbytes < HOST_FIT_BYTES
                or last is None
                or last["nbytes"] != nbytes
                or agreed is None
                or not seconds > 0.0
            ):
                return
            rates = self._rates(agreed)
            fit = model.fit_host_rate_shares(
                last["shares"], rates.send, rates.recv, float(nbytes), seconds
            )
            self._host_fits.extend(self._gate.offer(fit, ran))

    def _exchange(self) -> None:
        """All-gather every rank's record through the executor and agree. Runs on the
        thread that runs the all_reduce, in its place in the order of operations."""
        comm = self.comm
        self.current = self.local()
        send = np.frombuffer(bandwidth.pack(self.current), dtype=np.uint8).copy()
        recv = np.empty(bandwidth.RECORD_SIZE * comm.size, dtype=np.uint8)
        from mrc.collectives.ops import DTYPES, signature

        if self._exchange_plan is None:  # the same every time: planned and packed once
            self._exchange_plan = (
                S.all_gather(comm.rank, comm.size, bandwidth.RECORD_SIZE, 1).pack(),
                signature("bandwidth exchange", bandwidth.RECORD_SIZE),
            )
        packed, sig = self._exchange_plan
        comm._run_raw("bandwidth exchange", packed, send, recv, DTYPES["uint8"], 0, sig)
        records = bandwidth.unpack_all(recv.tobytes(), comm.size)
        new = bandwidth.agree(records, self.agreed)
        self.exchanges += 1
        self._last_exchange = self.ops
        self._bytes_since = 0
        if bandwidth.changed(self.agreed, new):
            self.epoch += 1
            self._plans.clear()
            if self.agreed is not None or any(b.planes_down for b in records):
                log.info(
                    "rank %d: bandwidths agreed at all_reduce %d (epoch %d, %s):\n%s",
                    comm.rank,
                    self.ops,
                    self.epoch,
                    new.source,
                    new.describe(),
                )
        self.agreed = new

    def _rates(self, agreed: bandwidth.AgreedBandwidths) -> bandwidth.AgreedBandwidths:
        return agreed.scaled(self.plane_rate) if agreed.source == "planes" else agreed

    # --- the hook: called by Collectives.all_reduce ------------------------------------

    def plan_for(self, nbytes: int, auto: bool = False) -> tuple[str, tuple[float, ...] | None]:
        """(algo, shares) of this all_reduce, the same on every rank: "direct" with its
        shares (None: equal), or, for a caller that left the algorithm to "auto", "hier"
        or "chain" where the hosts' links favour it for these shares and bandwidths
        (model.layout_algo through the communicator's _layout_algo). An exchange point
        first refreshes the agreement (a collective of its own)."""
        with self._lock:
            self.ops += 1
            n = self.comm.size
            if not self.enabled or n < 3:
                # n <= 2: every share costs the same (model.shares); nothing to plan.
                plan = model.Plan("equal", (1.0 / n,) * n, math.nan)
            else:
                plan = self._plan(nbytes)
            shares = None if plan.name == "equal" else tuple(plan.shares)
            how = self.comm._layout_algo(shares, self.agreed) if auto else "direct"
            if how != "direct":  # the chain or the chain of hosts: no shares
                plan, shares = model.Plan(how, (1.0 / n,) * n, math.nan), None
            self._note(plan, nbytes)
            return how, shares

    def _plan(self, nbytes: int) -> model.Plan:
        self._bytes_since += nbytes
        if (
            self._bytes_since >= self.exchange_bytes
            or self.ops <= EARLY_EXCHANGES
            or self.ops - self._last_exchange >= self.exchange_every
        ):
            self._exchange()
        assert self.agreed is not None
        plan = self._plans.get(nbytes)
        if plan is None:
            rates = self._rates(self.agreed)
            host = self.agreed.host_rate if self.host_aware else None
            plan = model.plan(rates, float(nbytes), self.alpha, host_rate=host)
            if len(self._plans) >= _PLAN_CACHE:
                self._plans.clear()
            self._plans[nbytes] = plan
            if log.isEnabledFor(logging.DEBUG):
                table = model.candidates(rates, float(nbytes), self.alpha, host_rate=host)
                log.debug(
                    "rank %d: all_reduce of %d bytes, candidates:\n%s",
                    self.comm.rank,
                    nbytes,
                    model.format_table(table),
                )
        return plan

    def _note(self, plan: model.Plan, nbytes: int) -> None:
        self.schedules[plan.name] += 1
        prev = self.last
        self.last = {
            "op": self.ops,
            "nbytes": nbytes,
            "schedule": plan.name,
            "shares": list(plan.shares),
            "predicted_s": plan.predicted,
            "epoch": self.epoch,
        }
        if prev is None or prev["schedule"] != plan.name or prev["shares"] != list(plan.shares):
            self.switches.append(
                {"op": self.ops, "epoch": self.epoch, "schedule": plan.name, "nbytes": nbytes}
            )
            if plan.name in ("chain", "hier"):
                log.info(
                    "rank %d: all_reduce %d (%d bytes) runs schedule %s (%s), for bandwidths %s",
                    self.comm.rank,
                    self.ops,
                    nbytes,
                    plan.name,
                    self.comm._layout_last[1],
                    "not agreed" if self.agreed is None else _short(self.agreed),
                )
            elif prev is not None or plan.name != "equal":
                assert self.agreed is not None
                log.info(
                    "rank %d: all_reduce %d (%d bytes) runs schedule %s, shares %s, "
                    "predicted %.3g ms, for bandwidths %s",
                    self.comm.rank,
                    self.ops,
                    nbytes,
                    plan.name,
                    [round(x, 4) for x in plan.shares],
                    plan.predicted * 1e3,
                    _short(self.agreed),
                )

    def packed(
        self,
        count: int,
        esize: int,
        shares: tuple[float, ...] | None,
        avg: bool,
        lag: int,
        algo: str = "direct",
    ) -> Any:
        """The executor's plan of this all_reduce (direct with shares, or the chain "auto"
        may take instead: ops._layout_algo), cached here: it is built on whichever thread
        runs the operation, so not in the mixin's cache (filled by callers). lag: the
        mixin's step lag (its scratch slots)."""
        key = (count, esize, shares, avg, lag, algo)
        with self._lock:
            packed = self._packed.get(key)
        if packed is None:
            sch = S.all_reduce(
                self.comm.rank,
                self.comm.size,
                count,
                esize,
                shares=shares,
                avg=avg,
                lag=lag,
                algo=algo,
                groups=self.comm._host_groups(),
            )
            packed = sch.pack()
            with self._lock:
                if len(self._packed) >= _PLAN_CACHE:
                    self._packed.clear()
                self._packed[key] = packed
        return packed

    def stats(self) -> dict[str, Any]:
        """What comm.stats()["resilient"] shows. Without the lock: an exchange holds it
        for as long as the collective takes, and a monitoring thread must not wait on it
        (each field is read once; they may be one operation apart)."""
        ag = self.agreed
        return {
            "enabled": self.enabled,
            "host_aware": self.host_aware,
            "host_busy": self._gate.busy,
            "exchange_bytes": self.exchange_bytes,
            "exchange_every": self.exchange_every,
            "all_reduces": self.ops,
            "exchanges": self.exchanges,
            "epoch": self.epoch,
            "local": None
            if self.current is None
            else {
                "send": self.current.send,
                "recv": self.current.recv,
                "planes_up": list(self.current.planes_up),
                "source": self.current.source,
                "host_rate": self.current.host,
            },
            "agreed": None
            if ag is None
            else {
                "source": ag.source,
                "send": list(ag.send),
                "recv": list(ag.recv),
                "levels": [list(x) for x in ag.levels],
                "planes_up": [[p for p in range(np_) if mask >> p & 1] for mask, np_ in ag.planes],
                "host_rate": ag.host_rate,
            },
            "schedule": None if self.last is None else dict(self.last),
            "schedules": dict(self.schedules),
            "switches": list(self.switches),
        }


def _conn_hosts(comm: Any) -> dict[int, str] | None:
    """Connection id -> peer host for this rank's connections to ranks on other hosts, on
    real NICs (bandwidth.plane_usable): connections to ranks on its own host go
    host-internal whatever the cables do, so their paths would hide a pulled one, and a
    failure seen towards one host only may be that host's cable. None (every path counts,
    as its own) on loopback planes (127.x, ::1: the tests' and demos' emulated NICs, where
    a pulled plane is the datapath's doing) or where the hosts are not known."""
    hosts = getattr(comm, "hosts", None)
    if not hosts or len(hosts) != comm.size:
        return None
    try:
        if all(ipaddress.ip_address(a).is_loopback for a, _ in comm.endpoint.planes):
            return None
    except ValueError:
        return None
    me = hosts[comm.rank]
    return {
        p.ids[0]: hosts[r]
        for r, p in enumerate(comm.peers)
        if p is not None and r != comm.rank and hosts[r] != me
    }


def _short(ag: bandwidth.AgreedBandwidths) -> str:
    """The agreed vector in one line: per rank send/recv and the planes up."""
    parts = []
    for r, ((ls, lr), (mask, np_)) in enumerate(zip(ag.levels, ag.planes, strict=True)):
        up = "".join(str(p) for p in range(np_) if mask >> p & 1)
        if ag.source == "planes":
            rate = f"{ag.send[r]:g}/{ag.recv[r]:g} planes"
        else:
            rate = f"{ag.send[r] * 8e-9:.3g}/{ag.recv[r] * 8e-9:.3g} Gbit/s"
        parts.append(f"r{r} {rate} ({ls}/{lr} of {ag.scale}, planes {up})")
    if ag.host_rate is not None:
        parts.append(f"hosts {ag.host_rate * 8e-9:.3g} Gbit/s")
    return "; ".join(parts)


__all__ = ["DEFAULT_EXCHANGE_BYTES", "Resilience"]
