"""The tools as a new user meets them (issue 11): --version, loss units, MRC_LOSS errors,
--out_json_file checked first, the JSON's fields, the Mss line and keys of mismatched
sides, mrc-route live at 80 columns and stale sockets, a non-builder user of the venv."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_perf import finish, popen, run, start_server

import mrc

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    "module", ["mrc.perf.cli", "mrc.routing.cli", "mrc.fabric.cli", "mrc.fabric.xfer"]
)
def test_every_cli_has_version(module: str) -> None:
    r = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(rf"mrc[-.]\w+(\.\w+)?, version {re.escape(mrc.__version__)}\n", r.stdout)


def test_xfer_subcommands_have_help() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "mrc.fabric.xfer", "--help"], capture_output=True, text=True
    )
    assert "Send a seeded pattern" in r.stdout and "Receive one verified" in r.stdout


def test_loss_is_percent_on_every_command_line() -> None:
    perf = subprocess.run(
        [sys.executable, "-m", "mrc.perf.cli", "write_bw", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout
    assert "percent (0..100, not a fraction)" in perf
    fabric = subprocess.run(
        [sys.executable, "-m", "mrc.fabric.cli", "--help"], capture_output=True, text=True
    ).stdout
    # The loss line is whole (it was cut off) and the group says the convention.
    assert "loss    Drop PERCENT % of LINK's packets (0 removes it)." in fabric
    assert "probability 0..1" in " ".join(fabric.split())
    assert "0..1" in (mrc.Endpoint.inject.__doc__ or "")


def test_mrc_loss_in_percent_and_named_when_bad(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MRC_LOSS", "all:100%")
    with mrc.Endpoint(["127.0.0.1", "127.0.0.2"]):
        pass  # parses: percent with a % sign
    r = subprocess.run(
        [sys.executable, "-m", "mrc.perf.cli", "write_bw", "--local", "-n", "10"],
        capture_output=True,
        text=True,
        env={**os.environ, "MRC_LOSS": "banana"},
        timeout=60,
    )
    assert r.returncode == 1
    assert "MRC_LOSS='banana' is invalid: expected PLANE:PERCENT" in r.stderr
    assert "Traceback" not in r.stderr


def test_out_json_file_is_checked_before_the_run(tmp_path: Path) -> None:
    t0 = time.monotonic()
    r = run(["write_bw", "--local", "-D", "30", "--out_json_file", "/nonexistent/x.json"])
    assert r.returncode == 2
    assert "/nonexistent/x.json: directory /nonexistent does not exist" in r.stderr
    assert time.monotonic() - t0 < 25  # refused at once, not after a 30 s run


def test_json_has_mss_planes_timeline_version_time(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    r = run(["write_bw", "--local", "--nplanes", "2", "-n", "200", "--out_json_file", str(out)])
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert d["mss"] == {"used": 32768, "local": 32768, "peer": 32768}
    assert len(d["planes"]["local"]) == 2 and d["planes"]["peer"] == ["127.0.1.1", "127.0.1.2"]
    assert d["timeline"]["samples"] and len(d["timeline"]["samples"][0]["plane_bytes"]) == 2
    assert d["mrc_version"] == mrc.__version__
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", d["timestamp"])


def _header_keys(out: str) -> tuple[str, str]:
    local = re.search(r"local address:.*Key (0x[0-9a-f]+)", out)
    remote = re.search(r"remote address:.*Key (0x[0-9a-f]+)", out)
    assert local and remote, out
    return local.group(1), remote.group(1)


def test_mss_mismatch_prints_the_mss_used_and_keys_match() -> None:
    server, port = start_server(["write_bw", "-s", "4096", "-n", "100", "--mss", "1024"])
    client = popen(
        ["write_bw", "-s", "4096", "-n", "100", "--mss", "9000", "-p", str(port)] + ["127.0.0.1"]
    )
    crc, cout, cerr = finish(client)
    src, sout, serr = finish(server)
    assert (crc, src) == (0, 0), (cerr, serr)
    assert "Mss             : 1024[B] (the smaller: this side --mss 9000, peer 1024)" in cout
    assert "Mss             : 1024[B]" in sout and "9000" not in sout.split("Mss")[1][:20]
    c_local, c_remote = _header_keys(cout)
    s_local, s_remote = _header_keys(sout)
    assert (s_remote, c_remote) == (c_local, s_local)


def test_ipv6_addresses_print_with_brackets() -> None:
    from mrc.perf.report import hostport

    assert hostport("fd00::1", 4791) == "[fd00::1]:4791"
    assert hostport("10.0.0.1", 4791) == "10.0.0.1:4791"
    assert mrc._datapath.hostport("::1", 80) == "[::1]:80"


def test_remote_client_without_server_planes_is_told_about_planes() -> None:
    # 127.0.0.1 is a loopback server; 192.0.2.1 (TEST-NET-1) is a "remote" one nobody runs.
    r = run(["write_bw", "-p", "1", "--timeout", "1", "192.0.2.1"])
    assert r.returncode == 1
    assert "no mrc-perf server at 192.0.2.1" in r.stderr
    assert "started with --planes" in r.stderr


def test_live_fits_80_columns_and_names_stale_sockets(tmp_path: Path) -> None:
    sock = str(tmp_path / "s.sock")
    from helpers import connected_pair

    with connected_pair(2) as p, p.a.serve_stats(sock):
        r = subprocess.run(
            [sys.executable, "-m", "mrc.routing.cli", "live", sock, "--count", "1"],
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "80"},
            timeout=30,
        )
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert any("good" in line for line in lines)
        assert max(len(line) for line in lines) <= 80, r.stdout
    # A socket whose process died without closing it.
    stale = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(stale)
    s.close()
    r = subprocess.run(
        [sys.executable, "-m", "mrc.routing.cli", "live", stale, "--count", "1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode != 0 and "is a stale stats socket" in r.stderr, r.stderr


def test_serve_stats_names_a_missing_directory() -> None:
    with mrc.Endpoint("127.0.0.1") as ep, pytest.raises(mrc.UsageError, match="/nonexistent"):
        ep.serve_stats("/nonexistent/dir/s.sock")


def test_read_only_array_and_negative_values_are_usage_errors() -> None:
    from helpers import connected_pair

    ro = np.zeros(64, np.uint8)
    ro.flags.writeable = False
    with connected_pair(1) as p:
        with pytest.raises(mrc.UsageError, match="writable"):
            p.a.register(ro)
        mr = p.a.register(np.zeros(64, np.uint8))
        with pytest.raises(mrc.UsageError, match="length must be an integer 0..2\\^64-1, got -1"):
            p.ca.send(mr, length=-1)
        with pytest.raises(mrc.UsageError, match="offset must be"):
            p.ca.recv(mr, offset=-3)
        with pytest.raises(mrc.UsageError, match="remote_offset must be"):
            p.ca.write(mr, mrc.RemoteRegion(1, 64), remote_offset=-1)
        with pytest.raises(mrc.UsageError, match="tag must be"):
            p.ca.send(mr, tag=-1)


def test_fabric_endpoint_outside_its_host_says_exec() -> None:
    from mrc.paths import fabric_endpoint

    with pytest.raises(mrc.UsageError, match="mrc-fabric exec h0"):
        fabric_endpoint(ROOT / "routing" / "2host-2plane.toml", "h0")


@pytest.mark.root
def test_another_user_runs_the_tools_of_a_root_built_venv() -> None:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("needs setpriv (util-linux)")
    nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    fabric = str(ROOT / "routing" / "2host-2plane.toml")
    if subprocess.run([*nobody, "test", "-r", fabric]).returncode != 0:
        pytest.skip(f"uid 65534 cannot read the checkout at {ROOT}")
    r = subprocess.run(
        [*nobody, str(BIN / "mrc-route"), "check", fabric],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok: 2host-2plane")


def _readme_block(first_line: str) -> str:
    text = (ROOT / "README.md").read_text()
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        if block.startswith(first_line):
            return block
    raise AssertionError(f"README has no python block starting {first_line!r}")


def test_readme_python_example_runs_as_written(tmp_path: Path) -> None:
    """The two-process example: the port reaches the client on the command line, the
    region descriptor over the connection."""
    (tmp_path / "server.py").write_text(_readme_block("# server.py"))
    (tmp_path / "client.py").write_text(_readme_block("# client.py"))
    server = subprocess.Popen(
        [sys.executable, "server.py"], cwd=tmp_path, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        client = subprocess.run(
            [sys.executable, "client.py", port], cwd=tmp_path, capture_output=True, timeout=60
        )
        assert client.returncode == 0, client.stderr
        out, _ = server.communicate(timeout=60)
        assert server.returncode == 0
        assert out.split() == ["(42,", "1048576)", "1048576"]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
