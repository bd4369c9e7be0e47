"""Soak: a long verified stream over the 4-plane SRv6 fabric under constant faults.

1% random loss on every link and h0's plane-1 cable flapping every 500 ms, while h0
streams `--gib` GiB of tag-ordered SENDs to h2 (mrc.fabric.xfer --mode stream:
bounded memory, both ends hash the stream). Side by side, in the same run and on
the same fabric: the same stream with no faults (`--baseline-gib`), and the least
retransmission overhead the random loss alone forces (every transmission crosses
four lossy links). Reports goodput, retransmit overhead and whether the checksums
match, to results/soak.json, and goodput over time to results/soak.png. Root only.

    python benchmarks/soak.py [--gib 20] [--baseline-gib 4]

A run that stops making progress for `--stall` seconds is failed with both ends'
counters and path states in the JSON (`--hold` keeps the processes for a debugger).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import click
from common import RESULTS, record_load, save

from mrc.fabric.testing import RunningFabric, fabric_up
from mrc.telemetry import fetch

ROOT = Path(__file__).resolve().parent.parent
FABRIC = ROOT / "tests" / "fabrics" / "4host-4plane-fast.toml"
LINKS_PER_PATH = 4  # host-leaf, leaf-spine, spine-leaf, leaf-host: each may drop it
FLAP_S = 0.5


class Stalled(Exception):
    pass


def stream(
    fab: RunningFabric, gib: float, label: str, flap: bool, stall: float, hold: bool
) -> dict[str, Any]:
    """Streams `gib` GiB h0 -> h2; returns the client's result plus the server's hash,
    the progress timeline and the number of flaps."""
    size = int(gib * (1 << 30))
    tmp = tempfile.mkdtemp(prefix="mrc-soak-")
    socks = {"client": f"{tmp}/client.sock", "server": f"{tmp}/server.sock"}
    x = fab.xfer(
        "h0",
        "h2",
        ["--size", str(size), "--mode", "stream", "--timeout", "10"],
        client_args=["--progress", "0.01", "--stats-socket", socks["client"]],
        server_args=["--stats-socket", socks["server"]],
    )
    cli, srv = x.client, x.server
    stop = threading.Event()
    flaps = 0
    last = time.monotonic()
    stalled: dict[str, Any] = {}

    def flapper() -> None:
        nonlocal flaps
        down = False
        while not stop.wait(FLAP_S):
            state = "up" if down else "down"
            subprocess.run(["ip", "-n", fab.ns("h0"), "link", "set", "nic1", state], check=True)
            down = not down
            flaps += 1
        if down:
            subprocess.run(["ip", "-n", fab.ns("h0"), "link", "set", "nic1", "up"], check=True)

    def watchdog() -> None:
        # A stream that stops moving without an error is a bug: record both ends'
        # counters and path states, then end the run.
        while not stop.wait(1.0):
            if time.monotonic() - last < stall:
                continue
            for side, path in socks.items():
                try:
                    stalled[side] = fetch(path)["stats"]
                except OSError as e:
                    stalled[side] = {"error": str(e)}
            if hold:
                click.echo(f"stalled: client pid {cli.pid}, server pid {srv.pid}", err=True)
                stop.wait()
            cli.kill()
            return

    threads = [threading.Thread(target=watchdog, daemon=True)]
    if flap:
        threads.append(threading.Thread(target=flapper))
    for t in threads:
        t.start()
    result: dict[str, Any] = {}
    timeline: list[tuple[float, int]] = [(0.0, 0)]
    shown = 0.0
    assert cli.stdout is not None
    for line in cli.stdout:
        ev = json.loads(line)
        last = time.monotonic()
        if ev["event"] == "progress":
            timeline.append((ev["t"], ev["bytes"]))
            if ev["bytes"] / size >= shown + 0.05:
                shown = ev["bytes"] / size
                click.echo(f"{label}: {shown:4.0%}  {ev['t']:6.1f} s", err=True)
        else:
            result = ev
    stop.set()
    for t in threads[1:]:
        t.join()
    cli.wait()
    if stalled:
        x.kill()
        raise Stalled(json.dumps(stalled))
    if result.get("event") != "done":
        x.kill()
        raise SystemExit(f"{label} failed: {result}")
    server = x.server_result()
    timeline.append((result["elapsed"], result["bytes"]))
    return {**result, "server_sha256": server["sha256"], "timeline": timeline, "flaps": flaps}


def summary(r: dict[str, Any]) -> dict[str, Any]:
    st = r["stats"]
    data_pkts = st["tx_pkts"] - st["retx"]
    return {
        "gib": round(r["bytes"] / (1 << 30), 2),
        "elapsed_s": round(r["elapsed"], 1),
        "goodput_gbps": round(r["gbps"], 3),
        "retransmit_overhead": round(st["retx"] / max(1, data_pkts), 4),
        "checksums_equal": r["sha256"] == r["server_sha256"],
        "sha256": r["sha256"],
        "flaps": r["flaps"],
        "lost_rack": st["lost_rack"],
        "lost_rto": st["lost_rto"],
        "lost_flush": st["lost_flush"],
        "rnr_naks": st["rnr_naks"],
        "link_events": st["link_events"],
    }


def plot(runs: dict[str, dict[str, Any]], row: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for label, r in runs.items():
        tl = r["timeline"]
        ts = [(t0 + t1) / 2 for (t0, _), (t1, _) in zip(tl, tl[1:], strict=False)]
        rate = [
            (b1 - b0) * 8 / (t1 - t0) / 1e9 if t1 > t0 else 0.0
            for (t0, b0), (t1, b1) in zip(tl, tl[1:], strict=False)
        ]
        ax.plot(ts, rate, label=f"{label}: {r['gbps']:.2f} Gb/s mean", lw=1)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("goodput (Gb/s, per 1% of the stream)")
    ax.set_ylim(bottom=0)
    s = row["soak"]
    ax.set_title(
        f"{s['gib']} GiB, 1% loss on every link, a plane flapping every {FLAP_S} s: "
        f"{row['goodput_ratio']:.2f} of fault-free; retransmits {s['retransmit_overhead']:.1%}"
        f" (loss alone forces {row['retransmit_bound']:.1%})",
        fontsize=9,
    )
    ax.legend(loc="lower right")
    fig.tight_layout()
    out = RESULTS / "soak.png"
    fig.savefig(out, dpi=100)
    return out


@click.command()
@click.option("--gib", default=20.0, show_default=True, help="GiB to stream under faults.")
@click.option("--baseline-gib", default=4.0, show_default=True, help="GiB without faults.")
@click.option("--loss", default=1.0, show_default=True, help="Percent loss on every link.")
@click.option(
    "--stall", default=30.0, show_default=True, help="Seconds without progress that fail a run."
)
@click.option("--hold", is_flag=True, help="On a stall, keep both processes for a debugger.")
def main(gib: float, baseline_gib: float, loss: float, stall: float, hold: bool) -> None:
    record_load()
    runs: dict[str, dict[str, Any]] = {}
    try:
        with fabric_up(FABRIC, prefix="soak") as fab:
            if baseline_gib:
                runs["no faults"] = stream(fab, baseline_gib, "no faults", False, stall, hold)
            for link in fab.fabric.links:
                fab.loss(link.name, loss)
            runs["soak"] = stream(fab, gib, "soak", True, stall, hold)
    except Stalled as e:
        save("soak", {"benchmark": "soak", "stalled": json.loads(str(e)), "stall_s": stall})
        raise SystemExit(f"soak stalled (no progress for {stall} s): stats saved") from None
    q = 1 - (1 - loss / 100) ** LINKS_PER_PATH  # one transmission is lost
    row: dict[str, Any] = {
        "loss_percent_per_link": loss,
        "flap_period_s": FLAP_S,
        "soak": summary(runs["soak"]),
        # Each packet needs 1/(1-q) transmissions on average, whatever the transport.
        "retransmit_bound": round(q / (1 - q), 4),
    }
    if "no faults" in runs:
        row["no_faults"] = summary(runs["no faults"])
        row["goodput_ratio"] = round(runs["soak"]["gbps"] / runs["no faults"]["gbps"], 3)
    row["retransmit_ratio_to_bound"] = round(
        row["soak"]["retransmit_overhead"] / row["retransmit_bound"], 2
    )
    click.echo(json.dumps(row, indent=1))
    save(
        "soak",
        {
            "benchmark": "soak: 20 GiB stream under loss and a flapping plane",
            "result": row,
            "timelines": {k: r["timeline"] for k, r in runs.items()},
        },
    )
    if "goodput_ratio" in row:
        plot(runs, row)
    if not row["soak"]["checksums_equal"]:
        raise SystemExit("soak: checksums differ")


if __name__ == "__main__":
    main()
