"""The tools as a new user meets them (issue 11): --version, loss units, MRC_LOSS errors,
--out_json_file checked first, the JSON's fields, the Mss line and keys of mismatched
sides, mrc-route live at 80 columns and stale sockets, a non-builder user of the venv."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
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
    "module", ["mrc.perf.cli", "mrc.routing.cli", "mrc.fabric.cli", "mrc.fabric.xfer", "mrc.run"]
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


def test_rebuilds_on_import_run_one_at_a_time(tmp_path: Path) -> None:
    """The editable build's rebuild-on-import, wrapped by tools/mrc_shared_build.py: ranks
    importing mrc together after a source changed ran ninja in one build directory at
    once and corrupted its deps log (every later import then rebuilt everything). Under
    the wrap the rebuilds of 6 threads (each its own lock file descriptor, as processes
    have) never overlap."""
    import importlib.util
    import threading

    spec = importlib.util.spec_from_file_location("msb", ROOT / "tools" / "mrc_shared_build.py")
    assert spec is not None and spec.loader is not None
    msb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(msb)
    inside, most = [0], [0]
    guard = threading.Lock()

    def rebuild() -> int:
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.02)  # a rebuild that takes a while: room for another to overlap
        with guard:
            inside[0] -= 1
        return 1

    locked = msb._one_at_a_time(rebuild, str(tmp_path))
    threads = [threading.Thread(target=locked) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1, f"{most[0]} rebuilds at once"
    assert (tmp_path / ".mrc-rebuild.lock").exists()


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


# --- bad input on every command line: the problem and where, never a traceback ---------


LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
LAUNCHER_VARS += ("PMI_RANK", "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS")


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """python -m args, without a launcher's variables unless env gives them."""
    base = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**base, **(env or {})},
    )


def said(r: subprocess.CompletedProcess[str], code: int, *parts: str) -> None:
    out = r.stdout + r.stderr
    assert r.returncode == code, out
    assert "Traceback" not in out, out
    for part in parts:
        assert part in out, out


def test_a_command_keeps_its_own_options(tmp_path: Path) -> None:
    """mrc-run and mrc-fabric exec stop at the command: its -n is not theirs (mpirun's
    and torchrun's habit), with or without `--`."""
    argv = "import sys; print(sys.argv[1:])"
    r = cli("mrc.run", "-n", "1", sys.executable, "-c", argv, "-n", "8", "--timeout", "5")
    said(r, 0, "[0] ['-n', '8', '--timeout', '5']")
    assert "[1]" not in r.stdout
    env = {"MRC_FABRIC_STATE_DIR": str(tmp_path)}
    for args in (["h0", "ip", "-n", "100"], ["h0", "-n", "demo", "--", "ip", "-n", "9"]):
        r = cli("mrc.fabric.cli", "exec", *args, env=env)
        name = "demo" if "demo" in args else "mrc"
        said(r, 1, f"fabric '{name}' is not up")


def test_bad_collective_arguments_and_failures_are_one_line() -> None:
    perf = ("mrc.perf.cli", "all_reduce")
    for args, hint in (
        (["-b", "inf"], "-b"),
        (["-e", "1e30"], "-e"),
        (["-f", "nan"], "-f"),
        (["-b", "8", "-e", "4"], "-e"),
        (["--out_json", "/nonexistent/r.json"], "--out_json"),
        (["--timeout", "-1"], "--timeout"),
    ):
        said(cli(*perf, *args), 2, "Invalid value for", hint)
    said(
        cli(*perf, "-b", "8", "-e", "8"),
        1,
        "mrc-perf: error: no launcher variables",
        "start the ranks with a launcher (mrc-run -n N",
    )
    # Ranks that disagree on the size: each says so in one line, mrc-run names the rank.
    code = (
        "import os, sys; from mrc.perf.cli import main; "
        "n = str(8 * (int(os.environ['RANK']) + 1)); "
        "sys.argv = ['mrc-perf', 'all_reduce', '-b', n, '-e', n, '-n', '1']; main()"
    )
    r = cli("mrc.run", "-n", "2", "--timeout", "20", "--", sys.executable, "-c", code)
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, r.stdout
    assert "[0] mrc-perf: error: rank 0: all_reduce of 2 float32" in r.stdout, r.stdout
    assert "[1] mrc-perf: error: rank 1: all_reduce of 4 float32" in r.stdout, r.stdout


def test_a_fail_plane_after_the_run_is_not_reported_as_done() -> None:
    r = cli(
        "mrc.perf.cli", "write_bw", "--local", "--nplanes", "2", "-n", "50",
        "--fail-plane", "1@30",
    )  # fmt: skip
    said(r, 0, "Plane 1 was not taken down: the run ended before 30 s")
    assert "was taken down during the run" not in r.stdout
    said(cli("mrc.perf.cli", "write_bw", "--local", "--fail-plane", "1@inf"), 2, "--fail-plane")


def test_model_table_fits_80_columns_and_plot_is_checked_first(tmp_path: Path) -> None:
    r = cli("mrc.perf.cli", "model", "-n", "4,1024", "-x", "1/4,3/4", env={"COLUMNS": "80"})
    said(r, 0, "+6.7%", "+33.3%")
    assert max(len(line) for line in r.stdout.splitlines()) <= 80, r.stdout
    for plot, why in (("/nonexistent/o.png", "does not exist"), ("o.txt", ".png, .svg or .pdf")):
        r = cli("mrc.perf.cli", "model", "-n", "4", "-x", "0.25", "--plot", plot)
        said(r, 2, "--plot", why)
        assert "healthy" not in r.stdout  # refused before the table


def test_route_tables_and_fabric_files_name_the_file_and_field(tmp_path: Path) -> None:
    good = json.loads(cli("mrc.routing.cli", "show", "routing/4host-4plane.toml", "--json").stdout)
    cases: list[tuple[object, str]] = [([], "format: not a route table")]
    no_paths = dict(good)
    del no_paths["paths"]
    cases.append((no_paths, "paths: missing key 'paths'"))
    no_dst = json.loads(json.dumps(good))
    del no_dst["paths"][2]["dst_addr"]
    cases.append((no_dst, "paths[2].dst_addr: missing key"))
    bad_id = json.loads(json.dumps(good))
    bad_id["paths"][1]["id"] = "x"
    cases.append((bad_id, "paths[1]: bad value"))
    for i, (doc, why) in enumerate(cases):
        f = tmp_path / f"t{i}.json"
        f.write_text(json.dumps(doc))
        said(cli("mrc.routing.cli", "show", str(f)), 2, f"{f}: {why}")
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe\x00 planes = 4")
    said(cli("mrc.routing.cli", "check", str(binary)), 2, f"{binary}: not a text (UTF-8) file")
    said(cli("mrc.run", "-n", "2", "--fabric", str(binary), "--", "true"), 2, "not a text")
    r = cli("mrc.routing.cli", "show", "routing/4host-4plane.toml", "--failed", "plane9")
    said(r, 2, "planes are plane0..plane3")


def test_live_says_what_the_path_is_and_ends_on_ctrl_c(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_text("")
    said(cli("mrc.routing.cli", "live", str(plain)), 2, "is not a socket")
    said(cli("mrc.routing.cli", "live", str(tmp_path)), 2, "is a directory")
    sock = str(tmp_path / "s.sock")
    with mrc.Endpoint("127.0.0.1") as ep, ep.serve_stats(sock):
        p = subprocess.Popen(
            [sys.executable, "-m", "mrc.routing.cli", "live", sock, "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert p.stdout is not None and p.stdout.readline().startswith("{")  # it is running
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0 and not err, err


def test_launcher_and_fabric_refuse_bad_values(tmp_path: Path) -> None:
    for opt, value in (("--timeout", "0"), ("--time-limit", "-1"), ("--settle", "-1")):
        said(cli("mrc.run", "-n", "1", opt, value, "--", "true"), 2, opt)
    noexec = tmp_path / "prog"
    noexec.write_text("x")
    said(cli("mrc.run", "-n", "1", "--", str(noexec)), 126, "Permission denied")
    env = {"MRC_FABRIC_STATE_DIR": str(tmp_path)}
    said(cli("mrc.fabric.cli", "status", "--name", "bad-x", env=env), 2, "bad fabric name")
    (tmp_path / "broken.json").write_text('{"fabric": "x"}')
    said(cli("mrc.fabric.cli", "status", "--name", "broken", env=env), 1, "not a fabric state")
    with pytest.raises(mrc.UsageError, match="127.0.0.1 is given twice"):
        mrc.Endpoint(["127.0.0.1", "127.0.0.1"])
