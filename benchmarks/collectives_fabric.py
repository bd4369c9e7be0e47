"""Collectives on the shaped fabric, side by side (issue 12): mrc, Gloo and Open MPI.

Runs as root. Fabric: routing/4host-4plane-1g.toml (4 planes x 1 Gbit/s per host, line
4 Gbit/s), 4 ranks, one per host namespace, float32 sum:

1. all_reduce 8 B .. 256 MiB (x2; the mean of 100 operations up to 512 KiB, of 5 above):
   mrc; mrc_planes (MRC_ROUTES=planes: a plain-IPv6 path per plane, no SRH); Gloo (torch
   CPU, GLOO_SOCKET_IFNAME = the 4 planes' interfaces); Open MPI (btl tcp,self on the 4
   planes' interfaces) with its default algorithm and with its ring
   (coll_tuned_allreduce_algorithm=4). busbw as
   nccl-tests (2(n-1)/n), CPU use, and the issue's ratios: mrc busbw at 64 MiB / the
   better peer (target >= 1.3) and / line (>= 0.85), 1 MiB time / the better peer's
   (<= 0.5), 8 B time / the better peer's (<= 1); the same for mrc_planes
   (summary["mrc_planes"]).
2. all_gather, reduce_scatter, broadcast at 64 MiB: busbw of each.
3. the targets again, in --rounds rounds (default 3): 8 B (the mean of 1000 operations),
   1 MiB (of 30) and 64 MiB (of 5) for mrc and each peer in turn, every round a fresh
   start of each; the four ratios per round
   (against the better peer of the same round) and their medians. Run-to-run spread on
   this VM is 10-15% for every framework, so one sweep can meet or miss a target by
   chance; summary["rounds"] says how many rounds met each target.

Open MPI runs with mpi_yield_when_idle=1: 4 ranks on 2 cores, and its default busy
polling otherwise starves the ranks that have work (8 B took 45 ms instead of 0.3 ms).

    python benchmarks/collectives_fabric.py            # full: about 10 minutes idle (estimated)
    python benchmarks/collectives_fabric.py --quick    # 8 B .. 4 MiB (6 sizes), 2 iterations
    python benchmarks/collectives_fabric.py --bind core  # every rank of every framework bound
                                                         # as mrc-run --bind-to core binds it


Writes results/collectives_fabric.json and .png (--bind core: collectives_fabric-bound.*;
--quick: collectives_fabric-quick.*, not for committing: a check that everything runs).
"""

from __future__ import annotations

import os
import statistics
from typing import Any

import click
from common import RESULTS, load_note, record_load, save
from fabric_coll import (
    FAB_1G,
    Run,
    gbps,
    run_gloo,
    run_mpi,
    run_mrc,
    setup_peers,
    worker_args,
)

from mrc.fabric.testing import fabric_up
from mrc.run import BIND_MODES

LINE_GBPS = 4.0
YIELD = [("mpi_yield_when_idle", "1")]
PEERS = ("gloo", "mpi_default", "mpi_ring")
# mrc_planes: mrc with routes="planes" (one plain-IPv6 path per plane, no SRH: UDP GSO
# batches stay whole); mrc is the default, routes="auto": the route table's SRv6 paths
# where the kernel keeps UDP GSO for them (seg6 lwtunnels), else the same as mrc_planes.
FRAMEWORKS = ("mrc", "mrc_planes", *PEERS)
OTHER = ("all_gather", "reduce_scatter", "broadcast")
KEY_SIZE = 64 << 20


def sizes(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 2
    return out


def launch(fab: Any, fw: str, coll: str, size_list: list[int], iters: int, warmup: int) -> Run:
    args = worker_args(coll, size_list, iters, warmup)
    if fw == "mrc":
        r = run_mrc(fab, args)
    elif fw == "mrc_planes":
        r = run_mrc(fab, args, env={"MRC_ROUTES": "planes"})
    elif fw == "gloo":
        r = run_gloo(fab, args)
    else:
        r = run_mpi(fab, args, fw.split("_")[1], YIELD)
    if r.status != "ok":
        click.echo(f"  {fw} {coll}: {r.status} (rc {r.rc}): {r.message}")
    return r


def sweep(fab: Any, fw: str, quick: bool) -> dict[str, Any]:
    """all_reduce rows for one framework: small sizes with more iterations."""
    if quick:
        runs = [launch(fab, fw, "all_reduce", [8, 256, 8 << 10, 256 << 10, 1 << 20, 4 << 20], 2, 1)]
    else:
        runs = [
            launch(fab, fw, "all_reduce", sizes(8, 512 << 10), 100, 5),
            launch(fab, fw, "all_reduce", sizes(1 << 20, 256 << 20), 5, 1),
        ]
    rows = [row for r in runs for row in r.rows]
    for row in rows:
        click.echo(
            f"  {fw:12s} {row['size']:>10d} B {row['time_us']:12.1f} us "
            f"busbw {row['busbw_gbps']:7.3f} Gbit/s cpu {row['rank_cpu_cores']:.2f} "
            f"(machine {row['machine_busy_cores']:.2f}) wrong {row['wrong']}"
        )
    return {
        "rows": rows,
        "status": [r.status for r in runs],
        "retried_start": [r.retried for r in runs],
        "errors": [r.message for r in runs if r.status != "ok"],
    }


# The four targets: busbw ratios at least, time ratios at most, these.
GOALS = {
    "busbw_vs_best_peer": 1.3,
    "busbw_vs_line": 0.85,
    "time_1m_vs_best_peer": 0.5,
    "latency_8b_vs_best_peer": 1.0,
}
TARGETS = tuple(GOALS)


def met_by(target: str, ratio: float) -> float:
    """How far a ratio meets its target: >= 1 when met (busbw ratio / goal, goal /
    time ratio)."""
    goal = GOALS[target]
    return ratio / goal if target.startswith("busbw") else goal / ratio


def at(result: dict[str, Any], size: int) -> dict[str, Any] | None:
    return next((r for r in result["rows"] if r["size"] == size), None)


def ratios(
    res: dict[str, dict[str, Any]], big: int, mid: int, small: int, fw: str = "mrc"
) -> dict[str, Any]:
    """The issue's targets: mrc (fw) against the better peer at each size."""
    out: dict[str, Any] = {"sizes": {"busbw": big, "time": mid, "latency": small}}
    m_big, m_mid, m_small = (at(res[fw], s) for s in (big, mid, small))
    peers_big = [at(res[p], big) for p in PEERS]
    best_bw = max((r["busbw_gbps"] for r in peers_big if r), default=None)
    peers_mid = [r["time_us"] for r in (at(res[p], mid) for p in PEERS) if r]
    peers_small = [r["time_us"] for r in (at(res[p], small) for p in PEERS) if r]
    if m_big and best_bw:
        out["busbw_vs_best_peer"] = round(m_big["busbw_gbps"] / best_bw, 3)
        out["busbw_vs_line"] = round(m_big["busbw_gbps"] / LINE_GBPS, 3)
        out["mrc_cpu_cores"] = round(m_big["rank_cpu_cores"], 2)
        out["machine_busy_cores"] = round(m_big["machine_busy_cores"], 2)
    if m_mid and peers_mid:
        out["time_1m_vs_best_peer"] = round(m_mid["time_us"] / min(peers_mid), 3)
    if m_small and peers_small:
        out["latency_8b_vs_best_peer"] = round(m_small["time_us"] / min(peers_small), 3)
    out["targets"] = {
        "busbw_vs_best_peer": ">= 1.3",
        "busbw_vs_line": ">= 0.85 where the CPU allows",
        "time_1m_vs_best_peer": "<= 0.5",
        "latency_8b_vs_best_peer": "<= 1.0",
    }
    out["met"] = {
        k: out[k] >= g if k.startswith("busbw") else out[k] <= g
        for k, g in GOALS.items()
        if k in out
    }
    return out


LAT_ITERS = 1000  # 8 B operations per framework and round


def target_rounds(fab: Any, n: int, quick: bool) -> dict[str, Any]:
    """The targets' sizes, mrc and the peers in turn, n rounds; ratios per round and
    their medians."""
    big = (4 << 20) if quick else KEY_SIZE
    per_round: list[dict[str, Any]] = []
    for k in range(n):
        click.echo(f"targets, round {k + 1} of {n}:")
        res: dict[str, dict[str, Any]] = {}
        for fw in ("mrc", *PEERS):
            # 8 B: a mean over 1000 operations (0.1-1.3 s), so that one scheduling stall of
            # a few ms on this 2-core host does not decide it (over 30, as before, one such
            # stall moved the mean by 100 us or more).
            tiny = launch(fab, fw, "all_reduce", [8], 2 if quick else LAT_ITERS, 2 if quick else 20)
            small = launch(fab, fw, "all_reduce", [1 << 20], 2 if quick else 30, 2)
            large = launch(fab, fw, "all_reduce", [big], 2 if quick else 5, 1)
            res[fw] = {"rows": tiny.rows + small.rows + large.rows}
            for row in res[fw]["rows"]:
                click.echo(f"  {fw:12s} {row['size']:>10d} B {row['time_us']:12.1f} us")
        r = ratios(res, big, 1 << 20, 8)
        per_round.append({k2: r[k2] for k2 in TARGETS if k2 in r} | {"met": r["met"]})
    median: dict[str, float] = {}
    met_in: dict[str, int] = {}
    for t in TARGETS:
        vals = sorted(x[t] for x in per_round if t in x)
        if vals:
            median[t] = round(statistics.median(vals), 3)
            met_in[t] = sum(1 for x in per_round if x["met"].get(t))
    click.echo(f"targets over {n} rounds: median {median}, met in {met_in} of {n}")
    return {"sizes": {"busbw": big, "time": 1 << 20, "latency": 8}, "rounds": per_round,
            "median": median, "met_in_rounds": met_in, "n": n}  # fmt: skip


@click.command()
@click.option("--quick", is_flag=True, help="8 B .. 4 MiB, 2 iterations: a check that it runs.")
@click.option(
    "--rounds",
    type=click.IntRange(0, 20),
    default=3,
    show_default=True,
    help="Rounds of the targets' sizes (8 B, 1 MiB, 64 MiB) for mrc and every peer.",
)
@click.option(
    "--bind",
    type=click.Choice(BIND_MODES),
    default="none",
    show_default=True,
    help="core: every rank (mrc, Gloo, Open MPI alike) bound as mrc-run --bind-to core binds it.",
)
def main(quick: bool, rounds: int, bind: str) -> None:
    record_load()
    os.environ["MRC_BENCH_BIND"] = bind  # read by coll_worker.py in every rank
    versions = setup_peers()
    click.echo(f"peers: {versions}")
    res: dict[str, dict[str, Any]] = {}
    other: dict[str, dict[str, Any]] = {}
    other_size = (4 << 20) if quick else KEY_SIZE
    with fabric_up(FAB_1G, prefix="bcf") as fab:
        for fw in FRAMEWORKS:
            click.echo(f"all_reduce, {fw}:")
            res[fw] = sweep(fab, fw, quick)
        for coll in OTHER:
            other[coll] = {}
            for fw in ("mrc", "gloo", "mpi_default"):
                r = launch(fab, fw, coll, [other_size], 2 if quick else 5, 1)
                row = r.rows[0] if r.rows else None
                other[coll][fw] = {
                    "row": row,
                    "status": r.status,
                    "error": r.message if r.status != "ok" else None,
                    "retried_start": r.retried,
                }
                click.echo(f"  {coll:15s} {fw:12s} busbw {gbps(row)} Gbit/s ({r.status})")
        repeated = target_rounds(fab, rounds, quick) if rounds else None
    big, mid = (4 << 20, 1 << 20) if quick else (KEY_SIZE, 1 << 20)
    summary = ratios(res, big, mid, 8)
    summary["mrc_planes"] = ratios(res, big, mid, 8, "mrc_planes")
    summary["rounds"] = repeated
    click.echo(f"ratios: {summary}")
    name = "collectives_fabric" + ("-bound" if bind == "core" else "") + ("-quick" if quick else "")
    out = save(
        name,
        {
            "benchmark": "all_reduce and other collectives on the shaped 4 x 1 Gbit/s fabric, "
            "4 ranks: mrc, Gloo, Open MPI (default and ring)",
            "quick": quick,
            "fabric": str(FAB_1G.name),
            "line_gbps": LINE_GBPS,
            "peers": versions,
            "mpi_mca": dict(YIELD),
            "binding": bind,
            "note": load_note(),
            "all_reduce": res,
            "other_collectives": other,
            "summary": summary,
        },
    )
    plot(res, other, repeated, name)
    click.echo(f"wrote {out}")


def plot(
    res: dict[str, dict[str, Any]],
    other: dict[str, dict[str, Any]],
    repeated: dict[str, Any] | None,
    name: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(19, 4.5))
    for fw in FRAMEWORKS:
        rows = res[fw]["rows"]
        if rows:
            a1.plot([r["size"] for r in rows], [r["busbw_gbps"] for r in rows], "o-", ms=3,
                    label=fw)  # fmt: skip
    a1.axhline(LINE_GBPS, color="gray", ls=":", label="line (4 x 1 Gbit/s)")
    a1.set_xscale("log", base=2)
    a1.set_xlabel("all_reduce size (bytes)")
    a1.set_ylabel("busbw (Gbit/s)")
    a1.set_title("all_reduce busbw, 4 ranks, shaped fabric")
    a1.legend(fontsize=8)
    colls = list(other)
    fws = ("mrc", "gloo", "mpi_default")
    for i, fw in enumerate(fws):
        vals = [gbps(other[c][fw]["row"]) or 0.0 for c in colls]
        a2.bar([x + 0.27 * (i - 1) for x in range(len(colls))], vals, 0.27, label=fw)
    a2.set_xticks(range(len(colls)), colls)
    a2.set_ylabel("busbw (Gbit/s)")
    a2.set_title("other collectives")
    a2.legend(fontsize=8)
    # The targets per round, each as how far it is met (>= 1: met for all four).
    if repeated:
        for i, t in enumerate(TARGETS):
            ys = [met_by(t, r[t]) for r in repeated["rounds"] if t in r]
            a3.plot([i] * len(ys), ys, "o", alpha=0.7)
            if t in repeated["median"]:
                a3.plot([i - 0.2, i + 0.2], [met_by(t, repeated["median"][t])] * 2, "k-")
        a3.axhline(1.0, color="gray", ls=":")
        a3.set_xticks(range(len(TARGETS)),
                      ["64 MiB busbw\nvs peer (1.3x)", "64 MiB busbw\nvs line (0.85)",
                       "1 MiB time\nvs peer (0.5x)", "8 B time\nvs peer (1x)"],
                      fontsize=8)  # fmt: skip
        a3.set_ylabel("how far met (>= 1: met)")
        a3.set_yscale("log")
        a3.set_title(f"targets, {repeated['n']} rounds (dots) and median (bar)")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=100)


if __name__ == "__main__":
    main()
