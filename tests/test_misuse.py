"""Call orders from Python that used to crash the interpreter or touch freed memory
(issue 10), bounded receiver memory, the error classes, read-only and raw-address
registration. Each misuse sequence runs in a subprocess: a crash is a failure."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from helpers import connected_pair, pattern, sha

import mrc
from mrc import _datapath, errors

PRELUDE = """
import gc, sys, threading, time
import numpy as np
import mrc
from helpers import connected_pair, pattern, sha
"""


def run_isolated(body: str, timeout: float = 180) -> str:
    """Runs body in a fresh interpreter; it must exit 0 and print OK."""
    code = PRELUDE + textwrap.dedent(body) + "\nprint('OK')\n"
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), (
        f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"
    )
    return r.stdout


def test_region_close_with_pending_ops_is_busy() -> None:
    run_isolated("""
    with connected_pair(1) as p:
        src, dst = pattern(8 << 20, 1), np.zeros(8 << 20, np.uint8)
        ms, md = p.a.register(src, remote_write=False), p.b.register(dst)
        ops = [p.ca.write(ms, md.descriptor()) for _ in range(4)]
        try:
            ms.close()
        except mrc.BusyError as e:
            assert "still pending" in str(e) and "operation" in str(e), e
        else:
            raise AssertionError("close() of a busy region succeeded")
        for op in ops:
            op.wait(timeout=30)
        ms.close()  # idle now
        assert sha(dst) == sha(src)
    """)


def test_operation_after_endpoint_close() -> None:
    run_isolated("""
    with connected_pair(1) as p:
        src, dst = pattern(4 << 20, 2), np.zeros(4 << 20, np.uint8)
        ms, md = p.a.register(src), p.b.register(dst)
        ops = [p.ca.write(ms, md.descriptor()) for _ in range(4)]
        ops.append(p.cb.recv(md, length=10, tag=5))  # never matched
        p.a.close()
        p.b.close()
        for op in ops:
            assert op.done
            assert op.status in (0, -5005, -5010), op.status
            try:
                op.wait(timeout=1)
            except mrc.MrcError as e:
                assert isinstance(e, mrc.ConnectionClosedError), e
            repr(op), op.nbytes, op.kind
        del ops
        gc.collect()
    """)


def test_close_racing_posts_from_another_thread() -> None:
    run_isolated("""
    for round in range(20):
        with connected_pair(1) as p:
            src = pattern(1 << 16, 3)
            ms = p.a.register(src)
            md = p.b.register(np.zeros(1 << 16, np.uint8))
            go = threading.Event()
            errs = []
            def poster():
                go.set()
                try:
                    while True:
                        p.ca.write(ms, md.descriptor(), length=4096)
                        p.ca.send(ms, length=64, tag=1)
                except mrc.ConnectionClosedError:
                    pass
                except BaseException as e:
                    errs.append(e)
            t = threading.Thread(target=poster)
            t.start()
            go.wait()
            (p.ca if round % 2 else p.a).close()
            t.join(timeout=30)
            assert not t.is_alive() and not errs, errs
    """)


def test_close_while_another_thread_waits_for_an_immediate() -> None:
    run_isolated("""
    with connected_pair(1) as p:
        got = []
        def waiter():
            try:
                p.cb.wait_imm(timeout=None)
            except BaseException as e:
                got.append(e)
        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.05)  # let it block (a race either way is fine: both are checked)
        p.b.close()
        t.join(timeout=30)
        assert not t.is_alive()
        assert got and isinstance(got[0], mrc.ConnectionClosedError), got
    """)


def test_dropped_operation_keeps_its_region_alive() -> None:
    run_isolated("""
    with connected_pair(1) as p:
        dst = np.zeros(8 << 20, np.uint8)
        md = p.b.register(dst)
        src = pattern(8 << 20, 4)
        expect = sha(src)
        ms = p.a.register(src)
        p.ca.write(ms, md.descriptor())  # Operation dropped at once, still pending
        del ms, src
        gc.collect()
        last = p.ca.write(p.a.register(np.zeros(1, np.uint8)), md.descriptor(), length=1,
                          remote_offset=(8 << 20) - 1)
        last.wait(timeout=30)  # ordered after the first on the same connection
        dst[-1] = pattern(8 << 20, 4)[-1]
        assert sha(dst) == expect
    """)


def test_rnr_limit_fails_the_send() -> None:
    a = mrc.Endpoint(["127.0.0.1"], rnr_timeout=0.3)
    b = mrc.Endpoint(["127.0.1.1"], max_unexpected=1000)
    try:
        port = b.listen()
        import threading

        box: dict[str, object] = {}
        t = threading.Thread(target=lambda: box.setdefault("c", b.accept(timeout=10)))
        t.start()
        ca = a.connect("127.0.1.1", port)
        t.join()
        ms = a.register(np.ones(4096, np.uint8))
        with pytest.raises(errors.ReceiverNotReadyError, match="receiver not ready"):
            ca.send(ms, tag=1).wait(timeout=30)
        assert isinstance(ca.error, errors.ReceiverNotReadyError)
    finally:
        a.close()
        b.close()


RECEIVER = """
import sys, mrc
b = mrc.Endpoint(["127.0.1.1"], max_unexpected=4096)
print(b.listen(), flush=True)
c = b.accept(timeout=20)
sys.stdin.readline()
st = b.stats()
print(st["staged_msgs"], st["drops"]["no_buffer"], flush=True)
sys.stdin.readline()
"""


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_200000_empty_sends_are_bounded_at_the_receiver() -> None:
    """Regression: every empty SEND was staged (+16 MiB RSS, 0 RNR NAKs)."""
    rx = subprocess.Popen(
        [sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    a = mrc.Endpoint(["127.0.0.1"], rnr_timeout=None)
    try:
        assert rx.stdout and rx.stdin
        port = int(rx.stdout.readline())
        ca = a.connect("127.0.1.1", port)
        before = rss_kib(rx.pid)
        ms = a.register(np.zeros(1, np.uint8))
        ops = [ca.send(ms, length=0, tag=7) for _ in range(200_000)]
        deadline = time.monotonic() + 60
        while a.stats()["rnr_naks"] < 100 and time.monotonic() < deadline:
            ops[-1].done  # noqa: B018 - a cheap call into the endpoint
        assert a.stats()["rnr_naks"] >= 100
        grew = rss_kib(rx.pid) - before
        rx.stdin.write("\n")
        rx.stdin.flush()
        staged, no_buffer = map(int, rx.stdout.readline().split())
        assert staged <= 2 * 4096 // 256, staged
        assert no_buffer > 0
        assert grew < 4096, f"receiver RSS grew {grew} KiB"
        ca.close()
        for op in ops[-10:]:  # never admitted (the first ones were staged: done)
            with pytest.raises(mrc.ConnectionClosedError):
                op.wait(timeout=10)
    finally:
        a.close()
        if rx.stdin:
            rx.stdin.close()
        rx.wait(timeout=20)


def test_error_classes() -> None:
    e = _datapath.error_for(-111, "Failed to connect")
    assert isinstance(e, ConnectionRefusedError) and isinstance(e, mrc.MrcError)
    assert e.errno == 111 and e.code == -111 and "ECONNREFUSED" in str(e)
    e = _datapath.error_for(-12, "x")
    assert isinstance(e, OSError) and isinstance(e, errors.SystemCallError) and e.errno == 12
    e = _datapath.error_for(-5011, "Failed to register")
    assert isinstance(e, errors.NoBuffersError) and "table full" in str(e) and e.code == -5011
    assert isinstance(_datapath.error_for(-105, "send"), errors.NoBuffersError)
    assert isinstance(_datapath.error_for(-5012, "close"), errors.BusyError)
    assert isinstance(_datapath.error_for(-5013, "send"), errors.ReceiverNotReadyError)
    # The connection timing out is not a WaitTimeout; a wait that ran out is.
    t = _datapath.error_for(-5003, "write")
    assert isinstance(t, mrc.TimeoutError) and not isinstance(t, errors.WaitTimeout)
    with connected_pair(1) as p:
        md = p.b.register(np.zeros(16, np.uint8))
        op = p.cb.recv(md, tag=3)
        with pytest.raises(errors.WaitTimeout, match="still pending"):
            op.wait(timeout=0.01)
        with pytest.raises(mrc.TimeoutError):  # the same, caught as the base class
            op.wait(timeout=0)
        with pytest.raises(errors.WaitTimeout):
            p.cb.wait_imm(timeout=0.01)
        assert not op.done
        src = p.a.register(np.arange(16, dtype=np.uint8))
        p.ca.send(src, tag=3).wait(timeout=10)
        op.wait(timeout=10)  # retrying after WaitTimeout works
        assert (np.asarray(md.obj) == np.arange(16)).all()


def test_readonly_and_raw_address_registration() -> None:
    data = bytes(pattern(1 << 20, 5))
    with connected_pair(2) as p:
        with pytest.raises(mrc.UsageError, match="remote_write=False"):
            p.a.register(data)  # remote_write=True needs writable memory
        ro = p.a.register(data, remote_write=False)
        assert ro.readonly
        dst = np.zeros(1 << 20, np.uint8)
        md = p.b.register(dst)
        p.ca.write(ro, md.descriptor()).wait(timeout=30)
        assert sha(dst) == sha(data)
        with pytest.raises(mrc.UsageError, match="read-only"):
            p.ca.recv(ro)
        # raw address + owner: the owner is kept alive by the region
        owner = pattern(1 << 20, 6)
        raw = p.a.register_address(owner.ctypes.data, owner.nbytes, owner)
        assert raw.obj is owner and len(raw) == owner.nbytes
        target = np.zeros(1 << 20, np.uint8)
        rrecv = p.b.register_address(target.ctypes.data, target.nbytes, target)
        r = p.cb.recv(rrecv, tag=9)
        p.ca.send(raw, tag=9).wait(timeout=30)
        r.wait(timeout=30)
        assert sha(target) == sha(owner)
        with pytest.raises(mrc.UsageError, match="owner"):
            p.a.register_address(owner.ctypes.data, 16, None)
        with pytest.raises(mrc.UsageError, match="address 0"):
            p.a.register_address(0, 16, owner)


def test_libmrc_exports_only_mrc_symbols() -> None:
    r = subprocess.run(
        ["make", "-s", "-C", "src_c", "symbols"], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all mrc_*" in r.stdout


def test_close_while_another_thread_accepts() -> None:
    run_isolated("""
    ep = mrc.Endpoint(["127.0.0.1"])
    ep.listen()
    got = []
    def acceptor():
        try:
            ep.accept(timeout=None)
        except BaseException as e:
            got.append(e)
    t = threading.Thread(target=acceptor)
    t.start()
    time.sleep(0.05)  # let it block (if it has not yet, it finds the endpoint closed)
    t0 = time.monotonic()
    ep.close()
    t.join(timeout=30)
    assert not t.is_alive() and time.monotonic() - t0 < 5
    assert got and isinstance(got[0], mrc.ConnectionClosedError), got
    """)


def test_close_racing_register_and_stats() -> None:
    run_isolated("""
    for round in range(10):
        ep = mrc.Endpoint(["127.0.0.1"])
        stop = []
        def worker():
            bufs = []
            try:
                while True:
                    b = np.zeros(1 << 16, np.uint8)
                    bufs.append((b, ep.register(b)))
                    ep.stats()
            except mrc.ConnectionClosedError:
                pass
            except BaseException as e:
                stop.append(e)
        t = threading.Thread(target=worker)
        t.start()
        time.sleep(0.01 * (round % 3))
        ep.close()
        t.join(timeout=30)
        assert not t.is_alive() and not stop, stop
    """)


def test_immediates_nobody_takes_are_bounded() -> None:
    """Regression: the immediate queue grew without bound (and a failed malloc
    dropped an immediate silently). Past 4096 untaken, the sender is refused."""
    n = 4096 + 200
    with connected_pair(1) as p:
        ms = p.a.register(np.zeros(8, np.uint8))
        md = p.b.register(np.zeros(8, np.uint8))
        ops = [p.ca.write(ms, md.descriptor(), imm=i) for i in range(n)]
        deadline = time.monotonic() + 30
        while p.a.stats()["rnr_naks"] == 0 and time.monotonic() < deadline:
            pass  # polling the sender's counter
        assert p.a.stats()["rnr_naks"] > 0
        assert not ops[-1].done  # held back by the receiver, not lost
        got = [p.cb.wait_imm(timeout=20)[0] for _ in range(n)]
        assert got == list(range(n))
        for op in ops:
            op.wait(timeout=20)


def test_connection_close_racing_endpoint_close() -> None:
    run_isolated("""
    for round in range(20):
        with connected_pair(1) as p:
            ms = p.a.register(pattern(1 << 20, 7))
            md = p.b.register(np.zeros(1 << 20, np.uint8))
            ops = [p.ca.write(ms, md.descriptor()) for _ in range(4)]
            t = threading.Thread(target=p.ca.close)
            t.start()
            time.sleep(0.0005 * (round % 4))
            p.a.close()
            t.join(timeout=30)
            assert not t.is_alive()
            for op in ops:
                try:
                    op.wait(timeout=10)
                except mrc.ConnectionClosedError:
                    pass
    """)
