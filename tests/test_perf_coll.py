"""mrc-perf's collective tests: the reference and table arithmetic, and (once the
collectives are in) all_reduce under mrc-run printing nccl-tests' table with #wrong 0."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import numpy as np
import pytest

from mrc.collectives.ops import Collectives
from mrc.perf.coll import (
    bf16_to_f32,
    busbw_factor,
    f32_to_bf16,
    finish,
    parse_size,
    rank_data,
    reduced,
    sizes,
    wrong,
)

ROOT = Path(__file__).resolve().parent.parent


def test_sizes_and_factors() -> None:
    assert [parse_size(s) for s in ("8", "64K", "1M", "2G", "0")] == [8, 65536, 1 << 20, 2 << 30, 0]
    with pytest.raises(click.BadParameter, match="want bytes"):
        parse_size("lots")
    assert sizes(8, 128, 2, 0) == [8, 16, 32, 64, 128]
    assert sizes(0, 2, 2, 0) == [0, 1, 2]
    assert sizes(10, 30, 2, 10) == [10, 20, 30]
    assert busbw_factor("all_reduce", 4) == 1.5
    assert busbw_factor("all_gather", 4) == busbw_factor("alltoall", 4) == 0.75
    assert busbw_factor("broadcast", 4) == busbw_factor("reduce", 4) == 1.0


def test_bfloat16_rounds_to_nearest_even() -> None:
    f = np.array([1.0, 1.00390625, 1.01171875, -2.5, np.inf], dtype=np.float32)
    # 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to even (1.0);
    # 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: to even (1 + 2^-6).
    assert bf16_to_f32(f32_to_bf16(f)).tolist() == [1.0, 1.0, 1.015625, -2.5, np.inf]
    assert np.isnan(bf16_to_f32(f32_to_bf16(np.array([np.nan], dtype=np.float32))))[0]


def test_reference_is_in_rank_order() -> None:
    """The check would notice a reduction in another order: for random floats the
    rank-order sum and the reverse-order sum differ in some bits."""
    n, count = 5, 4096
    want = reduced(count, "float32", "sum", n)
    rev = rank_data(n - 1, count, "float32", "sum").copy()
    for r in range(n - 2, -1, -1):
        rev = rev + rank_data(r, count, "float32", "sum")
    assert wrong(rev, want) > 0
    assert wrong(want.copy(), want) == 0


def test_avg_and_wrong() -> None:
    acc = np.array([7, -7, 5, -1], dtype=np.int32)
    assert finish(acc, "avg", "int32", 2).tolist() == [3, -3, 2, 0]  # toward zero, as C
    assert wrong(np.array([0.0, 1.0]), np.array([-0.0, 1.0])) == 1  # bits, not ==
    assert wrong(np.zeros(0, np.float32), np.zeros(0, np.float32)) == 0
    nan = np.array([np.nan])
    assert wrong(nan, nan.copy()) == 0


def test_prod_inputs_stay_exact() -> None:
    for dtype in ("int8", "float16", "bfloat16"):
        got = reduced(1000, dtype, "prod", 5)
        assert got.size == 1000  # small integers: 5 of them neither overflow nor round


@pytest.mark.skipif(
    not hasattr(Collectives, "all_reduce"), reason="the collectives (wip/coll) are not merged yet"
)
def test_all_reduce_table_under_mrc_run(tmp_path: Path) -> None:
    out_json = tmp_path / "ar.json"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "mrc.run",
            "-n",
            "3",
            "--timeout",
            "20",
            "--",
            sys.executable,
            "-m",
            "mrc.perf.cli",
            "all_reduce",
            "-b",
            "8",
            "-e",
            "256K",
            "-f",
            "8",
            "-n",
            "2",
            "-w",
            "1",
            "-c",
            "1",
            "--out_json",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "MRC_ALGO"},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    table = [x for x in res.stdout.splitlines() if x.startswith("[0] ")]
    assert not any(x.startswith(("[1] ", "[2] ")) for x in res.stdout.splitlines())
    rows = [x for x in table if re.match(r"\[0\] +\d+ +\d+ +float +sum +-1 ", x)]
    assert [int(r.split()[1]) for r in rows] == [8, 64, 512, 4096, 32768, 262144]
    for r in rows:
        cols = r.split()
        assert cols[9] == "0" and cols[13] == "0", r  # #wrong, out-of-place and in-place
    assert any("# Avg bus bandwidth" in x for x in table)
    data = json.loads(out_json.read_text())
    assert data["wrong"] == 0 and data["ranks"] == 3 and data["busbw_factor"] == 4 / 3
    assert data["algo"] == "auto" and "[0] # all_reduce algorithm: auto (MRC_ALGO)" in table
