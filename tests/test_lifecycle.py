"""Object lifecycles a Python program can produce: reference cycles the garbage collector
breaks in any order, fork() with live endpoints, Ctrl-C in blocking calls, close() racing
a connect(). None may crash, hang or touch freed memory. Each case runs in its own
interpreter, so a crash or a hang is this test's failure, not the suite's."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def script(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "Exception ignored" not in r.stderr, r.stderr
    return r


# Every object of an endpoint, reachable only from a reference cycle: the collector
# clears the cycle in the order the holder lists them. An op is pending on the region.
CYCLE = """
    import gc, sys, threading
    import numpy as np, mrc
    order = sys.argv[1].split(",")
    a = mrc.Endpoint(["127.0.7.1"]); b = mrc.Endpoint(["127.0.8.1"])
    port = b.listen(); got = {}
    t = threading.Thread(target=lambda: got.update(c=b.accept(timeout=10))); t.start()
    ca = a.connect("127.0.8.1", port, timeout=10); t.join(); cb = got.pop("c")
    mr = b.register(np.zeros(1 << 16, np.uint8))
    cq = b.create_cq()
    objs = dict(b=b, cb=cb, mr=mr, op=cb.recv(mr), cq=cq,
                cqop=cb.recv(b.register(np.zeros(64, np.uint8)), cq=cq))
    class Holder:
        pass
    h = Holder(); h.me = h
    h.objs = [objs[k] for k in order]
    del h, b, cb, mr, cq, objs
    gc.collect()
    a.close()
    print("collected")
"""

ORDERS = ["b,cb,mr,op,cq,cqop", "op,cb,b", "cb,b", "mr,b", "cqop,cq,b", "b,op,cq"]
ORDERS += [",".join(p) for p in itertools.islice(itertools.permutations("b cb mr op".split()), 3)]


@pytest.mark.parametrize("order", ORDERS)
def test_a_reference_cycle_is_collected_in_any_order(order: str) -> None:
    assert "collected" in script(CYCLE, order).stdout


FORK = """
    import os, sys, numpy as np, mrc
    from helpers import connected_pair
    with connected_pair(2) as p:
        src = p.a.register(np.ones(1 << 20, np.uint8), remote_write=False)
        dst = np.zeros(1 << 20, np.uint8)
        md = p.b.register(dst)
        cq = p.a.create_cq()
        pending = p.cb.recv(p.b.register(np.zeros(8, np.uint8)))
        pid = os.fork()
        if pid == 0:  # the child: every call refused, closing lets go; then a normal exit
            refused = 0
            for call in (lambda: p.ca.write(src, md.descriptor()), lambda: p.a.stats(),
                         lambda: pending.wait(1), lambda: cq.poll(), lambda: src.key,
                         lambda: p.a.register(np.zeros(8, np.uint8))):
                try:
                    call()
                except mrc.UsageError as e:
                    assert "forked" in str(e), e
                    refused += 1
            assert refused == 6, refused
            q = mrc.Endpoint(["127.0.9.1"])  # the child's own endpoint works
            q.close()
            pending.connection.close(); cq.close(); md.close(); p.a.close()
            sys.exit(0)  # and the with-block closes the rest on the way out
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        p.ca.write(src, md.descriptor()).wait(10)  # the parent's endpoint is untouched
        assert dst.sum() == 1 << 20
        p.ca.send(p.a.register(np.ones(8, np.uint8), remote_write=False)).wait(10)
        pending.wait(10)
    print("parent ok")
"""


def test_a_forked_child_cannot_use_its_parents_endpoint_and_exits() -> None:
    code = "import sys; sys.path.insert(0, 'tests')\n" + textwrap.dedent(FORK)
    assert "parent ok" in script(code).stdout


# Ctrl-C: SIGINT arrives 0.3 s into a wait that would otherwise last for ever (or for the
# communicator's timeout); KeyboardInterrupt must come within a slice of it.
SIGINT = """
    import os, signal, sys, threading, time
    import numpy as np, mrc
    sys.path.insert(0, "tests")
    from helpers import connected_pair
    from concurrent.futures import ThreadPoolExecutor

    def interrupted(name, call):
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        try:
            call()
        except KeyboardInterrupt:
            took = time.monotonic() - t0
            assert took < 2.0, (name, took)
            print(name, "interrupted", flush=True)
            return
        raise AssertionError(f"{name}: returned without KeyboardInterrupt")

    with connected_pair(1) as p:
        mr = p.b.register(np.zeros(64, np.uint8))
        interrupted("wait", lambda: p.cb.recv(mr).wait(None))
        interrupted("wait_imm", lambda: p.cb.wait_imm(None))
        interrupted("cq", lambda: p.a.create_cq().wait(None))
        p.b.listen()
        interrupted("accept", lambda: p.b.accept(timeout=None))
    uid = mrc.get_unique_id()
    with ThreadPoolExecutor(2) as ex:
        c0, c1 = [f.result() for f in
                  [ex.submit(mrc.Communicator, r, 2, uid, planes=1, timeout=60) for r in (0, 1)]]
    # rank 1 never joins: the all_reduce waits for it
    interrupted("all_reduce", lambda: c0.all_reduce(np.ones(16, np.float32)))
    try:
        c0.all_reduce(np.ones(16, np.float32))
        raise AssertionError("the communicator went on after an interrupted collective")
    except mrc.CollectiveError as e:
        assert "interrupted (KeyboardInterrupt)" in str(e), e
    c0.abort(); c1.abort()
    with ThreadPoolExecutor(2) as ex:
        list(ex.map(lambda c: c.close(), (c0, c1)))
    print("done")
"""


def test_ctrl_c_ends_every_blocking_wait() -> None:
    out = script(SIGINT).stdout
    for name in ("wait", "wait_imm", "cq", "accept", "all_reduce"):
        assert f"{name} interrupted" in out, out
    assert "done" in out


def test_close_ends_a_connect_under_way() -> None:
    """A connect() in its hello exchange with a listener that never answers: close()
    from another thread ends it with ConnectionClosedError, and returns at once."""
    code = """
        import socket, threading, time, mrc
        mute = socket.create_server(("127.0.9.7", 0))  # a TCP listener that never greets
        port = mute.getsockname()[1]
        ep = mrc.Endpoint(["127.0.9.8"])
        got = {}
        def go():
            try:
                ep.connect("127.0.9.7", port, timeout=None)
            except Exception as e:
                got["e"] = e
        t = threading.Thread(target=go)
        t.start()
        conn, _ = mute.accept()  # the connect is under way: its TCP connection is here
        t0 = time.monotonic()
        ep.close()
        took = time.monotonic() - t0
        t.join(10)
        assert not t.is_alive() and took < 2.0, took
        assert isinstance(got.get("e"), mrc.ConnectionClosedError), got
        assert "closed meanwhile" in str(got["e"]), got
        print("ok")
    """
    assert "ok" in script(code).stdout


def test_a_rank_that_closes_early_fails_its_peers_call_at_once() -> None:
    """Rank 0 makes 3 all_reduces and closes; rank 1 calls a 4th, which rank 0 never
    makes: it fails at once naming rank 0, not at the 30 s timeout, and rank 0's close()
    (waiting for every rank to close or fail) returns then too."""
    code = """
        import time, numpy as np, mrc
        from concurrent.futures import ThreadPoolExecutor
        uid = mrc.get_unique_id()
        with ThreadPoolExecutor(2) as ex:
            comms = [f.result() for f in
                     [ex.submit(mrc.Communicator, r, 2, uid, planes=1, timeout=30) for r in (0, 1)]]
        def rank(c):
            for _ in range(3):
                c.all_reduce(np.ones(1 << 16, np.float32))
            t0 = time.monotonic()
            if c.rank == 0:
                c.close()
                return ("closed", time.monotonic() - t0)
            try:
                c.all_reduce(np.ones(1 << 16, np.float32))
                return ("no error", 0.0)
            except mrc.CollectiveError as e:
                return (str(e), time.monotonic() - t0)
            finally:
                c.close()
        with ThreadPoolExecutor(2) as ex:
            (closed, t_close), (err, t_err) = ex.map(rank, comms)
        assert closed == "closed" and t_close < 10, t_close
        assert "rank 0 closed its communicator without making this call" in err, err
        assert t_err < 10, t_err
        print("ok")
    """
    assert "ok" in script(code).stdout


def test_numbers_that_are_not_numbers_are_usage_errors() -> None:
    code = """
        import sys, numpy as np, mrc
        sys.path.insert(0, "tests")
        from helpers import connected_pair
        nan = float("nan")
        def usage(call, match):
            try:
                call()
            except mrc.UsageError as e:
                assert match in str(e), (match, e)
                return
            raise AssertionError(f"no UsageError ({match})")
        with connected_pair(1) as p:
            mr = p.b.register(np.zeros(64, np.uint8))
            src = p.a.register(np.zeros(64, np.uint8))
            usage(lambda: p.cb.recv(mr).wait(nan), "timeout must be >= 0")
            usage(lambda: p.cb.wait_imm(nan), "timeout must be >= 0")
            usage(lambda: p.a.create_cq().wait(nan), "timeout must be >= 0")
            usage(lambda: p.a.connect("127.0.1.1", 1, timeout=nan), "timeout must be >= 0")
            usage(lambda: mrc.RemoteRegion(-1, 64), "key must be an integer")
            usage(lambda: p.ca.write(src, mr.descriptor(), cq=p.a.create_cq(), ctx=-1), "ctx")
            usage(lambda: p.a.register_address((1 << 63) + 8, 1 << 63, src), "past the end")
        for kw, match in ((dict(port=2**40), "port"), (dict(max_unexpected=-1), "max_unexpected"),
                          (dict(timeout=nan), "timeout"), (dict(mss="big"), "mss")):
            usage(lambda: mrc.Endpoint(["127.0.9.9"], **kw), match)
        ep = mrc.Endpoint(["127.0.9.9"])
        ep.close()
        try:
            ep.serve_stats("/tmp/never.sock")
            raise AssertionError("a closed endpoint served stats")
        except mrc.ConnectionClosedError:
            pass
        print("ok")
    """
    assert "ok" in script(code).stdout


def test_an_async_call_on_a_closed_communicator_starts_no_thread() -> None:
    code = """
        import threading, numpy as np, mrc
        from concurrent.futures import ThreadPoolExecutor
        uid = mrc.get_unique_id()
        with ThreadPoolExecutor(2) as ex:
            comms = [f.result() for f in
                     [ex.submit(mrc.Communicator, r, 2, uid, planes=1, timeout=30) for r in (0, 1)]]
            list(ex.map(lambda c: c.close(), comms))
        for c in comms:
            try:
                c.all_reduce(np.ones(4, np.float32), async_op=True)
                raise AssertionError("queued on a closed communicator")
            except mrc.CollectiveError as e:
                assert "closed" in str(e), e
        left = [t.name for t in threading.enumerate() if t.name.startswith("mrc-coll")]
        assert not left, left
        print("ok")
    """
    assert "ok" in script(code).stdout
