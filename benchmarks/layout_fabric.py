"""all_reduce where ranks share hosts, on the shaped fabric: what "auto" runs, next to
mrc's direct and chain schedules, Gloo, and the links' bound.

Runs as root. Fabric routing/4host-4plane-1g.toml (4 planes x 1 Gbit/s per host), float32
sum, four placements (mrc-run --hosts): h0,h1,h2,h3 (one rank per host), h0,h0,h1,h1 (two
hosts, two ranks each), h0,h0,h1,h1,h2,h2,h3,h3 (four hosts, two each) and four ranks on
each of h0 and h1. For each, in
--rounds rounds (a fresh launch per framework and round, the order rotated each round):
`mrc_auto` (what a user gets: model.layout_algo picks direct, chain or hier),
`mrc_direct`, `mrc_chain` and `mrc_hier` (MRC_ALGO: hier is the chain over the hosts,
direct inside each), and `gloo` (torch CPU, its ring, GLOO_SOCKET_IFNAME on the 4
planes), at 1, 16 and 64 MiB; the mean per operation of --iters after 8 warm-up ones,
averaged over the ranks (benchmarks/coll_worker.py), the median over the rounds.

Beside them the links' bound of each schedule: model.host_link_time(hosts, algo) x D over
a host's 4 Gbit/s, what its busiest host link must carry (no CPU, no latency; hier and
Gloo's ring in this placement carry what the chain does), and the ratios: auto / direct,
auto / the best of direct, chain and hier, Gloo / auto, and auto / its schedule's bound.

    python benchmarks/layout_fabric.py [--rounds 2] [--iters 10]    # about 14 minutes

Writes results/layout_fabric.json and .png.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

import click
from common import RESULTS, load_note, record_load, save
from fabric_coll import FAB_1G, ROOT, ensure_torch, run_gloo, run_mrc, sized_rows, worker_args

from mrc.collectives import model
from mrc.fabric.testing import fabric_up

PLACEMENTS = {
    "1 per host (h0 h1 h2 h3)": ["h0", "h1", "h2", "h3"],
    "2 hosts x 2 (h0 h0 h1 h1)": ["h0", "h0", "h1", "h1"],
    "4 hosts x 2 (h0 h0 .. h3 h3)": ["h0", "h0", "h1", "h1", "h2", "h2", "h3", "h3"],
    "2 hosts x 4 (h0 x4, h1 x4)": ["h0"] * 4 + ["h1"] * 4,
}
FRAMEWORKS = ("mrc_auto", "mrc_direct", "mrc_chain", "mrc_hier", "gloo")
SIZES = (1 << 20, 16 << 20, 64 << 20)
HOST_RATE = 4 * 125e6  # bytes/s: 4 planes x 1 Gbit/s


def launch(fab: Any, fw: str, hosts: list[str], iters: int) -> dict[int, dict[str, Any]]:
    # 8 warm-up operations per size: a communicator's first 8 all_reduces are also
    # bandwidth exchange points (resilient.EARLY_EXCHANGES), a start-up cost.
    args = worker_args("all_reduce", SIZES, iters, 8)
    if fw == "gloo":
        run = run_gloo(fab, args, hosts=hosts)
    else:
        algo = fw.removeprefix("mrc_")
        run = run_mrc(fab, args, {"MRC_ALGO": algo, "OMP_NUM_THREADS": "1"}, hosts=hosts)
    return sized_rows(run, SIZES, f"{fw} on {','.join(hosts)}")


def plot(data: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(data["placements"])
    fig, axes = plt.subplots(2, 2, figsize=(11.5, 8.6), squeeze=False)
    mib = [s / 2**20 for s in data["sizes"]]
    for ax, name in zip(axes.flat, names, strict=True):
        pl = data["placements"][name]
        for fw in FRAMEWORKS:
            ax.plot(mib, [pl["time_ms"][fw][str(s)] for s in data["sizes"]], marker="o", label=fw)
        for algo, style, what in (("direct", ":", "direct"), ("chain", "--", "chain, hier")):
            ax.plot(mib, [pl["bound_ms"][algo][str(s)] for s in data["sizes"]], style,
                    color="gray", label=f"links' bound, {what}")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("all_reduce size, MiB (float32)")
        ax.set_ylabel("time per operation, ms")
        ax.set_title(f"{name}: auto runs {pl['auto_algo']}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"all_reduce by rank placement, shaped 4 x 1 Gbit/s fabric ({data['note']})",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=110)


@click.command()
@click.option("--rounds", default=2, show_default=True, type=click.IntRange(1, 20))
@click.option("--iters", default=10, show_default=True, type=click.IntRange(1, 1000))
def main(rounds: int, iters: int) -> None:
    if os.geteuid() != 0:
        raise click.UsageError("needs root: the fabric is namespaces")
    record_load()
    ensure_torch()
    runs: dict[str, dict[str, dict[int, list[float]]]] = {
        name: {fw: {s: [] for s in SIZES} for fw in FRAMEWORKS} for name in PLACEMENTS
    }
    sched: dict[str, set[str]] = {name: set() for name in PLACEMENTS}
    with fabric_up(FAB_1G, prefix="blf") as fab:
        for rnd in range(rounds):
            for name, hosts in PLACEMENTS.items():
                k = rnd % len(FRAMEWORKS)
                order = FRAMEWORKS[k:] + FRAMEWORKS[:k]
                for fw in order:
                    rows = launch(fab, fw, hosts, iters)
                    for s in SIZES:
                        runs[name][fw][s].append(rows[s]["time_us"] / 1e3)
                        if fw == "mrc_auto" and rows[s].get("schedule"):
                            sched[name].add(rows[s]["schedule"])
                    got = {s >> 20: round(rows[s]["time_us"] / 1e3, 1) for s in SIZES}
                    click.echo(f"round {rnd + 1} {name} {fw}: {got} ms (MiB: ms)")
    out: dict[str, Any] = {}
    for name, hosts in PLACEMENTS.items():
        algo, why = model.layout_algo(hosts)
        t = {fw: {str(s): round(statistics.median(runs[name][fw][s]), 2) for s in SIZES}
             for fw in FRAMEWORKS}  # fmt: skip
        bound = {
            a: {str(s): round(model.host_link_time(hosts, a) * s / HOST_RATE * 1e3, 2)
                for s in SIZES}
            for a in ("direct", "chain", "hier")
        }  # fmt: skip
        ratios = {}
        for s in map(str, SIZES):
            auto, d, c, h, g = (t[fw][s] for fw in FRAMEWORKS)
            ratios[s] = {
                "auto_over_direct": round(auto / d, 3),
                "auto_over_best_mrc": round(auto / min(d, c, h), 3),
                "gloo_over_auto": round(g / auto, 3),
                "auto_over_its_bound": round(auto / bound[algo][s], 3),
            }
        out[name] = {
            "hosts": hosts,
            "auto_algo": algo,
            "auto_why": why,
            "auto_schedules_reported": sorted(sched[name]),  # comm.stats()["resilient"]
            "time_ms": t,
            "runs_ms": {
                fw: {str(s): [round(x, 2) for x in runs[name][fw][s]] for s in SIZES}
                for fw in FRAMEWORKS
            },  # fmt: skip
            "bound_ms": bound,
            "ratios": ratios,
        }
        click.echo(json.dumps({name: {"auto": algo, "time_ms": t, "ratios": ratios}}))
    data = {
        "benchmark": "layout_fabric",
        "fabric": str(FAB_1G.relative_to(ROOT)),
        "sizes": list(SIZES),
        "rounds": rounds,
        "iters": iters,
        "note": f"{os.cpu_count()} cores; {load_note()}",
        "placements": out,
    }
    path = save("layout_fabric", data)
    plot(data, RESULTS / "layout_fabric.png")
    click.echo(f"wrote {path} and layout_fabric.png")


if __name__ == "__main__":
    main()
