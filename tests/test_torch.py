"""The torch.distributed backend "mrc" (mrc.torch): ranks are processes on loopback planes.

Each test starts 2-4 processes of tests/torch_ranks.py (or torchrun, or the DDP example);
every rank checks its own results against a rank-order reference and Gloo, and the test
checks what all ranks report.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

try:
    import torch
except ImportError:
    # CI installs the torch extra (make test-py): a missing torch there is a failure
    if os.environ.get("CI") or os.environ.get("MRC_REQUIRE_ROOT") == "1":
        raise
    pytest.skip("torch is not installed (pip install 'mrc[torch]')", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
RANKS = ROOT / "tests" / "torch_ranks.py"
EXAMPLE = ROOT / "examples" / "ddp_train.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("MRC_FABRIC", None)
    env.pop("MRC_HOST", None)
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run_ranks(
    scenario: str, size: int, tmp: Path, timeout: float = 120, **extra: str
) -> list[dict]:
    """Start `size` ranks of torch_ranks.py SCENARIO; return each rank's JSON report."""
    init = f"file://{tmp}/init"
    procs = []
    for r in range(size):
        env = _env(**{"RANK": str(r), "WORLD_SIZE": str(size), "MRC_TEST_INIT": init, **extra})
        log = open(tmp / f"log{r}", "w")  # noqa: SIM115 - closed below
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, str(RANKS), scenario, str(tmp)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
                log,
            )
        )
    deadline = time.monotonic() + timeout
    try:
        for p, _ in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    logs = {r: (tmp / f"log{r}").read_text()[-3000:] for r in range(size)}
    for r, (p, _) in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{logs[r]}"
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(size)]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_collectives_match_rank_order_and_gloo(size: int, tmp_path: Path) -> None:
    """Every collective, 8 dtypes, in-place and strided, sync and async, a new_group."""
    reports = run_ranks("collectives", size, tmp_path)
    assert all(r["checks"] > 150 for r in reports), reports


def test_fsdp_matches_gloo(tmp_path: Path) -> None:
    reports = run_ranks("fsdp", 2, tmp_path)
    assert reports[0]["sha"] == reports[1]["sha"]  # every rank the same full parameters


def test_tcp_init_explicit_store_timeout_and_abort(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a free port for the tcp:// store (rank 0 listens on it)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reports = run_ranks("lifecycle", 2, tmp_path, MRC_TEST_INIT=f"tcp://127.0.0.1:{port}")
    rep = reports[0]
    assert rep["tcp"] == rep["store"] == [3.0] * 4, rep
    assert "no error" not in rep["timeout"] and 2.5 < rep["timeout_secs"] < 10, rep
    assert "no error" not in rep["abort"] and rep["abort_secs"] < 5, rep
    assert reports[1]["tcp"] == [3.0] * 4


def test_bad_input_raises_before_sending(tmp_path: Path) -> None:
    reports = run_ranks("errors", 2, tmp_path)
    for rank, rep in enumerate(reports):
        m = rep["messages"]
        assert f"rank {rank}" in m["complex"] and "complex64" in m["complex"]
        assert "bool" in m["bool_sum"] and "SUM, PRODUCT, MAX or MIN" in m["bool_sum"]
        assert "split sizes" in m["a2a_splits"]
        if rank != 0:
            assert f"global rank {rank} which does not belong" in m["outside"], m


def test_different_sizes_on_ranks_is_an_error(tmp_path: Path) -> None:
    reports = run_ranks("mismatch", 2, tmp_path, MRC_TEST_TIMEOUT="20")
    for rank, rep in enumerate(reports):
        assert rep["secs"] < 25, rep
        # the error names this rank's tensor and the rank it disagrees with
        assert f"tensor ({10 + rank},) float32" in rep["error"], rep
        assert f"rank {1 - rank}" in rep["error"] and "does not match" in rep["error"], rep


def test_dead_rank_fails_the_others_within_the_timeout(tmp_path: Path) -> None:
    timeout = 10
    reports = run_ranks("die", 3, tmp_path, MRC_TEST_TIMEOUT=str(timeout))
    assert reports[2] == {"died": True}
    for rep in reports[:2]:
        assert rep["secs"] < timeout + 5, rep
        assert "rank 2" in rep["error"], rep


def test_torchrun_runs_an_unchanged_script(tmp_path: Path) -> None:
    """No mrc import in the script: the "torch.backends" entry point registers the backend."""
    script = tmp_path / "plain.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('mrc')\n"
        "t = torch.arange(6, dtype=torch.float32) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(t)\n"
        "import sys\n"
        "sys.stdout.write(f'RESULT {dist.get_rank()} {dist.get_world_size()} {t.tolist()}\\n')\n"
        "dist.destroy_process_group()\n"
        # again: torchrun's store outlives the group, whose id must not be read again
        "dist.init_process_group('mrc')\n"
        "t = torch.ones(2)\n"
        "dist.all_reduce(t)\n"
        "sys.stdout.write(f'AGAIN {dist.get_rank()} {t.tolist()}\\n')\n"
        "dist.destroy_process_group()\n"
    )
    out = subprocess.run(
        [str(TORCHRUN), "--nproc-per-node", "2", "--standalone", str(script)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # ranks share the pipe: find the results anywhere, not line by line
    got = sorted(re.findall(r"RESULT \d \d \[[^\]]*\]", out.stdout))
    want = [float(3 * i) for i in range(6)]
    assert got == [f"RESULT {r} 2 {want}" for r in range(2)], out.stdout
    assert sorted(re.findall(r"AGAIN \d \[[^\]]*\]", out.stdout)) == [
        f"AGAIN {r} [2.0, 2.0]" for r in range(2)
    ], out.stdout


def _start_training(tmp: Path, name: str, nproc: int, steps: int, *extra: str):  # type: ignore[no-untyped-def]
    js = tmp / f"{name}.json"
    cmd = [str(TORCHRUN), "--nproc-per-node", str(nproc), "--standalone", str(EXAMPLE)]
    cmd += ["--steps", str(steps), "--quiet", "--json", str(js), *extra]
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return p, js


def _finish_training(p, js: Path) -> dict:  # type: ignore[no-untyped-def]
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:] + err[-3000:]
    shas = re.findall(r"rank (\d+) params sha256 ([0-9a-f]{64})", out)
    assert len(shas) == 2 and len({s for _, s in shas}) == 1, out  # the same parameters
    return json.loads(js.read_text())


@pytest.mark.gpu
def test_ddp_on_cuda_matches_the_cpu_run_and_rides_out_a_plane(tmp_path: Path) -> None:
    """DDP with the model and gradients on the GPU (gradients staged through pinned host
    memory): the same losses as the CPU run to rounding (other kernels), and bit-identical
    with and without rank 1's plane 0 down from step 6."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (GPU tests run with `make gpu-check` on a GPU machine)")
    steps = 12
    cpu = _finish_training(*_start_training(tmp_path, "cpu", 2, steps))
    gpu = _finish_training(*_start_training(tmp_path, "cuda", 2, steps, "--device", "cuda"))
    failed = _finish_training(
        *_start_training(tmp_path, "cuda_failed", 2, steps, "--device", "cuda",
                         "--fail-plane", "1:0@6")
    )  # fmt: skip
    assert gpu["loss_bits"] == failed["loss_bits"] and gpu["sha256"] == failed["sha256"]
    assert np.allclose(gpu["losses"], cpu["losses"], rtol=2e-3)


def test_ddp_with_a_failed_plane_is_bit_identical(tmp_path: Path) -> None:
    """DDP over torchrun, healthy and with rank 1's plane 0 down from step 6 (both runs at
    once: they are independent jobs on their own loopback addresses and ports)."""
    steps = 16
    a = _start_training(tmp_path, "healthy", 2, steps)
    b = _start_training(tmp_path, "failed", 2, steps, "--fail-plane", "1:0@6")
    healthy, failed = _finish_training(*a), _finish_training(*b)
    assert healthy["loss_bits"] == failed["loss_bits"]
    assert healthy["sha256"] == failed["sha256"]
    assert healthy["losses"][-1] < healthy["losses"][0]  # it trains


def _fabric_train(fab: object, steps: int, fail_at: int | None, tmp: Path, name: str) -> dict:
    """The example on 4 fabric hosts under mrc-run; pull h1's plane-0 cable at fail_at."""
    js = tmp / f"{name}.json"
    cmd = [
        str(Path(sys.executable).parent / "mrc-run"),
        "-n",
        "4",
        "--fabric",
        fab.file,  # type: ignore[attr-defined]
        "--name",
        fab.prefix,  # type: ignore[attr-defined]
        # the rendezvous' first connection crosses the pulled plane-0 cable too; its links
        # on the other planes keep every rank heard (it once had to outlast the run)
        "--timeout",
        "30",
        "--",
        sys.executable,
        str(EXAMPLE),
        "--steps",
        str(steps),
        "--json",
        str(js),
    ]
    p = subprocess.Popen(
        cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    assert p.stdout is not None
    for line in p.stdout:  # mrc-run prefixes every line with "[rank] "
        lines.append(line)
        if fail_at is not None and line.startswith(f"[0] step {fail_at} "):
            fab.fail(fab.fabric.host_link("h1", 0).name)  # type: ignore[attr-defined]
    assert p.wait(300) == 0, "".join(lines[-60:])
    shas = {x.split()[-1] for x in lines if "params sha256" in x}
    assert len(shas) == 1, "".join(lines[-20:])
    return json.loads(js.read_text())


@pytest.mark.root
def test_ddp_on_the_fabric_with_a_pulled_cable_is_bit_identical(tmp_path: Path) -> None:
    """4 ranks in fabric host namespaces, 200 steps; h1's plane-0 link fails at step 60."""
    from mrc.fabric.testing import fabric_up

    fabric = ROOT / "tests" / "fabrics" / "4host-4plane-fast.toml"
    steps = 200
    with fabric_up(fabric) as fab:
        healthy = _fabric_train(fab, steps, None, tmp_path, "healthy")
    with fabric_up(fabric) as fab:
        failed = _fabric_train(fab, steps, 60, tmp_path, "failed")
        assert fab.failed, "the link was not failed"
    assert healthy["loss_bits"] == failed["loss_bits"]
    assert healthy["sha256"] == failed["sha256"]


@pytest.mark.root
def test_subgroups_on_the_fabric_serve_on_their_own_rank_0s_plane(tmp_path: Path) -> None:
    """A group whose rank 0 is global rank 1 or 2: that process is in another fabric host's
    namespace, where MASTER_ADDR (h0's plane 0) is not its own. Its rendezvous serves on
    its own first plane; before, new_group failed with "cannot start the rendezvous on
    fd00::1 port 0: Cannot assign requested address"."""
    from mrc.fabric.testing import fabric_up

    fabric = ROOT / "tests" / "fabrics" / "4host-4plane-fast.toml"
    with fabric_up(fabric) as fab:
        p = subprocess.run(
            [str(Path(sys.executable).parent / "mrc-run"), "-n", "4", "--fabric", str(fabric),
             "--name", fab.prefix, "--timeout", "30", "--",
             sys.executable, str(RANKS), "subgroups", str(tmp_path)],
            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=180,
        )  # fmt: skip
    assert p.returncode == 0, p.stdout[-4000:]
    checks = [json.loads((tmp_path / f"rank{r}.json").read_text())["checks"] for r in range(4)]
    assert checks == [1, 5, 7, 5], checks  # 2 dtypes in 0, 2, 3, 2 groups, then the world


def test_contiguous_tensors_are_not_copied() -> None:
    """The numpy arrays handed to the communicator are the tensors' own memory."""
    import torch

    from mrc.torch._tensors import Staged, byte_view, flat_view

    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        t = torch.zeros((3, 5), dtype=dtype)
        st = Staged()
        assert st.output(t) is t and st.input(t) is t
        assert flat_view(t).ctypes.data == t.data_ptr() == byte_view(t).ctypes.data
        assert flat_view(t).nbytes == t.numel() * t.element_size()
    # a strided output goes through a contiguous copy that lands back in it at the end
    wide = torch.zeros((4, 2))
    col = wide[:, 0]
    st = Staged()
    c = st.output(col)
    assert c is not col and c.is_contiguous()
    c.fill_(7.0)
    st.finish()
    assert wide[:, 0].tolist() == [7.0] * 4 and wide[:, 1].tolist() == [0.0] * 4


def test_one_rank_group_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group of one: every call completes locally, in this process. MRC_ENDPOINT_TIMEOUT
    reaches its endpoint. MRC_STATS_SOCKET:
    the world group serves its stats there, a later group of the process does not, and
    after destroy_process_group the next world group serves them again."""
    import torch
    import torch.distributed as dist

    import mrc.torch
    from mrc import telemetry

    monkeypatch.setenv("MRC_STATS_SOCKET", str(tmp_path / "r{rank}.sock"))
    monkeypatch.setenv("MRC_ENDPOINT_TIMEOUT", "12")
    monkeypatch.setattr(mrc.torch, "_stats_owner", None)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("mrc", store=store, rank=0, world_size=1)
    try:
        assert isinstance(dist.group.WORLD, mrc.torch.ProcessGroupMRC)
        assert mrc.torch.communicator().endpoint.timeout == 12.0  # the transport's give-up
        assert telemetry.fetch(str(tmp_path / "r0.sock"))["stats"]["conns"] == 0
        sub = dist.new_group([0])
        assert mrc.torch.communicator(sub).stats_socket is None
        t = torch.arange(5, dtype=torch.float32)
        dist.all_reduce(t)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        o = torch.empty(5)
        dist.all_gather_into_tensor(o, t)
        assert torch.equal(o, t)
        dist.reduce_scatter_tensor(o, t * 2)
        assert torch.equal(o, t * 2)
        a = torch.empty(5)
        dist.all_to_all_single(a, t)
        assert torch.equal(a, t)
        dist.broadcast(t, 0)
        dist.barrier()
        w = dist.all_reduce(t, async_op=True)
        assert w.get_future().wait()[0] is t and w.is_completed()
        assert mrc.torch.communicator().size == 1
    finally:
        dist.destroy_process_group()
    store = dist.FileStore(str(tmp_path / "store2"), 1)
    dist.init_process_group("mrc", store=store, rank=0, world_size=1)
    try:
        assert telemetry.fetch(str(tmp_path / "r0.sock"))["stats"]["conns"] == 0
    finally:
        dist.destroy_process_group()
