"""The communicator's bootstrap, mesh and failure handling, across processes on loopback.

Each rank of the multi-process tests is tests/comm_worker.py in its own process; the
error tests that need no data run ranks as threads of this process (the binding
releases the GIL in connect and accept).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import wait_for

import mrc
from mrc import _datapath
from mrc.collectives import communicator, rendezvous
from mrc.collectives.communicator import (
    _server_planes,
    launch_env,
    loopback_planes,
    rendezvous_port,
)
from mrc.collectives.rendezvous import UniqueId
from mrc.routing import load_fabric

WORKER = str(Path(__file__).with_name("comm_worker.py"))


def stop(pid: int) -> None:
    """SIGSTOP, then wait until every thread of pid is stopped: kill() returns before
    the signal has reached a thread that is running, which could still take a packet."""

    def stopped() -> bool:
        tasks = Path(f"/proc/{pid}/task")
        return all((t / "stat").read_text().rsplit(")", 1)[1].split()[0] in "tT"
                   for t in tasks.iterdir())  # fmt: skip

    os.kill(pid, signal.SIGSTOP)
    wait_for(stopped, what=f"process {pid} stopped")


def start_ranks(
    mode: str,
    size: int,
    uid: str,
    timeout: float = 10.0,
    env: dict[str, str] | None = None,
    modes: dict[int, str] | None = None,
    envs: dict[int, dict[str, str]] | None = None,
) -> list[subprocess.Popen[str]]:
    procs = []
    for r in range(size):
        e = dict(os.environ, **(env or {}), **((envs or {}).get(r, {})), COMM_WAIT_GO="1")
        m = (modes or {}).get(r, mode)
        argv = [sys.executable, WORKER, m, str(r), str(size), uid, str(timeout)]
        procs.append(
            subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True, env=e)
        )
    for p in procs:  # every rank has imported mrc: start them together
        assert p.stdout is not None
        assert json.loads(p.stdout.readline()).get("ready")
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    return procs


def results(procs: list[subprocess.Popen[str]], limit: float = 60) -> list[dict[str, Any]]:
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=limit)
            lines = [json.loads(x) for x in text.splitlines() if x.startswith("{")]
            out.append(lines[-1] if lines else {"exit": p.returncode})
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def expected_sha(src: int, dst: int) -> str:
    data = np.random.default_rng(1000 * src + dst).integers(0, 256, 100_003, dtype=np.uint8)
    return hashlib.sha256(data.tobytes()).hexdigest()


def check_mesh(res: list[dict[str, Any]], size: int, npaths: int = 4) -> None:
    for r, got in enumerate(res):
        assert got.get("ok"), got
        assert got["got"] == {str(p): expected_sha(p, r) for p in range(size) if p != r}
        assert got["npaths"] == [0 if p == r else npaths for p in range(size)]


@pytest.mark.parametrize("size", [2, 5])
def test_mesh_across_processes(size: int) -> None:
    uid = mrc.get_unique_id()
    check_mesh(results(start_ranks("mesh", size, uid.hex())), size)


def test_mesh_of_8_ranks() -> None:
    uid = mrc.get_unique_id()
    res = results(start_ranks("mesh", 8, uid.hex()))
    check_mesh(res, 8)
    # No timing target under this load, but set-up is one round, not a crawl.
    assert max(r["setup_s"] for r in res) < 10, [r["setup_s"] for r in res]


def test_ranks_that_close_as_soon_as_they_are_made() -> None:
    """A rank whose set-up is done may close at once while others are still connecting:
    the others are told it closed before their executors exist, keep that for them, and
    every rank exits cleanly (the monitor once raised AttributeError there and failed
    the whole group: 3 of 3 runs of 8 ranks)."""
    code = "import mrc; mrc.Communicator.from_env().close(); print('closed')"
    p = subprocess.run(
        [sys.executable, "-m", "mrc.run", "-n", "8", "--timeout", "60", "--",
         sys.executable, "-c", code],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("closed") == 8 and "Traceback" not in p.stderr + p.stdout


def test_from_env_across_processes() -> None:
    """torchrun's variables: rank 0 starts the rendezvous on MASTER_PORT + 1 itself."""
    port = free_port()
    env = {"WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port - 1)}
    envs = {r: {"RANK": str(r)} for r in range(3)}
    check_mesh(results(start_ranks("mesh", 3, "env", env=env, envs=envs)), 3)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# from_env: each launcher's variables ------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "rank", "size", "port"),
    [
        (
            {"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"},
            2,
            4,
            29501,
        ),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3"}, 1, 3, 29501),
        ({"PMI_RANK": "0", "PMI_SIZE": "2", "MRC_PORT": "4000"}, 0, 2, 4000),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "123456"}, 5, 8, 29957),
    ],
    ids=["torchrun", "openmpi", "pmi", "slurm"],
)
def test_launch_env(env: dict[str, str], rank: int, size: int, port: int) -> None:
    cfg = launch_env(env)
    assert (cfg["rank"], cfg["size"]) == (rank, size)
    uid = UniqueId.unpack(cfg["unique_id"])
    assert (uid.addr, uid.port) == (env.get("MASTER_ADDR", "127.0.0.1"), port)
    assert rendezvous_port(env) == port


def test_launch_env_mrc_run_variables_and_tokens() -> None:
    base = {"WORLD_SIZE": "4", "MASTER_ADDR": "fd00::1", "MRC_PORT": "5000", "MRC_RUN_ID": "a"}
    extra = {"MRC_FABRIC": "routing/4host-4plane.toml", "MRC_HOST": "h3", "MRC_TIMEOUT": "7.5"}
    cfgs = [launch_env({**base, **extra, "RANK": str(r)}) for r in range(4)]
    assert cfgs[3]["fabric"] == "routing/4host-4plane.toml"
    assert cfgs[3]["host"] == "h3" and cfgs[3]["timeout"] == 7.5
    # Every rank of a run derives the same id; another run (or size) another token.
    assert len({c["unique_id"] for c in cfgs}) == 1
    other = launch_env({**base, "MRC_RUN_ID": "b", "RANK": "0"})
    assert UniqueId.unpack(other["unique_id"]).token != UniqueId.unpack(cfgs[0]["unique_id"]).token
    assert UniqueId.unpack(cfgs[0]["unique_id"]).addr == "fd00::1"
    assert launch_env({**base, "RANK": "0", "MRC_PLANES": "2"})["planes"] == "2"
    sock = "/tmp/mrc-{rank}.sock"
    assert launch_env({**base, "RANK": "0", "MRC_STATS_SOCKET": sock})["stats_socket"] == sock
    got = launch_env({**base, "RANK": "0", "MRC_ENDPOINT_TIMEOUT": "12"})
    assert got["endpoint"] == {"timeout": 12.0}


def test_from_env_gives_the_endpoint_its_timeout() -> None:
    """MRC_ENDPOINT_TIMEOUT reaches the communicator's endpoint (the transport's give-up),
    under endpoint options passed in the call."""
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "MRC_PORT": str(port), "MRC_ENDPOINT_TIMEOUT": "12"}
    with mrc.Communicator.from_env(env, planes=1) as c:
        assert c.endpoint.timeout == 12.0
    with mrc.Communicator.from_env(env, planes=1, endpoint={"timeout": 3}) as c:
        assert c.endpoint.timeout == 3.0


def test_rank_0s_other_planes_come_from_the_fabric() -> None:
    """Without MRC_MASTER_ADDRS (torchrun, Slurm), a fabric communicator joins over the
    other planes of the host that owns the unique id's address, however it is spelt."""
    fab = load_fabric(Path(__file__).resolve().parents[1] / "routing" / "4host-4plane.toml")
    assert _server_planes(fab, "fd00::1") == ["fd00:1::1", "fd00:2::1", "fd00:3::1"]
    assert _server_planes(fab, "fd00:2:0:1:0:0:0:1") == [
        "fd00:0:0:1::1", "fd00:1:0:1::1", "fd00:3:0:1::1"
    ]  # fmt: skip
    assert _server_planes(fab, "fd00:9::1") == []  # not the fabric's
    assert _server_planes(fab, "rank0.cluster") == []  # a name: left to the resolver


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({}, "RANK/WORLD_SIZE"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, r"rank 4 out of range .* 4 ranks \(0..3\)"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MRC_PORT": "70000"}, "port 70000 out of range"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MRC_TIMEOUT": "soon"}, "MRC_TIMEOUT='soon'"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MRC_ENDPOINT_TIMEOUT": "-1"}, "seconds > 0"),
    ],
)
def test_launch_env_errors(env: dict[str, str], match: str) -> None:
    with pytest.raises(mrc.UsageError, match=match):
        launch_env(env)


def test_loopback_planes_are_distinct_per_rank() -> None:
    assert loopback_planes(0) == ["127.1.0.1", "127.1.0.2", "127.1.0.3", "127.1.0.4"]
    assert loopback_planes(6, 2) == ["127.7.0.1", "127.7.0.2"]
    with pytest.raises(mrc.UsageError, match="ranks 0..253, got rank 254"):
        loopback_planes(254)


# Bad input and missing ranks: ranks as threads ----------------------------------------------


def in_threads(
    specs: list[tuple[int, int, bytes]], timeout: float, **kw: Any
) -> list[mrc.Communicator | BaseException]:
    """Build a communicator per (rank, size, uid) at once; each result or its exception."""
    out: list[mrc.Communicator | BaseException] = [RuntimeError("not run")] * len(specs)

    def run(i: int, rank: int, size: int, uid: bytes) -> None:
        try:
            out[i] = mrc.Communicator(rank, size, uid, timeout=timeout, planes=1, **kw)
        except BaseException as e:
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, *s)) for i, s in enumerate(specs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    return out


def close_all(items: list[mrc.Communicator | BaseException]) -> None:
    """close() is collective: every rank closes at once, each in its own thread."""
    threads = [threading.Thread(target=c.close) for c in items if isinstance(c, mrc.Communicator)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


def test_each_rank_serves_its_stats_for_mrc_route_live(tmp_path: Path) -> None:
    """stats_socket (MRC_STATS_SOCKET): "{rank}" becomes the rank; each socket shows that
    rank's paths, to every peer, until close() removes it."""
    from mrc import telemetry

    uid = mrc.get_unique_id()
    comms = in_threads(
        [(r, 3, uid) for r in range(3)], 10, stats_socket=f"{tmp_path}/r{{rank}}.sock"
    )
    try:
        assert all(isinstance(c, mrc.Communicator) for c in comms), comms
        for r, c in enumerate(comms):
            assert isinstance(c, mrc.Communicator) and c.stats_socket == f"{tmp_path}/r{r}.sock"
            doc = telemetry.fetch(c.stats_socket)
            assert doc["pid"] == os.getpid() and doc["stats"]["conns"] == 2
            paths = doc["stats"]["paths"]
            assert len(paths) == 2 and {p["conn_error"] for p in paths} == {None}
            assert {p["peer"] for p in paths} == {str(q) for q in range(3) if q != r}
    finally:
        close_all(comms)
    assert not list(tmp_path.iterdir())


def test_a_stats_socket_that_cannot_be_made_fails_the_set_up_cleanly(tmp_path: Path) -> None:
    uid = mrc.get_unique_id()
    with pytest.raises(mrc.UsageError, match="directory .*nowhere does not exist"):
        mrc.Communicator(0, 1, uid, planes=1, stats_socket=f"{tmp_path}/nowhere/r.sock")
    comm = mrc.Communicator(0, 1, uid, planes=1)  # the rendezvous is free again
    comm.close()


def test_mesh_in_threads_and_close() -> None:
    uid = mrc.get_unique_id()
    comms = in_threads([(r, 3, uid) for r in range(3)], timeout=10)
    try:
        assert all(isinstance(c, mrc.Communicator) for c in comms), comms
        for c in comms:
            assert isinstance(c, mrc.Communicator)
            assert c.peers[c.rank] is None and sum(p is not None for p in c.peers) == 2
            # The acceptor (the lower rank) knows each caller by the name it gave: its rank.
            assert [c.peers[p].peer_name for p in range(c.rank + 1, 3)] == [  # type: ignore[union-attr]
                str(p) for p in range(c.rank + 1, 3)
            ]
            assert c.fabric_info is None and c.failure is None
    finally:
        close_all(comms)
    for c in comms:
        assert isinstance(c, mrc.Communicator)
        c.close()  # idempotent
        with pytest.raises(mrc.CollectiveError, match="closed"):
            c.check_failure()


def test_rank_out_of_range_and_bad_args() -> None:
    uid = mrc.get_unique_id()
    with pytest.raises(mrc.UsageError, match=r"rank 3 out of range .* 3 ranks \(0..2\)"):
        mrc.Communicator(3, 3, uid)
    with pytest.raises(mrc.UsageError, match="rank -1 out of range"):
        mrc.Communicator(-1, 3, uid)
    with pytest.raises(mrc.UsageError, match="size must be an int >= 1, got 0"):
        mrc.Communicator(0, 0, uid)
    with pytest.raises(mrc.UsageError, match="not an mrc unique id"):
        mrc.Communicator(0, 2, b"hello")
    with pytest.raises(mrc.UsageError, match="protocol version 9"):
        mrc.Communicator(0, 2, b"mrc-uid/9/127.0.0.1/1234/ab")
    with pytest.raises(mrc.UsageError, match="timeout must be > 0"):
        mrc.Communicator(0, 2, uid, timeout=0)


def test_wrong_unique_id() -> None:
    uid = UniqueId.unpack(mrc.get_unique_id())
    bad = UniqueId(uid.addr, uid.port, "0" * 32).pack()
    t0 = time.monotonic()
    with pytest.raises(mrc.UsageError, match="wrong unique id: the rendezvous at 127.0.0.1"):
        mrc.Communicator(1, 2, bad, timeout=5, planes=1)
    assert time.monotonic() - t0 < 5  # refused at once, not after the timeout


def test_missing_rank_is_named_within_the_timeout() -> None:
    uid = mrc.get_unique_id()
    t0 = time.monotonic()
    res = in_threads([(0, 4, uid), (1, 4, uid), (3, 4, uid)], timeout=1.5)
    took = time.monotonic() - t0
    close_all(res)
    for e in res:
        assert isinstance(e, mrc.CollectiveError), e
        assert "rank 2 of 4 did not join within 1.5 s (joined: 0, 1, 3)" in str(e)
        assert e.rank == 2
    assert took < 1.5 + 5


def test_unreachable_rendezvous_names_rank_0() -> None:
    bad = UniqueId("127.0.0.1", free_port(), "ab" * 16).pack()
    with pytest.raises(mrc.CollectiveError, match="could not reach the rendezvous of rank 0") as e:
        mrc.Communicator(1, 2, bad, timeout=0.5, planes=1)
    assert e.value.rank == 0


def test_a_forming_group_says_who_it_waits_for(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """While a group forms, every PROGRESS_S the ranks that joined log which ranks are
    still missing (a start that hangs on a thousand ranks says who it waits for before
    the timeout), and a rank that cannot reach rank 0 says so."""
    monkeypatch.setattr(rendezvous, "PROGRESS_S", 0.3)
    caplog.set_level(logging.WARNING, logger="mrc.collectives")
    uid = mrc.get_unique_id()
    got = in_threads([(r, 3, uid) for r in range(2)], 2)  # rank 2 never comes
    assert all(isinstance(g, mrc.CollectiveError) for g in got), got
    assert "rank 2 of 3 did not join within 2 s" in str(got[0])
    said = [r.getMessage() for r in caplog.records]
    for r in (0, 1):
        assert any(f"rank {r}: waited" in m and "for rank 2 of 3 to join" in m for m in said), said
    # Many missing: the first 16 and a count (the message stays small whatever the size).
    caplog.clear()
    got = in_threads([(0, 20, mrc.get_unique_id())], 1)
    assert isinstance(got[0], mrc.CollectiveError), got
    many = ", ".join(str(r) for r in range(1, 17)) + " and 3 more of 20 to join"
    said = [r.getMessage() for r in caplog.records]
    assert any("rank 0: waited" in m and f"for ranks {many}" in m for m in said), said

    caplog.clear()
    bad = UniqueId("127.0.0.1", free_port(), "ab" * 16).pack()
    with pytest.raises(mrc.CollectiveError, match="could not reach the rendezvous of rank 0"):
        mrc.Communicator(1, 2, bad, timeout=1.0, planes=1)
    said = [r.getMessage() for r in caplog.records]
    assert any("not reachable for 0 s (Connection refused)" in m for m in said), said


@pytest.mark.parametrize("banner", [b"", b"SSH-2.0-OpenSSH_9.6\r\n"])
def test_port_held_by_a_stranger_is_named_at_once(banner: bytes) -> None:
    """Rank 0 finds its rendezvous port taken (by a program left from another job, say)
    and joins whoever listens there: a listener that does not greet as an mrc rendezvous
    is a clear error within the greeting time, not a wait for the whole timeout."""
    import socket

    with socket.socket() as lsock:
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(8)
        port = int(lsock.getsockname()[1])
        held: list[socket.socket] = []

        def answer() -> None:
            while True:
                try:
                    conn, _ = lsock.accept()
                except OSError:
                    return
                held.append(conn)
                if banner:
                    conn.sendall(banner)

        threading.Thread(target=answer, daemon=True).start()
        uid = UniqueId("127.0.0.1", port, "ab" * 16).pack()
        t0 = time.monotonic()
        with pytest.raises(mrc.CollectiveError, match="is not an mrc rendezvous") as e:
            mrc.Communicator(0, 2, uid, timeout=30, planes=1)
        took = time.monotonic() - t0
        for conn in held:
            conn.close()
    assert e.value.rank == 0
    assert f"127.0.0.1 port {port}" in str(e.value)
    assert took < rendezvous.GREETING_S + 5  # the greeting's wait, not the 30 s timeout
    if banner:
        assert took < 5 and "its first line is not ours" in str(e.value)
    else:
        assert "said nothing for 10 s" in str(e.value)


def test_a_stopped_rank_0_is_named_as_a_cause(monkeypatch: Any) -> None:
    """Rank 0 stopped (SIGSTOP, a debugger) while the others start: its kernel still
    completes their TCP handshakes and nothing answers. The error lists that cause, not
    only a stranger on the port (which it stated as a fact before)."""
    monkeypatch.setattr(rendezvous, "GREETING_S", 0.5)
    token = "t" * 32
    code = (
        "import sys, time\n"
        "from mrc.collectives import rendezvous\n"
        f"s = rendezvous.RendezvousServer(rendezvous.UniqueId('127.0.0.1', 0, {token!r}))\n"
        "print(s.uid.port, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGSTOP)
        with pytest.raises(mrc.CollectiveError) as e:
            rendezvous.RendezvousClient(UniqueId("127.0.0.1", port, token), 10)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    msg = str(e.value)
    assert e.value.rank == 0 and f"127.0.0.1 port {port}" in msg, msg
    assert "said nothing for 0.5 s: rank 0 is stopped or too busy to answer" in msg, msg


def test_a_silent_rendezvous_address_tries_rank_0s_others(monkeypatch: Any) -> None:
    """A connection to the rendezvous that hears nothing (its plane's path went dead
    after the TCP handshake, as a pulled cable does; here a listener that never
    answers) asks rank 0's other addresses at once and joins over the one that
    greets. Every address silent is the stranger's error, naming them all."""
    monkeypatch.setattr(rendezvous, "GREETING_S", 0.5)
    token = "s" * 32
    server = rendezvous.RendezvousServer(UniqueId("127.0.0.2", 0, token))
    port = server.uid.port
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", port))
        silent.listen(8)  # the kernel completes the handshake; nobody answers
        client = rendezvous.RendezvousClient(
            UniqueId("127.0.0.1", port, token), 10, alternates=["127.0.0.2"]
        )
        try:
            assert client._joined_addr == "127.0.0.2"
            assert len(client.join(0, 1, {"x": 1})) == 1
        finally:
            client.close()
            server.stop()
        with socket.socket() as silent2:
            silent2.bind(("127.0.0.2", port))
            silent2.listen(8)
            with pytest.raises(mrc.CollectiveError, match="is not an mrc rendezvous") as e:
                rendezvous.RendezvousClient(
                    UniqueId("127.0.0.1", port, token), 10, alternates=["127.0.0.2"]
                )
    assert "said nothing for 0.5 s on each of 2 of rank 0's addresses" in str(e.value)


def test_last_words_are_flushed_until_acknowledged() -> None:
    """rendezvous._flush, which a closing end (and an exit without close()) runs so that a
    reset does not drop its last message: it waits while the peer has not acknowledged
    what was written (here the peer reads nothing and its window is full), up to its
    limit, and returns as soon as the peer has taken everything."""
    with socket.create_server(("127.0.0.1", 0)) as ls:
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        tx = socket.create_connection(ls.getsockname())
        rx, _ = ls.accept()
    with tx, rx:
        tx.setblocking(False)
        sent = 0
        try:
            while True:
                sent += tx.send(b"x" * 65536)
        except BlockingIOError:
            pass
        assert rendezvous._unacked(tx) > 0
        t0 = time.monotonic()
        rendezvous._flush(lambda: [tx], 0.3)
        assert time.monotonic() - t0 >= 0.3  # nothing was acknowledged: the whole wait

        def drain() -> None:
            got = 0
            while got < sent:
                got += len(rx.recv(1 << 20))

        reader = threading.Thread(target=drain)
        reader.start()
        t0 = time.monotonic()
        rendezvous._flush(lambda: [tx], 30)
        took = time.monotonic() - t0
        reader.join()
        assert rendezvous._unacked(tx) == 0 and took < 10, took


def test_two_ranks_with_the_same_number() -> None:
    uid = mrc.get_unique_id()
    res = in_threads([(0, 3, uid), (1, 3, uid), (1, 3, uid)], timeout=5)
    close_all(res)
    for e in res:
        assert isinstance(e, mrc.CollectiveError), e
        assert "two processes joined as rank 1" in str(e) and e.rank == 1


def test_size_mismatch() -> None:
    uid = mrc.get_unique_id()
    res = in_threads([(0, 2, uid), (1, 3, uid)], timeout=5)
    close_all(res)
    errs = [e for e in res if isinstance(e, mrc.CollectiveError)]
    assert errs and all("disagree on the communicator's size" in str(e) for e in errs), res


def test_abort_from_another_thread_reaches_every_rank() -> None:
    uid = mrc.get_unique_id()
    comms = in_threads([(0, 2, uid), (1, 2, uid)], timeout=10)
    try:
        c0, c1 = comms
        assert isinstance(c0, mrc.Communicator) and isinstance(c1, mrc.Communicator)
        threading.Timer(0.2, c1.abort, args=("test says stop",)).start()
        deadline = time.monotonic() + 10
        while c0.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)  # polls the flag the monitor thread sets; bounded
        assert c1.failure is not None and c1.failure.rank == 1
        with pytest.raises(mrc.CollectiveError, match="rank 1 aborted its communicator: test"):
            c0.check_failure()
        with pytest.raises(mrc.CollectiveError, match="rank 1 aborted"):
            c1.check_failure()
    finally:
        close_all(comms)


def test_a_broken_connection_waits_for_the_verdict_then_names_the_peer() -> None:
    """peer_error, the order a dying rank's survivors can see (c207107): rank 1's
    connection to rank 0 breaks (rank 0 heard that rank 2 died and closed) before the
    rendezvous' verdict reaches rank 1. The verdict, arriving within VERDICT_GRACE_S, is
    the error; with none, the broken connection's peer is named, after at most the grace."""
    uid = mrc.get_unique_id()
    comms = in_threads([(r, 3, uid) for r in range(3)], timeout=10)
    try:
        assert all(isinstance(c, mrc.Communicator) for c in comms), comms
        c0, c1, c2 = comms
        assert isinstance(c0, mrc.Communicator) and isinstance(c1, mrc.Communicator)
        assert isinstance(c2, mrc.Communicator)
        broken = mrc.MrcError("connection closed")
        # No verdict: the peer of the broken connection, once the grace is over.
        t0 = time.monotonic()
        err = c0.peer_error(1, broken)
        waited = time.monotonic() - t0
        assert err.rank == 1 and "connection to rank 1 failed" in str(err), err
        grace = min(communicator.VERDICT_GRACE_S, c0.timeout / 4)
        assert grace - 0.05 <= waited < grace + 2, waited
        # The verdict comes while rank 1 waits: the verdict, not the peer that closed.
        threading.Timer(0.2, c2.abort, args=("rank 2 is gone",)).start()
        err = c1.peer_error(0, broken)
        assert err.rank == 2 and "rank 2 aborted its communicator" in str(err), err
        assert c1.failure is err
        # Once a verdict is known it is the answer at once, for any broken connection.
        t0 = time.monotonic()
        assert c1.peer_error(0, broken) is err
        assert time.monotonic() - t0 < grace / 2
    finally:
        close_all(comms)


# A rank that dies or stops ----------------------------------------------------------------


@pytest.mark.parametrize("how", ["exit", "sigkill", "sigstop"])
def test_dead_rank_is_named_within_the_timeout(how: str) -> None:
    """Rank 2 of 4 dies (or is stopped) after the mesh carried data; the others, blocked
    on a RECV from it, raise CollectiveError naming rank 2 within the timeout."""
    timeout, dead = 3.0, 2
    uid = mrc.get_unique_id()
    modes = {dead: "die" if how == "exit" else "mesh_hold"}
    procs = start_ranks("survive", 4, uid.hex(), timeout, env={"DEAD_RANK": str(dead)}, modes=modes)
    try:
        if how != "exit":
            victim = procs[dead]
            assert victim.stdout is not None
            assert json.loads(victim.stdout.readline()).get("holding")  # its mesh is up
            os.kill(victim.pid, signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
        res = results([p for r, p in enumerate(procs) if r != dead])
        if how == "sigstop":  # resumed: what does the stopped rank say?
            os.kill(procs[dead].pid, signal.SIGCONT)
            (own,) = results([procs[dead]], limit=30)
    finally:
        if procs[dead].poll() is None:
            procs[dead].kill()
            procs[dead].wait()
    for got in res:
        assert got.get("type") == "CollectiveError", got
        assert got["err_rank"] == dead and f"rank {dead}" in got["error"], got
        # Death: noticed at once (its socket closes); a stopped rank: one timeout.
        assert got["secs"] < timeout + 3, got
    if how == "sigstop":
        assert all("sent nothing for" in g["error"] for g in res), res
        # Resumed, the stopped rank learns the verdict about itself, not "rank 0 silent".
        assert own.get("type") == "CollectiveError", own
        assert own["err_rank"] == dead and f"rank {dead} sent nothing for" in own["error"], own


def run_all(comms: list[Any], fn: Any) -> list[Any]:
    """fn(communicator) on a thread per rank; the results in rank order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(comms)) as ex:
        return list(ex.map(fn, comms))


def test_a_stray_line_leaves_the_rendezvous_running() -> None:
    """Valid JSON that is not a message (null, a list, a number) from a stray client, before
    and after the group formed: the rendezvous drops that client and goes on (its thread
    died on `null.get`, and every rank then failed at the timeout blaming rank 0)."""
    uid = mrc.get_unique_id()
    port = UniqueId.unpack(uid).port

    def stray(line: bytes) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.makefile("rb").readline()  # the rendezvous' greeting
            s.sendall(line)
            while s.recv(4096):  # at most a refusal, then dropped
                pass

    stray(b"null\n")
    comms: list[Any] = []
    try:
        comms = in_threads([(r, 2, uid) for r in range(2)], 10)
        for line in (b"[1]\n", b"7\n", b'{"op": "join", "rank": "x"}\n'):
            stray(line)
        assert any(t.name == "mrc-rendezvous" for t in threading.enumerate())  # still up
        got = run_all(comms, lambda c: c.all_reduce(np.ones(4, np.float32)))
        assert all(float(g[0]) == 2.0 for g in got), got
    finally:
        close_all(comms)


def test_a_rank_reset_mid_group_leaves_the_rendezvous_running() -> None:
    """A rank's connection ends in a reset (its process gone with bytes unread): the
    rendezvous' offer of the verdict to that rank then fails with EPIPE, which killed the
    rendezvous thread, and with it every later verdict for the others. It must go on."""
    server = rendezvous.RendezvousServer(UniqueId("127.0.0.1", 0, "r" * 32))
    uid = server.uid
    clients = [rendezvous.RendezvousClient(uid, 10) for _ in range(2)]
    try:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as ex:
            tables = list(ex.map(lambda r: clients[r].join(r, 2, {"r": r}), range(2)))
        assert all(len(t) == 2 for t in tables)
        sock = clients[1]._sock
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # RST, not FIN
        deadline = time.monotonic() + 10
        while 1 not in server._left and time.monotonic() < deadline:
            time.sleep(0.01)  # polls the server's state; the condition, not the time, ends it
        assert 1 in server._left, "the rendezvous never judged rank 1"
        assert server._thread.is_alive(), "the rendezvous thread died"
    finally:
        clients[0].close()
        server.stop()


def test_a_dropped_communicator_lets_go_and_the_others_are_told() -> None:
    """A communicator dropped without close() (a notebook cell run again, an exception
    past its owner): its monitor and async worker held it, so it lived, with its threads,
    sockets and endpoint, until the process exited, and the others never heard. Now it is
    freed, warns ResourceWarning, and the other ranks' next call names it."""
    import gc
    import weakref

    uid = mrc.get_unique_id()
    comms = in_threads([(r, 2, uid) for r in range(2)], 10)
    try:
        got = run_all(comms, lambda c: c.all_reduce(np.ones(4, np.float32), async_op=True).wait())
        assert all(float(g[0]) == 2.0 for g in got), got
        dropped = comms.pop(1)
        assert isinstance(dropped, mrc.Communicator)
        worker, ref = dropped._coll_worker, weakref.ref(dropped)
        assert worker is not None and worker.is_alive()
        del dropped, got
        with pytest.warns(ResourceWarning, match="unclosed <mrc.Communicator rank 1 of 2"):
            gc.collect()  # the communicator and its planner hold each other
        assert ref() is None, gc.get_referrers(ref())
        worker.join(10)
        assert not worker.is_alive()
        with pytest.raises(mrc.CollectiveError, match="rank 1 dropped its communicator") as e:
            comms[0].all_reduce(np.ones(4, np.float32))
        assert e.value.rank == 1
    finally:
        close_all(comms)


def test_a_bug_in_the_rendezvous_fails_the_group_with_its_cause(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An exception in rank 0's rendezvous thread (a bug) ended that thread silently: no
    rank heard of any failure again, and a rank that died later was found only by a
    timeout. Now every rank fails at once with the cause."""
    uid = mrc.get_unique_id()
    comms = in_threads([(r, 2, uid) for r in range(2)], 10)
    try:
        assert all(isinstance(c, mrc.Communicator) for c in comms), comms

        def boom(self: Any, now: float) -> None:
            raise RuntimeError("boom")

        monkeypatch.setattr(rendezvous.RendezvousServer, "_beat", boom)
        for c in comms:
            assert c._failed_ev.wait(10), "no rank was told"
            with pytest.raises(
                mrc.CollectiveError, match=r"rendezvous failed \(RuntimeError: boom"
            ):
                c.all_reduce(np.ones(4, np.float32))
        assert "RuntimeError: boom" in capsys.readouterr().err  # the traceback, for the report
    finally:
        close_all(comms)


def test_a_bug_in_a_monitor_callback_fails_that_communicator() -> None:
    """An exception in the rendezvous monitor (here its on_closed callback) killed the
    monitor, and its communicator then heard of no failure again: now it fails at once,
    naming the cause."""
    server = rendezvous.RendezvousServer(UniqueId("127.0.0.1", 0, "m" * 32))
    clients = [rendezvous.RendezvousClient(server.uid, 10) for _ in range(2)]
    failed: list[tuple[int | None, str]] = []
    done = threading.Event()
    try:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda r: clients[r].join(r, 2, {"r": r}), range(2)))

        def on_closed(rank: int | None, runs: Any) -> None:
            raise RuntimeError("callback bug")

        def on_failed(rank: int | None, message: str) -> None:
            failed.append((rank, message))
            done.set()

        clients[0].start_monitor(on_failed, on_closed, lambda: None)
        clients[1].send({"op": "bye"})  # the server tells rank 0: on_closed raises
        assert done.wait(10), "the monitor died without a word"
        assert failed[0][0] is None
        assert "rank 0's rendezvous monitor failed (RuntimeError: callback bug)" in failed[0][1]
    finally:
        for c in clients:
            c.close()
        server.stop()


def test_a_mismatched_call_is_the_cause_every_rank_sees() -> None:
    """Rank 1 calls broadcast where the others call all_reduce: rank 1 finds the mismatch
    and tells the group, so ranks 0 and 2 get that cause, not rank 1's closed connection."""
    uid = mrc.get_unique_id()
    comms = in_threads([(r, 3, uid) for r in range(3)], 10)
    try:

        def call(c: Any) -> str:
            try:
                if c.rank == 1:
                    c.broadcast(np.ones(1024, np.float32), root=0)
                else:
                    c.all_reduce(np.ones(1024, np.float32))
            except mrc.CollectiveError as e:
                return str(e)
            return "no error"

        errs = run_all(comms, call)
    finally:
        close_all(comms)
    assert all("does not match the call of rank" in e for e in errs), errs


def test_a_rank_given_another_world_size_is_told_so() -> None:
    """from_env() with WORLD_SIZE 3, 3 and 4: every rank hears that the sizes differ, at
    once (it was "wrong unique id" for one rank and a timeout for the others)."""
    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port - 1)}
    envs = {r: {"RANK": str(r), "WORLD_SIZE": "4" if r == 2 else "3"} for r in range(3)}
    res = results(start_ranks("mesh", 3, "env", timeout=20, env=env, envs=envs), limit=60)
    for got in res:
        assert "disagree on the communicator's size" in got.get("error", ""), got
        assert got["secs"] < 10, got


def test_a_hung_rank_is_named_by_the_rank_that_found_it_to_the_others() -> None:
    """Rank 2 stops (a hung process) with the communicator's timeout far above the
    transport's (5 s): rank 1, sending to it, finds every path failed; rank 0 waits on a
    RECV from rank 1 only. Rank 1 tells the group what it found, so rank 0's error names
    rank 2 too, not rank 1 whose connections closed as it gave up; both well before the
    communicator's timeout, which is when the rendezvous itself would notice."""
    timeout, hung = 30.0, 2
    uid = mrc.get_unique_id()
    procs = start_ranks("p2p_chain", 3, uid.hex(), timeout, modes={hung: "mesh_hold"})
    try:
        victim = procs[hung]
        assert victim.stdout is not None
        assert json.loads(victim.stdout.readline()).get("holding")  # its mesh is up
        for p in procs[:hung]:
            assert p.stdout is not None
            assert json.loads(p.stdout.readline()).get("meshed")
        stop(victim.pid)
        for p in procs[:hung]:  # only now: rank 2 must not take rank 1's data first
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        res = results(procs[:hung])
    finally:
        procs[hung].kill()
        procs[hung].wait()
    for got in res:
        assert got.get("type") == "CollectiveError", res
        assert got["err_rank"] == hung and "connection to rank 2 failed" in got["error"], res
        # the transport's timeout gave up, and the error says whose (a transport timeout
        # used to read "no progress for" the communicator's 30 s)
        assert "(the endpoint's timeout: 5 s)" in got["error"], got
        assert got["secs"] < timeout / 2, got


def test_a_hung_rank_0_is_not_blamed_on_the_rank_that_found_it() -> None:
    """Rank 0 stops, and with it the rendezvous: rank 1, sending to it, finds every path
    failed and names rank 0, but cannot tell the others; rank 2, waiting on a RECV from
    rank 1 only, sees rank 1's connection close. It used to blame rank 1 (err.rank 1,
    "connection to rank 1 failed: connection closed"); now it blames no rank and says
    that rank 0 has been silent, which explains both."""
    timeout = 30.0
    port = free_port()  # from_env(): rank 0's process serves the rendezvous
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port - 1), "HUNG_RANK": "0"}
    envs = {r: {"RANK": str(r), "WORLD_SIZE": "3"} for r in range(3)}
    procs = start_ranks("p2p_chain", 3, "env", timeout, env, {0: "mesh_hold"}, envs)
    try:
        victim = procs[0]
        assert victim.stdout is not None
        assert json.loads(victim.stdout.readline()).get("holding")
        for p in procs[1:]:
            assert p.stdout is not None
            assert json.loads(p.stdout.readline()).get("meshed")
        stop(victim.pid)
        for p in procs[1:]:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        r1, r2 = results(procs[1:])
    finally:
        procs[0].kill()
        procs[0].wait()
    assert r1.get("err_rank") == 0 and "connection to rank 0 failed" in r1["error"], r1
    assert r2.get("err_rank") is None, r2
    assert "rank 0 (the rendezvous) has sent nothing for" in r2["error"], r2
    for got in (r1, r2):
        assert got["secs"] < timeout / 2, got


def test_a_collective_nothing_answers_names_the_communicators_timeout() -> None:
    """Rank 1 is alive (its transport acknowledges, so no connection gives up) but never
    makes the call: rank 0's all_reduce ends after the communicator's timeout with
    nothing completed (STALLED, not the transport's TimeoutError), naming rank 1."""
    uid = mrc.get_unique_id()
    comms = in_threads([(r, 2, uid) for r in range(2)], 1.5)
    try:
        c0 = comms[0]
        assert isinstance(c0, mrc.Communicator), comms
        t0 = time.monotonic()
        with pytest.raises(mrc.CollectiveError) as ei:
            c0.all_reduce(np.ones(1 << 16, np.float32))
        took = time.monotonic() - t0
        assert ei.value.rank == 1 and ei.value.code == _datapath.STALLED, ei.value
        assert "no progress for 1.5 s waiting for rank 1" in str(ei.value), ei.value
        assert 1.4 < took < 5, took
    finally:
        close_all(comms)


# Real collectives (the Collectives mixin of wip/coll) across processes ---------------------

needs_collectives = pytest.mark.skipif(
    not hasattr(mrc.Communicator, "all_reduce"), reason="the collectives (wip/coll) are not merged"
)


@needs_collectives
@pytest.mark.parametrize("size", [2, 3, 5])
def test_collectives_across_processes(size: int) -> None:
    uid = mrc.get_unique_id()
    res = results(start_ranks("coll", size, uid.hex(), timeout=30), limit=120)
    for got in res:
        assert got.get("ok"), got
        bad = {k: v for k, v in got["wrong"].items() if v}
        assert not bad, (got["rank"], bad)


@needs_collectives
def test_rank_killed_mid_collective() -> None:
    timeout, dead = 3.0, 1
    uid = mrc.get_unique_id()
    res = results(
        start_ranks("coll_die", 3, uid.hex(), timeout, env={"DEAD_RANK": str(dead)}), limit=120
    )
    assert res[dead] == {"exit": 3}, res[dead]
    survivors = [g for r, g in enumerate(res) if r != dead]
    for got in survivors:
        assert got.get("type") == "CollectiveError", got
        assert got["err_rank"] == dead and f"rank {dead}" in got["error"], got
        assert got["secs"] < timeout + 5, got


def test_close_waits_for_the_others_at_most_the_timeout() -> None:
    """close() is collective; a rank whose peer never closes gives up after the timeout,
    and the peer, told the rendezvous is gone, then closes at once."""
    uid = mrc.get_unique_id()
    comms = in_threads([(0, 2, uid), (1, 2, uid)], timeout=2.0)
    c0, c1 = comms
    assert isinstance(c0, mrc.Communicator) and isinstance(c1, mrc.Communicator)
    t0 = time.monotonic()
    c0.close()
    assert 1.9 < time.monotonic() - t0 < 10
    assert c1._released.wait(5)  # so its close() will not wait
    c1.close()
    assert c1.failure is None  # a peer that closed is not a failure


def test_a_communicator_of_one() -> None:
    with mrc.Communicator(0, 1, mrc.get_unique_id(), timeout=5, planes=1) as comm:
        assert comm.peers == [None] and comm.hosts and comm.failure is None
        if hasattr(comm, "all_reduce"):
            x = np.arange(5, dtype=np.float32)
            comm.all_reduce(x)
            assert x.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(mrc.CollectiveError, match="closed"):
        comm.check_failure()


def _joined_pair(timeout: float) -> tuple[rendezvous.RendezvousServer, list[Any], list[Any]]:
    """A rendezvous on 127.0.0.1 with a link listener on 127.0.0.2, two ranks joined and
    watching (threads of this process)."""
    server = rendezvous.RendezvousServer(UniqueId("127.0.0.1", 0, "t" * 32))
    server.add_links(["127.0.0.2"])
    clients = [rendezvous.RendezvousClient(server.uid, timeout) for _ in range(2)]
    joins = [threading.Thread(target=c.join, args=(r, 2, {})) for r, c in enumerate(clients)]
    for t in joins:
        t.start()
    for t in joins:
        t.join(timeout)
    events: list[Any] = []
    for c in clients:
        c.start_monitor(
            lambda rank, msg: events.append((rank, msg)), lambda rank, runs: None, lambda: None
        )
    return server, clients, events


def _links_to(client: Any, addr: str) -> list[Any]:
    with client._lock:
        return [s for s in client._socks if client._where.get(s, ("",))[0] == addr]


def _until(cond: Any, within: float) -> bool:
    deadline = time.monotonic() + within
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)  # polling a condition, with a deadline
    return True


def test_a_link_that_went_is_opened_again_and_a_quiet_group_opens_none() -> None:
    """rendezvous.py, "A link is kept": the server ends rank 1's link (as a path that
    broke does); within a few heartbeat intervals rank 1 has a fresh link to that
    address (before, it stayed without one for the communicator's life). A group whose
    paths all work keeps its connections: no link is opened or retired."""
    timeout = 1.0
    interval = rendezvous.heartbeat_interval(timeout)
    server, clients, events = _joined_pair(timeout)
    try:
        assert _until(lambda: all(len(_links_to(c, "127.0.0.2")) == 1 for c in clients), 5)
        quiet = [set(c._socks) for c in clients]
        time.sleep(10 * interval)  # ten heartbeats of nothing happening: the check itself
        assert [set(c._socks) for c in clients] == quiet and not events

        (old,) = _links_to(clients[1], "127.0.0.2")
        mine = [p for p in list(server._peers) if p.owner is not None and p.rank == 1]
        assert len(mine) == 1
        mine[0].sock.shutdown(socket.SHUT_RDWR)
        assert _until(
            lambda: _links_to(clients[1], "127.0.0.2") not in ([], [old]),
            (rendezvous.STALE_BEATS + 3) * interval,
        )
        assert _until(
            lambda: (
                [p.rank for p in list(server._peers) if p.owner is not None] in ([0, 1], [1, 0])
            ),
            5 * interval,
        )
        assert not events
    finally:
        for c in clients:
            c.close({"op": "bye"})
        server.stop()


def test_a_server_outside_rank_0_listens_on_rank_0s_planes() -> None:
    """get_unique_id() in a launcher, not in rank 0's process: the server learns rank 0's
    planes from its join and listens on those it can (here all: the same host), so every
    rank gets its links as when rank 0 serves (before, none: one connection only)."""
    timeout = 2.0
    server = rendezvous.RendezvousServer(UniqueId("127.0.0.1", 0, "u" * 32))
    clients = [rendezvous.RendezvousClient(server.uid, timeout) for _ in range(2)]
    infos = [{"planes": ["127.0.0.1", "127.0.0.3", "192.0.2.1"]}, {"planes": ["127.0.0.4"]}]
    joins = [threading.Thread(target=c.join, args=(r, 2, infos[r])) for r, c in enumerate(clients)]
    try:
        for t in joins:
            t.start()
        for t in joins:
            t.join(timeout)
        for c in clients:
            c.start_monitor(lambda rank, msg: None, lambda rank, runs: None, lambda: None)
        # 127.0.0.1 is the join's own; 192.0.2.1 is not this host's: left out
        assert [a for a, _ in server._links] == ["127.0.0.3"]
        assert _until(lambda: all(len(_links_to(c, "127.0.0.3")) == 1 for c in clients), 5)
    finally:
        for c in clients:
            c.close({"op": "bye"})
        server.stop()


def test_a_full_connection_is_not_waited_on() -> None:
    """rendezvous._offer queues a whole message or none (False) without blocking: a
    heartbeat for a path down for minutes cannot stall the server or the rank."""
    a, b = socket.socketpair()
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sent = 0
        while rendezvous._offer(a, {"op": "hb"}):
            sent += 1
            assert sent < 1_000_000
        b.setblocking(False)
        got = b""
        while True:
            try:
                chunk = b.recv(65536)
            except BlockingIOError:
                break
            got += chunk
        lines = got.split(b"\n")
        assert sent > 0 and lines[:sent] == [b'{"op": "hb"}'] * sent
        assert len(b"\n".join(lines[sent:])) < len(b'{"op": "hb"}\n')  # at most part of one
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    ("offload", "used", "named"),
    [
        ([True, True, True], "table", None),
        ([True, False, True], "planes", "rank 1 would"),
        ([False, True, False], "planes", "ranks 0, 2 would"),
        ([None, True, True], "planes", "rank 0 would"),  # a rank that did not say
    ],
)
def test_routes_auto_is_settled_alike_from_every_rank(
    offload: list[bool | None], used: str, named: str | None
) -> None:
    """routes="auto" on a fabric: the route table only when every rank's SRH goes on after
    UDP GSO; one rank with a sticky header makes the whole group take one path per plane
    (both ends of a connection must build the same paths), and the reason names it."""
    comm = object.__new__(mrc.Communicator)
    fabric = Path(__file__).resolve().parents[1] / "routing" / "4host-4plane.toml"
    comm.routes, comm._fabric = "auto", load_fabric(fabric)
    comm._settle_routes([{"srh_offload": v} for v in offload])
    assert comm.routes == used
    assert (named is None) == comm.routes_why.startswith("auto: every rank")
    if named is not None:
        assert named in comm.routes_why
    comm.routes, comm._fabric = "auto", None  # loopback planes: nothing to choose
    comm._settle_routes([{"srh_offload": None}] * 3)
    assert comm.routes == "planes"
    comm.routes = "table"  # asked for: kept, whatever the ranks said
    comm._settle_routes([{"srh_offload": False}] * 3)
    assert comm.routes == "table"


def test_the_heartbeat_interval_grows_with_the_group() -> None:
    """1 s (or a fifth of a short timeout) up to BEAT_RANKS ranks; beyond, size/256 s, never
    over a fifth of the timeout: rank 0's rendezvous thread took 28% of a core for an
    idle group of 4096 ranks with 4 links each beating every second (2.3% now)."""
    hb = rendezvous.heartbeat_interval
    assert hb(60, 4) == hb(60, rendezvous.BEAT_RANKS) == 1.0
    assert hb(2, 4) == hb(2, 4096) == 0.4
    assert hb(60, 1024) == 4.0 and hb(60, 4096) == 12.0 and hb(600, 4096) == 16.0
    # the load tool runs: a real server, 32 simulated ranks
    res = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).parent.parent / "tools" / "rendezvous_load.py"),
            "32",
            "2",
            "1",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["ranks"] == 32 and got["interval_s"] == 1.0 and got["server_core_pct"] >= 0
