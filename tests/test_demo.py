"""`make demo`'s collective part (tools/demo.py --collectives): 4 ranks all-reduce in a
loop while h1's plane 1 fails and heals; the demo exits 0 only when every result of every
rank equals the healthy reference, the loop ran to its end and the planner switched to
the resilient schedule and back. Run as a user would, through its output and exit code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO = str(ROOT / "tools" / "demo.py")
SHA = re.compile(r"^  op +(\d+) +(equal|resilient) .* ms +([0-9a-f]{10}) (.*)$")


def run_demo(*args: str, **env: str) -> tuple[int, str]:
    # A wide console, so rich wraps no line the checks read.
    full_env = {**os.environ, "COLUMNS": "200", **env}
    p = subprocess.run(
        [sys.executable, DEMO, "--collectives", *args],
        capture_output=True, text=True, cwd=ROOT, env=full_env, timeout=240,
    )  # fmt: skip
    return p.returncode, p.stdout + p.stderr


def check_loop(out: str, failure_line: str, heal_line: str) -> None:
    ref = re.search(r"healthy reference: sha256 ([0-9a-f]{10})", out)
    assert ref, out
    ops = [m.groups() for m in map(SHA.match, out.splitlines()) if m]
    assert ops, out
    # Every operation ran, in order, and printed the reference's hash.
    assert [int(o[0]) for o in ops] == list(range(1, len(ops) + 1)), out
    assert all(o[2] == ref.group(1) and o[3] == "= reference" for o in ops), out
    scheds = [o[1] for o in ops]
    first = scheds.index("resilient")
    assert scheds[0] == "equal" and scheds[-3:] == ["equal"] * 3, scheds
    assert all(s == "resilient" for s in scheds[first : scheds.index("equal", first)])
    lines = out.splitlines()
    # The cut comes before the switch, the heal before the switch back.
    cut = next(i for i, ln in enumerate(lines) if failure_line in ln)
    switch = next(i for i, ln in enumerate(lines) if "runs schedule resilient" in ln)
    heal = next(i for i, ln in enumerate(lines) if heal_line in ln)
    back = next(i for i, ln in enumerate(lines) if "runs schedule equal" in ln)
    assert cut < switch < heal < back, out
    # The planner's line is followed by the agreed bandwidths: rank 1 without plane 1.
    assert "planes 023)" in lines[switch + 3], out
    assert f"{len(ops)} all_reduces x 4 ranks: all {4 * len(ops)} results bit-identical" in out
    assert "PASS" in out and "DIFFERS" not in out


def test_demo_loopback_loop_survives_the_cut_plane() -> None:
    rc, out = run_demo("--loopback")
    assert rc == 0, out
    assert "Endpoint.inject(1, down=True)" in out
    check_loop(out, "rank 1: plane 1 cut (inject down) during op 4", "rank 1: plane 1 healed")


def test_demo_fails_when_the_planner_never_switches() -> None:
    """The exit code is the verdict: with the planner off (MRC_RESILIENT=0) the results
    still match, but the demo's claim (the switch) does not hold, so it exits 1."""
    rc, out = run_demo("--loopback", MRC_RESILIENT="0")
    assert rc == 1, out
    assert "the planner never switched to the resilient schedule" in out
    assert "FAIL" in out


@pytest.mark.root
def test_demo_fabric_loop_survives_the_cable_pull() -> None:
    rc, out = run_demo()
    assert rc == 0, out
    assert "on the namespace fabric" in out
    check_loop(out, "mrc-fabric fail h1-p1l0", "mrc-fabric heal h1-p1l0")
    assert "send 4 3 4 4 Gbit/s" in out  # h1 agreed at 3 of its 4 x 1 Gbit/s
