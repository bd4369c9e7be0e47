"""Collective soak: thousands of random collectives on 4 ranks while links drop packets
and fail and heal, every result checked bit for bit.

Four ranks (mrc-run, one per host of the shaped 4-host 4-plane fabric) make the same
random sequence of calls (mrc/collectives/soak.py: every collective, op and dtype, in
place and not, 0 elements to --max-bytes, uneven all_to_all counts, barriers, batches
of async all_reduces); each rank checks each result against numpy in rank order. Side
by side, in the same run: the same sequence with no faults, then with --loss percent
dropped on every link and a random link (host cable or leaf-spine) failed or healed
every 0.2-1.0 x --flap-s seconds, never cutting a pair of hosts off (a failure that
would is skipped: the transport cannot carry data with no path, and its timeout then
rightly fails the connection). Any wrong bit, error or hang ends the run with the call
that failed. Results: results/coll_soak.json (calls, faults, times, the ratio, each
rank's counters) and results/coll_soak.png (calls done over time, faults marked).
Root only.

    python benchmarks/coll_soak.py [--calls 3000] [--loss 2] [--flap-s 0.3]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import click
from common import RESULTS, record_load, save

from mrc.fabric.testing import Faults, RunningFabric, fabric_up

ROOT = Path(__file__).resolve().parent.parent
FABRIC = ROOT / "routing" / "4host-4plane-1g.toml"
PROGRESS_EVERY = 10


def run_rank() -> None:
    """One rank, under mrc-run: the calls of SOAK_SEED, SOAK_CALLS, SOAK_MAX_BYTES."""
    import mrc
    from mrc.collectives import soak

    seed, calls = int(os.environ["SOAK_SEED"]), int(os.environ["SOAK_CALLS"])
    max_bytes = int(os.environ["SOAK_MAX_BYTES"])
    comm = mrc.Communicator.from_env()

    def say(**msg: Any) -> None:
        print(json.dumps({"rank": comm.rank, **msg}), flush=True)

    comm.barrier()
    t0 = time.monotonic()
    say(event="start", wall=time.time())
    kinds: Counter[str] = Counter()
    for i in range(calls):
        c = soak.call(seed, i, comm.size, max_bytes)
        try:
            good = soak.run(comm, seed, c)
        except Exception as e:
            say(event="error", call=c.describe(), error=f"{type(e).__name__}: {e}")
            sys.exit(2)
        if not good:
            say(event="mismatch", call=c.describe())
            sys.exit(3)
        kinds[c.kind] += 1
        if comm.rank == 0 and (i + 1) % PROGRESS_EVERY == 0:
            say(event="progress", calls=i + 1, t=round(time.monotonic() - t0, 3))
    st = comm.stats()["endpoint"]
    keep = ("retx", "lost_rto", "lost_rack", "rx_malformed", "staged_msgs", "link_events")
    say(event="done", calls=calls, secs=round(time.monotonic() - t0, 3), kinds=dict(kinds),
        counters={k: st[k] for k in keep if k in st})  # fmt: skip
    comm.close()


def soak(fab: RunningFabric, label: str, seed: int, calls: int, max_bytes: int,
         timeout: float) -> dict[str, Any]:  # fmt: skip
    """One sequence under mrc-run: rank 0's progress, every rank's end, or the failure."""
    env = {**os.environ, "SOAK_SEED": str(seed), "SOAK_CALLS": str(calls),
           "SOAK_MAX_BYTES": str(max_bytes)}  # fmt: skip
    argv = [sys.executable, "-m", "mrc.run", "-n", "4", "--fabric", fab.file,
            "--name", fab.prefix, "--timeout", str(timeout), "--",
            sys.executable, __file__, "--worker"]  # fmt: skip
    t0 = time.monotonic()
    # stderr to a file: a pipe read only at the end could fill and stop mrc-run.
    errf = tempfile.TemporaryFile("w+")
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=errf, text=True)
    progress: list[tuple[float, int]] = [(0.0, 0)]
    ends: dict[int, dict[str, Any]] = {}
    failures: list[dict[str, Any]] = []
    shown, start_wall = 0.0, 0.0
    assert p.stdout is not None
    for line in p.stdout:
        _, _, body = line.partition("] ")
        if not body.startswith("{"):
            continue
        msg = json.loads(body)
        if msg.get("event") == "start" and msg["rank"] == 0:
            start_wall = msg["wall"]
        elif msg.get("event") == "progress":
            progress.append((msg["t"], msg["calls"]))
            if msg["calls"] / calls >= shown + 0.1:
                shown = msg["calls"] / calls
                click.echo(f"{label}: {shown:4.0%}  {msg['t']:6.1f} s", err=True)
        elif msg.get("event") == "done":
            ends[msg["rank"]] = msg
        elif msg.get("event") in ("error", "mismatch"):
            failures.append(msg)
    rc = p.wait()
    errf.seek(0)
    err = errf.read()
    errf.close()
    out = {"label": label, "rc": rc, "wall_s": round(time.monotonic() - t0, 2),
           "start_wall": start_wall, "progress": progress,
           "ranks": [ends[r] for r in sorted(ends)],
           "failures": failures}  # fmt: skip
    if rc or failures or len(ends) != 4:
        out["stderr_tail"] = err[-4000:]
    return out


def plot(runs: dict[str, dict[str, Any]], faults: Faults, row: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for label, r in runs.items():
        ts, cs = zip(*r["progress"], strict=True)
        ax.plot(ts, cs, label=f"{label}: {r['secs']:.1f} s", lw=1.2)
    t0 = runs["faults"]["start_wall"]  # the faults run's first call
    fails = [t - t0 for t, what, _ in faults.events if what == "fail"]
    heals = [t - t0 for t, what, _ in faults.events if what == "heal"]
    ax.plot(fails, [0] * len(fails), "|", color="tab:red", ms=12, label="link failed")
    ax.plot(heals, [0] * len(heals), "|", color="tab:green", ms=8, label="link healed")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("calls done, every result bit-exact")
    ax.set_title(
        f"{row['calls']} random collectives on 4 ranks: {row['loss_percent_per_link']}% loss "
        f"per link, {len(fails)} link failures: {row['time_ratio']:.2f}x the fault-free time",
        fontsize=9,
    )
    ax.legend(loc="lower right")
    fig.tight_layout()
    out = RESULTS / "coll_soak.png"
    fig.savefig(out, dpi=100)
    return out


@click.command()
@click.option("--calls", default=3000, show_default=True, help="Random collective calls.")
@click.option("--max-bytes", default=4 << 20, show_default=True, help="Largest call, bytes.")
@click.option("--loss", default=2.0, show_default=True, help="Percent loss on every link.")
@click.option("--flap-s", default=0.3, show_default=True,
              help="A link fails or heals every 0.2-1.0 x this many seconds.")  # fmt: skip
@click.option("--seed", default=1, show_default=True, help="Which sequence of calls.")
@click.option("--timeout", default=60.0, show_default=True, help="Communicator timeout, s.")
@click.option("--worker", is_flag=True, hidden=True)
def main(calls: int, max_bytes: int, loss: float, flap_s: float, seed: int, timeout: float,
         worker: bool) -> None:  # fmt: skip
    if worker:
        return run_rank()
    record_load()
    runs: dict[str, dict[str, Any]] = {}
    with fabric_up(FABRIC, prefix="csoak") as fab:
        runs["no faults"] = soak(fab, "no faults", seed, calls, max_bytes, timeout)
        with Faults(fab, loss, flap_s, seed) as faults:
            runs["faults"] = soak(fab, "faults", seed, calls, max_bytes, timeout)
    ok = all(r["rc"] == 0 and not r["failures"] and len(r["ranks"]) == 4 for r in runs.values())
    for r in runs.values():
        r["secs"] = max((e["secs"] for e in r["ranks"]), default=float("nan"))
    row: dict[str, Any] = {
        "calls": calls,
        "max_bytes": max_bytes,
        "seed": seed,
        "loss_percent_per_link": loss,
        "link_failures": faults.failures,
        "failures_skipped_as_they_would_cut_a_pair": faults.skipped,
        "all_bit_exact": ok,
        "time_ratio": round(runs["faults"]["secs"] / runs["no faults"]["secs"], 3),
        "kinds": runs["no faults"]["ranks"][0]["kinds"] if runs["no faults"]["ranks"] else {},
    }
    data = {"benchmark": "coll_soak", "fabric": FABRIC.name, "row": row,
            "fault_events": faults.events, "runs": runs}  # fmt: skip
    out = save("coll_soak", data)
    if ok:
        png = plot(runs, faults, row)
        click.echo(
            f"{calls} calls bit-exact with and without faults; {row['link_failures']} link "
            f"failures, {loss}% loss per link: {row['time_ratio']:.2f}x the fault-free "
            f"time ({runs['faults']['secs']:.1f} vs {runs['no faults']['secs']:.1f} s). "
            f"{out}, {png}"
        )
        return
    for label, r in runs.items():
        for f in r["failures"]:
            click.echo(f"{label}: rank {f['rank']} {f['event']}: {json.dumps(f)}", err=True)
        if r.get("stderr_tail"):
            click.echo(f"{label}: mrc-run said:\n{r['stderr_tail']}", err=True)
    raise SystemExit(f"soak failed: see {out}")


if __name__ == "__main__":
    main()
