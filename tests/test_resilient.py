"""The resilient AllReduce on the namespace fabric (issue 13): 4 ranks in 4 host
namespaces agree on each other's bandwidth from their path states, take the resilient
shares when h1 lost plane 1 and the equal ones when it is healed, and every result is
bit-identical to the rank-order reference (so to a healthy run) throughout.

Rates come from the fabric file (20 Gbit/s links, so the CPU is the limit and the loops
are quick); MRC_RESILIENT_EXCHANGE_BYTES=0 makes every all_reduce an exchange point, so
each operation plans from the path states of its start.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mrc.collectives import model, resilient
from mrc.collectives import schedule as S
from mrc.fabric.testing import fabric_up

ROOT = Path(__file__).resolve().parent.parent
FABRIC = str(ROOT / "tests" / "fabrics" / "4host-4plane-fast.toml")
WORKER = str(ROOT / "tests" / "resilient_worker.py")
sys.path.insert(0, str(ROOT / "tests"))
from resilient_worker import data  # noqa: E402

H1_PLANE1 = "h1-p1l0"  # h1's cable on plane 1 (both ends go down)


def reference_sha(count: int | None = None, n: int = 4) -> str:
    """Rank order: ((x0 + x1) + x2) + x3 in float32, as mrc promises for every schedule."""
    acc = data(0, *(() if count is None else (count,))).copy()
    for r in range(1, n):
        acc += data(r, *(() if count is None else (count,)))
    return hashlib.sha256(acc.tobytes()).hexdigest()


def launch(
    fab: object,
    *worker_args: str,
    timeout: float = 30,
    env: dict[str, str] | None = None,
    hosts: str | None = None,
) -> subprocess.Popen[str]:
    """4 ranks on h0..h3, or one per entry of hosts (mrc-run --hosts)."""
    env = {**os.environ, "MRC_RESILIENT_EXCHANGE_BYTES": "0", **(env or {})}
    place = ["-n", "4"] if hosts is None else ["-n", str(hosts.count(",") + 1), "--hosts", hosts]
    return subprocess.Popen(
        [sys.executable, "-m", "mrc.run", *place, "--fabric", FABRIC,
         "--name", fab.prefix, "--timeout", str(timeout), "--", sys.executable, WORKER,
         *worker_args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
    )  # fmt: skip


def results(lines: list[str], n: int = 4) -> dict[int, dict]:
    got = {}
    for line in lines:
        if line.startswith("[") and "] {" in line:
            doc = json.loads(line.split("] ", 1)[1])
            if "hashes" in doc:
                got[doc["rank"]] = doc
    assert sorted(got) == list(range(n)), "".join(lines)
    return got


def follow(p: subprocess.Popen[str], on_op: Callable[[dict[str, Any]], None]) -> list[str]:
    """mrc-run's lines until it ends; on_op gets each of rank 0's per-operation events. A
    hang fails the test instead of stalling it."""
    lines: list[str] = []
    timer = threading.Timer(150, p.kill)
    timer.start()
    try:
        assert p.stdout is not None
        for line in p.stdout:
            lines.append(line)
            if line.startswith('[0] {"op"'):
                on_op(json.loads(line.split("] ", 1)[1]))
        p.wait(timeout=30)
    finally:
        timer.cancel()
    return lines


def run_loop(
    fab: object, n: int, env: dict[str, str] | None = None, hosts: str | None = None
) -> tuple[dict[int, dict], str]:
    p = launch(fab, "loop", str(n), env=env, hosts=hosts)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    ranks = 4 if hosts is None else hosts.count(",") + 1
    return results(out.splitlines(keepends=True), ranks), out


def test_loopback_agrees_on_plane_counts_and_keeps_equal_shares() -> None:
    """No fabric: the rates are counts of usable planes; all alike, so equal shares. The
    exchange points: the all_reduce that brings the bytes since the last one to
    MRC_RESILIENT_EXCHANGE_BYTES, the first 8, and every MRC_RESILIENT_EXCHANGE_EVERY-th;
    none with MRC_RESILIENT=0."""
    nbytes = 4 * 300_001  # resilient_worker.COUNT float32
    ref = reference_sha()
    cases = (
        ({"MRC_RESILIENT_EXCHANGE_BYTES": "0"}, 2, 2),
        ({"MRC_RESILIENT_EXCHANGE_BYTES": "0", "MRC_RESILIENT": "0"}, 2, 0),
        # Ops 1..8 (the early ones), then 10 and 12 (two since the last).
        (
            {"MRC_RESILIENT_EXCHANGE_BYTES": str(1 << 40), "MRC_RESILIENT_EXCHANGE_EVERY": "2"},
            12,
            10,
        ),
        # Ops 1..8, then 11 (three since the last bring the bytes to the threshold).
        ({"MRC_RESILIENT_EXCHANGE_BYTES": str(3 * nbytes)}, 12, 9),
    )
    for extra, n_ops, exchanges in cases:
        p = subprocess.run(
            [sys.executable, "-m", "mrc.run", "-n", "4", "--timeout", "30", "--",
             sys.executable, WORKER, "loop", str(n_ops)],
            capture_output=True, text=True, cwd=ROOT, env={**os.environ, **extra}, timeout=120,
        )  # fmt: skip
        assert p.returncode == 0, p.stdout + p.stderr
        got = results(p.stdout.splitlines(keepends=True))
        for r in range(4):
            assert got[r]["hashes"] == [ref] * n_ops
            assert got[r]["schedules"] == ["equal"] * n_ops
            st = got[r]["stats"]
            assert st["exchanges"] == exchanges and st["all_reduces"] == n_ops, (extra, st)
            if exchanges:
                assert st["agreed"]["source"] == "planes"
                assert st["agreed"]["send"] == [4.0] * 4
            else:
                assert st["agreed"] is None


def test_host_rate_is_fitted_agreed_and_planned_with() -> None:
    """All_reduces of 4 MiB and more, healthy, with equal shares: every rank fits its
    host's own rate to them (the time above the model's wire time), the records carry it,
    every rank agrees on the same value, and the planner's prediction is model.plan's with
    that host rate. MRC_RESILIENT_HOST=0: none of it. 12 operations: fits wait for a
    window of at least 0.1 s of them to say whether the CPUs were busy (HostGate)."""
    count = (4 << 20) // 4 + 3
    ref = reference_sha(count)
    for aware in ("1", "0"):
        env = {"MRC_RESILIENT_EXCHANGE_BYTES": "0", "MRC_TEST_COUNT": str(count),
               "MRC_RESILIENT_HOST": aware}  # fmt: skip
        p = subprocess.run(
            [sys.executable, "-m", "mrc.run", "-n", "4", "--timeout", "30", "--",
             sys.executable, WORKER, "loop", "12"],
            capture_output=True, text=True, cwd=ROOT, env={**os.environ, **env}, timeout=120,
        )  # fmt: skip
        assert p.returncode == 0, p.stdout + p.stderr
        got = results(p.stdout.splitlines(keepends=True))
        agreed = [got[r]["stats"]["agreed"] for r in range(4)]
        assert all(a == agreed[0] for a in agreed)
        host = agreed[0]["host_rate"]
        for r in range(4):
            st = got[r]["stats"]
            assert got[r]["hashes"] == [ref] * 12 and st["host_aware"] == (aware == "1")
            if aware == "0":
                assert host is None and st["local"]["host_rate"] == 0.0
                continue
            # Fitted after each op, reported at the next exchange (loopback's nominal
            # 10 Gbit/s planes are far faster than two cores: a finite rate). A host with
            # cores to spare (resilient.host_busy) fits none: the time is not the CPU's.
            spare = [g["stats"]["host_busy"] for g in got.values()]
            if host is None and any(b is not None and b < resilient.HOST_BUSY for b in spare):
                continue
            assert 0.0 < st["local"]["host_rate"] < math.inf
            assert host is not None and 0.0 < host < math.inf
            rates = [v * resilient.DEFAULT_PLANE_RATE for v in agreed[0]["send"]]
            plan = model.plan(rates, 4.0 * count, resilient.DEFAULT_ALPHA, host_rate=host)
            assert st["schedule"]["schedule"] == plan.name == "equal"
            assert st["schedule"]["predicted_s"] == pytest.approx(plan.predicted)
            wire = model.plan(rates, 4.0 * count, resilient.DEFAULT_ALPHA)
            assert plan.predicted > wire.predicted  # the host's time counts


@pytest.mark.root
def test_plane_failed_before_the_run_takes_the_resilient_schedule() -> None:
    ref = reference_sha()
    with fabric_up(FABRIC) as fab:
        healthy, _ = run_loop(fab, 3)
        fab.fail(H1_PLANE1)
        degraded, log = run_loop(fab, 12)
    for r in range(4):
        assert healthy[r]["hashes"] == [ref] * 3, r
        assert set(healthy[r]["schedules"]) == {"equal"}
        # Bit-identical to the healthy run in every operation, whatever the schedule.
        assert degraded[r]["hashes"] == [ref] * 12, r
        st = degraded[r]["stats"]
        # The transport may take an operation or two to find plane 1's paths failed (the
        # cable was down before the endpoint opened); from then on the agreed vector has
        # h1 without plane 1 and every rank runs the resilient shares.
        assert degraded[r]["schedules"][-1] == "resilient", degraded[r]["schedules"]
        assert st["agreed"]["planes_up"] == [[0, 1, 2, 3], [0, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]]
        send = st["agreed"]["send"]
        assert send[1] == pytest.approx(0.75 * send[0]) and send[0] == send[2] == send[3]
        shares = st["schedule"]["shares"]
        assert shares[1] < shares[0] == shares[2] == shares[3]
        assert sum(shares) == pytest.approx(1.0)
    # Every rank made the same choices at the same operations.
    assert len({json.dumps(degraded[r]["schedules"]) for r in range(4)}) == 1
    # The log names the schedule and the bandwidths agreed (rank 0's lines).
    switch = [ln for ln in log.splitlines() if ln.startswith("[0]") and "runs schedule" in ln]
    assert switch and "resilient" in switch[-1] and "planes 023" in switch[-1], log
    agreed = "rank 1: send/recv 0.750/0.750 of the fastest"
    assert any(ln.startswith("[0]") and agreed in ln for ln in log.splitlines()), log


@pytest.mark.root
def test_ranks_sharing_hosts_take_the_chain_and_keep_it_when_a_plane_fails() -> None:
    """Two ranks on h0 and two on h1 (mrc-run --hosts h0,h0,h1,h1): all_reduce "auto" runs
    the chain of hosts, "hier" (each host's links carry D each way where direct sends
    2 D; each of a host's ranks carries half of it), with h1's
    plane 1 failed too (h1 at 3/4: still 1/2 of direct's busiest-link time), every rank
    alike, with the rank-order bits; the log names the schedule and why. One rank per
    host keeps direct (the tests above)."""
    ref = reference_sha()
    hosts = "h0,h0,h1,h1"
    with fabric_up(FABRIC) as fab:
        healthy, log = run_loop(fab, 3, hosts=hosts)
        fab.fail(H1_PLANE1)
        degraded, _ = run_loop(fab, 12, hosts=hosts)
    for r in range(4):
        assert healthy[r]["hashes"] == [ref] * 3 and degraded[r]["hashes"] == [ref] * 12, r
        assert healthy[r]["schedules"] == ["hier"] * 3
        assert degraded[r]["schedules"] == ["hier"] * 12
        st = degraded[r]["stats"]
        # Every rank's cross-host paths lead to the one other host, so the plane is
        # gone between h0 and h1 for all four (bandwidth.plane_usable); the paths between
        # two ranks of one host say nothing.
        assert st["agreed"]["planes_up"] == [[0, 2, 3]] * 4, st["agreed"]
        assert st["schedule"]["schedule"] == "hier"
        assert degraded[r]["auto_layout"]["algo"] == "hier"
    why = "the busiest host link's time: hier 0.50 x direct's"
    assert any(ln.startswith("[0]") and "runs schedule hier" in ln and why in ln
               for ln in log.splitlines()), log  # fmt: skip


def test_eight_ranks_on_one_host_take_the_chain() -> None:
    """No fabric, 8 ranks on this host: "auto" runs the chain past gather's sizes
    (model.CHAIN_ONE_HOST_RANKS), with the rank-order bits; 4 ranks keep direct
    (test_loopback_agrees_on_plane_counts_and_keeps_equal_shares)."""
    n = model.CHAIN_ONE_HOST_RANKS
    p = subprocess.run(
        [sys.executable, "-m", "mrc.run", "-n", str(n), "--timeout", "60", "--",
         sys.executable, WORKER, "loop", "2"],
        capture_output=True, text=True, cwd=ROOT, timeout=180,
        env={**os.environ, "MRC_TEST_COUNT": "50001"},
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    got = results(p.stdout.splitlines(keepends=True), n)
    ref = reference_sha(50001, n)
    for r in range(n):
        assert got[r]["hashes"] == [ref] * 2 and got[r]["schedules"] == ["chain"] * 2
        assert got[r]["auto_layout"] == {
            "algo": "chain", "why": f"{n} ranks on one host: two neighbours each instead of {n - 1}"
        }  # fmt: skip


def test_sixteen_ranks_gather_small_inputs_up_a_tree() -> None:
    """No fabric, 16 ranks on this host: "auto" runs a small all_reduce as "tree"
    (schedule.TREE_MIN_RANKS: the inputs up a binomial tree, rank 0 folds them in rank
    order, the result back down) with the rank-order bits, sync and async."""
    n = S.TREE_MIN_RANKS
    count = 3  # 12 bytes
    assert S.small_all_reduce(n, 4 * count) == "tree"
    p = subprocess.run(
        [sys.executable, "-m", "mrc.run", "-n", str(n), "--timeout", "60", "--",
         sys.executable, WORKER, "loop", "4"],
        capture_output=True, text=True, cwd=ROOT, timeout=180,
        env={**os.environ, "MRC_TEST_COUNT": str(count)},
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    got = results(p.stdout.splitlines(keepends=True), n)
    ref = reference_sha(count, n)
    for r in range(n):
        assert got[r]["hashes"] == [ref] * 4 and got[r]["ran"] == ["all_reduce_tree"] * 4


@pytest.mark.root
def test_plane_failed_mid_loop_and_healed_keeps_the_bits() -> None:
    ref = reference_sha()
    with fabric_up(FABRIC) as fab:
        p = launch(fab, "heal", "3000")
        events: dict[str, int] = {}

        def on_op(ev: dict[str, Any]) -> None:
            if ev["op"] == 3 and "fail" not in events:
                fab.fail(H1_PLANE1)  # between (or during) operations 3 and 4
                events["fail"] = ev["op"]
            elif ev["schedule"] == "resilient" and "heal" not in events:
                fab.heal(H1_PLANE1)
                events["heal"] = ev["op"]

        lines = follow(p, on_op)
    assert p.returncode == 0, "".join(lines[-40:])
    got = results(lines)
    for r in range(4):
        sched = got[r]["schedules"]
        n = len(sched)
        assert got[r]["hashes"] == [ref] * n, r
        assert sched[0] == "equal" and sched[-1] == "equal" and "resilient" in sched
        first = sched.index("resilient")
        assert first > events["fail"]
        assert got[r]["planes"][str(first)][1] == [0, 2, 3]
        assert got[r]["planes"][str(n - 1)][1] == [0, 1, 2, 3]
    assert len({json.dumps(got[r]["schedules"]) for r in range(4)}) == 1


@pytest.mark.root
def test_the_rendezvous_plane_pulled_mid_loop_keeps_the_group(tmp_path: Path) -> None:
    """The rendezvous listens on rank 0's plane-0 address (MASTER_ADDR), so h1's plane-0
    cable carries h1's first rendezvous connection. Pulled mid-loop, with a 2 s timeout:
    the group lives on through its links on the other planes (rendezvous.py) for
    several timeouts, every result stays bit-identical, and close() does not wait out a timeout.
    Before the links, the group failed one timeout after the pull ("rank 1 sent nothing
    for 2 s"), while the transport was carrying on. The loop runs until 2.5 timeouts after
    the pull (a stop file), however fast its operations are."""
    timeout, ref = 2.0, reference_sha()
    stop = tmp_path / "stop"
    with fabric_up(FABRIC) as fab:
        p = launch(fab, "until", "100000", timeout=timeout, env={"MRC_TEST_STOP_FILE": str(stop)})
        at = {"pulled": 0.0, "last": 0.0}

        def on_op(ev: dict[str, Any]) -> None:
            at["last"] = time.monotonic()
            if ev["op"] == 3 and not at["pulled"]:
                fab.fail("h1-p0l0")
                at["pulled"] = time.monotonic()
            if at["pulled"] and at["last"] - at["pulled"] > 2.5 * timeout:
                stop.touch()

        lines = follow(p, on_op)
        ended = time.monotonic()
    pulled, last = at["pulled"], at["last"]
    assert p.returncode == 0, "".join(lines[-40:])
    assert pulled and last - pulled > 2 * timeout, (pulled, last)  # outlived it, twice over
    assert ended - last < timeout, (last, ended)  # and closed without waiting one out
    got = results(lines)
    for r in range(4):
        n = len(got[r]["hashes"])
        assert n > 4 and got[r]["hashes"] == [ref] * n, r


@pytest.mark.root
def test_a_plane_0_black_hole_healed_then_the_others_pulled_keeps_the_group(
    tmp_path: Path,
) -> None:
    """h0's plane-0 cable (rank 0's: every rank's first rendezvous connection ends there)
    drops every packet for 18 s with its link up (a gray failure: no ICMP error comes
    back), is fixed, then h0's three other cables are pulled. TCP backs off while its
    packets vanish (its retransmission timeout doubles: tries at 0.2, 0.6, 1.4, ... 12.6,
    25.4 s for a 200 ms timeout; 18 s falls between the tries for timeouts of 200-280
    ms), so the other ranks' first connections stayed silent 7 s or more after the fix;
    with only plane 0 left, the group failed one timeout after the pull ("rank 1 sent
    nothing for 2.x s") while the transport carried on. A rank now opens a fresh
    link to an address whose connections went silent (rendezvous.py, "A link is kept"):
    the group lives on, every result bit-identical."""
    timeout, ref = 2.0, reference_sha()
    stop = tmp_path / "stop"
    with fabric_up(FABRIC) as fab:
        p = launch(fab, "until", "100000", timeout=timeout, env={"MRC_TEST_STOP_FILE": str(stop)})
        at: dict[str, float] = {}

        def on_op(ev: dict[str, Any]) -> None:
            now = at["last"] = time.monotonic()
            if ev["op"] == 3 and "holed" not in at:
                fab.loss("h0-p0l0", 100)
                at["holed"] = time.monotonic()
            elif "holed" in at and "fixed" not in at and now - at["holed"] > 18:
                fab.loss("h0-p0l0", 0)
                at["fixed"] = time.monotonic()
            elif "fixed" in at and "cut" not in at and now - at["fixed"] > 1:
                for plane in (1, 2, 3):
                    fab.fail(f"h0-p{plane}l0")
                at["cut"] = time.monotonic()
            elif "cut" in at and now - at["cut"] > 3 * timeout:
                stop.touch()

        lines = follow(p, on_op)
    assert p.returncode == 0, "".join(lines[-40:])
    assert "cut" in at and at["last"] - at["cut"] > 2 * timeout, at  # outlived it, twice over
    got = results(lines)
    n = len(got[0]["hashes"])
    for r in range(4):
        assert got[r]["hashes"] == [ref] * n, r


@pytest.mark.root
@pytest.mark.parametrize("told", [True, False], ids=["MRC_MASTER_ADDRS", "from_the_fabric"])
def test_a_rank_whose_plane_0_is_down_joins_over_another(told: bool) -> None:
    """mrc-run gives every rank rank 0's plane addresses (MRC_MASTER_ADDRS): with h1's
    plane-0 cable down before the run, rank 1 cannot reach MASTER_ADDR and joins over
    another plane; the group forms, and every result is bit-identical. Before, rank 1
    could not join ("could not reach the rendezvous of rank 0") and the job failed.
    Without MRC_MASTER_ADDRS (a launcher that sets only MASTER_ADDR), the fabric file
    names the other planes of the host that owns MASTER_ADDR."""
    ref = reference_sha()
    with fabric_up(FABRIC) as fab:
        fab.fail("h1-p0l0")
        env = {} if told else {"MRC_TEST_NO_MASTER_ADDRS": "1"}
        got, _ = run_loop(fab, 3, env=env)
    for r in range(4):
        assert got[r]["hashes"] == [ref] * 3, r
