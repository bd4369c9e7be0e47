"""all_reduce at more ranks than the fabric has hosts: mrc's direct and chain schedules
next to Gloo (torch CPU, its ring), N processes on loopback planes under mrc-run.

    .venv/bin/python benchmarks/ranks_loopback.py [--ranks 4,8,16,32] [--sizes 1048576,16777216]

Each point is a fresh mrc-run of benchmarks/coll_worker.py (warm-up, barrier, `--iters`
operations; the mean per operation averaged over the ranks, checked against the exact
sum): `mrc_direct` (MRC_ALGO=direct: reduce-scatter to owners and all-gather, every rank
talking to every other), `mrc_chain` (MRC_ALGO=chain: the partial sum up the ranks and the
result back down, two neighbours each) and `gloo`. All of a run's processes share this
machine's cores, so what is measured is CPU per operation as much as anything (the
ranks' summed CPU is reported next to each time). Writes
benchmarks/results/ranks_loopback.{json,png}: times, busbw, and the ratios of the better
mrc schedule to Gloo and of chain to direct.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click
from common import RESULTS, load_note, record_load, save
from fabric_coll import PY, ensure_torch, sized_rows, stream, worker_args

FRAMEWORKS = {
    "mrc_direct": ("mrc", {"MRC_ALGO": "direct"}),
    "mrc_chain": ("mrc", {"MRC_ALGO": "chain"}),
    "gloo": ("gloo", {"GLOO_SOCKET_IFNAME": "lo"}),
}


def run_point(fw: str, n: int, sizes: list[int], iters: int) -> dict[int, dict[str, Any]]:
    backend, extra = FRAMEWORKS[fw]
    worker, *args = worker_args("all_reduce", sizes, iters, 1)
    cmd = [PY, "-m", "mrc.run", "-n", str(n), "--timeout", "600", "--", PY, worker, backend, *args]
    run = stream(cmd, {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", **extra})
    return sized_rows(run, sizes, f"{fw} at {n} ranks")


def plot(data: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = data["sizes"]
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4.2), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        for fw in FRAMEWORKS:
            pts = [(p["ranks"], p[fw][str(size)]["time_ms"]) for p in data["points"]]
            ax.plot(*zip(*pts, strict=True), marker="o", label=fw)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks (processes on one 2-core machine, loopback)")
        ax.set_ylabel("all_reduce time, ms")
        ax.set_title(f"{size / 2**20:g} MiB float32")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"all_reduce vs ranks: mrc direct / chain vs Gloo ({data['note']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


@click.command()
@click.option("--ranks", default="4,8,16,32", show_default=True)
@click.option("--sizes", default="1048576,16777216", show_default=True, help="Bytes, float32.")
@click.option("--iters", default=5, show_default=True)
def main(ranks: str, sizes: str, iters: int) -> None:
    record_load()
    ensure_torch()
    size_list = [int(s) for s in sizes.split(",")]
    points = []
    for n in (int(x) for x in ranks.split(",")):
        point: dict[str, Any] = {"ranks": n}
        for fw in FRAMEWORKS:
            rows = run_point(fw, n, size_list, iters)
            point[fw] = {
                str(s): {
                    "time_ms": round(rows[s]["time_us"] / 1e3, 3),
                    "busbw_gbps": round(rows[s]["busbw_gbps"], 3),
                    "rank_cpu_cores": round(rows[s]["rank_cpu_cores"], 2),
                }
                for s in size_list
            }
        for s in map(str, size_list):
            d, c, g = (point[fw][s]["time_ms"] for fw in ("mrc_direct", "mrc_chain", "gloo"))
            point.setdefault("ratios", {})[s] = {
                "chain_over_direct": round(c / d, 3),
                "gloo_over_best_mrc": round(g / min(c, d), 3),
            }
        points.append(point)
        print(json.dumps(point), flush=True)
    data = {
        "benchmark": "ranks_loopback",
        "sizes": size_list,
        "iters": iters,
        "note": f"loopback, {os.cpu_count()} cores; {load_note()}",
        "points": points,
    }
    out = save("ranks_loopback", data)
    plot(data, RESULTS / "ranks_loopback.png")
    print(f"wrote {out} and ranks_loopback.png")


if __name__ == "__main__":
    main()
