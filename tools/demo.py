"""`make demo`: a multipath transfer that survives a failed plane.

As root (with iproute2 and nftables): a real fabric of network namespaces
(routing/4host-4plane-demo.toml: 4 hosts, 4 planes, 2 spines per plane, SRv6
End SIDs on the spines), one process per host, and plane 1 failed with
`ip link set down` in the middle of a 1 GiB WRITE. Otherwise: two endpoints on
four loopback planes in this process, with plane 1 cut by fault injection.
Either way the data is hashed at both ends and the per-path table shows which
paths carried it and which failed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TransferSpeedColumn  # noqa: E402
from rich.table import Table  # noqa: E402

import mrc  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
console = Console()
SIZE = 1 << 30
FAIL_AT = 0.3


def path_table(stats: dict[str, Any], title: str) -> Table:
    t = Table(title=title)
    for col in (
        "path",
        "plane",
        "via",
        "state",
        "packets",
        "retx",
        "lost",
        "RTT us",
        "share",
    ):
        t.add_column(col, justify="right" if col not in ("state", "via") else "left")
    total = sum(p["tx_bytes"] for p in stats["paths"]) or 1
    for p in stats["paths"]:
        style = {"good": "green", "failed": "red"}.get(p["state"], "yellow")
        t.add_row(
            str(p["path"]),
            str(p["plane"]),
            p.get("via", p["dst"]),
            f"[{style}]{p['state']}[/]",
            str(p["tx_pkts"]),
            str(p["retx"]),
            str(p["lost"]),
            f"{p['srtt_us']:.0f}",
            f"{100 * p['tx_bytes'] / total:.1f}%",
        )
    return t


def loopback() -> bool:
    console.rule("[bold]mrc demo: 4 loopback planes, plane 1 fails mid-transfer")
    console.print(
        "Not root (or no iproute2/nftables): using loopback planes "
        "127.0.0.1-4 <-> 127.0.1.1-4 and fault injection.\n"
    )
    a = mrc.Endpoint([f"127.0.0.{i}" for i in range(1, 5)], mss=32768)
    b = mrc.Endpoint([f"127.0.1.{i}" for i in range(1, 5)], mss=32768)
    port = b.listen()
    box: dict[str, mrc.Connection] = {}
    t = threading.Thread(target=lambda: box.setdefault("c", b.accept(timeout=10)))
    t.start()
    conn = a.connect("127.0.1.1", port)
    t.join()
    src = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    dst = np.zeros(SIZE, np.uint8)
    ms, md = a.register(src), b.register(dst)
    chunk, depth = 4 << 20, 16
    failed = False
    with Progress(
        TextColumn("{task.description}"), BarColumn(), TransferSpeedColumn(), console=console
    ) as bar:
        task = bar.add_task("WRITE 1 GiB", total=SIZE)
        pending: list[mrc.Operation] = []
        for off in range(0, SIZE, chunk):
            if len(pending) >= depth:
                bar.advance(task, pending.pop(0).wait(timeout=30).length)
            if not failed and off >= FAIL_AT * SIZE:
                a.inject(1, down=True)
                b.inject(1, down=True)
                failed = True
                bar.console.print(f"[red]plane 1 cut at {off >> 20} MiB[/]")
            pending.append(
                conn.write(ms, md.descriptor(), offset=off, length=chunk, remote_offset=off)
            )
        for op in pending:
            bar.advance(task, op.wait(timeout=30).length)
    stats = a.stats()
    console.print(path_table(stats, "client paths after the transfer"))
    ok = hashlib.sha256(src).digest() == hashlib.sha256(dst).digest()
    a.close()
    b.close()
    return ok


def fabric() -> bool:
    from mrc.fabric.testing import fabric_up

    fab_file = ROOT / "routing" / "4host-4plane-demo.toml"
    console.rule("[bold]mrc demo: SRv6 namespace fabric, plane 1 fails mid-transfer")
    console.print(
        f"Bringing up {fab_file.name}: 4 hosts, 4 planes x 2 spines, "
        "one namespace per host and switch ..."
    )
    with fabric_up(fab_file, prefix="mrcdemo") as fab:
        x = fab.xfer("h0", "h1", ["--size", str(SIZE), "--mode", "write"])
        cli = x.client
        assert cli.stdout is not None
        failed = False
        result: dict[str, Any] = {}
        with Progress(
            TextColumn("{task.description}"), BarColumn(), TransferSpeedColumn(), console=console
        ) as bar:
            task = bar.add_task("h0 -> h1 WRITE 1 GiB", total=SIZE)
            for line in cli.stdout:
                ev = json.loads(line)
                if ev["event"] == "progress":
                    bar.update(task, completed=ev["bytes"])
                    if not failed and ev["bytes"] >= FAIL_AT * SIZE:
                        fab.fail("plane1")
                        failed = True
                        bar.console.print(
                            f"[red]mrc-fabric fail plane1 at {ev['bytes'] >> 20} MiB "
                            "(every link of plane 1 down)[/]"
                        )
                elif ev["event"] in ("done", "error"):
                    result = ev
                    bar.update(task, completed=ev.get("bytes", 0))
        cli.wait(timeout=60)
        if result.get("event") != "done":
            x.kill()
            console.print(f"[red]client failed: {result}[/]")
            return False
        console.print(
            f"{result['bytes'] >> 20} MiB in {result['elapsed']:.1f} s "
            f"({result['gbps']:.2f} Gbit/s)"
        )
        paths = fab.paths("h0", "h1", include_failed=True)
        via = {p.id: p.spine for p in paths}
        for p in result["stats"]["paths"]:
            p["via"] = via.get(p["path"], "-")
        console.print(path_table(result["stats"], "h0's paths to h1 after the transfer"))
        return bool(result["sha256"] == x.server_result()["sha256"])


def can_fabric() -> bool:
    return (
        os.geteuid() == 0
        and all(shutil.which(t) for t in ("ip", "nft", "tc"))
        and (ROOT / "routing" / "4host-4plane-demo.toml").exists()
    )


def main() -> None:
    t0 = time.monotonic()
    ok = fabric() if can_fabric() else loopback()
    verdict = "[green]PASS: hashes equal at both ends[/]" if ok else "[red]FAIL: data differs[/]"
    console.print(f"{verdict}  ({time.monotonic() - t0:.1f} s)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
