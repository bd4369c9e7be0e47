"""The resilient AllReduce on the shaped fabric (issue 13): measured against the model.

Runs as root. Fabric routing/4host-4plane-1g.toml (4 x 1 Gbit/s per host), 4 ranks,
float32 sum, 64 MiB and 256 MiB:

1. Healthy: mrc's planner (equal shares).
2. h1's plane-1 cable down (X = 1/4), each schedule as the direct
   schedule with given shares (all keep the fixed reduction order, so R2CC's split runs
   as shares: model.r2cc_shares): equal shares (everyone at the degraded rank's pace, as
   a ring), R2CC's split at Y* and at Y = X, and mrc's planner (the resilient shares).
   Measured next to model.share_time for the fabric's rates; the ring and the lower bound
   modelled. mrc's planner learns the hosts' own rate from its operations (resilient.py)
   and plans with it: its shares and prediction come from comm.stats() (the prediction
   is in sample: that rate is fitted to the same operations). Targets: mrc within 10%
   of its model (the link-rate model of the shares it ran, and the host model fitted to
   the healthy runs, out of sample); its overhead over the healthy run <= 1.25 x the
   bound's overhead (+6.7% at n=4, X=1/4). Beside them, the model with the hosts' own
   rate (model.host_limited; fitted here to the healthy run, so every degraded schedule
   is predicted out of sample) and "mrc_host": the shares for that fitted rate,
   measured, with the same two comparisons against that model. 1 and 2 run in 3
   interleaved rounds (--rounds: healthy, then each degraded schedule), each reported by
   its median: one run here can be 10-20% slower than the next.
3. The plane fails mid-loop (a timer half an operation after one ends) and heals later:
   per-operation times and hashes for mrc; Gloo and Open MPI on the same cable pull, as
   they behave (an error, a hang cut by the idle timeout, or times).
4. Overhead vs X: 1, 2, 3 of h1's planes down (X = 1/4, 1/2, 3/4), mrc's planner and
   equal shares measured, the model's candidates.
5. The model at n = 16, 64, 1024.

    python benchmarks/resilient_fabric.py            # full: about 15 minutes idle
    python benchmarks/resilient_fabric.py --quick    # 4 MiB, 2 iterations

Writes results/resilient_fabric.json and .png (--quick: resilient_fabric-quick.*).
"""

from __future__ import annotations

import threading
from typing import Any

import click
from common import RESULTS, load_note, record_load, save
from fabric_coll import FAB_1G, Run, run_gloo, run_mpi, run_mrc, setup_peers, worker_args

from mrc.collectives import model
from mrc.fabric.testing import fabric_up

N = 4
DEGRADED = 1  # h1
PLANE_RATE = 1e9 / 8  # bytes/s of one host link (the fabric file's 1gbit)
CABLES = ["h1-p1l0", "h1-p2l0", "h1-p3l0"]  # h1's planes 1, 2, 3 (plane 0 carries the bootstrap)
YIELD = [("mpi_yield_when_idle", "1")]


def heal(fab: Any, cables: list[str]) -> None:
    """Heal the cables and wait until h0 reaches h1 on each of their planes again: a peer
    that starts before the routes and neighbours are back fails its connects (Open MPI
    aborts at start-up)."""
    import sys
    import time

    from mrc.routing import host_planes

    # A TCP connect to a closed port: refused (exit 0) once the address is reachable.
    probe = (
        "import socket, sys\n"
        "try:\n"
        "    socket.create_connection((sys.argv[1], 9), timeout=1).close()\n"
        "except ConnectionRefusedError:\n"
        "    sys.exit(0)\n"
        "except OSError:\n"
        "    sys.exit(1)\n"
    )

    for c in cables:
        fab.heal(c)
    addrs = host_planes(fab.fabric, "h1")
    for c in cables:
        plane = CABLES.index(c) + 1
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            got = fab.run("h0", [sys.executable, "-c", probe, addrs[plane]], check=False)
            if got.returncode == 0:
                break


def rates(lost: int) -> list[float]:
    r = [4 * PLANE_RATE] * N
    r[DEGRADED] = (4 - lost) * PLANE_RATE
    return r


# Each measurement is a fresh mrc-run, so fresh endpoints: a cable that was down before they
# opened is found by the first packets lost on it (netlink only reports changes), and the
# first operations pay for those retransmissions and run before the agreement has seen the
# failed plane. The warm-up lets both settle before the timed loop.
WARMUP = 4


def measure(fab: Any, nbytes: int, iters: int, shares: list[float] | None) -> dict[str, Any]:
    extra = [] if shares is None else ["--shares", ",".join(repr(x) for x in shares)]
    r = run_mrc(fab, worker_args("all_reduce", [nbytes], iters, WARMUP, *extra))
    if r.status != "ok" or not r.rows:
        raise SystemExit(f"mrc all_reduce of {nbytes} B failed ({r.status}): {r.message}")
    row = r.rows[0]
    return {"time_s": row["time_us"] * 1e-6, "schedule": row["schedule"], "wrong": row["wrong"],
            "cpu_cores": row["rank_cpu_cores"], "plan": row.get("plan")}  # fmt: skip


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median time (the lower middle one of an even count), with every run's
    time beside it."""
    ordered = sorted(runs, key=lambda r: r["time_s"])
    return {**ordered[(len(ordered) - 1) // 2], "times_s": [r["time_s"] for r in runs]}


def schedules_case(fab: Any, nbytes: int, iters: int, rounds: int) -> dict[str, Any]:
    """Healthy, then h1's plane 1 down: every schedule measured and modelled, in
    `rounds` interleaved rounds (healthy, then each degraded schedule), each reported by
    its median. On this 2-core host one run can be 10-20% slower than the next, and the
    overhead target is a margin of 8%: a single run of each decides nothing."""
    hr = rates(0)
    healthy_model = model.share_time([1 / N] * N, hr, hr, nbytes)
    dr = rates(1)
    x = 0.25
    y_opt = model.r2cc_y_opt(dr, dr)
    cases: dict[str, list[float] | None] = {
        "equal": [1 / N] * N,
        "r2cc_y_opt": model.r2cc_shares(N, DEGRADED, y_opt),
        "r2cc_y_x": model.r2cc_shares(N, DEGRADED, x),
        # The planner's choice: the shares for the agreed link rates and the hosts' rate
        # it fits to its own operations (resilient.py).
        "mrc": None,
        # The shares for the host rate this benchmark fitted to the first healthy run
        # (set below, then the same in every round).
        "mrc_host": None,
    }
    healthy_runs: list[dict[str, Any]] = []
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
    planned_host = 0.0
    for rnd in range(rounds):
        healthy_runs.append(measure(fab, nbytes, iters, None))
        if rnd == 0:
            # The hosts' own rate, fitted to the healthy run only (model.host_limited,
            # docs/collectives-model.md 7): what mrc_host's shares are planned with.
            planned_host = model.fit_host_rate(N, nbytes, healthy_runs[0]["time_s"], healthy_model)
            cases["mrc_host"] = list(model.plan(dr, nbytes, host_rate=planned_host).shares)
        fab.fail(CABLES[0])
        try:
            for name, sh in cases.items():
                runs[name].append(measure(fab, nbytes, iters, sh))
        finally:
            heal(fab, CABLES[:1])
        click.echo(
            f"  {nbytes >> 20} MiB round {rnd + 1}/{rounds}: healthy "
            f"{healthy_runs[-1]['time_s'] * 1e3:.1f} ms, "
            + ", ".join(f"{k} {v[-1]['time_s'] * 1e3:.1f}" for k, v in runs.items())
        )
    healthy_m = _median_run(healthy_runs)
    rows = {}
    exact: dict[str, list[float]] = {}  # the shares each ran with, unrounded
    for name, sh in cases.items():
        m = _median_run(runs[name])
        if sh is not None:
            used = sh
        elif m["plan"] is not None:  # the shares the planner ran the last op with
            used = list(m["plan"]["shares"])
        else:
            used = [1 / N] * N
        pred = model.share_time(used, dr, dr, nbytes)
        exact[name] = used
        rows[name] = {
            **m,
            "shares": [round(v, 5) for v in used],
            "model_s": pred,
            "measured_vs_model": m["time_s"] / pred,
            "overhead_model": pred / healthy_model - 1,
        }
    # The host rate of the healthy runs, the same healthy time the overheads use: every
    # degraded schedule is predicted from it, none of them fitted.
    host = model.fit_host_rate(N, nbytes, healthy_m["time_s"], healthy_model)
    dm, _ = model.host_limited(dr, dr, host)
    hm, _ = model.host_limited(hr, hr, host)
    healthy_host = model.share_time([1 / N] * N, hm, hm, nbytes)
    for name, row in rows.items():
        pred_host = model.share_time(exact[name], dm, dm, nbytes)
        row["host_model_s"] = pred_host
        row["measured_vs_host_model"] = row["time_s"] / pred_host
        row["overhead_host_model"] = pred_host / healthy_host - 1
        row["overhead_measured"] = row["time_s"] / healthy_m["time_s"] - 1
        click.echo(
            f"  {nbytes >> 20} MiB {name:11s} {row['time_s'] * 1e3:8.1f} ms (model "
            f"{row['model_s'] * 1e3:7.1f}, with host {row['host_model_s'] * 1e3:7.1f}) overhead "
            f"{row['overhead_measured']:+.1%} (model {row['overhead_model']:+.1%}, with host "
            f"{row['overhead_host_model']:+.1%}) schedule {row['schedule']}"
        )
    bound = model.lower_bound(dr, dr, nbytes)
    mrc, mrc_host = rows["mrc"], rows["mrc_host"]
    # The planner's own prediction (the agreed link rates and the host rate it learnt).
    # In sample: that rate is fitted to these same operations' times, so it matches them
    # by construction (recorded, not a target). The out-of-sample check is the host
    # model fitted to the healthy runs (measured_vs_host_model).
    plan = mrc.get("plan") or {}
    mrc["planner_predicted_s"] = plan.get("predicted_s")
    mrc["planner_host_rate_gbps"] = plan.get("host_rate_gbps")
    mrc["measured_vs_planner"] = (
        mrc["time_s"] / plan["predicted_s"] if plan.get("predicted_s") else None
    )
    click.echo(
        f"  mrc's planner: host rate {plan.get('host_rate_gbps')} Gbit/s, predicted "
        f"{(plan.get('predicted_s') or float('nan')) * 1e3:.1f} ms, shares "
        f"{[round(v, 4) for v in plan.get('shares', [])]}"
    )
    bound_over = bound / healthy_model - 1
    host_bound = model.lower_bound(dr, dr, nbytes, host)
    host_bound_over = host_bound / healthy_host - 1  # healthy: the bound with equal rates
    return {
        "nbytes": nbytes,
        "healthy": {**healthy_m, "model_s": healthy_model},
        "degraded": rows,
        "ring_model_s": model.ring_time(dr, dr, nbytes),
        "lower_bound_s": bound,
        "bound_overhead": bound_over,
        "y_opt": y_opt,
        "host_rate_gbps": host * 8 / 1e9,
        "host_rate_planned_gbps": planned_host * 8 / 1e9,
        "host_lower_bound_s": host_bound,
        "host_bound_overhead": host_bound_over,
        "targets": {
            "mrc_within_10pct_of_model": abs(mrc["measured_vs_model"] - 1) <= 0.10,
            # Out of sample: the host model fitted to the healthy runs, predicting the
            # degraded run of the shares mrc's planner chose.
            "mrc_within_10pct_of_host_model": abs(mrc["measured_vs_host_model"] - 1) <= 0.10,
            "mrc_overhead_le_1.25x_bound": mrc["overhead_measured"] <= 1.25 * bound_over,
            # The same two with the host rate in the model and the planner (not the
            # issue's targets, which are the two above).
            "mrc_host_within_10pct_of_host_model": (
                abs(mrc_host["measured_vs_host_model"] - 1) <= 0.10
            ),
            "mrc_host_overhead_le_1.25x_host_bound": (
                mrc_host["overhead_measured"] <= 1.25 * host_bound_over
            ),
        },
    }


def loop_case(
    fab: Any, fw: str, nbytes: int, n_ops: int, fail_op: int, heal_op: int, idle: float
) -> dict[str, Any]:
    """n_ops all_reduces; half an operation after op fail_op ends, h1's plane-1 cable is
    pulled; after op heal_op it is healed. Per-op times as the framework reports them."""
    events: dict[str, Any] = {}
    times: list[float] = []

    def on_row(row: dict[str, Any]) -> None:
        if "op" not in row:
            return
        times.append(row["time_s"])
        if row["op"] == fail_op and "fail" not in events:
            t = threading.Timer(row["time_s"] / 2, fab.fail, [CABLES[0]])
            t.start()
            events["fail"] = (row["op"], t)
        if row["op"] == heal_op and "heal" not in events:
            events["fail"][1].join()
            heal(fab, CABLES[:1])
            events["heal"] = row["op"]

    args = worker_args("all_reduce", [nbytes], 1, 0, "--loop", str(n_ops), "--random")
    run: Run
    if fw == "mrc":
        run = run_mrc(fab, args, on_row=on_row, idle_timeout=idle)
    elif fw == "gloo":
        run = run_gloo(fab, args, on_row=on_row, idle_timeout=idle)
    else:
        # run_mpi starts once more when Open MPI failed at start-up (before any operation,
        # so before the cable pull).
        run = run_mpi(fab, args, fw.split("_")[1], YIELD, on_row=on_row, idle_timeout=idle)
    if "fail" in events:
        events["fail"][1].join()
    if "heal" not in events and "fail" in events:
        heal(fab, CABLES[:1])  # the run ended (or hung) before the heal
    ops = [r for r in run.rows if "op" in r]
    shas = {r["sha"] for r in ops}
    out = {
        "framework": fw,
        "status": run.status,
        "error": run.message if run.status != "ok" else None,
        "ops_done": len(ops),
        "times_s": [r["time_s"] for r in ops],
        "schedules": [r["schedule"] for r in ops],
        "identical_bits": len(shas) == 1 if ops else None,
        "exact_vs_rank_order": all(r["exact"] for r in ops) if ops else None,
        "retried_start": run.retried,
        "fail_after_op": fail_op,
        "heal_after_op": events.get("heal"),
    }
    click.echo(
        f"  mid-loop {fw:12s}: {run.status}, {len(ops)}/{n_ops} ops, max "
        f"{max(out['times_s'], default=0) * 1e3:.1f} ms, identical bits {out['identical_bits']}"
        + (f": {out['error'][-200:]}" if out["error"] else "")
    )
    return out


def overhead_vs_x(fab: Any, nbytes: int, iters: int) -> list[dict[str, Any]]:
    # Healthy before and after the degraded runs, the faster one: a single healthy
    # measurement slowed by other load would make every overhead look negative.
    healthy = measure(fab, nbytes, iters, None)["time_s"]
    hr = rates(0)
    h_model = model.share_time([1 / N] * N, hr, hr, nbytes)
    rows = []
    degraded = []
    for lost in (1, 2, 3):
        for c in CABLES[:lost]:
            fab.fail(c)
        try:
            dr = rates(lost)
            m = measure(fab, nbytes, iters, None)
            eq = measure(fab, nbytes, iters, [1 / N] * N)
        finally:
            heal(fab, CABLES[:lost])
        degraded.append((lost, dr, m, eq))
    healthy = min(healthy, measure(fab, nbytes, iters, None)["time_s"])
    for lost, dr, m, eq in degraded:
        x = lost / 4
        used = m["plan"]["shares"] if m["plan"] else model.plan(dr, nbytes).shares
        mrc_model = model.share_time(used, dr, dr, nbytes)  # the link-rate model of its shares
        r2cc = model.r2cc_time(dr, dr, model.r2cc_y_opt(dr, dr), nbytes)
        row = {
            "x": x,
            "planes_lost": lost,
            "mrc_measured": m["time_s"] / healthy - 1,
            "mrc_schedule": m["schedule"],
            "mrc_shares": [round(v, 5) for v in used],
            "equal_measured": eq["time_s"] / healthy - 1,
            "mrc_model": mrc_model / h_model - 1,
            "equal_model": model.share_time([1 / N] * N, dr, dr, nbytes) / h_model - 1,
            "bound_model": model.lower_bound(dr, dr, nbytes) / h_model - 1,
            "ring_model": model.ring_time(dr, dr, nbytes) / h_model - 1,
            "r2cc_y_opt_model": r2cc / h_model - 1,
        }
        rows.append(row)
        click.echo(
            f"  X = {x:.2f}: mrc {row['mrc_measured']:+.1%} (model {row['mrc_model']:+.1%}), "
            f"equal {row['equal_measured']:+.1%} (model {row['equal_model']:+.1%}), "
            f"bound {row['bound_model']:+.1%}"
        )
    return rows


def model_at_scale() -> list[dict[str, Any]]:
    rows = []
    for n in (4, 16, 64, 1024):
        for x in (0.25, 0.5, 0.75):
            s = model.summary(n, x)
            h = s["healthy"]
            rows.append(
                {"n": n, "x": x, **{k: round(v, 6) for k, v in s.items()},
                 **{f"{k}_overhead": round(s[k] / h - 1, 6)
                    for k in ("ring", "split_opt", "split_x", "lower_bound", "mrc")}}
            )  # fmt: skip
    return rows


@click.command()
@click.option("--quick", is_flag=True, help="4 MiB, 2 iterations, 1 round: a check that it runs.")
@click.option(
    "--rounds",
    type=click.IntRange(1, 9),
    default=None,
    help="Interleaved rounds of the schedules (healthy, then each degraded), medians "
    "reported [default: 3, --quick 1].",
)
def main(quick: bool, rounds: int | None) -> None:
    record_load()
    versions = setup_peers()
    sizes = [4 << 20] if quick else [64 << 20, 256 << 20]
    iters = 2 if quick else 5
    if rounds is None:
        rounds = 1 if quick else 3
    loop_bytes = (4 << 20) if quick else (64 << 20)
    n_ops, fail_op, heal_op = (16, 4, 10) if quick else (40, 10, 25)
    idle = 20.0 if quick else 60.0
    with fabric_up(FAB_1G, prefix="brf") as fab:
        click.echo("schedules, h1's plane 1 down before the run:")
        sched = [schedules_case(fab, s, iters, rounds) for s in sizes]
        click.echo("plane 1 of h1 pulled mid-loop, healed later:")
        loops = [
            loop_case(fab, fw, loop_bytes, n_ops, fail_op, heal_op, idle)
            for fw in ("mrc", "gloo", "mpi_default", "mpi_ring")
        ]
        click.echo("overhead vs X:")
        over = overhead_vs_x(fab, sizes[0], iters)
    mrc_loop = loops[0]
    dr = rates(1)
    ring_deg = model.ring_time(dr, dr, loop_bytes)
    eq_meas = next(c for c in sched if c["nbytes"] == sizes[0])["degraded"]["equal"]["time_s"]
    # The loop starts cold (no warm-up op, as a job's first all_reduce): its slowest op
    # can come before the pull, so the ops from the pull on are reported apart.
    times = mrc_loop["times_s"]
    from_pull = times[mrc_loop["fail_after_op"] :]
    loop_check = {
        "max_op_s": max(times, default=None),
        "slowest_op": max(range(len(times)), key=times.__getitem__) if times else None,
        "max_op_from_pull_s": max(from_pull, default=None),
        "ring_degraded_model_s": ring_deg,
        "equal_shares_degraded_measured_s": eq_meas if loop_bytes == sizes[0] else None,
        "no_op_slower_than_ring_model": max(times, default=0) <= ring_deg,
        "no_op_from_pull_slower_than_equal_measured": (
            max(from_pull, default=0) <= eq_meas if loop_bytes == sizes[0] else None
        ),
    }
    click.echo(
        f"  mrc from the pull on: slowest {loop_check['max_op_from_pull_s'] or 0:.3f} s; "
        f"whole loop: slowest op {loop_check['slowest_op']} at {loop_check['max_op_s'] or 0:.3f} s"
        f" (ring model for the degraded state {ring_deg:.3f} s)"
    )
    name = "resilient_fabric-quick" if quick else "resilient_fabric"
    out = save(
        name,
        {
            "benchmark": "resilient all_reduce on the shaped 4 x 1 Gbit/s fabric, 4 ranks, "
            "h1's plane(s) down",
            "quick": quick,
            "rounds": rounds,
            "peers": versions,
            "note": load_note(),
            "schedules": sched,
            "mid_loop": loops,
            "mid_loop_check": loop_check,
            "overhead_vs_x": over,
            "model_at_scale": model_at_scale(),
        },
    )
    plot(sched, loops, over, name)
    click.echo(f"wrote {out}")


def plot(sched: list[dict], loops: list[dict], over: list[dict], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(17, 4.5))
    case = sched[0]
    names = list(case["degraded"])
    xs = range(len(names))
    for dx, key, label in (
        (-0.27, "time_s", "measured"),
        (0.0, "model_s", "model (wire)"),
        (0.27, "host_model_s", "model (wire + host)"),
    ):
        a1.bar([x + dx for x in xs], [case["degraded"][k][key] * 1e3 for k in names], 0.27,
               label=label)  # fmt: skip
    a1.axhline(case["lower_bound_s"] * 1e3, color="red", ls="--", label="lower bound")
    a1.axhline(case["ring_model_s"] * 1e3, color="gray", ls=":", label="ring (model)")
    a1.axhline(case["healthy"]["time_s"] * 1e3, color="green", ls="-.", label="healthy measured")
    a1.set_xticks(list(xs), names)
    a1.set_ylabel("ms")
    a1.set_title(f"{case['nbytes'] >> 20} MiB, h1 lost plane 1")
    a1.legend(fontsize=7)
    for lp in loops:
        if lp["times_s"]:
            a2.plot([t * 1e3 for t in lp["times_s"]], ".-", ms=3,
                    label=f"{lp['framework']} ({lp['status']})")  # fmt: skip
    a2.axvline(loops[0]["fail_after_op"] + 0.5, color="red", ls="--", label="cable pulled")
    if loops[0]["heal_after_op"] is not None:
        a2.axvline(loops[0]["heal_after_op"] + 0.5, color="green", ls="--", label="healed")
    a2.set_xlabel("operation")
    a2.set_ylabel("ms per all_reduce")
    a2.set_yscale("log")
    a2.set_title("plane fails mid-loop")
    a2.legend(fontsize=7)
    xs2 = [r["x"] for r in over]
    for key, style in (
        ("mrc_measured", "o-"),
        ("equal_measured", "s-"),
        ("mrc_model", "o--"),
        ("equal_model", "s--"),
        ("bound_model", "r:"),
        ("r2cc_y_opt_model", "^--"),
    ):
        a3.plot(xs2, [r[key] * 100 for r in over], style, label=key)  # fmt: skip
    a3.set_xlabel("X (fraction of h1's bandwidth lost)")
    a3.set_ylabel("overhead over healthy (%)")
    a3.set_title("overhead vs X")
    a3.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=100)


if __name__ == "__main__":
    main()
