"""What bandwidth a rank can use, and one vector of them that every rank agrees on (issue 13).

The planner (mrc.collectives.model.plan) must pick the same schedule on every rank, so it
must see the same numbers on every rank. The flow, per communicator:

1. each rank: rank_bandwidth(endpoint.stats(), ...) -> RankBandwidth (its usable send and
   receive rate, from which planes still have a usable path);
2. all ranks exchange pack(...) records (an all-gather; the communicator's job);
3. each rank: agree(records, previous) -> AgreedBandwidths, a pure function of the
   records (and of the previous agreement), so every rank computes the same vector; it
   quantises rates to LEVELS steps of the fastest rate and keeps the previous step while
   a rank moved by less than HYSTERESIS, so measurement noise does not flip schedules;
4. plan(agreed, nbytes, alpha, host_rate=agreed.host_rate) on every rank; a changed plan
   takes effect at the next operation boundary (every rank switches at the same operation).

A record also carries the rank's estimate of its host's own rate (model.host_limited: the
bytes per second of traffic its cores can move, sent plus received), fitted by the
communicator to the all_reduces it planned (resilient.py); agree() takes the fastest
rank's (see agree_host_rate).

Everything here is pure (dicts in, values out) so it is tested on synthetic stats.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mrc.errors import UsageError

# Path states (src_c path.c, mrc_path_state_str) that still carry data or soon will: a
# suspect or probing path is one probe away from good. Only "failed" is excluded.
USABLE_STATES = frozenset({"good", "suspect", "probing"})
KNOWN_STATES = USABLE_STATES | {"failed"}

# Where a rank's rates came from, best first. "planes" counts usable planes (each 1.0):
# always available, exact, right whenever planes are alike.
SOURCES = ("fabric", "measured", "planes")
MAX_PLANES = 64  # planes are a bit mask in the exchanged record

# A measurement moving fewer bytes than this (either direction) says nothing about what
# the links can carry: the rank falls back to counting planes.
MIN_MEASURED_BYTES = 1 << 20

# Agreement: rates in steps of 1/LEVELS of the fastest rank's rate; a rank keeps its
# previous step unless it moved by more than HYSTERESIS of that rate (2 steps). One plane
# of 4 is 16 steps and one of 8 is 8 (3/4 is exactly 48/64); 1-2% measurement noise is
# about one step and stays under the hysteresis.
LEVELS = 64
HYSTERESIS = 2 / 64
# The agreed host rate: steps of 2^(1/HOST_STEPS_PER_OCTAVE) (4.4%), kept while the new
# estimate is within HOST_HYSTERESIS steps of the previous one.
HOST_STEPS_PER_OCTAVE = 16
HOST_HYSTERESIS = 2


@dataclass(frozen=True)
class RankBandwidth:
    """One rank's usable rates. send/recv are bytes per second for the "fabric" and
    "measured" sources and a count of usable planes for "planes"."""

    send: float
    recv: float
    up_mask: int  # bit p set: plane p has a usable path (or no path yet)
    nplanes: int
    source: str
    # Bytes/s of traffic (sent plus received) this rank's host moved in the all_reduces
    # it planned: 0.0 not measured yet, inf at the wire's pace (the host is no limit).
    host: float = 0.0

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise UsageError(f"bandwidth source {self.source!r} is not one of {SOURCES}")
        if not 1 <= self.nplanes <= MAX_PLANES:
            raise UsageError(f"nplanes = {self.nplanes}: must be 1..{MAX_PLANES}")
        if not 0 <= self.up_mask < (1 << self.nplanes):
            raise UsageError(
                f"up_mask {self.up_mask:#x} names planes beyond the {self.nplanes} there are"
            )
        for name, v in (("send", self.send), ("recv", self.recv)):
            if not math.isfinite(v) or v < 0.0:
                raise UsageError(f"{name} rate {v!r}: must be finite and >= 0")
        if math.isnan(self.host) or self.host < 0.0:
            raise UsageError(f"host rate {self.host!r}: must be >= 0 (inf: no limit)")

    @property
    def planes_up(self) -> tuple[int, ...]:
        return tuple(p for p in range(self.nplanes) if self.up_mask >> p & 1)

    @property
    def planes_down(self) -> tuple[int, ...]:
        return tuple(p for p in range(self.nplanes) if not self.up_mask >> p & 1)


# One rank's view -----------------------------------------------------------------------------


def _paths(stats: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    paths = stats.get("paths")
    if not isinstance(paths, list):
        raise UsageError("stats has no 'paths' list: pass what Endpoint.stats() returns")
    for i, p in enumerate(paths):
        for key in ("plane", "state"):
            if key not in p:
                raise UsageError(f"stats paths[{i}] has no {key!r}: {dict(p)}")
        if p["state"] not in KNOWN_STATES:
            raise UsageError(
                f"stats paths[{i}] state {p['state']!r} is not one of {sorted(KNOWN_STATES)}"
            )
    return paths


def plane_usable(
    stats: Mapping[str, Any],
    nplanes: int | None = None,
    conn_hosts: Mapping[int, str] | None = None,
) -> list[bool]:
    """Per plane: False when some of its paths failed and none is good. Suspect and
    probing paths say neither (a lost packet not yet confirmed, a probe not yet
    answered), so a plane whose paths are all suspect or probing stays usable, and one
    whose failed paths are probed stays lost until a probe makes a path good again. A
    plane with no path (no connection uses it yet) counts as usable: nothing says it is
    broken. Nor does a path that has sent nothing (tx_pkts 0: a connection the schedules
    leave idle, such as a chain's non-neighbours): its state is the one it started in.

    A rank's own cable pulled fails its paths on that plane to every peer; a peer's cable
    fails only the paths to that peer, so this rank keeps the plane (the peer reports its
    own loss). conn_hosts (connection id -> the peer's host, for the connections that
    cross this host's cables; the others' paths are left out): a plane whose failed paths
    all lead to one host is that host's loss unless it is the only other host (then the
    plane is gone between them either way) — what a rank that talks to one neighbouring
    host only (a chain) cannot tell apart.
    """
    # A connection that ended keeps its paths' last states, no longer probed: stale.
    paths = [p for p in _paths(stats) if not p.get("conn_error") and p.get("tx_pkts") != 0]
    if conn_hosts is not None:
        paths = [p for p in paths if p.get("conn_id") in conn_hosts]
    seen = [int(p["plane"]) for p in paths]
    if nplanes is None:
        if not seen:
            raise UsageError("no paths in stats and no nplanes: cannot tell the planes")
        nplanes = max(seen) + 1
    if not 1 <= nplanes <= MAX_PLANES:
        raise UsageError(f"nplanes = {nplanes}: must be 1..{MAX_PLANES}")
    for p in seen:
        if not 0 <= p < nplanes:
            raise UsageError(f"a path is on plane {p}, but there are {nplanes} planes")
    good = [False] * nplanes
    failed = [False] * nplanes
    failed_to: list[set[str]] = [set() for _ in range(nplanes)]
    for p in paths:
        plane = int(p["plane"])
        if p["state"] == "good":
            good[plane] = True
        elif p["state"] not in USABLE_STATES:
            failed[plane] = True
            if conn_hosts is not None:
                failed_to[plane].add(conn_hosts[p["conn_id"]])
    others = 0 if conn_hosts is None else len(set(conn_hosts.values()))
    out = []
    for i in range(nplanes):
        lost = failed[i] and not good[i]
        if lost and conn_hosts is not None and len(failed_to[i]) < 2 <= others:
            lost = False  # one other host's paths: its cable, not necessarily ours
        out.append(not lost)
    return out


def fabric_plane_rates(fabric: Any, host: str) -> list[float]:
    """Bytes per second of `host`'s NIC link on each plane, from a fabric file (path) or an
    mrc.routing.fabric.Fabric. A link is full duplex: the same rate each way. Leaf uplinks
    are not counted (the fabric files here give them room: see routing/*.toml)."""
    from mrc.routing.fabric import Fabric, load_fabric

    fab = fabric if isinstance(fabric, Fabric) else load_fabric(Path(fabric))
    try:
        fab.host(host)
    except KeyError as e:
        raise UsageError(f"{e.args[0]} (hosts: {', '.join(h.name for h in fab.hosts)})") from None
    return [fab.host_link(host, p).rate_bps / 8.0 for p in range(fab.planes)]


def measured_plane_rates(
    prev: Mapping[str, Any], cur: Mapping[str, Any], interval: float, nplanes: int
) -> list[tuple[float, float]]:
    """(sent, received) bytes per second per plane between two stats snapshots `interval`
    seconds apart. Paths are matched by (conn_id, path); a path missing from `prev` (a new
    connection) is left out rather than credited with bytes from before the interval."""
    if not math.isfinite(interval) or interval <= 0.0:
        raise UsageError(f"interval must be > 0 seconds, got {interval!r}")
    before = {(p.get("conn_id"), p.get("path")): p for p in _paths(prev)}
    tx = [0.0] * nplanes
    rx = [0.0] * nplanes
    for p in _paths(cur):
        old = before.get((p.get("conn_id"), p.get("path")))
        plane = int(p["plane"])
        if old is None or not 0 <= plane < nplanes:
            continue
        # A counter that went backwards (a connection re-created under the same id) adds 0.
        tx[plane] += max(0, int(p.get("tx_bytes", 0)) - int(old.get("tx_bytes", 0)))
        rx[plane] += max(0, int(p.get("rx_bytes", 0)) - int(old.get("rx_bytes", 0)))
    return [(tx[i] / interval, rx[i] / interval) for i in range(nplanes)]


def rank_bandwidth(
    stats: Mapping[str, Any],
    *,
    nplanes: int | None = None,
    plane_rates: Sequence[float] | None = None,
    prev: Mapping[str, Any] | None = None,
    interval: float | None = None,
    min_bytes: int = MIN_MEASURED_BYTES,
    usable: Sequence[bool] | None = None,
) -> RankBandwidth:
    """This rank's usable send and receive rate.

    - plane_rates (bytes/s per plane, e.g. fabric_plane_rates()): the sum over usable
      planes, source "fabric";
    - else prev + interval (an earlier stats snapshot): what the usable planes delivered
      in between, source "measured", when at least min_bytes went each way (an idle link
      says nothing about its capacity);
    - else the number of usable planes, source "planes".
    Failed planes never count. usable: the planes to count (default: plane_usable(stats)).
    """
    if plane_rates is not None:
        if nplanes is not None and nplanes != len(plane_rates):
            raise UsageError(f"nplanes = {nplanes} but {len(plane_rates)} plane rates")
        nplanes = len(plane_rates)
        for p, v in enumerate(plane_rates):
            if not math.isfinite(v) or v <= 0.0:
                raise UsageError(f"plane_rates[{p}] = {v!r}: must be > 0 bytes/s")
    if usable is None:
        usable = plane_usable(stats, nplanes)
    elif nplanes is not None and len(usable) != nplanes:
        raise UsageError(f"nplanes = {nplanes} but {len(usable)} usable flags")
    n = len(usable)
    mask = sum(1 << p for p in range(n) if usable[p])
    if plane_rates is not None:
        rate = math.fsum(plane_rates[p] for p in range(n) if usable[p])
        return RankBandwidth(rate, rate, mask, n, "fabric")
    if (prev is None) != (interval is None):
        raise UsageError("prev and interval go together (a measurement needs both)")
    if prev is not None and interval is not None:
        per_plane = measured_plane_rates(prev, stats, interval, n)
        send = math.fsum(per_plane[p][0] for p in range(n) if usable[p])
        recv = math.fsum(per_plane[p][1] for p in range(n) if usable[p])
        if min(send, recv) * interval >= min_bytes:
            return RankBandwidth(send, recv, mask, n, "measured")
    count = float(sum(usable))
    return RankBandwidth(count, count, mask, n, "planes")


# The exchanged record ------------------------------------------------------------------------

# magic, version, source index, nplanes, up_mask, send, recv, host: little-endian, 40 bytes.
_RECORD = struct.Struct("<4sBBHQddd")
_MAGIC = b"MRCB"
_VERSION = 2
RECORD_SIZE = _RECORD.size


def pack(bw: RankBandwidth) -> bytes:
    """The fixed-size record a rank contributes to the exchange."""
    return _RECORD.pack(
        _MAGIC, _VERSION, SOURCES.index(bw.source), bw.nplanes, bw.up_mask, bw.send, bw.recv,
        bw.host,
    )  # fmt: skip


def unpack(data: bytes) -> RankBandwidth:
    """One record back; a malformed one raises UsageError saying what is wrong."""
    if len(data) != RECORD_SIZE:
        raise UsageError(f"bandwidth record of {len(data)} bytes, want {RECORD_SIZE}")
    magic, version, source, nplanes, mask, send, recv, host = _RECORD.unpack(data)
    if magic != _MAGIC or version != _VERSION:
        raise UsageError(
            f"not a bandwidth record (magic {magic!r}, version {version}; want {_MAGIC!r}, "
            f"{_VERSION})"
        )
    if source >= len(SOURCES):
        raise UsageError(f"bandwidth record with unknown source {source}")
    return RankBandwidth(send, recv, mask, nplanes, SOURCES[source], host)


def unpack_all(data: bytes, n: int) -> list[RankBandwidth]:
    """n records laid end to end (what an all-gather of pack() gives), index = rank."""
    if len(data) != n * RECORD_SIZE:
        raise UsageError(f"{len(data)} bytes for {n} bandwidth records of {RECORD_SIZE}")
    return [unpack(data[i * RECORD_SIZE : (i + 1) * RECORD_SIZE]) for i in range(n)]


# Agreement -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AgreedBandwidths:
    """The vector every rank plans with (model.plan takes it as is)."""

    send: tuple[float, ...]  # levels * unit
    recv: tuple[float, ...]
    levels: tuple[tuple[int, int], ...]  # per rank (send, recv) in 1..scale
    scale: int  # the `levels` agree() ran with
    unit: float  # bytes/s (or planes) per level
    source: str
    planes: tuple[tuple[int, int], ...]  # per rank (up_mask, nplanes), for the log
    # The hosts' rate plan() takes (bytes/s, 2^(host_level / HOST_STEPS_PER_OCTAVE));
    # None: not known, or no host slower than the wire.
    host_level: int | None = None

    @property
    def host_rate(self) -> float | None:
        if self.host_level is None:
            return None
        return 2.0 ** (self.host_level / HOST_STEPS_PER_OCTAVE)

    def scaled(self, bytes_per_unit: float) -> AgreedBandwidths:
        """The same agreement with rates multiplied: for source "planes", pass one plane's
        rate in bytes/s so that plan()'s alpha term and its rates share units."""
        if not math.isfinite(bytes_per_unit) or bytes_per_unit <= 0.0:
            raise UsageError(f"bytes_per_unit must be > 0, got {bytes_per_unit!r}")
        return AgreedBandwidths(
            tuple(v * bytes_per_unit for v in self.send),
            tuple(v * bytes_per_unit for v in self.recv),
            self.levels,
            self.scale,
            self.unit * bytes_per_unit,
            self.source,
            self.planes,
            self.host_level,
        )

    def describe(self) -> str:
        """One line per rank: what the planner's log shows next to its choice."""
        out = []
        top = self.scale
        for r, ((ls, lr), (mask, np_)) in enumerate(zip(self.levels, self.planes, strict=True)):
            up = [p for p in range(np_) if mask >> p & 1]
            rate = (
                f"{self.send[r]:g}/{self.recv[r]:g} planes"
                if self.source == "planes"
                else f"{self.send[r] * 8e-9:.3f}/{self.recv[r] * 8e-9:.3f} Gbit/s"
            )
            out.append(
                f"rank {r}: send/recv {ls / top:.3f}/{lr / top:.3f} of the fastest ({rate}), "
                f"planes up {up} of {np_}"
            )
        h = self.host_rate
        out.append(
            "hosts: no limit known"
            if h is None
            else f"hosts: {h * 8e-9:.3g} Gbit/s of traffic (sent plus received)"
        )
        return "\n".join(out)


def _common_source(records: Sequence[RankBandwidth]) -> str:
    sources = {b.source for b in records}
    # Mixed sources are not comparable (a nominal link rate against what was delivered):
    # every record also says how many planes are up, so fall back to counting them.
    return sources.pop() if len(sources) == 1 else "planes"


def agree_host_rate(records: Sequence[RankBandwidth], previous: int | None) -> int | None:
    """The host level every rank computes alike. The fastest rank's estimate: every rank
    times the same operations, and all but the last to arrive also time their wait for
    it, so the largest rate is the least inflated one. None when no rank has measured
    one, or the fastest ran at the wire's pace (inf). Steps of 2^(1/16), and the previous
    level is kept while within HOST_HYSTERESIS steps."""
    known = [b.host for b in records if b.host > 0.0]
    if not known or math.isinf(max(known)):
        return None
    level = round(HOST_STEPS_PER_OCTAVE * math.log2(max(known)))
    if previous is not None and abs(level - previous) <= HOST_HYSTERESIS:
        return previous
    return level


def agree(
    records: Sequence[RankBandwidth],
    previous: AgreedBandwidths | None = None,
    *,
    levels: int = LEVELS,
    hysteresis: float = HYSTERESIS,
) -> AgreedBandwidths:
    """The bandwidth vector every rank computes alike from the same records (index = rank).

    Rates are rounded to steps of 1/levels of the fastest rate (at least one step: a rank
    with any usable plane is never 0). With `previous` (the last agreement, which every
    rank holds too) a rank keeps its previous step unless it moved by more than
    `hysteresis` of the fastest rate. A rank with nothing usable is an error naming it.
    """
    if not records:
        raise UsageError("no bandwidth records to agree on")
    if not 1 <= levels <= 1 << 16:
        raise UsageError(f"levels = {levels}: must be 1..65536")
    if not 0.0 <= hysteresis < 1.0:
        raise UsageError(f"hysteresis = {hysteresis}: must be a fraction in [0, 1)")
    source = _common_source(records)
    if source == "planes":
        rates = [(float(b.up_mask.bit_count()),) * 2 for b in records]
    else:
        rates = [(b.send, b.recv) for b in records]
    dead = [r for r, (s, g) in enumerate(rates) if s <= 0.0 or g <= 0.0]
    if dead:
        raise UsageError(
            "no usable bandwidth on rank(s) "
            + ", ".join(f"{r} (send {rates[r][0]:g}, recv {rates[r][1]:g})" for r in dead)
            + ": every plane failed"
        )
    ref = max(max(s, g) for s, g in rates)
    unit = ref / levels

    def step(v: float) -> int:
        return min(levels, max(1, math.floor(v / unit + 0.5)))

    lv = [(step(s), step(g)) for s, g in rates]
    if (
        previous is not None
        and previous.source == source
        and previous.scale == levels
        and len(previous.levels) == len(lv)
    ):
        keep = math.floor(hysteresis * levels + 1e-9)  # 2/64 * 64 is 2, not 1.99...

        def hold(new: int, old: int) -> int:
            return old if abs(new - old) <= keep else new

        lv = [
            (hold(s, ps), hold(g, pg)) for (s, g), (ps, pg) in zip(lv, previous.levels, strict=True)
        ]
    return AgreedBandwidths(
        send=tuple(s * unit for s, _ in lv),
        recv=tuple(g * unit for _, g in lv),
        levels=tuple((int(s), int(g)) for s, g in lv),
        scale=levels,
        unit=unit,
        source=source,
        planes=tuple((b.up_mask, b.nplanes) for b in records),
        host_level=agree_host_rate(records, None if previous is None else previous.host_level),
    )


def changed(previous: AgreedBandwidths | None, new: AgreedBandwidths) -> bool:
    """Whether the plan may differ: another source, any rank on another step, or another
    host level."""
    return (
        previous is None
        or previous.source != new.source
        or previous.levels != new.levels
        or previous.host_level != new.host_level
    )


class Tracker:
    """One rank's bandwidth over time, for the communicator: feed it stats snapshots (with
    the time they were taken), read the record to exchange, and whether it changed in a
    way that needs a new agreement (a plane failed or came back). Pure: no clock, no I/O.
    """

    def __init__(
        self, *, nplanes: int | None = None, plane_rates: Sequence[float] | None = None
    ) -> None:
        self.nplanes = nplanes
        self.plane_rates = list(plane_rates) if plane_rates is not None else None
        self._prev: tuple[Mapping[str, Any], float] | None = None
        self._reported: RankBandwidth | None = None
        self.current: RankBandwidth | None = None

    def observe(self, stats: Mapping[str, Any], now: float) -> RankBandwidth:
        """This rank's bandwidth from the newest snapshot (measured against the previous
        one when there are no plane rates)."""
        prev, interval = None, None
        if self.plane_rates is None and self._prev is not None and now > self._prev[1]:
            prev, interval = self._prev[0], now - self._prev[1]
        self.current = rank_bandwidth(
            stats, nplanes=self.nplanes, plane_rates=self.plane_rates, prev=prev, interval=interval
        )
        self._prev = (stats, now)
        return self.current

    def needs_agreement(self) -> bool:
        """True until the current record is reported, and again once the set of usable
        planes differs from the one last reported (rates alone drift: the agreement's
        quantisation and hysteresis deal with them at the next periodic exchange)."""
        if self.current is None:
            return False
        return self._reported is None or self._reported.up_mask != self.current.up_mask

    def reported(self) -> bytes:
        """The record to exchange now; marks it reported."""
        if self.current is None:
            raise UsageError("Tracker.reported() before any observe(): nothing to report")
        self._reported = self.current
        return pack(self.current)
