"""all_reduce of CUDA tensors through mrc's pinned-host staging, next to the same
sizes in host memory and torch's Gloo backend with CUDA tensors, in one run
(issue 15). N ranks are processes on one machine sharing its GPU, on loopback
planes. Also measures the D2H/H2D copy bandwidth of pinned memory beside the
transfer, and the staging overhead (CUDA time / host time - 1).

    python benchmarks/gpu_allreduce.py [--quick] [--ranks 4] [--out FILE.json]

Needs a CUDA device and torch (tools/gpu_check.sh runs it); writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

SIZES_FULL = [1 << 20, 4 << 20, 16 << 20, 64 << 20]
SIZES_QUICK = [1 << 20, 64 << 20]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _timed(fn: Any, iters: int, sync: Any) -> float:
    fn()  # warm-up (registrations, plans, pinned buffers)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def worker(rank: int, n: int, sizes: list[int], iters: int, port: int, store: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import mrc

    env = {"RANK": str(rank), "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}  # fmt: skip
    comm = mrc.Communicator.from_env(env)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=n)
    sync = torch.cuda.synchronize
    rows = []
    for nbytes in sizes:
        count = nbytes // 4
        host = np.ones(count, np.float32)
        dev = torch.ones(count, device="cuda")
        t_host = _timed(partial(comm.all_reduce, host), iters, sync)
        t_cuda = _timed(partial(comm.all_reduce, dev), iters, sync)
        t_gloo = _timed(partial(dist.all_reduce, dev), iters, sync)
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        d8 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        t_d2h = _timed(partial(pinned.copy_, d8, non_blocking=True), iters, sync)
        t_h2d = _timed(partial(d8.copy_, pinned, non_blocking=True), iters, sync)
        # The timed calls reduce in place and grow the values: check a fresh one.
        a = torch.full((count,), float(rank + 1), device="cuda")
        comm.all_reduce(a)
        ok = bool((a == n * (n + 1) / 2).all().item())
        rows.append({"bytes": nbytes, "host_s": t_host, "cuda_s": t_cuda, "gloo_cuda_s": t_gloo,
                     "d2h_GBps": nbytes / t_d2h / 1e9, "h2d_GBps": nbytes / t_h2d / 1e9,
                     "correct": ok})  # fmt: skip
    if rank == 0:
        print(json.dumps(rows))
    dist.destroy_process_group()
    comm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="two sizes, fewer iterations")
    ap.add_argument("--out", default="benchmarks/results/gpu_allreduce.json")
    ap.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--store", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    sizes, iters = (SIZES_QUICK, 3) if a.quick else (SIZES_FULL, 10)
    if a.worker >= 0:
        worker(a.worker, a.ranks, sizes, iters, a.port, a.store)
        return
    port = _free_port()
    store = tempfile.mktemp(prefix="mrc-gpu-bench-")
    cmd = [sys.executable, __file__, "--ranks", str(a.ranks), "--port", str(port),
           "--store", store] + (["--quick"] if a.quick else [])  # fmt: skip
    procs = [subprocess.Popen(cmd + ["--worker", str(r)], stdout=subprocess.PIPE, text=True)
             for r in range(a.ranks)]  # fmt: skip
    outs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"a rank failed: exit codes {[p.returncode for p in procs]}")
    rows = json.loads(outs[0].strip().splitlines()[-1])
    import torch

    for r in rows:
        r["staging_overhead"] = r["cuda_s"] / r["host_s"] - 1
        r["cuda_vs_gloo"] = r["gloo_cuda_s"] / r["cuda_s"]
        r["busbw_cuda_Gbps"] = r["bytes"] * 8 * 2 * (a.ranks - 1) / a.ranks / r["cuda_s"] / 1e9
    result = {"benchmark": "gpu_allreduce", "ranks": a.ranks,
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "target": "staging overhead at 64 MiB <= 10%", "rows": rows}  # fmt: skip
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'bytes':>10} {'host ms':>9} {'cuda ms':>9} {'gloo ms':>9} {'overhead':>9} "
          f"{'D2H GB/s':>9} {'H2D GB/s':>9} ok")  # fmt: skip
    for r in rows:
        print(f"{r['bytes']:>10} {r['host_s'] * 1e3:9.2f} {r['cuda_s'] * 1e3:9.2f} "
              f"{r['gloo_cuda_s'] * 1e3:9.2f} {r['staging_overhead']:9.1%} "
              f"{r['d2h_GBps']:9.1f} {r['h2d_GBps']:9.1f} {r['correct']}")  # fmt: skip
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        xs = [r["bytes"] / 2**20 for r in rows]
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, label in (("host_s", "mrc, host memory"), ("cuda_s", "mrc, CUDA (staged)"),
                           ("gloo_cuda_s", "Gloo, CUDA")):  # fmt: skip
            ax.plot(xs, [r[key] * 1e3 for r in rows], "o-", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("all_reduce size (MiB, float32)")
        ax.set_ylabel("time per call (ms)")
        ax.set_title(f"{a.ranks} ranks on one GPU machine, loopback planes")
        ax.legend()
        fig.tight_layout()
        fig.savefig(Path(a.out).with_suffix(".png"), dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    if os.path.exists(store):
        os.unlink(store)


if __name__ == "__main__":
    main()
