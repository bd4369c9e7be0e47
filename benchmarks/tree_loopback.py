"""Small calls at many ranks: mrc's binomial-tree schedules against its flat ones and Gloo,
N processes on loopback planes under mrc-run.

    .venv/bin/python benchmarks/tree_loopback.py [--ranks 8,16,32] [--iters 200]

Per rank count, four calls: all_reduce of 8 B and of 1 KiB, broadcast of 8 B, barrier.
`mrc_tree` (MRC_TREE_MIN_RANKS=2: up and down a binomial tree, the barrier by
dissemination), `mrc_flat` (MRC_TREE_MIN_RANKS past the rank count: all_reduce "gather",
every rank sends every other its input; broadcast from root to all; the barrier a message
to and from every rank), both with the default busy poll (off where a host runs more than
4 ranks per core: from 9 ranks on a 2-core machine), `mrc_flat_poll` (flat with the busy
poll on: mrc's defaults before the tree) and `gloo` (torch CPU). What mrc's "auto" runs is
mrc_tree from schedule.TREE_MIN_RANKS ranks (16), mrc_flat below. Each point is a fresh mrc-run of
benchmarks/coll_worker.py per call (warm-up, barrier, --iters calls; the mean per call
averaged over the ranks; all_reduce and broadcast checked exactly). Every process shares
this machine's cores, so a message's CPU and the scheduler's hand-overs are most of what
is measured (the ranks' summed CPU is reported next to each time). Writes
benchmarks/results/tree_loopback.{json,png}: times and the ratios flat / tree,
flat_poll / tree and Gloo / tree.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click
from common import RESULTS, load_note, record_load, save
from fabric_coll import PY, ensure_torch, sized_rows, stream, worker_args

CALLS = (("all_reduce", 8), ("all_reduce", 1024), ("broadcast", 8), ("barrier", 0))
FRAMEWORKS = {
    "mrc_tree": ("mrc", {"MRC_TREE_MIN_RANKS": "2"}),
    "mrc_flat": ("mrc", {"MRC_TREE_MIN_RANKS": "1000000"}),
    "mrc_flat_poll": ("mrc", {"MRC_TREE_MIN_RANKS": "1000000", "MRC_BUSY_POLL_US": "1000"}),
    "gloo": ("gloo", {"GLOO_SOCKET_IFNAME": "lo"}),
}
ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def label(coll: str, size: int) -> str:
    return coll if coll == "barrier" else f"{coll} {size} B"


def run_point(fw: str, n: int, iters: int) -> dict[str, dict[str, Any]]:
    backend, extra = FRAMEWORKS[fw]
    out = {}
    for coll, size in CALLS:
        worker, *args = worker_args(coll, [size], iters, max(10, iters // 10))
        cmd = [PY, "-m", "mrc.run", "-n", str(n), "--timeout", "600", "--", PY, worker, backend]
        run = stream([*cmd, *args], {**ENV, **extra})
        row = sized_rows(run, [size], f"{fw} {coll} at {n} ranks")[size]
        out[label(coll, size)] = {
            "time_us": round(row["time_us"], 1),
            "rank_cpu_cores": round(row["rank_cpu_cores"], 2),
            "ran": row.get("ran"),
        }
    return out


def plot(data: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    calls = [label(c, s) for c, s in CALLS]
    fig, axes = plt.subplots(1, len(calls), figsize=(4.6 * len(calls), 4.2), squeeze=False)
    for ax, call in zip(axes[0], calls, strict=True):
        for fw in FRAMEWORKS:
            pts = [(p["ranks"], p[fw][call]["time_us"] / 1e3) for p in data["points"]]
            ax.plot(*zip(*pts, strict=True), marker="o", label=fw)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks (processes on one machine, loopback)")
        ax.set_ylabel("time per call, ms")
        ax.set_title(call)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"small calls vs ranks: mrc tree / flat vs Gloo ({data['note']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


@click.command()
@click.option("--ranks", default="8,16,32", show_default=True)
@click.option("--iters", default=200, show_default=True, help="Calls per point.")
def main(ranks: str, iters: int) -> None:
    record_load()
    ensure_torch()
    points = []
    for n in (int(x) for x in ranks.split(",")):
        point: dict[str, Any] = {"ranks": n}
        for fw in FRAMEWORKS:
            point[fw] = run_point(fw, n, iters)
        point["ratios"] = {
            call: {
                "flat_over_tree": round(
                    point["mrc_flat"][call]["time_us"] / point["mrc_tree"][call]["time_us"], 2
                ),
                "flat_poll_over_tree": round(
                    point["mrc_flat_poll"][call]["time_us"] / point["mrc_tree"][call]["time_us"],
                    2,
                ),
                "gloo_over_tree": round(
                    point["gloo"][call]["time_us"] / point["mrc_tree"][call]["time_us"], 2
                ),
            }
            for call in point["mrc_tree"]
        }
        points.append(point)
        print(json.dumps(point), flush=True)
    data = {
        "benchmark": "tree_loopback",
        "calls": [label(c, s) for c, s in CALLS],
        "iters": iters,
        "note": f"loopback, {os.cpu_count()} cores; {load_note()}",
        "points": points,
    }
    out = save("tree_loopback", data)
    plot(data, RESULTS / "tree_loopback.png")
    print(f"wrote {out} and tree_loopback.png")


if __name__ == "__main__":
    main()
