"""What mrc-perf prints: perftest's header box and result tables, the per-path table,
the failover timeline, JSON, and the live progress line (stderr, rich)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any, TextIO

import click
from rich.console import Console
from rich.live import Live
from rich.text import Text

from mrc.perf.options import TESTS, PerfOptions
from mrc.perf.stats import BwResult, LatResult

RULE = "-" * 87

BW_HEADER = " #bytes     #iterations    BW peak[{u}]    BW average[{u}]   MsgRate[Mpps]"
LAT_HEADER = (
    " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]"
    "    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] "
)


def header_block(
    opts: PerfOptions,
    local_planes: Sequence[tuple[str, int]],
    peer_planes: Sequence[str],
    npaths: int,
    local_key: int | None,
    remote_key: int | None,
    mss: tuple[int, int, int | None] | None = None,
) -> str:
    """perftest's dashed box, adapted: connections instead of QPs, planes and paths.
    mss: (used, this side's --mss, the peer's) when known."""
    size = "2-8388608 (-a)" if opts.all_sizes else str(opts.size)
    lines = [
        RULE,
        f"                    {TESTS[opts.test]}",
        f" Number of qps   : {opts.qps:<14d}Transport type : MRC (multipath, UDP)",
        f" Connection type : RC{'':<12}Using SRQ      : OFF",
        f" TX depth        : {opts.tx_depth if opts.is_bw else 1}",
        f" Message size    : {size}[B]",
        f" Mss             : {_mss_text(opts.mss, mss)}",
        f" Planes          : {len(local_planes)}",
        f" Paths per conn  : {npaths}",
        " Data ex. method : mrc SEND (control tag)",
    ]
    if opts.duration:
        lines.append(f" Duration        : {opts.duration:g}[sec]")
    if opts.fail_plane or opts.loss:
        faults = [f"plane {p} down at {s:g}s" for p, s in opts.fail_plane]
        faults += [f"plane {p} loss {pct:g}%" for p, pct in opts.loss]
        lines.append(f" Faults (local)  : {', '.join(faults)}")
    lines.append(RULE)
    local = ",".join(hostport(a, p) for a, p in local_planes)
    lines.append(
        f" local address:  planes {local}"
        + (f"  Key {local_key:#018x}" if local_key is not None else "")
    )
    lines.append(
        f" remote address: planes {','.join(peer_planes)}"
        + (f"  Key {remote_key:#018x}" if remote_key is not None else "")
    )
    lines.append(RULE)
    return "\n".join(lines)


def hostport(addr: str, port: int) -> str:
    """addr:port, IPv6 in brackets ([fd00::1]:4791), so the port is not read as a group."""
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def _mss_text(mine: int, mss: tuple[int, int, int | None] | None) -> str:
    if mss is None or mss[2] is None or mss[2] == mine:
        return f"{mine if mss is None else mss[0]}[B]"
    used, _, peer = mss
    return f"{used}[B] (the smaller: this side --mss {mine}, peer {peer})"


def table_header(opts: PerfOptions) -> str:
    if opts.is_bw:
        head = BW_HEADER.format(u="Gb/sec" if opts.report_gbits else "MB/sec")
        return head + ("    CPU_Util[%]" if opts.cpu_util else "")
    return LAT_HEADER


def bw_row(r: BwResult, cpu_util: bool = False) -> str:
    """cpu_util: add the CPU_Util column (this side asked for it; the client measures)."""
    # perftest: " %-7lu    %-7lu          %-7.2lf            %-7.2lf\t\t   %-7.6lf"
    return (
        f" {r.bytes:<7d}    {r.iterations:<7d}          {r.bw_peak:<7.2f}"
        f"            {r.bw_avg:<7.2f}\t\t   {r.msg_rate_mpps:<7.6f}"
        + (f"\t    {r.cpu_util:<7.2f}" if cpu_util and r.cpu_util is not None else "")
    )


def lat_row(r: LatResult) -> str:
    return (
        f" {r.bytes:<7d} {r.iterations:<10d}   {r.t_min:<7.2f}        {r.t_max:<7.2f}"
        f"      {r.t_typical:<7.2f}            {r.t_avg:<7.2f}        {r.t_stdev:<7.2f}"
        f"         {r.p99:<7.2f}                {r.p999:<7.2f}"
    )


def fmt_count(n: float) -> str:
    return f"{n:,.0f}"


def paths_table(paths: list[dict[str, Any]], local_planes: Sequence[tuple[str, int]]) -> str:
    """One line per path of this side's connections; share = this path's part of the
    data bytes this side sent and received."""
    total = sum(p["tx_bytes"] + p["rx_bytes"] for p in paths) or 1
    lines = [
        " Paths (this side)",
        " conn path plane  local            dst              state     tx_pkts      rx_pkts"
        "      retx     lost   srtt[us]  share",
    ]
    for p in paths:
        local = local_planes[p["plane"]][0] if p["plane"] < len(local_planes) else "?"
        share = 100.0 * (p["tx_bytes"] + p["rx_bytes"]) / total
        lines.append(
            f" {p['conn']:<4d} {p['path']:<4d} {p['plane']:<5d}  {local:<16s} {p['dst']:<16s}"
            f" {p['state']:<8s} {p['tx_pkts']:>9d}  {p['rx_pkts']:>11d}  {p['retx']:>8d}"
            f" {p['lost']:>8d} {p['srtt_us']:>10.1f} {share:>5.1f}%"
        )
    lines.append(RULE)
    return "\n".join(lines)


def timeline_table(
    samples: list[tuple[float, list[int]]], nplanes: int, events: list[tuple[float, str]]
) -> str:
    """Gb/s carried by each local plane in each interval between samples (bytes this side
    sent plus received), with fault events marked where they happened."""
    if len(samples) < 2:
        return ""
    head = " time[s]  " + "".join(f"plane{i:<2d}  " for i in range(nplanes)) + "  total[Gb/s]"
    lines = [" Per-plane throughput [Gb/s] over the run", head]
    pending = sorted(events)
    for (t0, b0), (t1, b1) in zip(samples, samples[1:], strict=False):
        dt = t1 - t0
        if dt < 0.05:  # the closing sample right after the last periodic one
            continue
        rates = [(b1[i] - b0[i]) * 8 / dt / 1e9 for i in range(nplanes)]
        cells = "".join(f"{r:>7.2f}  " for r in rates)
        note = ""
        while pending and pending[0][0] <= t1:
            note += f"  <- {pending.pop(0)[1]}"
        lines.append(f" {t1:>6.1f}  {cells}  {sum(rates):>9.2f}{note}")
    lines.append(RULE)
    return "\n".join(lines)


def failover_summary(
    paths: list[dict[str, Any]],
    fail_plane: Sequence[tuple[int, float]],
    failed_planes: Sequence[int],
    local_planes: Sequence[tuple[str, int]],
    verified: bool | None = None,
) -> str:
    """Plain words for what a failed plane did to the run. fail_plane: what --fail-plane
    asked for; failed_planes: the planes actually taken down before the run ended."""
    out = [
        f" Plane {plane} was not taken down: the run ended before {secs:g} s (--fail-plane "
        f"{plane}@{secs:g}); give a longer run (-n or -D) or an earlier time."
        for plane, secs in fail_plane
        if plane not in failed_planes
    ]
    for plane in failed_planes:
        mine = [p for p in paths if p["plane"] == plane]
        states = ", ".join(sorted({p["state"] for p in mine})) or "no paths"
        others = sorted({p["plane"] for p in paths if p["plane"] != plane and p["state"] == "good"})
        retx = sum(p["retx"] for p in paths)
        addr = local_planes[plane][0] if plane < len(local_planes) else "?"
        out.append(
            f" Plane {plane} ({addr}) was taken down during the run: its path is now {states};"
            f" traffic continued on plane(s) {', '.join(map(str, others)) or 'none'}"
            f" ({retx} packets retransmitted on other paths)."
        )
    if verified:
        out.append(" Every byte arrived intact (--verify PASS).")
    elif verified is False:
        out.append(" Data differed at the two ends (--verify FAIL).")
    return "\n".join(out)


def out_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An output file's option, checked before the run, so a bad path does not lose a
    finished run's results."""
    if value is None:
        return None
    parent = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(parent):
        raise click.BadParameter(f"{value}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(value) and not os.access(value, os.W_OK)):
        raise click.BadParameter(f"{value}: not writable")
    return value


def write_json(data: dict[str, Any], path: str | None, out: TextIO) -> None:
    text = json.dumps(data, indent=2)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    else:
        out.write(text + "\n")


class ProgressLine:
    """A live "elapsed, Gb/s" line on stderr, only on a terminal, only once a run has
    lasted two seconds (short runs stay clean), never with --quiet."""

    DELAY = 2.0

    def __init__(self, enabled: bool, label: str) -> None:
        self.console = Console(stderr=True)
        self.enabled = enabled and self.console.is_terminal
        self.label = label
        self.live: Live | None = None
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.last_bytes = 0
        self.last_t = self.t0

    def update(self, nbytes: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.last < 0.25 or now - self.t0 < self.DELAY:
            return
        gbps = (nbytes - self.last_bytes) * 8 / max(1e-9, now - self.last_t) / 1e9
        self.last, self.last_bytes, self.last_t = now, nbytes, now
        text = Text(f" {self.label}: {now - self.t0:6.1f} s  {gbps:8.2f} Gb/s", style="bold")
        if self.live is None:
            self.live = Live(text, console=self.console, transient=True, auto_refresh=False)
            self.live.start()
        self.live.update(text, refresh=True)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
