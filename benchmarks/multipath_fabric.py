"""Multipath WRITE goodput on the shaped SRv6 namespace fabric, and failover.

Runs as root (namespaces). Fabrics: routing/4host-4plane-1g.toml (4 planes x 1 Gbit/s)
and routing/4host-4plane-unequal.toml (2, 1, 1, 0.5 Gbit/s). h0 writes to h2 (different
leaves: every packet crosses leaf, spine, leaf, with SRv6 End at the spine).

1. Aggregate goodput / sum of plane rates: all planes; plane 1 failed; unequal planes.
2. Failover timeline: goodput in 1 ms bins (64 KiB writes) while plane 1 fails
   mid-transfer; the gap is the longest stretch below 50% of the remaining capacity.
3. Side by side: iperf3 TCP with one stream per plane, all at once (the peer on the
   same fabric: mrc / TCP); iperf3 TCP over one plane (plane 1's addresses), and over
   plane 1 while it fails: TCP is bound to the plane and stalls.

    python benchmarks/multipath_fabric.py [--size-mib 1024]

Writes results/multipath_fabric.json and results/multipath_fabric.png.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import click
import numpy as np
from common import RESULTS, ensure_tool, iperf3_tcp_streams, record_load, save

from mrc.fabric.testing import fabric_up
from mrc.routing import host_planes

ROOT = Path(__file__).resolve().parent.parent
FAB_1G = ROOT / "routing" / "4host-4plane-1g.toml"
FAB_UNEQUAL = ROOT / "routing" / "4host-4plane-unequal.toml"
SRC, DST = "h0", "h2"


def transfer(
    fab: Any, size: int, chunk: int, depth: int, on_progress: Any = None
) -> dict[str, Any]:
    x = fab.xfer(
        SRC,
        DST,
        ["--size", str(size), "--chunk", str(chunk)],
        client_args=["--depth", str(depth), "--timeline", "--progress", "0.01"],
    )
    cli = x.client
    result: dict[str, Any] = {}
    for line in cli.stdout:
        ev = json.loads(line)
        if ev["event"] == "progress":
            if on_progress:
                on_progress(ev["bytes"] / size)
        else:
            result = ev
    cli.wait()
    if result.get("event") != "done":
        x.kill()
        raise SystemExit(f"transfer failed: {result}")
    server = x.server_result()
    result["verified"] = result["sha256"] == server["sha256"]
    return result


def plane_shares(result: dict[str, Any]) -> list[float]:
    by_plane: dict[int, int] = {}
    for p in result["stats"]["paths"]:
        by_plane[p["plane"]] = by_plane.get(p["plane"], 0) + p["tx_bytes"]
    total = sum(by_plane.values()) or 1
    return [round(by_plane.get(i, 0) / total, 3) for i in range(4)]


def goodput_case(
    name: str, fabric: Path, capacity_gbps: float, size: int, failed: list[str] = ()
) -> dict[str, Any]:
    with fabric_up(fabric, prefix="bmp") as fab:
        for el in failed:
            fab.fail(el)
        r = transfer(fab, size, 4 << 20, 16)
    row = {
        "case": name,
        "capacity_gbps": capacity_gbps,
        "goodput_gbps": round(r["gbps"], 3),
        "ratio": round(r["gbps"] / capacity_gbps, 3),
        "verified": r["verified"],
        "retx": r["stats"]["retx"],
        "plane_shares": plane_shares(r),
    }
    click.echo(
        f"{name:28s} {r['gbps']:.3f} Gb/s of {capacity_gbps} -> {row['ratio']:.3f}"
        f"  shares {row['plane_shares']}  verified={r['verified']}"
    )
    return row


def longest_low_run(low: np.ndarray, start: int, stop: int) -> int:
    """Longest run of True in low[i] for runs starting in [start, stop)."""
    best, i = 0, start
    while i < stop:
        if low[i]:
            j = i
            while j < len(low) and low[j]:
                j += 1
            best = max(best, j - i)
            i = j
        else:
            i += 1
    return best


def failover_case(size: int, side: str) -> dict[str, Any]:
    """Plane 1's cable is pulled (`ip link set nic1 down`: both veth ends lose carrier at
    once) when 40% is done: the sender's own cable (side "local": netlink tells mrc) or
    the receiver's (side "remote": mrc finds out from silence). Goodput: bytes
    acknowledged, sampled every millisecond inside the client, in 1 ms bins."""
    host = SRC if side == "local" else DST
    fail_at: dict[str, float] = {}
    with fabric_up(FAB_1G, prefix="bmf") as fab:

        def on_progress(frac: float) -> None:
            if frac >= 0.4 and "t" not in fail_at:
                fail_at["t"] = time.monotonic()
                subprocess.run(
                    ["ip", "-n", fab.ns(host), "link", "set", "nic1", "down"], check=True
                )
                fail_at["done"] = time.monotonic()

        r = transfer(fab, size, 1 << 20, 16, on_progress)
    t_fail = fail_at["t"] - r["t0"]
    ts, acked = np.asarray(r["acked"], dtype=float).T
    edges = np.arange(0.0, ts[-1], 0.001)
    bins = np.diff(np.interp(edges, ts, acked)) * 8 / 1e-3 / 1e9  # Gb/s per 1 ms bin
    fail_bin = int(t_fail * 1000)
    remaining = 3.0
    low = bins < 0.5 * remaining
    gap = longest_low_run(low, fail_bin, min(len(bins), fail_bin + 50))
    noise = longest_low_run(low, max(0, fail_bin - 500), fail_bin)
    before = bins[max(0, fail_bin - 500) : fail_bin]
    after = bins[fail_bin + 50 : fail_bin + 550]
    row = {
        "side": side,
        "fail_at_s": round(t_fail, 4),
        "fail_command_ms": round((fail_at["done"] - fail_at["t"]) * 1000, 2),
        "gap_ms": gap,
        "noise_gap_ms_before_failure": noise,
        "goodput_before_gbps": round(float(before.mean()), 3),
        "goodput_after_gbps": round(float(after.mean()), 3),
        "verified": r["verified"],
        "lost_rto": r["stats"]["lost_rto"],
        "lost_flush": r["stats"]["lost_flush"],
        "link_events": r["stats"]["link_events"],
        "bins_gbps": [round(float(b), 3) for b in bins],
    }
    click.echo(
        f"failover ({side} cable): gap {gap} ms below 50% of 3 Gb/s "
        f"(longest before the failure: {noise} ms);"
        f" {row['goodput_before_gbps']} -> {row['goodput_after_gbps']} Gb/s"
    )
    return row


INTERVAL = re.compile(r"\[\s*\d+\]\s+([\d.]+)-([\d.]+)\s+sec\s+\S+ \S+\s+([\d.]+) Mbits/sec")


def iperf3_tcp(seconds: float, fail_after: float | None) -> dict[str, Any]:
    """iperf3 TCP between plane 1's addresses of h0 and h2 (so it can only use plane 1);
    with fail_after, h0's plane-1 cable is pulled then. TCP stalls and iperf3 never
    finishes on its own: it is stopped `seconds` + 2 s after the start."""
    iperf = ensure_tool("iperf3", "iperf3")
    series: list[tuple[float, float]] = []
    with fabric_up(FAB_1G, prefix="bmi") as fab:
        src_addr = host_planes(fab.fabric, SRC)[1]
        dst_addr = host_planes(fab.fabric, DST)[1]
        srv = fab.popen(
            DST,
            [iperf, "-s", "-1", "-B", dst_addr],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        from mrc.fabric.testing import wait_tcp_listening

        wait_tcp_listening(fab, DST, 5201)
        cli = fab.popen(
            SRC,
            [
                iperf,
                "-c",
                dst_addr,
                "-B",
                src_addr,
                "-t",
                str(seconds),
                "-i",
                "0.1",
                "-f",
                "m",
                "--forceflush",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        t0 = time.monotonic()
        timers = [threading.Timer(seconds + 2, cli.kill)]
        if fail_after is not None:
            cmd = ["ip", "-n", fab.ns(SRC), "link", "set", "nic1", "down"]
            timers.append(threading.Timer(fail_after, subprocess.run, [cmd]))
        for tm in timers:
            tm.start()
        assert cli.stdout is not None
        for line in cli.stdout:
            m = INTERVAL.search(line)
            if m and "sender" not in line and "receiver" not in line:
                series.append((float(m.group(1)), float(m.group(3)) / 1000))
        cli.wait()
        for tm in timers:
            tm.cancel()
        srv.kill()
        srv.wait()
    elapsed = time.monotonic() - t0
    avg = float(np.mean([g for _, g in series])) if series else 0.0
    after = [g for t, g in series if fail_after is not None and t >= fail_after + 0.1]
    when = f" (cable pulled at {fail_after:.1f} s)" if fail_after else ""
    click.echo(
        f"iperf3 TCP on plane 1{when}: {avg:.3f} Gb/s average over {len(series)} "
        f"intervals"
        + (f", {np.mean(after) if after else 0:.3f} Gb/s after the pull" if fail_after else "")
    )
    return {
        "avg_gbps": round(avg, 3),
        "series": series,
        "fail_after_s": fail_after,
        "gbps_after_failure": round(float(np.mean(after)), 3) if after else 0.0,
        "elapsed_s": round(elapsed, 2),
    }


def iperf3_tcp_all_planes(seconds: float) -> dict[str, Any]:
    """The peer on the same shaped fabric: one iperf3 TCP stream per plane (each pair
    bound to that plane's addresses of SRC and DST), all at once; their sum."""
    with fabric_up(FAB_1G, prefix="bmt") as fab:
        nplanes = len(host_planes(fab.fabric, SRC))
        streams = iperf3_tcp_streams(fab, [(SRC, DST, i) for i in range(nplanes)], seconds)
    per_plane = [s["gbps"] for s in streams]
    total = sum(per_plane)
    click.echo(
        f"iperf3 TCP, one stream per plane: {total:.3f} Gb/s "
        f"({', '.join(f'{g:.3f}' for g in per_plane)})"
    )
    return {"per_plane_gbps": [round(g, 3) for g in per_plane], "total_gbps": round(total, 3)}


@click.command()
@click.option("--size-mib", default=1024, show_default=True, help="Bytes per goodput run.")
def main(size_mib: int) -> None:
    record_load()
    size = size_mib << 20
    rows = [
        goodput_case("4 x 1 Gb/s", FAB_1G, 4.0, size),
        goodput_case("4 x 1 Gb/s, plane 1 failed", FAB_1G, 3.0, size, ["plane1"]),
        goodput_case("2 + 1 + 1 + 0.5 Gb/s", FAB_UNEQUAL, 4.5, size),
    ]
    failover = [failover_case(size, "local"), failover_case(size, "remote")]
    tcp = iperf3_tcp(3.0, None)
    tcp_fail = iperf3_tcp(3.0, 1.0)
    tcp_all = iperf3_tcp_all_planes(3.0)
    rows[0]["iperf3_tcp_gbps"] = tcp_all["total_gbps"]
    rows[0]["ratio_to_tcp"] = round(rows[0]["goodput_gbps"] / tcp_all["total_gbps"], 3)
    click.echo(f"mrc / iperf3 TCP on 4 x 1 Gb/s: {rows[0]['ratio_to_tcp']:.3f}")
    out = save(
        "multipath_fabric",
        {
            "benchmark": "multipath WRITE goodput and failover on the SRv6 namespace fabric",
            "targets": {"ratio": 0.95, "ratio_unequal": 0.93, "gap_ms": 10},
            "goodput": rows,
            "failover": failover,
            "iperf3_tcp_one_plane": tcp,
            "iperf3_tcp_plane_fails": tcp_fail,
            "iperf3_tcp_all_planes": tcp_all,
        },
    )
    plot(rows, failover, tcp_all, tcp_fail)
    click.echo(f"wrote {out}")


def plot(rows: list[dict], fos: list[dict], tcp_all: dict, tcp_fail: dict) -> None:
    fo = fos[-1]  # the remote-cable case: the harder one
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.5))
    x = np.arange(len(rows))
    a1.bar(
        x - 0.2, [r["capacity_gbps"] for r in rows], 0.4, label="sum of plane rates", color="#bbb"
    )
    a1.bar(x + 0.2, [r["goodput_gbps"] for r in rows], 0.4, label="mrc WRITE goodput")
    a1.bar([len(rows) + 0.2], [tcp_all["total_gbps"]], 0.4, label="iperf3 TCP, a stream per plane")
    a1.bar([len(rows) - 0.2], [4.0], 0.4, color="#bbb")
    for xi, r in zip(x, rows, strict=True):
        a1.text(xi + 0.2, r["goodput_gbps"] + 0.05, f"{r['ratio']:.2f}", ha="center")
    a1.set_xticks(
        list(x) + [len(rows)], [r["case"] for r in rows] + ["4 x 1 Gb/s, TCP"], fontsize=8
    )
    a1.set_ylabel("Gbit/s")
    a1.legend(fontsize=8)
    a1.set_title("Goodput on the shaped fabric")
    bins = np.asarray(fo["bins_gbps"])
    t = np.arange(len(bins)) / 1000
    a2.plot(t, bins, lw=0.6, label="mrc, 1 ms bins")
    a2.axvline(fo["fail_at_s"], color="red", ls="--", label="plane 1 fails")
    a2.axhline(1.5, color="gray", ls=":", label="50% of remaining 3 Gb/s")
    if tcp_fail["series"]:
        ts, gs = zip(*tcp_fail["series"], strict=True)
        shift = fo["fail_at_s"] - tcp_fail["fail_after_s"]
        a2.step(
            np.asarray(ts) + shift,
            gs,
            where="post",
            color="green",
            label="iperf3 TCP on plane 1 (aligned)",
        )
    a2.set_xlabel("seconds")
    a2.set_ylabel("Gbit/s")
    a2.set_title(f"Failover, receiver's plane-1 cable pulled: gap {fo['gap_ms']} ms")
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "multipath_fabric.png", dpi=100)


if __name__ == "__main__":
    main()
