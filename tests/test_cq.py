"""Completion queues from Python: hundreds of operations over many connections
complete once each on their CQ with their ctx, in batches of one call; immediates
arrive as IMM entries; wait() times out; fileno() works with selectors and asyncio;
close() refuses while in use; an endpoint closed with operations pending on a CQ
(and a thread waiting on it) neither crashes nor hangs."""

from __future__ import annotations

import asyncio
import selectors
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from helpers import pattern, planes, sha

import mrc

NCONN = 8


def connect_many(a: mrc.Endpoint, b: mrc.Endpoint, n: int) -> list[tuple]:
    """n connections a -> b, as (a's side, b's side) in connection order."""
    port = b.listen()
    accepted: list[mrc.Connection] = []
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            for _ in range(n):
                accepted.append(b.accept(timeout=10))
        except BaseException as e:  # surfaced below
            errors.append(e)

    t = threading.Thread(target=serve)
    t.start()
    outs = [a.connect(b.planes[0][0], port, timeout=10, name=f"c{i}") for i in range(n)]
    t.join()
    if errors:
        raise errors[0]
    by_name = {c.peer_name: c for c in accepted}
    return [(outs[i], by_name[f"c{i}"]) for i in range(n)]


@pytest.fixture
def pair():
    a = mrc.Endpoint(planes(2, 0))
    b = mrc.Endpoint(planes(2, 1))
    try:
        yield a, b, connect_many(a, b, NCONN)
    finally:
        a.close()
        b.close()


def drain(cq: mrc.CompletionQueue, n: int, batch: int = 16) -> np.ndarray:
    """Exactly n completions, read by wait() in batches of at most `batch`."""
    parts = []
    got = 0
    deadline = time.monotonic() + 30
    while got < n:
        assert time.monotonic() < deadline, f"only {got} of {n} completions arrived"
        arr = cq.wait(timeout=10, max=min(batch, n - got))
        assert len(arr) <= batch
        parts.append(arr)
        got += len(arr)
    assert len(cq.poll()) == 0, "more completions than operations"
    return np.concatenate(parts)


def test_many_connections_hundreds_of_ops(pair) -> None:
    a, b, conns = pair
    per, msg = 40, 5000
    total = NCONN * per * msg
    src = pattern(total, 1)
    dst = np.zeros(total, np.uint8)
    wdst = np.zeros(total, np.uint8)
    ms = a.register(src, remote_write=False)
    md = b.register(dst, remote_write=False)
    mw = b.register(wdst)
    with a.create_cq() as cqa, mrc.CompletionQueue(b) as cqb:
        for i, (_, cb) in enumerate(conns):
            cb.set_cq(cqb, ctx=1_000_000 + i)
        for i, (_, cb) in enumerate(conns):
            for k in range(per):
                off = (i * per + k) * msg
                assert cb.recv(md, offset=off, length=msg, tag=k, cq=cqb, ctx=off) is None
        for i, (ca, _) in enumerate(conns):
            for k in range(per):
                off = (i * per + k) * msg
                ca.send(ms, offset=off, length=msg, tag=k, cq=cqa, ctx=2 * off)
                ca.write(
                    ms,
                    mw.descriptor(),
                    offset=off,
                    length=msg,
                    remote_offset=off,
                    imm=i * per + k,
                    cq=cqa,
                    ctx=2 * off + 1,
                )
        n = NCONN * per * 2
        ea = drain(cqa, n)
        assert (ea["status"] == 0).all()
        assert (ea["bytes"] == msg).all()
        assert sorted(ea["ctx"].tolist()) == sorted(
            [2 * (j * msg) for j in range(NCONN * per)]
            + [2 * (j * msg) + 1 for j in range(NCONN * per)]
        )
        kinds = np.where(ea["ctx"] % 2 == 1, cqa.WRITE, cqa.SEND)
        assert (ea["kind"] == kinds).all()
        handles = {ca.handle: i for i, (ca, _) in enumerate(conns)}
        assert all(
            handles[h] == c // 2 // msg // per
            for h, c in zip(ea["conn"].tolist(), ea["ctx"].tolist(), strict=True)
        )

        eb = drain(cqb, n)
        assert (eb["status"] == 0).all()
        recvs = eb[eb["kind"] == cqb.RECV]
        imms = eb[eb["kind"] == cqb.IMM]
        assert len(recvs) == len(imms) == NCONN * per
        assert sorted(recvs["ctx"].tolist()) == [j * msg for j in range(NCONN * per)]
        assert (recvs["tag"] == recvs["ctx"] // msg % per).all()
        bhandles = {cb.handle: i for i, (_, cb) in enumerate(conns)}
        for i in range(NCONN):
            mine = imms[imms["ctx"] == 1_000_000 + i]
            # immediates of one connection arrive in order, on that connection
            assert mine["imm"].tolist() == list(range(i * per, (i + 1) * per))
            assert {bhandles[h] for h in mine["conn"].tolist()} == {i}
    assert sha(dst) == sha(src)
    assert sha(wdst) == sha(src)


def test_poll_returns_one_batch_of_at_most_max(pair) -> None:
    a, b, conns = pair
    ca, cb = conns[0]
    buf = np.zeros(1000, np.uint8)
    src = pattern(1000, 2)
    md, ms = b.register(buf), a.register(src)
    with b.create_cq() as cq:
        assert cq.poll().shape == (0,)
        assert cq.poll().dtype == cq.dtype
        assert cq.dtype.names == ("ctx", "status", "kind", "bytes", "tag", "imm", "conn")
        for k in range(10):
            cb.recv(md, offset=k * 100, length=100, tag=k, cq=cq, ctx=k)
        ops = [ca.send(ms, offset=k * 100, length=100, tag=k) for k in range(10)]
        for op in ops:
            op.wait(10)
        # Every SEND was acknowledged, but b sends a pass's ACKs before it publishes that
        # pass's completions: one more message, sent after those ACKs came back, is taken
        # in a later pass of b's loop, so once it too is acknowledged every RECV above is
        # on the queue (polling for it instead would take the batch this test looks at).
        fence = np.zeros(1, np.uint8)
        r = cb.recv(b.register(fence), tag=99)
        ca.send(a.register(np.ones(1, np.uint8)), tag=99).wait(10)
        r.wait(10)
        first = cq.poll(4)
        rest = cq.poll(64)
        assert len(first) == 4 and len(rest) == 6
        assert sorted(first["ctx"].tolist() + rest["ctx"].tolist()) == list(range(10))
        assert len(cq.poll()) == 0
    assert sha(buf) == sha(src)


def test_wait_times_out_with_an_empty_batch(pair) -> None:
    a, _, _ = pair
    with a.create_cq() as cq:
        t0 = time.monotonic()
        got = cq.wait(timeout=0.05)
        assert len(got) == 0
        assert time.monotonic() - t0 >= 0.045
        assert len(cq.wait(timeout=0)) == 0


def test_fileno_in_selectors(pair) -> None:
    a, b, conns = pair
    ca, cb = conns[1]
    buf = np.zeros(64, np.uint8)
    md, ms = b.register(buf), a.register(pattern(64, 3))
    with b.create_cq() as cq, selectors.DefaultSelector() as sel:
        sel.register(cq.fileno(), selectors.EVENT_READ)
        assert sel.select(timeout=0) == []
        cb.recv(md, cq=cq, ctx=99)
        ca.send(ms).wait(10)
        assert len(sel.select(timeout=10)) == 1
        got = cq.poll()
        assert got["ctx"].tolist() == [99] and got["status"].tolist() == [0]
        assert sel.select(timeout=0) == [], "still readable once the queue is empty"


def test_fileno_with_asyncio_add_reader(pair) -> None:
    a, b, conns = pair
    ca, cb = conns[2]
    buf = np.zeros(4096, np.uint8)
    src = pattern(4096, 4)
    md, ms = b.register(buf), a.register(src)

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        seen: list[int] = []
        done = loop.create_future()

        def readable() -> None:
            seen.extend(cq.poll()["ctx"].tolist())
            if len(seen) == 8 and not done.done():
                done.set_result(None)

        loop.add_reader(cq.fileno(), readable)
        try:
            for k in range(8):
                cb.recv(md, offset=k * 512, length=512, tag=k, cq=cq, ctx=k)
                ca.send(ms, offset=k * 512, length=512, tag=k, cq=cqa, ctx=k)
            await asyncio.wait_for(done, 10)
        finally:
            loop.remove_reader(cq.fileno())
        return seen

    with b.create_cq() as cq, a.create_cq() as cqa:
        seen = asyncio.run(main())
        assert sorted(seen) == list(range(8))
        assert len(drain(cqa, 8)) == 8
    assert sha(buf) == sha(src)


def test_immediates_move_to_the_cq_when_bound_late(pair) -> None:
    a, b, conns = pair
    ca, cb = conns[3]
    dst = np.zeros(100, np.uint8)
    ms, mw = a.register(pattern(100, 5)), b.register(dst)
    ca.write(ms, mw.descriptor(), imm=5).wait(10)
    assert cb.wait_imm(10) == (5, 100)
    # acknowledged only after the immediate was queued at b
    ca.write(ms, mw.descriptor(), length=10, imm=6).wait(10)
    with b.create_cq() as cq:
        cb.set_cq(cq, ctx=77)
        got = cq.poll()
        assert got["kind"].tolist() == [cq.IMM]
        assert (got["imm"][0], got["bytes"][0], got["ctx"][0]) == (6, 10, 77)
        assert got["conn"][0] == cb.handle
    # closing the CQ unbound the connection: immediates go to wait_imm() again
    ca.write(ms, mw.descriptor(), length=3, imm=7).wait(10)
    assert cb.wait_imm(10) == (7, 3)


def test_close_refused_while_an_op_is_pending(pair) -> None:
    _, b, conns = pair
    _, cb = conns[4]
    md = b.register(np.zeros(64, np.uint8))
    cq = b.create_cq()
    cb.recv(md, tag=12345, cq=cq, ctx=3)  # nothing will match it
    with pytest.raises(mrc.BusyError, match="pending"):
        cq.close()
    cb.close()
    got = cq.wait(timeout=10)
    assert got["ctx"].tolist() == [3]
    err = mrc._datapath.error_for(int(got["status"][0]), "recv")
    assert isinstance(err, mrc.ConnectionClosedError), err
    cq.close()
    assert cq.closed
    with pytest.raises(mrc.UsageError, match="closed"):
        cq.poll()


def test_usage_errors_name_the_problem(pair) -> None:
    a, b, conns = pair
    ca, cb = conns[5]
    ma = a.register(np.zeros(8, np.uint8))
    with b.create_cq() as cqb:
        with pytest.raises(mrc.UsageError, match="another endpoint"):
            ca.send(ma, cq=cqb)
        with pytest.raises(mrc.UsageError, match="another endpoint"):
            ca.set_cq(cqb)
        with pytest.raises(mrc.UsageError, match="CompletionQueue"):
            ca.send(ma, cq="nope")
        with pytest.raises(mrc.UsageError, match="max must be >= 1"):
            cqb.poll(0)
        with pytest.raises(mrc.UsageError, match="32-bit"):
            ca.write(ma, mrc.RemoteRegion(1, 8), imm=2**32)


SCRIPT = textwrap.dedent(
    """
    import sys, threading
    sys.path.insert(0, {tests!r})
    import numpy as np
    import mrc
    from helpers import planes
    from test_cq import connect_many

    a = mrc.Endpoint(planes(1, 0))
    b = mrc.Endpoint(planes(1, 1))
    conns = connect_many(a, b, 3)
    cqa, cqb, cqw = a.create_cq(), b.create_cq(), b.create_cq()
    src = np.ones(1 << 20, np.uint8)
    ma, mb = a.register(src), b.register(np.zeros(1 << 20, np.uint8))
    conns[0][1].set_cq(cqb, ctx=1)
    for i in range(60):
        ca, cb = conns[i % 3]
        cb.recv(mb, length=100, tag=2, cq=cqb, ctx=i)  # never matched
        ca.send(ma, tag=1, cq=cqa, ctx=i)              # staged at b
        ca.write(ma, mb.descriptor(), imm=i, cq=cqa, ctx=1000 + i)
    kept = conns[1][0].send(ma, tag=1)  # an Operation handle too, released after
    err = []
    def waiter():
        try:
            cqw.wait()
        except mrc.ConnectionClosedError as e:
            err.append(e)
    t = threading.Thread(target=waiter)
    t.start()
    a.close()
    b.close()
    t.join(10)
    assert not t.is_alive(), "a thread in cq.wait() was not released"
    assert err, "wait() did not raise ConnectionClosedError"
    for q in (cqa, cqb, cqw):
        try:
            q.poll()
        except mrc.ConnectionClosedError:
            pass
        else:
            raise AssertionError("poll on a CQ of a closed endpoint")
        q.close()
    del cqa, cqb, cqw, kept, conns
    import gc; gc.collect()
    print("OK")
    """
)


def test_endpoint_close_with_ops_pending_on_cqs_in_subprocess() -> None:
    import os

    tests = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(tests=tests)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("OK"), out.stdout + out.stderr
