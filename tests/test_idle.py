"""An endpoint with nothing in flight sleeps: its loop runs only when a timer that
exists is due. Counted from the loop_iters counter (behaviour, not speed); the
timers still run once there is something to time again."""

from __future__ import annotations

import time

import numpy as np
from helpers import pattern, planes, sha
from test_cq import connect_many

import mrc


def iters(*eps: mrc.Endpoint) -> int:
    return sum(ep.stats()["loop_iters"] for ep in eps)


def test_idle_connections_do_not_wake_the_loop() -> None:
    with mrc.Endpoint(planes(2, 0)) as a, mrc.Endpoint(planes(2, 1)) as b:
        conns = connect_many(a, b, 64)
        # the handshakes' last packets may still be settling: wait until quiet
        deadline = time.monotonic() + 10
        while True:
            i0 = iters(a, b)
            time.sleep(0.5)
            woke = iters(a, b) - i0 - 2  # each stats() call wakes its loop once
            if woke < 100 or time.monotonic() > deadline:
                break
        # a 250 us timer would be 4000 wake-ups in 0.5 s, per endpoint
        assert woke < 100, f"{woke} loop iterations in 0.5 s with 64 idle connections"

        # after sleeping, work is timed again: a transfer with loss completes,
        # through retransmission timeouts
        ca, cb = conns[0]
        src, dst = pattern(1 << 20, 7), np.zeros(1 << 20, np.uint8)
        ms, md = a.register(src), b.register(dst)
        a.inject(0, loss=0.3)
        a.inject(1, loss=0.3)
        ca.write(ms, md.descriptor()).wait(20)
        a.inject(0, loss=0.0)
        a.inject(1, loss=0.0)
        assert sha(dst) == sha(src)
        assert a.stats()["retx"] > 0


def test_a_waiting_receiver_keeps_probing_its_paths() -> None:
    """A RECV posted and nothing else: the connection has keepalives to send,
    and only those wake the loop."""
    with mrc.Endpoint(planes(1, 0)) as a, mrc.Endpoint(planes(1, 1)) as b:
        ((_, cb),) = connect_many(a, b, 1)
        mb = b.register(np.zeros(8, np.uint8))
        op = cb.recv(mb, tag=5)
        p0 = b.stats()["paths"][0]["probes"]
        deadline = time.monotonic() + 10
        while b.stats()["paths"][0]["probes"] < p0 + 3:
            assert time.monotonic() < deadline, "no keepalive probes from a waiting receiver"
            time.sleep(0.05)
        assert not op.done


def test_a_waiting_receiver_probes_one_path_per_keepalive() -> None:
    """Over 4 planes the waiting connection's keepalives take its paths in turn, one
    probe per 100 ms interval (not one per path each time): probing every path once
    takes about four intervals."""
    with mrc.Endpoint(planes(4, 0)) as a, mrc.Endpoint(planes(4, 1)) as b:
        ((_, cb),) = connect_many(a, b, 1)
        mb = b.register(np.zeros(8, np.uint8))

        def probes() -> list[int]:
            return [q["probes"] for q in b.stats()["paths"]]

        p0 = probes()
        op = cb.recv(mb, tag=5)
        t0 = time.monotonic()
        deadline = t0 + 10
        while True:
            got = [n - m for n, m in zip(probes(), p0, strict=True)]
            if sum(got) >= 4:
                break
            assert time.monotonic() < deadline, f"keepalive probes per path: {got}"
            time.sleep(0.02)  # polling the endpoint's counters
        elapsed = time.monotonic() - t0
        assert min(got) >= 1 and max(got) - min(got) <= 1, f"probes per path: {got}"
        assert elapsed >= 0.25, f"4 keepalives in {elapsed * 1000:.0f} ms"
        assert not op.done


def test_a_failed_plane_is_probed_less_and_less_and_still_heals() -> None:
    """A plane that stays down (a pulled cable waiting for a technician) has a failed
    path to every peer: each is probed 5 ms after it failed, then twice as long after
    each unanswered probe, up to 200 ms, and only those probes wake the loop (was: 25
    probes a second per path and a 250 us timer tick for as long as the plane was out:
    1000 peers would be 25k probes a second). When the plane comes back the
    first probe through restarts the other side's probing at the shortest gap."""
    n = 16
    with mrc.Endpoint(planes(2, 0)) as a, mrc.Endpoint(planes(2, 1)) as b:
        conns = connect_many(a, b, n)
        a.inject(1, down=True)
        # traffic both ways on every connection: each side's plane-1 paths fail
        size = 256 << 10
        bufs = [(pattern(size, i), np.zeros(size, np.uint8)) for i in range(2 * n)]
        regs = [
            (x.register(s), y.register(d))
            for (s, d), (x, y) in zip(bufs, [(a, b)] * n + [(b, a)] * n, strict=True)
        ]
        ops = [
            ca.write(ms, md.descriptor()) for (ca, _), (ms, md) in zip(conns, regs[:n], strict=True)
        ]
        ops += [
            cb.write(ms, md.descriptor()) for (_, cb), (ms, md) in zip(conns, regs[n:], strict=True)
        ]
        for op in ops:
            op.wait(20)
        assert all(sha(d) == sha(s) for s, d in bufs)

        def plane1(ep: mrc.Endpoint) -> list[dict]:
            return [p for p in ep.stats()["paths"] if p["plane"] == 1]

        deadline = time.monotonic() + 10
        while {p["state"] for p in plane1(a) + plane1(b)} != {"failed"}:
            assert time.monotonic() < deadline, [p["state"] for p in plane1(a) + plane1(b)]
            time.sleep(0.05)  # polling the endpoints' counters
        time.sleep(1.6)  # the gaps grow to the cap (5 + 10 + ... + 160 ms)
        p0 = [sum(p["probes"] for p in plane1(ep)) for ep in (a, b)]
        i0 = iters(a, b)
        time.sleep(1.0)
        probes = [
            sum(p["probes"] for p in plane1(ep)) - q for ep, q in zip((a, b), p0, strict=True)
        ]
        woke = iters(a, b) - i0 - 4  # the stats() calls wake the loops
        # 200 ms apart: about 5 per path and second (the fixed 5 ms gap gave 25)
        assert max(probes) <= 8 * n, f"{probes} probes in 1 s on {n} failed paths per side"
        assert woke < 40 * n, f"{woke} loop iterations in 1 s"

        a.inject(1, down=False)
        t0 = time.monotonic()
        while {p["state"] for p in plane1(a) + plane1(b)} != {"good"}:
            assert time.monotonic() - t0 < 5, [p["state"] for p in plane1(a) + plane1(b)]
            time.sleep(0.01)  # polling the endpoints' counters
        took = time.monotonic() - t0
        # the first probe through is at most one 200 ms gap away; three answers heal
        assert took < 1.0, f"plane 1 came back after {took:.3f} s"
