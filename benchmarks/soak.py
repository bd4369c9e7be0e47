"""Soak: a long verified stream over the 4-plane SRv6 fabric under constant faults.

1% random loss on every link and h0's plane-1 cable flapping every 500 ms, while h0
streams `--gib` GiB of tag-ordered SENDs to h2 (tools/fabric_xfer.py --mode stream:
bounded memory, both ends hash the stream). Reports goodput, retransmit overhead and
whether the checksums match, to results/soak.json. Root only.

    python benchmarks/soak.py [--gib 20]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import click
from common import save

from mrc.fabric.testing import fabric_up
from mrc.telemetry import fetch

ROOT = Path(__file__).resolve().parent.parent
FABRIC = ROOT / "tests" / "fabrics" / "4host-4plane-fast.toml"
XFER = str(ROOT / "tools" / "fabric_xfer.py")


@click.command()
@click.option("--gib", default=20, show_default=True, help="GiB to stream.")
@click.option("--loss", default=1.0, show_default=True, help="Percent loss on every link.")
@click.option(
    "--stall", default=30.0, show_default=True, help="Seconds without progress that fail the run."
)
@click.option("--hold", is_flag=True, help="On a stall, keep both processes for a debugger.")
def main(gib: int, loss: float, stall: float, hold: bool) -> None:
    size = gib << 30
    py = sys.executable
    tmp = tempfile.mkdtemp(prefix="mrc-soak-")
    socks = {"client": f"{tmp}/client.sock", "server": f"{tmp}/server.sock"}
    args = ["--fabric", str(FABRIC), "--size", str(size), "--mode", "stream", "--timeout", "10"]
    stop = threading.Event()
    flaps = 0
    last = time.monotonic()
    stalled: dict = {}
    with fabric_up(FABRIC, prefix="soak") as fab:
        for link in fab.fabric.links:
            fab.loss(link.name, loss)
        srv = fab.popen(
            "h2",
            [py, XFER, "server", "--host", "h2", "--stats-socket", socks["server"], *args],
            stdout=subprocess.PIPE,
        )
        port = json.loads(srv.stdout.readline())["port"]
        cli = fab.popen(
            "h0",
            [
                py,
                XFER,
                "client",
                "--host",
                "h0",
                "--peer",
                "h2",
                "--port",
                str(port),
                "--progress",
                "0.01",
                "--stats-socket",
                socks["client"],
                *args,
            ],
            stdout=subprocess.PIPE,
        )

        def flap() -> None:
            nonlocal flaps
            down = False
            while not stop.wait(0.5):  # the flap period
                state = "up" if down else "down"
                subprocess.run(["ip", "-n", fab.ns("h0"), "link", "set", "nic1", state])
                down = not down
                flaps += 1

        def watchdog() -> None:
            # A soak that stops moving without an error is the bug this run hunts:
            # record both ends' counters and path states, then end the run.
            while not stop.wait(1.0):
                if time.monotonic() - last < stall:
                    continue
                for side, path in socks.items():
                    try:
                        stalled[side] = fetch(path)["stats"]
                    except OSError as e:
                        stalled[side] = {"error": str(e)}
                click.echo(json.dumps(stalled, indent=1), err=True)
                if hold:
                    click.echo(f"stalled: client pid {cli.pid}, server pid {srv.pid}", err=True)
                    stop.wait()
                cli.kill()
                return

        flapper = threading.Thread(target=flap)
        flapper.start()
        dog = threading.Thread(target=watchdog, daemon=True)
        dog.start()
        result: dict = {}
        shown = 0.0
        for line in cli.stdout:
            ev = json.loads(line)
            last = time.monotonic()
            if ev["event"] == "progress":
                if ev["bytes"] / size >= shown + 0.05:
                    shown = ev["bytes"] / size
                    click.echo(f"{shown:5.0%}  {ev['t']:7.1f} s", err=True)
            else:
                result = ev
        stop.set()
        flapper.join()
        if stalled:
            srv.kill()
            save("soak", {"benchmark": "soak", "stalled": stalled, "stall_s": stall})
            raise SystemExit(f"soak stalled (no progress for {stall} s): both ends' stats saved")
        cli.wait()
        server = json.loads(srv.stdout.readline()) if result.get("event") == "done" else {}
        srv.wait(timeout=60)
    if result.get("event") != "done":
        raise SystemExit(f"soak failed: {result}")
    st = result["stats"]
    data_pkts = st["tx_pkts"] - st["retx"]
    row = {
        "gib": gib,
        "loss_percent_per_link": loss,
        "flap_period_s": 0.5,
        "flaps": flaps,
        "elapsed_s": round(result["elapsed"], 1),
        "goodput_gbps": round(result["gbps"], 3),
        "retransmit_overhead": round(st["retx"] / max(1, data_pkts), 4),
        "checksums_equal": result["sha256"] == server["sha256"],
        "sha256": result["sha256"],
        "lost_rack": st["lost_rack"],
        "lost_rto": st["lost_rto"],
        "link_events": st["link_events"],
    }
    click.echo(json.dumps(row, indent=1))
    save("soak", {"benchmark": "soak: stream under loss and a flapping plane", "result": row})


if __name__ == "__main__":
    main()
