"""Four transfers at once in a ring on the shaped SRv6 fabric, mrc vs iperf3 TCP.

The traffic of a ring AllReduce: on routing/4host-4plane-1g.toml (4 planes x 1 Gbit/s
per host) h0 -> h1, h1 -> h2, h2 -> h3 and h3 -> h0 run together, so every host sends
4 Gbit/s and receives 4 Gbit/s (16 Gbit/s of line in all). In one fabric, one after the
other:

1. mrc: `mrc-perf write_bw --verify` from each host to the next (all four at once);
   each route socket's SRH comes from a kernel seg6 route (src_c/seg6route.c). With
   --levers also with the SRH as the socket's sticky header instead (MRC_SRH=socket:
   the kernel cuts every GSO batch into datagrams at the sender), with UDP GRO off
   (MRC_GRO=0), with UDP GSO off (MRC_GSO=0), and over plain IP paths with GRO on and
   off (plane k -> plane k, no SRH; no spine choice, so a bound, not a configuration
   to run).
2. iperf3 TCP with one stream per plane per hop (16 streams at once).

For each: Gbit/s per hop and in all, the share of line, mrc / TCP, and CPU per byte:
CPU-seconds per GB moved by the whole machine (/proc/stat busy time, which includes the
kernel's forwarding through the switch namespaces; on a machine shared with other work
it is an upper bound) over the window in which all four hops move data (mrc: the
intersection of the clients' measured loops, `mrc-perf --cpu_util`; iperf3: from 1 s
after the last client started to 0.2 s before the first one ends), and, over the whole
run with the processes' start and exit, of the processes (getrusage of the children)
and of the machine.

    python benchmarks/ring_fabric.py [-D 8] [-s 1048576] [--levers]

Writes results/ring_fabric.json and results/ring_fabric.png.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
from common import RESULTS, CpuMeter, CpuTrace, iperf3_tcp_streams, record_load, save

from mrc.fabric.testing import fabric_up
from mrc.routing import host_planes

ROOT = Path(__file__).resolve().parent.parent
FABRIC = ROOT / "routing" / "4host-4plane-1g.toml"
HOSTS = ["h0", "h1", "h2", "h3"]
RING = [(HOSTS[i], HOSTS[(i + 1) % len(HOSTS)]) for i in range(len(HOSTS))]
PLANES = 4
LINE_GBPS = 4.0  # per host and direction
PERF = [sys.executable, "-m", "mrc.perf.cli", "write_bw"]

# (name, environment): what each mrc run turns off.
LEVERS = [
    ("mrc", {}),
    ("mrc, sticky SRH", {"MRC_SRH": "socket"}),
    ("mrc, no UDP GRO", {"MRC_GRO": "0"}),
    ("mrc, no UDP GSO", {"MRC_GSO": "0"}),
]


def perf_json(out: str) -> dict[str, Any]:
    """The JSON mrc-perf prints after its table (--out_json)."""
    return json.loads(out[out.index("\n{") + 1 :])


def mrc_ring(
    fab: Any, seconds: float, size: int, env: dict[str, str], plain: bool = False
) -> dict[str, Any]:
    """One mrc-perf server per host, then the four clients at once; their results.
    plain: each host's planes as plain IP paths (plane k -> peer plane k over the
    fabric's IPv6 routes, no SRH, no choice of spine) instead of the fabric's SRv6 paths."""
    opts = ["-s", str(size), "-D", str(seconds)]
    opts += ["--report_gbits", "--out_json", "--quiet", "--verify", "--cpu_util"]
    penv = {**os.environ, **env}

    def where(host: str) -> list[str]:
        if plain:
            return ["--planes", ",".join(host_planes(fab.fabric, host))]
        return ["--fabric", str(FABRIC), "--host", host]

    def peer(host: str) -> str:
        return host_planes(fab.fabric, host)[0] if plain else host

    with CpuTrace() as trace, CpuMeter() as cpu:
        servers, ports = {}, {}
        for _, dst in RING:
            p = fab.popen(
                dst, [*PERF, *opts, *where(dst), "-p", "0"], stdout=subprocess.PIPE, env=penv
            )
            assert p.stdout is not None
            for line in p.stdout:
                m = re.search(r"listening on \S+ port (\d+)", line)
                if m:
                    ports[dst] = int(m.group(1))
                    break
            else:
                raise SystemExit(f"mrc-perf server on {dst} never listened")
            servers[dst] = p
        clients = {
            (src, dst): fab.popen(
                src,
                [*PERF, *opts, *where(src), "-p", str(ports[dst]), peer(dst)],
                stdout=subprocess.PIPE,
                env=penv,
            )
            for src, dst in RING
        }
        outs = {hop: c.communicate(timeout=seconds + 60)[0] for hop, c in clients.items()}
        souts = {dst: s.communicate(timeout=30)[0] for dst, s in servers.items()}
    results = {}
    for (src, dst), c in clients.items():
        if c.returncode != 0:
            raise SystemExit(
                f"mrc-perf {src} -> {dst} failed ({c.returncode}):\n{outs[src, dst]}\n"
                f"server:\n{souts[dst]}"
            )
        results[src, dst] = perf_json(outs[src, dst])
    hops = []
    for (src, dst), r in results.items():
        (row,) = r["results"]
        hops.append(
            {
                "src": src,
                "dst": dst,
                "gbps": row["bw_avg"],
                "gbps_peak": row["bw_peak"],
                "bytes": row["bytes"] * row["iterations"],
                "verified": r["verify"] == "PASS",
                "retx": sum(p["retx"] for p in r["paths"]),
                "cpu_window": row["cpu_window"],
            }
        )
    t0 = max(h["cpu_window"][0] for h in hops)
    t1 = min(h["cpu_window"][1] for h in hops)
    return {"hops": hops, "cpu": cpu, "window": trace.window(t0, t1)}


def tcp_ring(fab: Any, seconds: float) -> dict[str, Any]:
    """iperf3 TCP: a stream per plane on every hop of the ring, all 16 at once."""
    streams = [(src, dst, plane) for src, dst in RING for plane in range(PLANES)]
    with CpuTrace() as trace, CpuMeter() as cpu:
        per_stream = iperf3_tcp_streams(fab, streams, seconds)
    t0 = max(s["t_start"] for s in per_stream) + 1.0
    window = trace.window(t0, min(s["t_start"] for s in per_stream) + seconds - 0.2)
    hops = []
    for src, dst in RING:
        mine = [s for s in per_stream if (s["src"], s["dst"]) == (src, dst)]
        hops.append(
            {
                "src": src,
                "dst": dst,
                "gbps": sum(s["gbps"] for s in mine),
                "bytes": sum(s["bytes"] for s in mine),
                "per_plane_gbps": [round(s["gbps"], 3) for s in mine],
            }
        )
    return {"hops": hops, "cpu": cpu, "window": window}


def summarise(name: str, run: dict[str, Any]) -> dict[str, Any]:
    hops = run["hops"]
    total = sum(h["gbps"] for h in hops)
    gb = sum(h["bytes"] for h in hops) / 1e9
    row = {
        "case": name,
        "total_gbps": round(total, 3),
        "line_gbps": LINE_GBPS * len(RING),
        "ratio_of_line": round(total / (LINE_GBPS * len(RING)), 3),
        "gb_moved": round(gb, 3),
        "hops": hops,
        **run["cpu"].result(gb),
    }
    w = run["window"]
    if w is None or w["seconds"] <= 0:
        raise SystemExit(f"{name}: the hops' measured windows do not overlap (runs too short?)")
    # GB moved in the window, at each hop's average rate.
    row["window"] = {
        "seconds": round(w["seconds"], 3),
        "machine_busy_cpu_s": round(w["cpu_s"], 3),
        "machine_busy_cpu_s_per_gb": round(w["cpu_s"] / (total / 8 * w["seconds"]), 3),
        "machine_steal": round(w["steal"], 3),
    }
    per_hop = ", ".join(f"{h['gbps']:.2f}" for h in hops)
    click.echo(
        f"{name:18s} {total:6.2f} of {row['line_gbps']:.0f} Gb/s ({row['ratio_of_line']:.3f})"
        f"  per hop {per_hop}  CPU-s/GB (machine) {row['window']['machine_busy_cpu_s_per_gb']:.2f}"
        f" while all hops ran ({w['seconds']:.1f} s, stolen {w['steal']:.0%});"
        f" whole run: processes {row['proc_cpu_s_per_gb']:.2f},"
        f" machine {row['machine_busy_cpu_s_per_gb']:.2f} (idle {row['machine_idle']:.0%})"
    )
    return row


@click.command()
@click.option("-D", "--duration", default=8.0, show_default=True, help="Seconds per run.")
@click.option("-s", "--size", default=1 << 20, show_default=True, help="mrc WRITE size.")
@click.option(
    "--levers",
    is_flag=True,
    help="Also run mrc with a sticky SRH, with UDP GRO off, UDP GSO off, and over plain IP paths.",
)
@click.option("--note", default="", help="Stored with the results (e.g. 'loaded machine: ...').")
def main(duration: float, size: int, levers: bool, note: str) -> None:
    record_load()
    rows = []
    with fabric_up(FABRIC, prefix="bmr") as fab:
        for name, env in LEVERS if levers else LEVERS[:1]:
            rows.append(summarise(name, mrc_ring(fab, duration, size, env)))
        if levers:  # where a GSO batch stays whole, GRO has something to coalesce
            for name, env in [("mrc, plain IP paths", {}), ("plain, no UDP GRO", {"MRC_GRO": "0"})]:
                rows.append(summarise(name, mrc_ring(fab, duration, size, env, plain=True)))
        tcp = summarise("iperf3 TCP", tcp_ring(fab, duration))
    for r in rows:
        r["ratio_to_tcp"] = round(r["total_gbps"] / tcp["total_gbps"], 3)
        click.echo(f"{r['case']} / iperf3 TCP: {r['ratio_to_tcp']:.3f}")
    out = save(
        "ring_fabric",
        {
            "benchmark": "four-flow ring on 4host-4plane-1g: mrc write_bw vs iperf3 TCP",
            "targets": {"ratio_of_line": 0.9, "ratio_to_tcp": 0.92},
            "duration_s": duration,
            "size": size,
            "note": note,
            "mrc": rows,
            "iperf3_tcp": tcp,
        },
    )
    plot([*rows, tcp], note)
    click.echo(f"wrote {out}")


def plot(rows: list[dict[str, Any]], note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = np.arange(len(rows))
    a1.bar(x, [r["total_gbps"] for r in rows], 0.6)
    a1.axhline(rows[0]["line_gbps"], color="gray", ls=":", label="line (4 x 4 Gb/s)")
    for xi, r in zip(x, rows, strict=True):
        a1.text(xi, r["total_gbps"] + 0.2, f"{r['ratio_of_line']:.2f}", ha="center")
    a1.set_xticks(x, [r["case"] for r in rows], fontsize=8)
    a1.set_ylabel("Gbit/s, four hops together")
    a1.set_title("Ring h0->h1->h2->h3->h0")
    a1.legend(fontsize=8)
    w = 0.4
    a2.bar(
        x - w / 2,
        [r["window"]["machine_busy_cpu_s_per_gb"] for r in rows],
        w,
        label="machine, while all four hops ran",
    )
    a2.bar(
        x + w / 2,
        [r["machine_busy_cpu_s_per_gb"] for r in rows],
        w,
        label="machine, whole run (with the processes' start and exit)",
    )
    a2.set_xticks(x, [r["case"] for r in rows], fontsize=8)
    a2.set_ylabel("CPU-seconds per GB moved")
    a2.set_title("CPU per byte (/proc/stat busy, softirq forwarding included)")
    a2.legend(fontsize=8)
    if note:
        fig.suptitle(note, fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "ring_fabric.png", dpi=100)


if __name__ == "__main__":
    main()
