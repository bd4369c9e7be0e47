"""DDP step time of examples/ddp_train.py over mrc and over Gloo on the shaped fabric.

    sudo .venv/bin/python benchmarks/ddp_step.py [--steps 200] [--fabric routing/4host-4plane.toml]

Four ranks, one per fabric host namespace. Cases, each a fresh fabric:
  healthy          every link up
  failed-before    host h1's plane-1 link is down before the run starts (not plane 0: the
                   communicator's rendezvous and failure detector run over TCP to rank
                   0's plane-0 address, so a rank without plane 0 cannot join)
  failed-during    h1's plane-0 link goes down when rank 0 reports step `--fail-at` (the
                   failure detector's TCP connection rides it out for MRC_TIMEOUT seconds)
Gloo runs over TCP on plane 0 only (GLOO_SOCKET_IFNAME = each host's plane-0 interface),
so a failed plane-0 link cuts it: its outcome is recorded as it is (error or timeout). mrc
sprays every plane and rides out the failure. Per case: the median step time, the median
time per step an all-reduce was in flight (DDP's buckets, from a comm hook), the loss
curve's checksum (mrc's must not change with the failure), and the exit status.
Writes benchmarks/results/ddp_step.json and ddp_step.png.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common import RESULTS, record_load, save

from mrc.fabric.testing import RunningFabric, fabric_up

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "ddp_train.py"
FAIL_HOST = "h1"
FAIL_PLANE = {"failed-before": 1, "failed-during": 0}


def launch(
    fab: RunningFabric,
    backend: str,
    steps: int,
    out: Path,
    timeout_s: float,
    fail_at: int | None,
    pg_timeout: float,
) -> dict[str, Any]:
    """Run the example on every host of fab; fail the link when rank 0 prints step fail_at."""
    hosts = [h.name for h in fab.fabric.hosts][:4]
    master = fab.fabric.host(hosts[0]).addrs[0]
    init = out / f"init-{backend}-{time.monotonic_ns()}"
    procs = []
    for r, h in enumerate(hosts):
        env = {
            **os.environ,
            "RANK": str(r),
            "WORLD_SIZE": str(len(hosts)),
            "MRC_MASTER_ADDR": master,
            "MRC_FABRIC": fab.file,
            "MRC_HOST": h,
            "MRC_TIMEOUT": str(pg_timeout),
            "GLOO_SOCKET_IFNAME": fab.fabric.host_link(h, 0).end(h)[0],
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
        }
        cmd = [sys.executable, str(EXAMPLE), "--backend", backend, "--steps", str(steps)]
        cmd += ["--init-method", f"file://{init}", "--timeout", str(pg_timeout)]
        if r == 0:
            cmd += ["--json", str(out / f"{backend}.json")]
        procs.append(fab.popen(h, cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    failed_at: list[float] = []

    def watch_rank0() -> None:
        assert procs[0].stdout is not None
        for line in procs[0].stdout:
            if fail_at is not None and not failed_at and line.startswith(f"step {fail_at} "):
                fab.fail(fab.fabric.host_link(FAIL_HOST, FAIL_PLANE["failed-during"]).name)
                failed_at.append(time.monotonic())

    t = threading.Thread(target=watch_rank0, daemon=True)
    t.start()
    start = time.monotonic()
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(max(1.0, start + timeout_s - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    res: dict[str, Any] = {"backend": backend, "exit": codes, "wall_s": time.monotonic() - start}
    js = out / f"{backend}.json"
    if codes[0] is not None and codes[0] != 0:
        res["outcome"] = f"failed (exit codes {codes})"
    elif js.exists():  # rank 0 finished training (its exit may still have hung)
        d = json.loads(js.read_text())
        res["step_ms_median"] = 1e3 * statistics.median(d["step_s"][5:])
        res["comm_ms_median"] = 1e3 * statistics.median(d["comm_s"][5:])
        res["sha256"] = d["sha256"]
        res["loss_bits_head"] = d["loss_bits"][:3]
        res["loss_sha256"] = hashlib.sha256(json.dumps(d["loss_bits"]).encode()).hexdigest()
        res["step_s"] = d["step_s"]
        js.unlink()
        if any(c != 0 for c in codes):
            res["outcome"] = f"trained, but exit codes {codes} (None: killed at the time limit)"
    else:
        res["outcome"] = "timed out" if None in codes else f"failed (exit codes {codes})"
    return res


def main() -> None:
    record_load()
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--fail-at", type=int, default=50)
    ap.add_argument("--fabric", default=str(ROOT / "routing" / "4host-4plane.toml"))
    ap.add_argument("--backends", default="mrc,gloo")
    ap.add_argument("--cases", default="healthy,failed-before,failed-during")
    ap.add_argument("--timeout", type=float, default=60.0, help="process group timeout, s")
    ap.add_argument("--out", default="ddp_step")
    args = ap.parse_args()
    out = Path("/tmp") / f"ddp_step-{os.getpid()}"
    out.mkdir(exist_ok=True)
    rows = []
    for case in args.cases.split(","):
        for backend in args.backends.split(","):
            with fabric_up(args.fabric, prefix=f"bdd{os.getpid() % 1000}") as fab:
                if case == "failed-before":
                    fab.fail(fab.fabric.host_link(FAIL_HOST, FAIL_PLANE[case]).name)
                fail_at = args.fail_at if case == "failed-during" else None
                r = launch(
                    fab, backend, args.steps, out, 3 * args.timeout + 120, fail_at, args.timeout
                )
            r["case"] = case
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "step_s"}), flush=True)
    path = save(args.out, {"steps": args.steps, "fabric": args.fabric, "rows": rows})
    plot(rows, RESULTS / f"{args.out}.png")
    print(f"wrote {path}")


def plot(rows: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels, steps, comms, colors = [], [], [], []
    for r in rows:
        labels.append(f"{r['backend']}\n{r['case']}")
        steps.append(r.get("step_ms_median", 0.0))
        comms.append(r.get("comm_ms_median", 0.0))
        colors.append("tab:blue" if r["backend"] == "mrc" else "tab:orange")
    x = range(len(rows))
    ax.bar(x, steps, color=colors, alpha=0.6, label="step (median)")
    ax.bar(x, comms, color=colors, label="all-reduce in flight (median)")
    for i, r in enumerate(rows):
        if "outcome" in r:
            ax.text(i, 0, r["outcome"], rotation=90, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("ms per DDP step")
    ax.set_title("examples/ddp_train.py, 4 ranks on the shaped fabric")
    ax.legend(fontsize=8)
    for r in rows:
        if "step_s" in r:
            ax2.plot([1e3 * s for s in r["step_s"]], label=f"{r['backend']} {r['case']}", lw=0.8)
    ax2.set_xlabel("step")
    ax2.set_ylabel("ms")
    ax2.set_yscale("log")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
