"""Random call sequences with faults at random moments, each seed in a subprocess (a
crash fails its test instead of ending the suite; `make asan-py` runs the same under
ASan+UBSan).

tests/api_chaos.py: random calls on the transport's API from four threads at once (no
crash, no error that is not an mrc error, no operation left pending once its endpoint
is closed). It found a completion queue polled, closed or waited on while another
thread closed its endpoint reading the queue the endpoint was freeing without the GIL
(6 of 7 seeds of 3000 calls per thread died by SIGSEGV or a double free's abort).

tests/coll_chaos.py: 3 communicators making random collectives while one of them is
aborted, closed, has its endpoint or a connection closed, a plane pulled or made lossy
(no wrong result; the survivable faults end every call; the others end every rank
sooner than the timeout). It found a rank whose own connection was closed under its
collective failing without telling the group: a rank waiting on it waited out its
whole communicator timeout (1 run in 3-6 with the connection fault).

tests/torch_chaos.py: the same for the torch backend's process groups (async works
waited in random orders, some never, some through their futures; abort, shutdown, an
endpoint closed, a plane pulled, a tiny wait): it found nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def run(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        [sys.executable, "-X", "faulthandler", str(HERE / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-6000:]}"
    return res


@pytest.mark.parametrize("seed", [1, 2, 3, 10])
def test_random_transport_calls_from_four_threads(seed: int) -> None:
    res = run("api_chaos.py", str(seed), "2000", "4", timeout=280)
    # The run did something: operations were posted and endpoints closed under them.
    counts = res.stdout.split(";", 1)[1]
    assert "'ep_close'" in counts and "'write'" in counts and "'recv'" in counts, res.stdout


CASES = [
    *[(s, "connection") for s in (9, 11, 12, 30, 31, 32)],
    *[(s, "endpoint") for s in (7, 13)],
    *[(s, "abort") for s in (2, 14)],
    *[(s, "close") for s in (4, 15)],
    *[(s, "plane") for s in (5, 6)],
    *[(s, "loss") for s in (19, 20)],
]


@pytest.mark.parametrize(("seed", "fault"), CASES)
def test_a_fault_at_a_random_moment_under_random_collectives(seed: int, fault: str) -> None:
    res = run("coll_chaos.py", str(seed), fault, timeout=120)
    assert f": {fault} on rank" in res.stdout, res.stdout


TORCH_CASES = [(2, "abort"), (1, "shutdown"), (2, "endpoint"), (1, "plane"), (1, "short_wait")]


@pytest.mark.parametrize(("seed", "fault"), TORCH_CASES)
def test_a_fault_at_a_random_moment_under_the_torch_backend(seed: int, fault: str) -> None:
    pytest.importorskip("torch")
    res = run("torch_chaos.py", str(seed), fault, timeout=120)
    assert f": {fault} on rank" in res.stdout, res.stdout
