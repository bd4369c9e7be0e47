"""CPU of two idle endpoints: what a communicator costs the host while it waits.

Two endpoints in this process (two progress threads) with 1 and 256 connected,
idle connections (nothing posted), and 256 connections each with one RECV posted
that nothing matches (a collective waiting on its peers: keepalives only). The
main thread sleeps for --seconds; reported: the process's CPU time from getrusage
(as % of one core), each progress thread's from /proc, and the loop wake-ups per
second from the endpoints' loop_iters. Results go to results/idle_cpu.json and a
PNG; a run with --label before (on older code) is kept and shown side by side.

    python benchmarks/idle_cpu.py [--seconds 3] [--label after]
"""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from pathlib import Path

import click
import numpy as np
from common import RESULTS, record_load, save

import mrc

TARGET_PCT = 0.5  # of one core, for 256 idle connections (issue 10)


def connect_many(a: mrc.Endpoint, b: mrc.Endpoint, n: int) -> list[mrc.Connection]:
    port = b.listen()
    accepted: list[mrc.Connection] = []
    t = threading.Thread(target=lambda: accepted.extend(b.accept(timeout=30) for _ in range(n)))
    t.start()
    outs = [a.connect(b.planes[0][0], port, timeout=30) for _ in range(n)]
    t.join()
    return outs + accepted


def thread_cpu() -> dict[int, float]:
    """CPU seconds of every thread of this process, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def measure(nconns: int, seconds: float, recv_posted: bool) -> dict:
    before = set(thread_cpu())
    a = mrc.Endpoint(["127.0.0.1"])
    b = mrc.Endpoint(["127.0.1.1"])
    try:
        conns = connect_many(a, b, nconns)
        progress = [t for t in thread_cpu() if t not in before]
        buf = np.zeros(64, np.uint8)
        mb = b.register(buf)
        ops = [c.recv(mb, tag=0xDEAD) for c in conns[nconns:]] if recv_posted else []
        time.sleep(0.2)  # set-up traffic (handshakes, first ACKs) settles
        it0 = a.stats()["loop_iters"] + b.stats()["loop_iters"]
        th0 = thread_cpu()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.monotonic()
        time.sleep(seconds)
        t1 = time.monotonic()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        th1 = thread_cpu()
        it1 = a.stats()["loop_iters"] + b.stats()["loop_iters"]
        wall = t1 - t0
        cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
        per_thread = [
            round(100 * (th1.get(t, 0) - th0.get(t, 0)) / wall, 3) for t in sorted(progress)
        ]
        assert all(not op.done for op in ops), "a RECV nothing matches completed"
        return {
            "conns": nconns,
            "recv_posted": recv_posted,
            "seconds": round(wall, 3),
            "cpu_pct": round(100 * cpu / wall, 3),
            "thread_cpu_pct": per_thread,
            "wakeups_per_s": round((it1 - it0 - 2) / wall, 1),  # the 2 stats calls wake it too
        }
    finally:
        a.close()
        b.close()


def plot(data: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {k: v for k, v in data["runs"].items() if v}
    labels = [
        f"{r['conns']} conn{'s' if r['conns'] > 1 else ''}{' + RECV' if r['recv_posted'] else ''}"
        for r in next(iter(runs.values()))
    ]
    x = np.arange(len(labels))
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, (name, rows) in enumerate(runs.items()):
        vals = [r["cpu_pct"] for r in rows]
        bars = ax.bar(x + (k - (len(runs) - 1) / 2) * width, vals, width, label=name)
        for bar, r in zip(bars, rows, strict=True):
            ax.text(
                bar.get_x() + bar.get_width() / 2,
                bar.get_height(),
                f"{r['cpu_pct']:.2f}%\n{r['wakeups_per_s']:.0f}/s",
                ha="center",
                va="bottom",
                fontsize=8,
            )
    top = max(r["cpu_pct"] for rows in runs.values() for r in rows)
    ax.set_ylim(0, max(top, TARGET_PCT) * 1.2)  # room for the labels
    ax.axhline(TARGET_PCT, color="gray", ls="--", lw=1, label=f"target {TARGET_PCT}%")
    ax.set_xticks(x, labels)
    ax.set_ylabel("% of one core (two endpoints)")
    ax.set_title(f"Idle endpoints: CPU and loop wake-ups ({data['note']})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "idle_cpu.png", dpi=100)


@click.command()
@click.option("--seconds", default=3.0, show_default=True, help="measured interval per case")
@click.option(
    "--label",
    default="after",
    show_default=True,
    help="name of this run: 'before' for older code, shown side by side",
)
@click.option(
    "--note",
    default="loaded machine: 2 cores shared by 7 engineers",
    show_default=True,
    help="conditions of the run, stored in the JSON",
)
def main(seconds: float, label: str, note: str) -> None:
    record_load()
    cases = [(1, False), (256, False), (256, True)]
    rows = []
    for n, recv in cases:
        r = measure(n, seconds, recv)
        rows.append(r)
        click.echo(
            f"{label}: {n:>3} conns{' + RECV' if recv else '       '}  "
            f"cpu {r['cpu_pct']:7.3f}% of a core  wake-ups {r['wakeups_per_s']:8.1f}/s"
        )
    path = RESULTS / "idle_cpu.json"
    runs = {}
    if path.exists():
        runs = {k: v for k, v in json.loads(path.read_text()).get("runs", {}).items() if k != label}
    runs[label] = rows
    data = {
        "benchmark": "CPU of two idle endpoints (getrusage of the process)",
        "note": note,
        "target_pct_256": TARGET_PCT,
        "runs": dict(sorted(runs.items(), key=lambda kv: kv[0] != "before")),
    }
    out = save("idle_cpu", data)
    plot(data)
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
