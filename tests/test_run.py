"""mrc-run: rank prefixes, the first failure's exit code and name, stopping the others,
Ctrl-C, and communicators under it on loopback and (root) on a namespace fabric."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import mrc
from mrc.fabric.testing import RunningFabric, fabric_up
from mrc.run import core_blocks, plan

ROOT = Path(__file__).resolve().parent.parent
HAVE_COLLECTIVES = hasattr(mrc.Communicator, "all_reduce")
MRC_RUN = [sys.executable, "-m", "mrc.run"]
WORKER = str(ROOT / "tests" / "comm_worker.py")


def mrc_run(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*MRC_RUN, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=None if env is None else {**os.environ, **env},
    )


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_the_command_finds_this_venvs_python_after_sudo_reset_path() -> None:
    """sudo resets PATH to the system's: `sudo .venv/bin/mrc-run -n 2 -- python x.py` ran
    the system python, which has no mrc (or mrc-perf was not found at all). The launcher's
    own bin goes first on the ranks' PATH, as mrc-fabric exec does."""
    code = "import mrc, sys; print(sys.executable)"
    res = mrc_run("-n", "2", "--", "python", "-c", code, env={"PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stdout + res.stderr
    venv_bin = os.path.dirname(os.path.abspath(sys.executable))
    for r in (0, 1):
        line = next(x for x in res.stdout.splitlines() if x.startswith(f"[{r}] "))
        assert os.path.dirname(line[4:]) == venv_bin, res.stdout


def test_prefixes_and_environment() -> None:
    code = (
        "import os\n"
        "for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MRC_PORT', 'MRC_RUN_ID'):\n"
        "    print(k, os.environ[k])\n"
    )
    res = mrc_run("-n", "3", "--", *py(code))
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    for r in range(3):
        mine = [x for x in lines if x.startswith(f"[{r}] ")]
        env = dict(x[len(f"[{r}] ") :].split(" ", 1) for x in mine)
        assert env["RANK"] == env["LOCAL_RANK"] == str(r)
        assert env["WORLD_SIZE"] == "3" and env["MASTER_ADDR"] == "127.0.0.1"
    # One run: the same rendezvous port and run id for every rank.
    for key in ("MRC_PORT", "MRC_RUN_ID"):
        assert len({x.split()[-1] for x in lines if f"] {key} " in x}) == 1


def test_core_blocks() -> None:
    assert core_blocks(2, [0, 1, 2, 3]) == [{0, 1}, {2, 3}]
    assert core_blocks(3, range(8)) == [{0, 1}, {2, 3}, {4, 5}]
    assert core_blocks(3, [4, 5]) == [{4}, {5}, {4}]  # more ranks than cores: wrap
    assert core_blocks(1, [0, 1]) == [{0, 1}]


def test_bind_to_core_pins_each_rank_and_the_threads_it_starts() -> None:
    code = (
        "import os, threading\n"
        "seen = []\n"
        "t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))\n"
        "t.start(); t.join()\n"
        "print(sorted(os.sched_getaffinity(0)), seen[0])\n"
    )
    res = mrc_run("-n", "3", "--bind-to", "core", "--", *py(code))
    assert res.returncode == 0, res.stdout + res.stderr
    want = core_blocks(3)
    assert res.stdout.startswith("mrc-run: bound to cores: "), res.stdout
    for r in range(3):
        (line,) = [x for x in res.stdout.splitlines() if x.startswith(f"[{r}] ")]
        main, thread = line[len(f"[{r}] ") :].split("] [")
        assert main + "]" == str(sorted(want[r])) and "[" + thread == str(sorted(want[r])), line
    free = mrc_run("-n", "2", "--", *py("import os; print(sorted(os.sched_getaffinity(0)))"))
    every = str(sorted(os.sched_getaffinity(0)))
    assert [x.split(" ", 1)[1] for x in free.stdout.splitlines()] == [every, every]
    bad = mrc_run("-n", "2", "--bind-to", "socket", "--", *py("pass"))
    assert bad.returncode == 2 and "socket" in bad.stderr


def test_first_failure_code_names_the_rank_and_stops_the_others() -> None:
    code = (
        "import os, sys, time\n"
        "r = int(os.environ['RANK'])\n"
        "print('started', flush=True)\n"
        "if r == 1:\n"
        "    print('rank one gives up', flush=True)\n"
        "    sys.exit(7)\n"
        "time.sleep(120)\n"  # the others would run on: mrc-run must stop them
    )
    t0 = time.monotonic()
    res = mrc_run("-n", "3", "--", *py(code))
    assert res.returncode == 7, res.stdout
    assert time.monotonic() - t0 < 30
    out = res.stdout
    assert "[1] rank one gives up" in out
    assert "mrc-run: rank 1 exited with code 7 (first failure)" in out
    assert "mrc-run: stopped ranks 0, 2" in out
    assert re.search(r"last \d+ lines of rank 1:\n  started\n  rank one gives up", out), out


def test_rank_killed_by_a_signal() -> None:
    code = "import os, signal\nif os.environ['RANK'] == '2': os.kill(os.getpid(), signal.SIGKILL)\n"
    res = mrc_run("-n", "3", "--", *py(code))
    assert res.returncode == 128 + signal.SIGKILL, res.stdout
    assert "rank 2 killed by SIGKILL (first failure)" in res.stdout


def test_missing_command_and_bad_hosts() -> None:
    res = mrc_run("-n", "2")
    assert res.returncode != 0 and "CMD" in res.stderr
    res = mrc_run("-n", "2", "--hosts", "h0,h1", "--", "true")
    assert res.returncode != 0 and "--hosts needs --fabric" in res.stderr
    res = mrc_run("-n", "2", "--", "/nonexistent/prog")
    assert res.returncode == 127 and "cannot start" in res.stdout


def sigint_default() -> None:
    """In the child, before exec: SIGINT as a terminal's foreground job has it. A shell
    starts a background job (`make test &`, CI scripts) with SIGINT ignored, and mrc-run,
    like any program, keeps a signal its parent ignored ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(
    ("sig", "code", "said"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated (SIGTERM)")],
)
def test_signal_stops_every_rank(sig: int, code: int, said: str) -> None:
    """Ctrl-C, or SIGTERM (kill, a batch system cancelling the job): mrc-run stops every
    rank (each in its own session: killing mrc-run alone would leave them running)."""
    rank = "import os, time\nprint('pid', os.getpid(), flush=True)\ntime.sleep(120)\n"
    proc = subprocess.Popen(
        [*MRC_RUN, "-n", "3", "--", *py(rank)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        preexec_fn=sigint_default,
    )
    assert proc.stdout is not None
    pids = [int(proc.stdout.readline().split()[-1]) for _ in range(3)]
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == code, out
    assert f"{said}; stopped ranks 0, 1, 2" in out
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def running(pid: int) -> bool:
    """pid exists and is not a zombie (an orphan's reaper may be slow, or absent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def killed_launcher_leaves_no_rank(extra: list[str]) -> None:
    rank = "import os, time\nprint('pid', os.getpid(), flush=True)\ntime.sleep(120)\n"
    proc = subprocess.Popen(
        [*MRC_RUN, "-n", "2", *extra, "--", *py(rank)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert proc.stdout is not None
    pids = [int(proc.stdout.readline().split()[-1]) for _ in range(2)]
    assert all(running(p) for p in pids)
    proc.kill()  # SIGKILL: mrc-run stops nothing itself
    proc.wait()
    # The kernel sends each rank SIGTERM as mrc-run dies; they end on their own.
    deadline = time.monotonic() + 10
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.01)  # polling processes this test does not own
    left = [p for p in pids if running(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert left == [], "ranks outlived a killed mrc-run"


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_a_killed_mrc_run_takes_its_ranks_with_it() -> None:
    """SIGKILL of mrc-run (the OOM killer, a scheduler) ended nothing else: each rank in its
    own session ran on orphaned. Now each has SIGTERM as its parent-death signal."""
    killed_launcher_leaves_no_rank([])


@pytest.mark.root
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_a_killed_mrc_run_takes_its_ranks_in_namespaces_with_it() -> None:
    """The same for ranks started through `ip netns exec` (which execs, keeping the signal)."""
    with fabric_up(str(ROOT / "routing/2host-2plane.toml")) as fab:
        killed_launcher_leaves_no_rank(["--fabric", fab.file, "--name", fab.prefix])


def marked(mark: str) -> list[int]:
    """The processes whose environment holds MRC_TEST_MARK=mark."""
    want = f"MRC_TEST_MARK={mark}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                env = (d / "environ").read_bytes().split(b"\0")
            except OSError:
                continue  # gone, or not ours to read
            if want in env:
                out.append(int(d.name))
    return out


def test_ctrl_c_while_ranks_start_leaves_none_running() -> None:
    """Ctrl-C while mrc-run is still starting ranks (here: the moment rank 1's process
    is forked, a real SIGINT to this thread): every rank started is stopped and run()
    says interrupted (130). Each rank runs in its own session, so one forked but never
    recorded, or recorded but left behind by a KeyboardInterrupt out of the start loop,
    would run on orphaned (it did before the start loop took Ctrl-C as a flag)."""
    from mrc.run import Launcher, Rank

    mark = f"{os.getpid()}-start"
    env = {**os.environ, "MRC_TEST_MARK": mark}
    argv = [sys.executable, "-c", "import time; time.sleep(120)"]
    ranks = [Rank(rank=r, argv=argv, env=env) for r in range(3)]
    out = io.StringIO()
    launcher = Launcher(ranks, out=out)
    real_start = launcher._start

    def start(rk: Rank) -> None:
        real_start(rk)
        if rk.rank == 1:
            signal.raise_signal(signal.SIGINT)  # to this thread; handled on return

    launcher._start = start  # type: ignore[method-assign]
    old = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    try:
        assert launcher.run() == 130
    finally:
        signal.signal(signal.SIGINT, old)
        for rk in ranks:
            if rk.proc is not None and rk.proc.poll() is None:
                rk.proc.kill()
                rk.proc.wait()
    assert "interrupted; stopped ranks 0, 1" in out.getvalue()
    assert ranks[2].proc is None  # not started after the Ctrl-C
    assert marked(mark) == []


def expected_sha(src: int, dst: int) -> str:
    data = np.random.default_rng(1000 * src + dst).integers(0, 256, 100_003, dtype=np.uint8)
    return hashlib.sha256(data.tobytes()).hexdigest()


def rank_results(stdout: str) -> dict[int, dict[str, object]]:
    out = {}
    for line in stdout.splitlines():
        m = re.match(r"\[(\d+)\] (\{.*\})$", line)
        if m:
            out[int(m.group(1))] = json.loads(m.group(2))
    return out


def test_communicators_under_mrc_run() -> None:
    """from_env() under mrc-run, with --planes 2: two loopback planes per rank."""
    res = mrc_run(
        "-n", "4", "--timeout", "10", "--planes", "2",
        "--", sys.executable, WORKER, "mesh", "env", "env", "env", "0",
    )  # fmt: skip
    assert res.returncode == 0, res.stdout
    got = rank_results(res.stdout)
    for r in range(4):
        assert got[r].get("ok"), got[r]
        assert got[r]["got"] == {str(p): expected_sha(p, r) for p in range(4) if p != r}
        assert got[r]["npaths"] == [0 if p == r else 2 for p in range(4)]


def test_killed_rank_under_mrc_run() -> None:
    """Rank 2 dies after the mesh carried data: the others raise CollectiveError naming it
    (within the timeout), and mrc-run exits with rank 2's code, naming it."""
    # With the collectives: rank 2 dies in the middle of a 64 MiB all_reduce.
    die, survive = ("coll_die", "coll_die") if HAVE_COLLECTIVES else ("die", "survive")
    code = (
        "import os, runpy, sys\n"
        f"mode = {die!r} if os.environ['RANK'] == '2' else {survive!r}\n"
        f"sys.argv = [{WORKER!r}, mode, 'env', 'env', 'env', '0']\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    # A death is seen at once (its socket closes); the timeout only bounds start-up.
    res = mrc_run("-n", "4", "--timeout", "20", "--", *py(code), timeout=60, env={"DEAD_RANK": "2"})
    assert res.returncode == 3, res.stdout
    assert "mrc-run: rank 2 exited with code 3 (first failure)" in res.stdout
    got = rank_results(res.stdout)
    # The survivors' communicators raise at once, within mrc-run's settle time.
    for r in (0, 1, 3):
        assert got.get(r, {}).get("type") == "CollectiveError", (r, res.stdout)
        assert got[r]["err_rank"] == 2 and "rank 2 exited" in str(got[r]["error"]), got[r]


def test_plan_on_a_fabric_needs_it_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mrc.fabric.state import FabricNetError

    monkeypatch.setenv("MRC_FABRIC_STATE_DIR", str(tmp_path))
    with pytest.raises(FabricNetError, match="is not up"):
        plan(2, ["true"], fabric=str(ROOT / "routing/2host-2plane.toml"), name="nosuch")


@pytest.mark.root
def test_fabric_ports_are_free_in_rank_0s_namespace() -> None:
    """On a fabric the rendezvous listens in rank 0's host namespace: mrc-run takes
    MRC_PORT and MASTER_PORT free there (a port free in the launcher's namespace may be
    held in the host's), and both can be bound there."""
    from mrc.fabric import netns

    fabric = str(ROOT / "routing/2host-2plane.toml")
    with fabric_up(fabric) as fab:
        ranks = plan(2, ["true"], fabric=fabric, name=fab.prefix)
        ports = [int(ranks[0].env["MRC_PORT"]), int(ranks[0].env["MASTER_PORT"])]
        assert ports[0] != ports[1] and all(r.env["MRC_PORT"] == str(ports[0]) for r in ranks)
        code = (
            "import socket,sys\n"
            "for p in sys.argv[1:]:\n"
            "    socket.socket(socket.AF_INET6).bind(('::', int(p)))\n"
        )
        argv = netns.exec_argv(fab.prefix, "h0", [sys.executable, "-c", code, *map(str, ports)])
        res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr


def fabric_mesh(fab: RunningFabric, routes_env: dict[str, str]) -> dict[int, dict[str, object]]:
    """4 ranks of comm_worker's mesh under mrc-run, rank r in host r of the running
    fabric `fab`: every rank must end ok with every peer's data checked. Returns each
    rank's result."""
    res = mrc_run(
        "-n", "4", "--fabric", fab.file, "--name", fab.prefix, "--timeout", "20",
        "--", sys.executable, WORKER, "mesh", "env", "env", "env", "0",
        timeout=120,
        env=routes_env,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    got = rank_results(res.stdout)
    for r in range(4):
        assert got[r].get("ok"), got[r]
        assert got[r]["got"] == {str(p): expected_sha(p, r) for p in range(4) if p != r}
    return got


@pytest.mark.root
def test_mrc_run_on_a_namespace_fabric() -> None:
    """4 ranks, each in its host's namespace, MRC_ROUTES=table: the mesh carries checked
    data on every path of the route table between the hosts."""
    fabric = str(ROOT / "routing/4host-4plane.toml")
    with fabric_up(fabric) as fab:
        npaths = len(fab.paths("h0", "h1"))
        got = fabric_mesh(fab, {"MRC_ROUTES": "table"})
    for r in range(4):
        assert got[r]["npaths"] == [0 if p == r else npaths for p in range(4)]
        assert got[r]["routes"] == {"used": "table", "why": "asked for"}
        info = got[r]["fabric_info"]
        assert isinstance(info, dict) and info["host"] == f"h{r}"
        rates = [fab.fabric.host_link(f"h{r}", p).rate_bps for p in range(4)]
        assert info["rates_bps"] == rates
        assert [x["host"] for x in info["ranks"]] == ["h0", "h1", "h2", "h3"]


@pytest.mark.root
@pytest.mark.skipif(not HAVE_COLLECTIVES, reason="the collectives (wip/coll) are not merged")
def test_collectives_on_a_namespace_fabric() -> None:
    """Every collective x a few dtypes/ops, 4 ranks in 4 host namespaces, checked bit for
    bit against the rank-order reference."""
    fabric = str(ROOT / "routing/4host-4plane.toml")
    with fabric_up(fabric) as fab:
        res = mrc_run(
            "-n", "4", "--fabric", fabric, "--name", fab.prefix, "--timeout", "30",
            "--", sys.executable, WORKER, "coll", "env", "env", "env", "0",
            timeout=180,
        )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    got = rank_results(res.stdout)
    for r in range(4):
        assert got[r].get("ok"), got[r]
        bad = {k: v for k, v in got[r]["wrong"].items() if v}  # type: ignore[union-attr]
        assert not bad, (r, bad)


@pytest.mark.root
def test_mrc_routes_planes_one_plain_path_per_plane() -> None:
    """MRC_ROUTES=planes under mrc-run on a fabric: every connection has one path per
    plane (no SRH, so UDP GSO batches stay whole) and carries checked data."""
    fabric = str(ROOT / "routing/4host-4plane.toml")
    with fabric_up(fabric) as fab:
        assert len(fab.paths("h0", "h2")) > 4  # the table's SRv6 paths: more than planes
        got = fabric_mesh(fab, {"MRC_ROUTES": "planes"})
    for r in range(4):
        assert got[r]["npaths"] == [0 if p == r else 4 for p in range(4)]


@pytest.mark.root
def test_routes_auto_takes_the_table_only_where_batches_stay_whole() -> None:
    """The default (routes="auto") on a fabric: the route table's SRv6 paths where the
    kernel can put the SRH on after UDP GSO (seg6 lightweight tunnels, asked here
    independently with `ip route ... encap seg6local`), else one plain path per plane
    (the sticky header would cut every batch); every rank chooses the same and says why.
    With MRC_SRH=socket every rank's SRH would be sticky: planes on any kernel."""
    from mrc.fabric.netns import kernel_has_seg6local

    fabric = str(ROOT / "routing/4host-4plane.toml")
    table = kernel_has_seg6local()
    with fabric_up(fabric) as fab:
        npaths = len(fab.paths("h0", "h1"))
        assert npaths > 4
        for env, want in (({}, "table" if table else "planes"), ({"MRC_SRH": "socket"}, "planes")):
            got = fabric_mesh(fab, env)
            for r in range(4):
                routes = got[r]["routes"]
                assert isinstance(routes, dict) and routes["used"] == want, (env, routes)
                k = npaths if want == "table" else 4
                assert got[r]["npaths"] == [0 if p == r else k for p in range(4)]
                if want == "planes":  # every rank named: all four send a sticky header
                    assert "ranks 0, 1, 2, 3 would send the SRH as a sticky" in routes["why"]


def test_routes_must_be_table_or_planes() -> None:
    with pytest.raises(
        mrc.UsageError, match="routes must be 'auto', 'table' or 'planes', got 'spine'"
    ):
        mrc.Communicator(0, 1, mrc.get_unique_id(), routes="spine")


SCALE_RANK = """
import os
import sys
import mrc
from mrc.collectives import soak
comm = mrc.Communicator.from_env(timeout=120)
seed, calls = int(sys.argv[1]), int(sys.argv[2])
for i in range(calls):
    c = soak.call(seed, i, comm.size, 256 << 10)
    assert soak.run(comm, seed, c), f"call {i}: {c} differs from the reference"
print("fds", len(os.listdir("/proc/self/fd")), flush=True)
comm.close()
"""


def test_thirty_two_ranks_on_two_cores() -> None:
    """Scale beyond the 2-5 ranks of the other tests: 32 ranks under mrc-run (16 per core
    on CI's machine) form their mesh (31 connections each, 4 loopback planes) and make
    40 random calls of the soak (every collective, op and dtype, up to 256 KiB), each
    bit-identical to numpy in rank order; a rank's sockets do not grow with its peers
    (one per plane, not per connection)."""
    res = mrc_run("-n", "32", "--", *py(SCALE_RANK), "7", "40", timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    fds = [
        int(m) for m in re.findall(r"^\[(?:[1-9]|[12][0-9]|3[01])\] fds (\d+)$", res.stdout, re.M)
    ]
    assert len(fds) == 31, res.stdout[-2000:]  # rank 0 also serves the rendezvous
    assert max(fds) < 40, fds
