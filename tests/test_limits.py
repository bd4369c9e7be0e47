"""Resource limits: 1000 connections between two endpoints, 10000 regions, and
endpoint shutdown with operations in flight (the C side of it, with a leak check, is
src_c/tests/test_shutdown.c)."""

from __future__ import annotations

import gc
import os
import threading

import numpy as np
import pytest
from helpers import connected_pair, pattern, planes, sha

import mrc

NCONN = 1000


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def nfds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_1000_connections() -> None:
    fds0 = nfds()
    # The default window: a connection's tables grow with its traffic, so an idle one
    # costs about 20 KiB per side whatever the window (report printed below).
    with mrc.Endpoint(planes(1, 0)) as a, mrc.Endpoint(planes(1, 1)) as b:
        port = b.listen()
        server: list[mrc.Connection] = []

        def accept_all() -> None:
            for _ in range(NCONN):
                server.append(b.accept(timeout=10))

        rss0 = rss_kib()
        t = threading.Thread(target=accept_all)
        t.start()
        clients = [a.connect(b.planes[0][0], port, timeout=10, name=f"c{i}") for i in range(NCONN)]
        t.join()
        assert len(server) == NCONN
        per_conn_kib = (rss_kib() - rss0) / (2 * NCONN)
        print(f"\nmemory per connection (one side): {per_conn_kib:.1f} KiB")
        assert a.stats()["conns"] == NCONN and b.stats()["conns"] == NCONN
        ids = {c.ids[0] for c in server}
        assert len(ids) == NCONN
        src = pattern(4096, 1)
        dst = np.zeros((NCONN, 4096), np.uint8)
        ms, md = a.register(src), b.register(dst)
        # Connections are accepted in connect order: server[i] is clients[i]'s peer.
        ops = [c.write(ms, md.descriptor(), remote_offset=i * 4096) for i, c in enumerate(clients)]
        for op in ops:
            op.wait(timeout=30)
        assert all(sha(dst[i]) == sha(src) for i in range(NCONN))
        drops = dict(a.stats()["drops"])  # duplicates: retransmissions on a loaded host
        assert drops.pop("duplicate") <= b.stats()["retx"]
        assert sum(drops.values()) == 0, drops
        for c in clients:
            c.close()
        for c in server:
            c.close()
        assert a.stats()["conns"] == 0
        ms.close()
        md.close()
    clients.clear()
    server.clear()
    gc.collect()
    assert nfds() <= fds0, "file descriptors leaked"


def test_10000_regions() -> None:
    n = 10000
    with connected_pair(1) as p:
        a, b, ca = p.a, p.b, p.ca
        buf = np.zeros((n, 256), np.uint8)
        regions = [b.register(buf[i]) for i in range(n)]
        keys = {r.key for r in regions}
        assert len(keys) == n and all(k & 0xFFFF for k in keys)
        src = pattern(256, 4)
        ms = a.register(src)
        picks = [0, 1, 4999, n - 1]
        for i in picks:
            ca.write(ms, regions[i].descriptor()).wait(timeout=10)
        for i in range(n):
            assert (sha(buf[i]) == sha(src)) == (i in picks)
        gone = regions[7].descriptor()
        for r in regions:
            r.close()
        # A key of a closed region is refused (and puts the connection in error).
        with pytest.raises(mrc.KeyRejectedError):
            ca.write(ms, gone).wait(timeout=10)
        assert not buf[7].any()


def test_endpoint_close_with_operations_in_flight() -> None:
    with connected_pair(2) as p:
        a, b, ca, cb = p.a, p.b, p.ca, p.cb
        size = 16 << 20
        src, dst = pattern(size, 2), np.zeros(size, np.uint8)
        ms, md = a.register(src), b.register(dst)
        writes = [ca.write(ms, md.descriptor()) for _ in range(8)]
        sends = [ca.send(ms, length=100_000, tag=1) for _ in range(4)]  # staged at b
        recvs = [cb.recv(md, length=1000, tag=2) for _ in range(4)]  # never matched
        a.close()
        b.close()
        for op in writes + sends + recvs:
            try:
                op.wait(timeout=10)
            except mrc.MrcError as e:  # a clear error, never a hang
                assert isinstance(e, (mrc.ConnectionClosedError, mrc.TimeoutError)), e
            assert op.done
        with pytest.raises(mrc.MrcError):
            ca.write(ms, md.descriptor())


# Past 4 GiB: every length and offset on the way is 64 bits (wire offsets, message
# lengths, regions, the executor's steps); a 32-bit one anywhere would wrap here.
BIG = (1 << 32) + 12345
PERIOD = (1 << 20) + 7  # the pattern's period: 2^32 is not a multiple, so a wrap shows


def periodic(n: int, seed: int) -> np.ndarray:
    return np.resize(pattern(PERIOD, seed), n)


def same_periodic(a: np.ndarray, base: np.ndarray) -> bool:
    """a == np.resize(base, len(a)), compared 64 MiB at a time (no second 4 GiB array)."""
    step = 64 << 20
    for s in range(0, len(a), step):
        want = np.resize(np.roll(base, -(s % len(base))), min(step, len(a) - s))
        if not np.array_equal(a[s : s + step], want):
            return False
    return True


def test_messages_past_4_gib() -> None:
    """A WRITE and a SEND of 4 GiB + 12345 bytes arrive byte for byte (8 GiB of memory)."""
    src = periodic(BIG, 4)
    dst = np.zeros(BIG, np.uint8)
    with connected_pair(4) as p:
        ms, md = p.a.register(src), p.b.register(dst)
        p.ca.write(ms, md.descriptor()).wait(timeout=120)
        assert same_periodic(dst, src[:PERIOD])
        dst[:] = 0
        r = p.cb.recv(md)
        p.ca.send(ms).wait(timeout=120)
        assert r.wait(timeout=120).nbytes == BIG
        assert same_periodic(dst, src[:PERIOD])


def test_an_all_reduce_past_4_gib() -> None:
    """2 ranks all-reduce 4 GiB + 12345 int8 elements in place (8 GiB of memory): every
    element is the sum of the two ranks' (int8 wraps alike in numpy and C)."""
    from coll_helpers import mesh, ok, run_ranks

    bases = [pattern(PERIOD, 10 + r).view(np.int8) for r in range(2)]
    want = (bases[0] + bases[1]).view(np.uint8)
    with mesh(2, timeout=120) as rs:
        xs = [np.resize(b, BIG) for b in bases]
        ok(run_ranks(rs, lambda rk: rk.all_reduce(xs[rk.rank])))
        for x in xs:
            assert same_periodic(x.view(np.uint8), want)
