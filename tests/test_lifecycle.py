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
