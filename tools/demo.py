"""`make demo`: a multipath transfer, then AllReduces in a loop, each surviving a failed plane.

As root (with iproute2 and nftables): a real fabric of network namespaces
(routing/4host-4plane-demo.toml: 4 hosts, 4 planes, 2 spines per plane, SRv6
End SIDs on the spines), one process per host, and plane 1 failed with
`ip link set down` in the middle of a 1 GiB WRITE. Otherwise: two endpoints on
four loopback planes in this process, with plane 1 cut by fault injection.
Either way the data is hashed at both ends and the per-path table shows which
paths carried it and which failed.

Then the collectives: 4 ranks (mrc-run; tools/allreduce_loop.py) all-reduce 4 MiB of
float32 in a loop, on the same fabric (one rank per host namespace) or on loopback planes.
h1's plane-1 cable is pulled during an operation (loopback: rank 1 injects plane 1 down on
its endpoint) and plugged back a few operations after the planner switched. Shown as it
goes: every operation's schedule, shares, time and result hash against the healthy
reference, and the planner's INFO lines naming the schedule and the bandwidths agreed.
Exits non-zero when any hash differs, the loop stops, or the planner never switched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from allreduce_loop import FAILED_PLANE, FAILED_RANK, reference_sha  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TransferSpeedColumn  # noqa: E402
from rich.table import Table  # noqa: E402

import mrc  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LOOP_WORKER = str(ROOT / "tools" / "allreduce_loop.py")
console = Console()
SIZE = 1 << 30
FAIL_AT = 0.3
RANKS = 4
OPS_MAX = 60  # the loop stops earlier: once the healthy schedule is back (and stays)
OPS_FAIL_AT = 4  # the cable is pulled during this operation
OPS_HOLD = 5  # plugged back after this many resilient operations
LOOP_DEADLINE_S = 150.0  # a hung loop is killed (and the demo fails) instead of stalling


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


def fabric(transfer: bool = True) -> bool:
    from mrc.fabric.testing import fabric_up

    fab_file = ROOT / "routing" / "4host-4plane-demo.toml"
    console.print(
        f"Bringing up {fab_file.name}: 4 hosts, 4 planes x 2 spines, "
        "one namespace per host and switch ..."
    )
    with fabric_up(fab_file, prefix="mrcdemo") as fab:
        ok = fabric_transfer(fab) if transfer else True
        # The collectives come next on this fabric: plane 1 back up first.
        if "plane1" in fab.failed:
            fab.heal("plane1")
        return collectives(fab) and ok


def fabric_transfer(fab: Any) -> bool:
    console.rule("[bold]mrc demo: SRv6 namespace fabric, plane 1 fails mid-transfer")
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
        f"{result['bytes'] >> 20} MiB in {result['elapsed']:.1f} s ({result['gbps']:.2f} Gbit/s)"
    )
    paths = fab.paths("h0", "h1", include_failed=True)
    via = {p.id: p.spine for p in paths}
    for p in result["stats"]["paths"]:
        p["via"] = via.get(p["path"], "-")
    console.print(path_table(result["stats"], "h0's paths to h1 after the transfer"))
    return bool(result["sha256"] == x.server_result()["sha256"])


def cable_of(fab: Any, host: str, plane: int) -> str:
    """The name of `host`'s NIC link on `plane` (its cable to the plane's leaf)."""
    return next(ln.name for ln in fab.fabric.links_of(host) if ln.plane == plane)


def short(sha: str) -> str:
    return sha[:10]


def collectives(fab: Any | None) -> bool:
    """4 ranks all-reduce in a loop while h1's plane 1 fails and heals; every result's
    hash is checked against the healthy reference. fab: the fabric to run on (one rank
    per host namespace, the cable pulled with mrc-fabric fail) or None: loopback planes
    in this namespace and Endpoint.inject on rank 1."""
    where = "the namespace fabric" if fab else "4 loopback planes per rank"
    console.rule(f"[bold]mrc demo: {RANKS} ranks all_reduce in a loop on {where}, a plane fails")
    env = dict(os.environ)
    if fab is None:
        console.print(
            "Not root (or no iproute2/nftables): no cable to pull. Rank 1 cuts its plane 1 "
            "with Endpoint.inject(1, down=True) instead, and heals it with down=False. "
            "Loopback planes are all the same cores, so the planner, told the hosts' rate "
            "it measures, would find the resilient shares barely faster (2%, its threshold): "
            "here it plans on the planes alone (MRC_RESILIENT_HOST=0)."
        )
        env["MRC_RESILIENT_HOST"] = "0"
    ref = reference_sha(RANKS)
    console.print(
        f"healthy reference: sha256 {short(ref)}... of the rank-order float32 sum "
        "(x0 + x1) + x2 + x3, which every schedule keeps bit for bit"
    )
    header = f"  {'op':5s}  {'schedule':9s} {'shares of r0 r1 r2 r3':23s} {'time':>9s}  sha256"
    console.print(header)
    cmd = [sys.executable, "-m", "mrc.run", "-n", str(RANKS), "--timeout", "30"]
    if fab is not None:
        cmd += ["--fabric", fab.file, "--name", fab.prefix]
    cmd += ["--", sys.executable, LOOP_WORKER, str(OPS_MAX), str(OPS_FAIL_AT), str(OPS_HOLD)]
    if fab is None:
        cmd.append("--inject")
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env
    )
    watchdog = threading.Timer(LOOP_DEADLINE_S, stop_hung, (p,))
    watchdog.start()
    cable = cable_of(fab, f"h{FAILED_RANK}", FAILED_PLANE) if fab is not None else ""
    finals: dict[int, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    tail: list[str] = []
    mismatches = 0
    resilient_seen = 0
    healed = False
    try:
        assert p.stdout is not None
        for line in p.stdout:
            tail = (tail + [line.rstrip()])[-30:]
            rank_s, _, text = line.partition("] ")
            if not rank_s.startswith("[") or not rank_s[1:].isdigit():
                continue
            rank = int(rank_s[1:])
            if "runs schedule" in text and rank == 0:
                show_switch(text)
                continue
            if not text.startswith("{"):
                continue
            try:
                ev = json.loads(text)
            except ValueError:
                continue  # some other line that starts with a brace
            if "hashes" in ev:
                finals[rank] = ev
            elif ev.get("event") == "inject":
                what = "cut (inject down) during" if ev["down"] else "healed (inject up) after"
                style = "red" if ev["down"] else "green"
                console.print(
                    f"  [{style}]rank {rank}: plane {ev['plane']} {what} op {ev['op']}[/]"
                )
            elif "op" in ev:
                rows.append(ev)
                mismatches += show_op(ev, ref)
                if fab is not None:
                    # Pulled when op FAIL_AT - 1 is done: it goes down in (or just before)
                    # operation FAIL_AT; plugged back after HOLD resilient operations.
                    resilient_seen += ev["schedule"] == "resilient"
                    if ev["op"] == OPS_FAIL_AT - 1:
                        fab.fail(cable)
                        console.print(f"  [red]mrc-fabric fail {cable} (h1's plane-1 cable)[/]")
                    elif resilient_seen == OPS_HOLD and not healed:
                        fab.heal(cable)
                        healed = True
                        console.print(f"  [green]mrc-fabric heal {cable}[/]")
        rc = p.wait(timeout=30)
    finally:
        watchdog.cancel()
        if p.poll() is None:
            p.kill()
            p.wait()
    return loop_verdict(rc, finals, rows, ref, mismatches, tail)


def stop_hung(p: subprocess.Popen[str]) -> None:
    """The loop stopped: SIGTERM to mrc-run, which stops its ranks (they run in sessions of
    their own, so killing mrc-run alone would leave them behind), then kill it. Not SIGINT:
    a demo started in the background (`make demo &`) runs with SIGINT ignored."""
    console.print(f"[red]the loop has not ended after {LOOP_DEADLINE_S:.0f} s: stopping it[/]")
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=15)
    except subprocess.TimeoutExpired:
        p.kill()


def show_op(ev: dict[str, Any], ref: str) -> bool:
    """One operation's line (and the agreement it planned from, when new). True: differs."""
    if ev.get("agreed") is not None:
        ag = ev["agreed"]
        up = ", ".join(f"r{r} {''.join(map(str, pl))}" for r, pl in enumerate(ag["planes_up"]))
        if ag["source"] == "planes":  # loopback: counts of usable planes
            rates = " ".join(f"{v:g}" for v in ag["send"]) + " planes"
        else:  # bytes/s from the fabric file's link rates
            rates = " ".join(f"{v * 8e-9:g}" for v in ag["send"]) + " Gbit/s"
        console.print(f"  [cyan]agreed: planes up {up}; send {rates}[/]")
    same = ev["sha"] == ref
    shares = " ".join(f"{v:.3f}" for v in ev["shares"])
    mark = "[green]= reference[/]" if same else "[bold red]DIFFERS[/]"
    style = "yellow" if ev["schedule"] == "resilient" else "white"
    console.print(
        f"  op {ev['op']:2d}  [{style}]{ev['schedule']:9s}[/] {shares} "
        f"{ev['ms']:6.1f} ms  {short(ev['sha'])} {mark}"
    )
    return not same


def show_switch(text: str) -> None:
    """The planner's INFO line (rank 0's; every rank logs the same), the agreed bandwidths
    one rank a line."""
    line = text.strip().removeprefix("mrc.collectives.resilient: ").removeprefix("rank 0: ")
    head, _, rates = line.partition(", for bandwidths ")
    what, _, shares = head.partition(", shares ")
    console.print(f"  [magenta]planner: {what},[/]")
    console.print(f"  [magenta]    shares {shares}, for bandwidths[/]")
    for part in rates.split("; "):
        console.print(f"  [magenta]    {part}[/]")


def loop_verdict(
    rc: int,
    finals: dict[int, dict[str, Any]],
    rows: list[dict[str, Any]],
    ref: str,
    mismatches: int,
    tail: list[str],
) -> bool:
    problems = []
    if rc != 0:
        problems.append(f"mrc-run exited {rc} (the loop stopped)")
    if sorted(finals) != list(range(RANKS)):
        problems.append(f"results from ranks {sorted(finals)}, want 0..{RANKS - 1}")
    wrong = sum(h != ref for doc in finals.values() for h in doc["hashes"])
    if wrong or mismatches:
        problems.append(f"{wrong} results of all ranks differ from the reference")
    if len({json.dumps(doc["schedules"]) for doc in finals.values()}) > 1:
        problems.append("the ranks ran different schedules")
    scheds = [r["schedule"] for r in rows]
    if "resilient" not in scheds:
        problems.append("the planner never switched to the resilient schedule")
    for msg in problems:
        console.print(f"[red]{msg}[/]")
    if problems:
        console.print("\n".join(tail))
        return False
    n = len(rows)
    by = {s: [r["ms"] for r in rows if r["schedule"] == s] for s in ("equal", "resilient")}
    console.print(
        f"{n} all_reduces x {RANKS} ranks: all {n * RANKS} results bit-identical to the "
        f"healthy reference; schedules {runs(scheds)}; median op "
        + ", ".join(f"{s} {statistics.median(v):.1f} ms" for s, v in by.items() if v)
    )
    return True


def runs(names: list[str]) -> str:
    """equal x4 -> resilient x6 -> equal x3"""
    out: list[list[Any]] = []
    for name in names:
        if out and out[-1][0] == name:
            out[-1][1] += 1
        else:
            out.append([name, 1])
    return " -> ".join(f"{name} x{k}" for name, k in out)


def can_fabric() -> bool:
    return (
        os.geteuid() == 0
        and all(shutil.which(t) for t in ("ip", "nft", "tc"))
        and (ROOT / "routing" / "4host-4plane-demo.toml").exists()
    )


def main() -> None:
    """tools/demo.py [--collectives] [--loopback]: --collectives runs the collective part
    only (tests/test_demo.py), --loopback takes loopback planes even as root."""
    args = sys.argv[1:]
    for a in args:
        if a not in ("--collectives", "--loopback"):
            sys.exit(f"demo.py: unknown argument {a!r} (want --collectives, --loopback)")
    only_coll = "--collectives" in args
    t0 = time.monotonic()
    if can_fabric() and "--loopback" not in args:
        ok = fabric(transfer=not only_coll)
    else:
        ok = (only_coll or loopback()) & collectives(None)
    verdict = (
        "[green]PASS: hashes equal at both ends, every all_reduce = the reference[/]"
        if ok
        else "[red]FAIL: data differs or the loop stopped[/]"
    )
    console.print(f"{verdict}  ({time.monotonic() - t0:.1f} s)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
