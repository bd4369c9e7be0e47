"""Shared by the collective benchmarks on the namespace fabric: set-up of the peers (Gloo
through torch, Open MPI through mpi4py), and launching 4 ranks of coll_worker.py in the
host namespaces with mrc, Gloo or Open MPI.

- mrc: mrc-run --fabric (rank r in host r's namespace).
- Gloo: mrc-run too (it sets RANK, WORLD_SIZE, MASTER_ADDR = h0's plane-0 address,
  MASTER_PORT), with GLOO_SOCKET_IFNAME listing the 4 planes' interfaces.
- Open MPI: mpirun inside h0's namespace, its rsh agent (tools: this file's
  `agent` mode) starting each orted in the namespace of the host it names; btl tcp,self on
  the planes' interfaces; ring (coll_tuned_allreduce_algorithm=4 with dynamic rules) or
  default.

Every run streams rank 0's JSON lines to a callback; a run that prints nothing for
`idle_timeout` seconds is killed and reported as a hang.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import ensure_tool

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(Path(__file__).resolve().parent / "coll_worker.py")
FAB_1G = ROOT / "routing" / "4host-4plane-1g.toml"
TORCH = "torch==2.13.0"  # the CPU wheel; never an unpinned torch
NICS = "nic0,nic1,nic2,nic3"
PY = sys.executable


def ensure_torch() -> None:
    """torch (Gloo's peer) in this venv: the pinned CPU wheel, installed when missing."""
    try:
        import torch  # noqa: F401
    except ImportError:
        subprocess.run([PY, "-m", "pip", "install", "-q", TORCH], check=True)


def setup_peers() -> dict[str, str]:
    """Install what the peers need (in the benchmark, never in `make test`): torch (Gloo)
    into this venv, Open MPI from Debian, mpi4py built against it. Returns versions."""
    pip = [PY, "-m", "pip", "install", "-q"]
    ensure_torch()
    ensure_tool("mpirun", "openmpi-bin")
    ensure_tool("mpicc", "libopenmpi-dev")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        subprocess.run([*pip, "mpi4py"], check=True)
    out = subprocess.run(
        [PY, "-c", "import torch, mpi4py; print(torch.__version__, mpi4py.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    ompi = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
    return {"torch": out[0], "mpi4py": out[1], "openmpi": ompi.splitlines()[0]}


@dataclass
class Run:
    """What one launch gave: rank 0's JSON lines, the exit status or 'hang', the tail."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    status: str = "ok"  # ok | error | hang
    rc: int | None = None
    tail: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    idle_timeout: float = 0.0
    retried: bool = False  # a start-up failure was run again

    @property
    def message(self) -> str:
        if self.status == "hang":
            last = self.tail[-1].strip() if self.tail else "nothing"
            return f"hang: no output for {self.idle_timeout:g} s, killed (last line: {last[:160]})"
        return "".join(self.tail[-20:]).strip()


def stream(
    argv: Sequence[str],
    env: dict[str, str] | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    idle_timeout: float = 120.0,
) -> Run:
    """Run argv; JSON lines (prefixed "[0] " by mrc-run, or bare) become rows, handed to
    on_row as they come. No output for idle_timeout seconds: killed, status 'hang'."""
    run = Run(idle_timeout=idle_timeout)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
        start_new_session=True,  # so a hang is killed with all its ranks
    )
    last = [time.monotonic()]
    hung = threading.Event()

    def watchdog() -> None:
        while proc.poll() is None:
            if time.monotonic() - last[0] > idle_timeout:
                hung.set()
                os.killpg(proc.pid, 9)
                return
            time.sleep(0.2)

    w = threading.Thread(target=watchdog, daemon=True)
    w.start()
    assert proc.stdout is not None
    for line in proc.stdout:
        last[0] = time.monotonic()
        run.tail = (run.tail + [line])[-40:]
        text = line.split("] ", 1)[1] if line.startswith("[0] ") else line
        if text.startswith("{"):
            try:
                row = json.loads(text)
            except json.JSONDecodeError:
                continue
            run.rows.append(row)
            if on_row is not None:
                on_row(row)
    run.rc = proc.wait()
    w.join()
    run.wall_s = time.monotonic() - t0
    run.status = "hang" if hung.is_set() else ("ok" if run.rc == 0 else "error")
    return run


def sized_rows(run: Run, sizes: Sequence[int], what: str) -> dict[int, dict[str, Any]]:
    """A sweep's rows by size; exits naming `what` when the run failed, missed a size or
    got a wrong result."""
    rows = {int(r["size"]): r for r in run.rows if "size" in r}
    if run.status != "ok" or len(rows) != len(sizes):
        raise SystemExit(f"{what}: {run.status}: {run.message}")
    if any(r["wrong"] for r in rows.values()):
        raise SystemExit(f"{what}: wrong results: {rows}")
    return rows


def worker_args(coll: str, sizes: Sequence[int], iters: int, warmup: int, *extra: str) -> list[str]:
    return [
        WORKER,
        coll,
        "--sizes",
        ",".join(str(s) for s in sizes),
        "--iters",
        str(iters),
        "--warmup",
        str(warmup),
        *extra,
    ]


def _mrc_run(
    fab: Any, backend: str, args: list[str], timeout: float, hosts: Sequence[str] | None = None
) -> list[str]:
    """mrc-run of a worker: 4 ranks one per host, or one rank per entry of hosts."""
    place = ["-n", "4"] if hosts is None else ["-n", str(len(hosts)), "--hosts", ",".join(hosts)]
    return [
        PY, "-m", "mrc.run", *place, "--fabric", fab.file, "--name", fab.prefix,
        "--timeout", str(timeout), "--", PY, args[0], backend, *args[1:],
    ]  # fmt: skip


def run_mrc(
    fab: Any,
    args: list[str],
    env: dict[str, str] | None = None,
    hosts: Sequence[str] | None = None,
    **kw: Any,
) -> Run:
    return stream(_mrc_run(fab, "mrc", args, 60, hosts), env, **kw)


def run_gloo(fab: Any, args: list[str], hosts: Sequence[str] | None = None, **kw: Any) -> Run:
    env = {"GLOO_SOCKET_IFNAME": NICS, "OMP_NUM_THREADS": "1"}
    return stream(_mrc_run(fab, "gloo", args, 60, hosts), env, **kw)


def run_mpi(
    fab: Any,
    args: list[str],
    algorithm: str = "default",
    extra_mca: Sequence[tuple[str, str]] = (),
    **kw: Any,
) -> Run:
    """4 ranks, one per host namespace, over btl tcp on the planes. algorithm "ring":
    Open MPI's tuned ring allreduce; "default": its own choice per size."""
    mpirun = shutil.which("mpirun") or "mpirun"
    hosts = ",".join(h.name for h in fab.fabric.hosts[:4])
    mca = [
        ("plm_rsh_agent", f"{PY} {Path(__file__).resolve()} agent {fab.prefix}"),
        ("oob_tcp_if_include", "nic0"),
        ("btl", "tcp,self"),
        ("btl_tcp_if_include", NICS),
        ("pml", "ob1"),
        ("orte_keep_fqdn_hostnames", "1"),
    ]
    if algorithm == "ring":
        mca += [("coll_tuned_use_dynamic_rules", "1"), ("coll_tuned_allreduce_algorithm", "4")]
    mca += list(extra_mca)
    argv = ["ip", "netns", "exec", fab.ns("h0"), mpirun, "--allow-run-as-root", "-n", "4"]
    argv += ["--host", hosts, "--map-by", "node", "-x", "OMP_NUM_THREADS", "-x", "MRC_BENCH_BIND"]
    for k, v in mca:
        argv += ["--mca", k, v]
    env = {"OMP_NUM_THREADS": "1", "MRC_BENCH_BIND": os.environ.get("MRC_BENCH_BIND", "none")}
    run = stream([*argv, PY, args[0], "mpi", *args[1:]], env, **kw)
    if run.status == "error" and not run.rows:
        # Now and then on the loaded machine a btl tcp connect at start-up fails ("usually
        # caused by a firewall"); nothing has run yet, so starting again measures the same.
        run = stream([*argv, PY, args[0], "mpi", *args[1:]], env, **kw)
        run.retried = True
    return run


def agent(prefix: str, argv: list[str]) -> None:
    """Open MPI's rsh agent: `agent PREFIX [ssh options] HOST CMD...` runs CMD in HOST's
    namespace of the fabric PREFIX (orted then connects back over plane 0)."""
    from mrc.fabric import netns

    args = [a for a in argv if not a.startswith("-")]
    host, cmd = args[0], argv[argv.index(args[0]) + 1 :]
    os.execvp("ip", ["ip", "netns", "exec", netns.ns_name(prefix, host), "sh", "-c", " ".join(cmd)])


def gbps(row: dict[str, Any] | None) -> float | None:
    return None if row is None else round(float(row["busbw_gbps"]), 4)


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "agent":
    agent(sys.argv[2], sys.argv[3:])
