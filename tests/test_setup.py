"""Connection set-up: over any plane, robust to slow and vanishing clients, many at
once, and clear errors for bad values (issue 11)."""

from __future__ import annotations

import hashlib
import json
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from helpers import pattern, planes

import mrc

ROOT = Path(__file__).resolve().parent.parent


def check_connection(ca: mrc.Connection, cb: mrc.Connection, seed: int, size: int = 4096) -> None:
    """One SEND each way, both checked byte for byte by hash."""
    for src, dst, s in ((ca, cb, seed), (cb, ca, seed + 1)):
        data = pattern(size, s)
        got = np.zeros(size, np.uint8)
        with src.endpoint.register(data) as smr, dst.endpoint.register(got) as rmr:
            r = dst.recv(rmr)
            src.send(smr).wait(timeout=30)
            r.wait(timeout=30)
        assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()


class Acceptor:
    """Accepts on `ep` in a thread the way mrc-perf's server did: accept(0.05) in a
    loop that swallows TimeoutError, keeping each connection by peer name."""

    def __init__(self, ep: mrc.Endpoint, count: int, slice_s: float = 0.05) -> None:
        self.ep, self.count, self.slice_s = ep, count, slice_s
        self.conns: dict[str, mrc.Connection] = {}
        self.errors: list[BaseException] = []
        self.done = threading.Event()
        self.cv = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + 120
        try:
            while len(self.conns) < self.count and time.monotonic() < deadline:
                try:
                    c = self.ep.accept(timeout=self.slice_s)
                except mrc.TimeoutError:
                    continue
                with self.cv:
                    self.conns[c.peer_name] = c
                    self.cv.notify_all()
        except BaseException as e:  # surfaced by wait()
            self.errors.append(e)
        finally:
            self.done.set()
            with self.cv:
                self.cv.notify_all()

    def get(self, name: str, timeout: float = 30) -> mrc.Connection:
        with self.cv:
            ok = self.cv.wait_for(lambda: name in self.conns or self.done.is_set(), timeout)
            if not ok or name not in self.conns:
                raise AssertionError(f"server never accepted {name}: {self.errors}")
            return self.conns[name]

    def wait(self) -> None:
        self.thread.join(timeout=120)
        assert not self.errors, self.errors
        assert len(self.conns) == self.count


@contextmanager
def relay(target_port: int, chunk: int, delay: float) -> Iterator[int]:
    """A TCP relay to 127.0.1.1:target_port that passes the client's bytes on `chunk`
    at a time, `delay` apart: a slow client, as a loaded machine makes one."""
    ls = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def pump(src: socket.socket, dst: socket.socket, slow: bool) -> None:
        try:
            while not stop.is_set():
                b = src.recv(chunk if slow else 65536)
                if not b:
                    break
                dst.sendall(b)
                if slow:
                    time.sleep(delay)  # the slowness under test, not synchronisation
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def serve() -> None:
        c, _ = ls.accept()
        u = socket.create_connection(("127.0.1.1", target_port))
        threading.Thread(target=pump, args=(u, c, False), daemon=True).start()
        pump(c, u, True)
        c.close()
        u.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield ls.getsockname()[1]
    finally:
        stop.set()
        ls.close()
        t.join(timeout=10)


def test_setup_loop_with_slow_and_vanishing_clients() -> None:
    """The intermittent two-process failure: the C accept gave reading the client's
    hello the same deadline as waiting for a client, so a hello arriving near the end
    of a server's accept(0.5) was cut off (client: "protocol mismatch") and an
    establish that took longer failed silently. Here the server accepts in 50 ms
    slices while clients connect normally, slowly (hello dribbled over many slices),
    connect and vanish, connect and say nothing, or send garbage."""
    n = 24
    with mrc.Endpoint(planes(2, 0)) as a, mrc.Endpoint(planes(2, 1)) as b:
        port = b.listen()
        acc = Acceptor(b, n)
        silent = []
        for i in range(n):
            kind = i % 4
            if kind == 1:  # connects and goes away
                socket.create_connection(("127.0.1.1", port)).close()
            elif kind == 2:  # connects and says nothing (held open until the end)
                silent.append(socket.create_connection(("127.0.1.2", port)))
            elif kind == 3:  # speaks another protocol
                with socket.create_connection(("127.0.1.1", port)) as g:
                    g.sendall(b"GET / HTTP/1.0\r\n\r\n")
            name = f"c{i}"
            if i % 6 == 5:  # slow: 40 bytes every 20 ms, over ~10 accept slices
                with relay(port, 40, 0.02) as rport:
                    ca = a.connect("127.0.0.1", rport, timeout=30, name=name)
                    cb = acc.get(name)
            else:
                ca = a.connect("127.0.1.1", port, timeout=30, name=name)
                cb = acc.get(name)
            check_connection(ca, cb, seed=i)
            ca.close()
        acc.wait()
        for s in silent:
            s.close()


def vanish_after_hello(port: int, name: str) -> None:
    """A client that sends a valid mrc hello, reads the server's and hangs up before
    its `ready` (handshake.c's struct hello: one IPv4 plane)."""
    plane = struct.pack("<HH16s", 4, 9, socket.inet_aton("127.0.1.9"))
    hello = struct.pack("<IHHIIII64s", 0x4843524D, 1, 1, 77, 1400, 1024, 0, name.encode())
    hello += plane + bytes(len(plane) * 15)  # MRC_MAX_PLANES = 16
    with socket.create_connection(("127.0.1.1", port), timeout=30) as s:
        s.sendall(hello)
        got = b""
        while len(got) < len(hello):
            b = s.recv(len(hello) - len(got))
            assert b, f"the server hung up on {name} before its hello"
            got += b


def test_a_client_that_vanishes_after_its_hello_is_dropped_and_named() -> None:
    """accept() drops a client that goes away between the hellos and `ready` and waits
    on: the next client's paths come from the callable with that client's name (they
    were the vanished one's), and a wait that then times out names the drop (it read
    outside the list: a crash found by a collective soak with links flapping)."""
    names: list[str] = []

    def paths_for(name: str) -> list:
        names.append(name)
        return []

    with mrc.Endpoint(planes(1, 0)) as a, mrc.Endpoint(planes(1, 1)) as b:
        port = b.listen()
        got: dict[str, mrc.Connection] = {}

        def clients() -> None:
            vanish_after_hello(port, "ghost")
            got["a"] = a.connect("127.0.1.1", port, timeout=30, name="real")

        t = threading.Thread(target=clients)
        t.start()
        try:
            cb = b.accept(timeout=30, paths=paths_for)
        finally:
            t.join(timeout=60)
        assert cb.peer_name == "real"
        assert names == ["ghost", "real"]
        check_connection(got["a"], cb, seed=3)

        t = threading.Thread(target=vanish_after_hello, args=(port, "ghost2"))
        t.start()
        try:
            with pytest.raises(mrc.TimeoutError, match=r"1 dropped during set-up, last: ghost2"):
                b.accept(timeout=2, paths=paths_for)
        finally:
            t.join(timeout=60)


def test_burst_of_64_setups_to_one_endpoint() -> None:
    """64 set-ups at once (8 client endpoints x 8 threads) to one server; every
    connection then carries its own data both ways."""
    nclients, per = 8, 8
    with mrc.Endpoint(planes(2, 1)) as server:
        port = server.listen()
        acc = Acceptor(server, nclients * per, slice_s=1.0)
        clients = [mrc.Endpoint(planes(1, 2 + k)) for k in range(nclients)]
        try:
            conns: dict[str, mrc.Connection] = {}
            errors: list[BaseException] = []
            start = threading.Barrier(nclients * per)

            def one(k: int, j: int) -> None:
                name = f"c{k}.{j}"
                try:
                    start.wait(timeout=30)
                    conns[name] = clients[k].connect(
                        [a for a, _ in server.planes], port, timeout=60, name=name
                    )
                except BaseException as e:
                    errors.append(e)

            threads = [
                threading.Thread(target=one, args=(k, j))
                for k in range(nclients)
                for j in range(per)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            assert not errors, errors[:3]
            acc.wait()
            assert sorted(acc.conns) == sorted(conns)
            for i, name in enumerate(sorted(conns)):
                check_connection(conns[name], acc.conns[name], seed=100 + i, size=1024)
        finally:
            for ep in clients:
                ep.close()


def test_full_mesh_of_8_endpoints() -> None:
    """8 endpoints, every pair connected (each connects to the higher ranks, all at
    once), every one of the 28 connections checked both ways."""
    n = 8
    eps = [mrc.Endpoint(planes(2, 10 + r)) for r in range(n)]
    try:
        ports = [ep.listen() for ep in eps]
        accs = [Acceptor(eps[r], r, slice_s=0.5) for r in range(n)]
        out: dict[tuple[int, int], mrc.Connection] = {}
        errors: list[BaseException] = []

        def dial(r: int) -> None:
            try:
                for s in range(r + 1, n):
                    out[r, s] = eps[r].connect(
                        [a for a, _ in eps[s].planes], ports[s], timeout=60, name=str(r)
                    )
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=dial, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors[:3]
        for acc in accs:
            acc.wait()
        assert len(out) == n * (n - 1) // 2
        for (r, s), ca in out.items():
            check_connection(ca, accs[s].conns[str(r)], seed=1000 + r * n + s, size=2048)
    finally:
        for ep in eps:
            ep.close()


def test_connect_races_every_address_and_reports_each() -> None:
    with mrc.Endpoint(planes(2, 0)) as a, mrc.Endpoint(planes(2, 1)) as b:
        port = b.listen()
        acc = Acceptor(b, 1)
        # The first address answers nobody (a plane that is down): the second carries it.
        ca = a.connect(["127.0.5.9", b.planes[1][0]], port, timeout=10, name="x")
        check_connection(ca, acc.get("x"), seed=7)
        acc.wait()
        with pytest.raises(mrc.UnreachableError) as e:
            a.connect(["127.0.5.9", "127.0.5.10"], port, timeout=5)
        msg = str(e.value)
        assert f"127.0.5.9:{port}: Connection refused" in msg
        assert f"127.0.5.10:{port}: Connection refused" in msg


def test_server_listens_on_every_plane() -> None:
    with mrc.Endpoint(planes(3, 0)) as a, mrc.Endpoint(planes(3, 1)) as b:
        port = b.listen()
        acc = Acceptor(b, 3)
        for i, (addr, _) in enumerate(b.planes):
            check_connection(a.connect(addr, port, timeout=10, name=f"p{i}"), acc.get(f"p{i}"), i)
        acc.wait()


def test_host_names_are_resolved() -> None:
    with mrc.Endpoint("127.0.0.1") as a, mrc.Endpoint("127.0.0.1") as b:
        port = b.listen()
        acc = Acceptor(b, 1)
        check_connection(a.connect("localhost", port, timeout=10, name="h"), acc.get("h"), 3)
        acc.wait()
        with pytest.raises(
            mrc.UnreachableError, match="cannot resolve host name 'no-such.invalid'"
        ):
            a.connect("no-such.invalid", port)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda ep: ep.listen(70000), r"port must be 0\.\.65535.*70000"),
        (lambda ep: ep.listen(-1), r"port must be 0\.\.65535.*-1"),
        (lambda ep: ep.listen(0, "not-an-ip"), "'not-an-ip' is not an IPv4 or IPv6 address"),
        (lambda ep: ep.connect("127.0.0.1", -1), r"port must be 1\.\.65535, got -1"),
        (lambda ep: ep.connect("127.0.0.1", 70000), r"port must be 1\.\.65535, got 70000"),
        (lambda ep: ep.connect("127.0.0.1", 0), r"port must be 1\.\.65535, got 0"),
        (lambda ep: ep.connect([], 80), "no address given"),
        (lambda ep: ep.accept(timeout=1), r"accept\(\) before listen\(\)"),
    ],
)
def test_bad_setup_values(call, match: str) -> None:  # type: ignore[no-untyped-def]
    with mrc.Endpoint("127.0.0.1") as ep, pytest.raises(mrc.UsageError, match=match):
        call(ep)


@contextmanager
def foreign_server(reply: bytes, first: bool) -> Iterator[int]:
    """A TCP server that speaks another protocol: says `reply` first (SSH, SMTP) or
    after reading a request (HTTP), then hangs up."""
    ls = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        c, _ = ls.accept()
        with c:
            if not first:
                c.recv(4096)
            c.sendall(reply)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield ls.getsockname()[1]
    finally:
        ls.close()
        t.join(timeout=10)


@pytest.mark.parametrize(
    ("reply", "first"),
    [(b"SSH-2.0-OpenSSH_9.6\r\n", True), (b"HTTP/1.1 400 Bad Request\r\n\r\n", False)],
)
def test_port_speaking_another_protocol(reply: bytes, first: bool) -> None:
    with mrc.Endpoint("127.0.0.1") as ep, foreign_server(reply, first) as port:
        t0 = time.monotonic()
        with pytest.raises(mrc.ProtocolError, match="not an mrc endpoint"):
            ep.connect("127.0.0.1", port, timeout=60)
        # Told apart by the first bytes, not by waiting for the timeout.
        assert time.monotonic() - t0 < 30


def test_silent_port_says_no_hello() -> None:
    ls = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody answers
    with ls, mrc.Endpoint("127.0.0.1") as ep:
        with pytest.raises(mrc.TimeoutError, match="sent no mrc hello within 0.5 s"):
            ep.connect("127.0.0.1", ls.getsockname()[1], timeout=0.5)


def test_help_shows_signatures() -> None:
    doc = mrc.Endpoint.connect.__doc__ or ""
    assert "connect(self, addr, int port" in doc
    # help(mrc.Endpoint) shows the class docstring, which Cython opens with __init__'s.
    assert (mrc.Endpoint.__doc__ or "").startswith("Endpoint(planes=")


# ---- on a namespace fabric ---------------------------------------------------------

FABRIC = str(ROOT / "routing" / "2host-2plane.toml")
WORKER = str(ROOT / "tests" / "setup_worker.py")


def _setups(fab, count: int, parallel: int) -> tuple[dict, dict]:  # type: ignore[no-untyped-def]
    srv = fab.popen(
        "h1",
        [
            sys.executable,
            WORKER,
            "server",
            "--fabric",
            FABRIC,
            "--host",
            "h1",
            "--count",
            str(count),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        port = json.loads(srv.stdout.readline())["port"]
        cli = fab.popen(
            "h0",
            [sys.executable, WORKER, "client", "--fabric", FABRIC, "--host", "h0", "--peer", "h1"]
            + ["--port", str(port), "--count", str(count), "--parallel", str(parallel)],
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE,
        )
        try:
            # Bounded: a client whose progress thread stops answering must fail the test,
            # not hang the suite (seen once: a set-up retried after its activation put
            # its connection on the active list twice, and link_poll_pt walked the cycle;
            # test_handshake's test_late_activation_is_final pins the fix).
            ready, _, _ = select.select([cli.stdout], [], [], 120)
            assert ready, "setup client printed nothing in 120 s"
            line = cli.stdout.readline()
            assert line, f"setup client exited {cli.wait()}"
            server_out = json.loads(srv.stdout.readline())
            cli.stdin.close()  # the server is done: the client may close its connections
            assert cli.wait(timeout=60) == 0
            srv.wait(timeout=60)
            return json.loads(line), server_out
        finally:
            if cli.poll() is None:
                cli.kill()
                cli.wait()
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()


@pytest.mark.root
@pytest.mark.parametrize("plane", ["plane0", "plane1"])
def test_setup_with_one_plane_failed(plane: str) -> None:
    from mrc.fabric.testing import fabric_up

    with fabric_up(FABRIC) as fab:
        fab.fail(plane)
        client, server = _setups(fab, count=4, parallel=2)
        assert client == {"ok": 4, "errors": []}
        assert server == {"ok": 4, "errors": []}


@pytest.mark.root
def test_setup_burst_while_a_plane_flaps() -> None:
    from mrc.fabric.testing import fabric_up

    with fabric_up(FABRIC) as fab:
        stop = threading.Event()
        started = threading.Event()
        changes = [0]

        def flap() -> None:
            while not stop.is_set():
                fab.fail("plane0")
                changes[0] += 1
                started.set()
                stop.wait(0.05)
                fab.heal("plane0")
                changes[0] += 1
                stop.wait(0.05)

        t = threading.Thread(target=flap)
        t.start()
        try:
            assert started.wait(30)
            before = changes[0]
            client, server = _setups(fab, count=48, parallel=8)
            during = changes[0] - before
        finally:
            stop.set()
            t.join()
        assert during >= 2, "plane0 did not change state while the set-ups ran"
        assert client == {"ok": 48, "errors": []}
        assert server == {"ok": 48, "errors": []}


def test_mrc_perf_setups_in_a_loop_with_vanishing_clients() -> None:
    """The issue's reproduction, as processes: mrc-perf servers (which accept in 0.5 s
    slices) each meet a client that connects and vanishes, one that says nothing, and
    then the real client; every run completes with its header and table on both sides."""
    from test_perf import finish, popen, start_server

    args = ["write_bw", "-s", "4096", "-n", "50", "-t", "8"]
    for i in range(5):
        server, port = start_server(args)
        socket.create_connection(("127.0.0.1", port)).close()
        silent = socket.create_connection(("127.0.0.1", port))
        try:
            client = popen([*args, "-p", str(port), "127.0.0.1"])
            crc, cout, cerr = finish(client)
            src, sout, serr = finish(server)
        finally:
            silent.close()
        assert (crc, src) == (0, 0), (i, cerr, serr)
        for out in (cout, sout):
            assert "remote address" in out and " #bytes" in out, out
