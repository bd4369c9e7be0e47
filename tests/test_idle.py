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
