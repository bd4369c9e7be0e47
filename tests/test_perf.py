"""mrc-perf end to end on loopback: server and client as real processes, tables parsed
from what they print, --verify, --out_json, option mismatches, failover, bad input."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mrc.perf.stats import bw_result, lat_result, machine_jiffies, percentile

CLI = [sys.executable, "-m", "mrc.perf.cli"]
TIMEOUT = 30
ENV = {**os.environ, "PYTHONFAULTHANDLER": "1"}
BW_COLS = ["bytes", "iterations", "bw_peak", "bw_avg", "msg_rate_mpps"]
LAT_COLS = ["bytes", "iterations", "t_min", "t_max", "t_typical", "t_avg", "t_stdev", "p99", "p999"]

# Small, fast runs: the test machine has two cores.
MODES = {
    "write_bw": ["-s", "4096", "-n", "400", "-t", "32"],
    "send_bw": ["-s", "4096", "-n", "400", "-t", "32"],
    "write_lat": ["-s", "64", "-n", "200"],
    "send_lat": ["-s", "64", "-n", "200"],
}


def parse_table(out: str) -> tuple[str, list[dict[str, float]]]:
    """The result table: (header line, one dict per row)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(" #bytes"))
    header = lines[start]
    cols = BW_COLS if "BW peak" in header else LAT_COLS
    if "CPU_Util" in header:
        cols = [*cols, "cpu_util"]
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("---"):
            break
        values = [float(v) for v in line.split()]
        assert len(values) == len(cols), line
        rows.append(dict(zip(cols, values, strict=True)))
    return header, rows


def json_after_table(out: str) -> dict:
    return json.loads(out[out.index("\n{") + 1 :])


def start_server(args: list[str]) -> tuple[subprocess.Popen[str], int]:
    """Start a server on an ephemeral port; return it once it says it is listening."""
    proc = popen([*args, "-p", "0", "--quiet"])
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        m = re.search(r"listening on \S+ port (\d+)", line)
        if m:
            return proc, int(m.group(1))
    proc.kill()
    raise AssertionError(f"server never listened: {''.join(seen)} {proc.stderr.read()}")  # type: ignore[union-attr]


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # faulthandler (ENV) prints every thread's stack
        out, err = proc.communicate()
        raise AssertionError(f"hung:\n{out}\n{err}") from None
    return proc.returncode, out, err


def popen(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )


def run(args: list[str]) -> subprocess.CompletedProcess[str]:
    proc = popen(args)
    rc, out, err = finish(proc)
    return subprocess.CompletedProcess(proc.args, rc, out, err)


@pytest.mark.parametrize("mode", list(MODES))
def test_mode_end_to_end(mode: str, tmp_path: Path) -> None:
    opts = [mode, *MODES[mode], "--verify", "--report_gbits"]
    server, port = start_server([*opts, "--out_json"])
    json_file = tmp_path / "client.json"
    client = popen([*opts, "-p", str(port), "--out_json_file", str(json_file), "127.0.0.1"])
    crc, cout, cerr = finish(client)
    src, sout, serr = finish(server)
    assert (crc, src) == (0, 0), (cout, cerr, sout, serr)

    header, rows = parse_table(cout)
    _, srows = parse_table(sout)
    assert len(rows) == 1 and rows == srows  # both sides print the same table
    row = rows[0]
    size, iters = int(MODES[mode][1]), int(MODES[mode][3])
    assert (row["bytes"], row["iterations"]) == (size, iters)
    if mode.endswith("_bw"):
        assert header.split() == (
            "#bytes #iterations BW peak[Gb/sec] BW average[Gb/sec] MsgRate[Mpps]".split()
        )
        assert 0 < row["bw_avg"] <= row["bw_peak"] and row["msg_rate_mpps"] > 0
    else:
        assert "t_typical[usec]" in header and "99.9% percentile[usec]" in header
        assert 0 < row["t_min"] <= row["t_typical"] <= row["p99"] <= row["p999"] <= row["t_max"]
        assert row["t_min"] <= row["t_avg"] <= row["t_max"]
    for out in (cout, sout):
        assert re.search(r"Verify\s+: PASS", out)
        assert "MRC_" in out and "Number of qps" in out and "Planes" in out  # header box

    # --out_json (file on the client, stdout on the server) says what the table says.
    for data in (json.loads(json_file.read_text()), json_after_table(sout)):
        assert data["test"] == mode and data["verify"] == "PASS"
        (res,) = data["results"]
        for col, value in row.items():
            assert round(res[col], 2) == pytest.approx(value, abs=0.006), col


def test_mismatched_size_fails_on_both_sides() -> None:
    server, port = start_server(["write_bw", "-s", "4096", "-n", "100"])
    client = run(["write_bw", "-s", "8192", "-n", "100", "-p", str(port), "127.0.0.1"])
    src, sout, serr = finish(server)
    assert client.returncode == 1 and src == 1
    assert "-s/--size: client 8192, server 4096" in client.stderr
    assert "-s/--size: server 4096, client 8192" in serr
    assert "#bytes" not in client.stdout  # nothing ran


def test_mismatched_test_and_iters_are_all_named() -> None:
    server, port = start_server(["send_bw", "-n", "100"])
    client = run(["write_bw", "-n", "200", "-p", str(port), "127.0.0.1"])
    src, _, serr = finish(server)
    assert client.returncode == 1 and src == 1
    for err in (client.stderr, serr):
        assert "test:" in err and "-n/--iters:" in err


def test_local_survives_a_failed_plane() -> None:
    r = run(
        ["write_bw", "--local", "--nplanes", "4", "--fail-plane", "1@0.3", "-D", "1.2",
         "--paths", "--verify", "--quiet", "-t", "64", "--report_gbits"]
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"Verify\s+: PASS", r.stdout)
    _, rows = parse_table(r.stdout)
    assert rows[0]["iterations"] > 0 and rows[0]["bw_avg"] > 0
    paths = {}
    lines = r.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(" conn path plane"))
    for line in lines[start + 1 :]:
        if line.startswith("---"):
            break
        f = line.split()
        paths[int(f[2])] = f[5]  # plane -> state
    assert sorted(paths) == [0, 1, 2, 3]
    assert paths[1] in ("failed", "suspect")
    assert all(paths[p] == "good" for p in (0, 2, 3))
    assert "plane 1 down" in r.stdout and "Plane 1 (127.0.0.2) was taken down" in r.stdout


@pytest.mark.parametrize("mode", ["write_bw", "send_bw"])
def test_local_several_connections(mode: str) -> None:
    r = run([mode, "--local", "--nplanes", "2", "-q", "3", "-n", "600", "-s", "2048",
             "--verify", "--out_json"])  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    _, rows = parse_table(r.stdout)
    assert rows[0]["iterations"] == 600
    assert json_after_table(r.stdout)["options"]["qps"] == 3


def test_send_bw_server_waits_on_a_connection_still_owed_data() -> None:
    """Before "done", a connection that got all its SENDs keeps RECVs posted ahead of the
    data; after "done", the server must block on a connection still owed a SEND, not on
    those. It blocked on connection 0's spare RECV for the whole timeout: 5 runs of 200 of
    test_local_several_connections[send_bw] failed so with both cores busy, 0 of 200 now."""
    from collections import deque

    from mrc.perf.runner import _oldest_owed

    spare0, first1, second1 = object(), object(), object()
    posted = [deque([spare0]), deque([first1, second1])]
    assert _oldest_owed(posted, [6, 5], None) is spare0  # before "done": any, in order
    assert _oldest_owed(posted, [6, 5], [6, 6]) is first1
    assert _oldest_owed(posted, [5, 6], [6, 6]) is spare0
    assert _oldest_owed(posted, [6, 6], [6, 6]) is None


def test_all_sizes_send_bw() -> None:
    """-a: every size from 2 B to 8 MiB, each with its own tag; the data of each checked."""
    r = run(["send_bw", "--local", "--nplanes", "2", "-a", "-n", "4", "--verify"])
    assert r.returncode == 0, r.stdout + r.stderr
    _, rows = parse_table(r.stdout)
    assert [int(x["bytes"]) for x in rows] == [2 << i for i in range(23)]
    assert re.search(r"Verify\s+: PASS", r.stdout)


def test_cpu_util_column_and_json() -> None:
    """--cpu_util (perftest's): the machine's busy share over the measured loop, in the
    table's last column and in the JSON with the loop's wall-clock window."""
    t0 = time.time()
    r = run(["write_bw", "--local", "--nplanes", "2", "-D", "0.5", "-s", "4096", "-t", "32",
             "--cpu_util", "--out_json"])  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    header, rows = parse_table(r.stdout)
    assert header.endswith("CPU_Util[%]")
    res = json_after_table(r.stdout)["results"][0]
    assert 0 < rows[0]["cpu_util"] <= 100 and rows[0]["cpu_util"] == round(res["cpu_util"], 2)
    assert 0 <= res["cpu_steal"] <= 100
    start, end = res["cpu_window"]
    assert t0 < start and end - start >= 0.5 and end < time.time()


def test_machine_jiffies_count_this_process() -> None:
    """The busy time --cpu_util reads holds this process's own CPU time."""
    hz = os.sysconf("SC_CLK_TCK")
    all0, busy0, _ = machine_jiffies()
    spent = time.process_time()
    while time.process_time() - spent < 0.3:
        pass
    all1, busy1, steal1 = machine_jiffies()
    assert busy1 - busy0 >= 0.25 * hz and all1 - all0 >= busy1 - busy0


@pytest.mark.parametrize("size", ["1", "16777216", "abc"])
def test_bad_size_is_a_usage_error(size: str) -> None:
    r = run(["write_bw", "-s", size, "127.0.0.1"])
    assert r.returncode == 2
    assert "-s" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["write_lat", "-q", "2"], "-q 1"),
        (["write_bw", "--fail-plane", "1"], "PLANE@SECONDS"),
        (["write_bw", "--loss", "0:200"], "percent"),
        (["write_bw", "--fail-plane", "3@1"], "plane 3 does not exist"),
        (["write_bw", "--fabric", "/nonexistent"], "does not exist"),
        (["write_bw", "--cpu_util", "127.0.0.1"], "-D/--duration"),
        (["write_lat", "--cpu_util", "-D", "1"], "bw test"),
    ],
)
def test_bad_options_are_usage_errors(args: list[str], match: str) -> None:
    r = run(args)
    assert r.returncode == 2 and match in r.stderr, r.stderr


def test_no_server_is_a_clear_error() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there now
    t0 = time.monotonic()
    r = run(["write_bw", "-p", str(port), "127.0.0.1"])
    assert r.returncode == 1
    assert f"no mrc-perf server at 127.0.0.1 port {port}" in r.stderr
    assert "Traceback" not in r.stderr and time.monotonic() - t0 < 15


def test_stats_arithmetic() -> None:
    # 10 x 1 MiB in 1 s: 10 MB/sec (perftest's MB is 2^20 bytes), 0.0838861 Gb/sec.
    comps = [0.1 * (i + 1) for i in range(10)]
    assert bw_result(1 << 20, 0.0, comps, gbits=False).bw_avg == pytest.approx(10.0)
    g = bw_result(1 << 20, 0.0, comps, gbits=True)
    assert g.bw_avg == pytest.approx(10 * (1 << 20) * 8 / 1e9) and g.units == "Gb/sec"
    assert g.msg_rate_mpps == pytest.approx(10 / 1e6)
    # Latency: half the round trip, in microseconds; percentiles as perftest picks them.
    r = lat_result(2, [2000 * (i + 1) for i in range(1000)])  # one-way 1..1000 us
    assert (r.t_min, r.t_max, r.t_typical) == (1.0, 1000.0, 501.0)
    assert (r.p99, r.p999) == (990.0, 999.0)
    assert r.t_avg == pytest.approx(500.5)
    assert percentile([5.0], 0.99) == 5.0
