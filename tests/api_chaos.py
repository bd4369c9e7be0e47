"""Random call sequences on the transport's Python API, from several threads at once.

    python api_chaos.py SEED STEPS [THREADS]

A few endpoints on loopback planes and whatever the threads make of them: connections
(connect, accept), regions (numpy arrays, bytearrays, bytes, slices; registered, closed,
dropped), completion queues (made, bound, polled, closed), WRITEs with and without an
immediate, SENDs and RECVs with random spans, tags, forged remote descriptors, waits
with random timeouts, injected loss and pulled planes, stats, garbage collection, and
now and then an endpoint closed under everything and a new one made. Each thread draws
its calls from random.Random(SEED + thread).

What may come back is an mrc error (mrc.MrcError: UsageError for a bad argument,
BusyError, ConnectionClosedError, ...) or BufferError for resizing a bytearray a region
holds. Anything else is printed with its traceback and the exit status is 1; a crash is
the process dying by a signal (under the ASan build, a sanitizer report). At the end every
operation ever posted must be done once every endpoint is closed (no op left pending by
a close). Prints one line of counts."""

from __future__ import annotations

import faulthandler
import gc
import random
import shutil
import sys
import tempfile
import threading
import traceback
from collections import Counter
from typing import Any

import numpy as np

import mrc
from mrc import telemetry

EXPECTED = (mrc.MrcError, BufferError)
DEBUG = False
NET0 = 180  # 127.0.NET.x: this script's loopback blocks (tests use lower ones)


class World:
    def __init__(self, seed: int) -> None:
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.net = NET0 + seed % 8 * 8  # 8 blocks per seed; seeds run one at a time
        self.eps: list[mrc.Endpoint] = []
        self.ports: dict[int, int] = {}
        self.conns: list[mrc.Connection] = []
        self.regions: list[mrc.MemoryRegion] = []
        self.remotes: list[tuple[mrc.Endpoint, mrc.RemoteRegion]] = []
        self.names: dict[str, mrc.Endpoint] = {}  # each endpoint's name, as peers see it
        self.ops: list[Any] = []
        self.all_ops: list[mrc.Operation] = []
        self.cqs: list[mrc.CompletionQueue] = []
        self.owners: list[Any] = []  # buffers handed to register, some resized later
        self.acceptors: list[threading.Thread] = []
        self.made = 0
        self.made_socks = 0
        self.tmp = tempfile.mkdtemp(prefix="mrc-chaos-")
        self.counts: Counter[str] = Counter()
        self.unexpected: list[str] = []

    def new_endpoint(self) -> None:
        k = self.made
        self.made += 1
        planes = [f"127.0.{self.net + k % 8}.{i + 1 + 4 * (k // 8 % 60)}" for i in range(2)]
        ep = mrc.Endpoint(planes, timeout=1.0, rnr_timeout=0.5)
        port = ep.listen()
        with self.lock:
            self.eps.append(ep)
            self.ports[id(ep)] = port
            self.names[f"ep{k}"] = ep
        t = threading.Thread(target=self.accept_loop, args=(ep, f"ep{k}"), daemon=True)
        t.start()
        self.acceptors.append(t)

    def name(self, ep: mrc.Endpoint) -> str:
        return next(k for k, e in self.names.items() if e is ep)

    def accept_loop(self, ep: mrc.Endpoint, name: str) -> None:
        while not self.stop.is_set() and not ep.closed:
            try:
                c = ep.accept(timeout=0.2, name=name)
            except EXPECTED:
                continue
            except BaseException:
                self.unexpected.append("accept:\n" + traceback.format_exc())
                return
            with self.lock:
                self.conns.append(c)

    def pick(self, items: list[Any], rng: random.Random, same: Any = None) -> Any:
        """A random item; with `same` (an endpoint), mostly one of that endpoint's."""
        with self.lock:
            if same is not None and rng.random() < 0.9:
                mine = [x for x in items if x.endpoint is same]
                items = mine or items
            return rng.choice(items) if items else None

    def live_endpoint(self, rng: random.Random) -> Any:
        with self.lock:
            live = [e for e in self.eps if not e.closed]
            return rng.choice(live) if live and rng.random() < 0.95 else None

    def prune(self) -> None:
        """Forget most objects of closed endpoints (a few stay, for calls on them)."""
        with self.lock:
            for items in (self.conns, self.regions, self.cqs):
                dead = [x for x in items if x.closed or x.endpoint.closed]
                for x in dead[2:]:
                    items.remove(x)
            self.eps = [e for e in self.eps if not e.closed] + [e for e in self.eps if e.closed][:1]


def buffer(rng: random.Random) -> Any:
    n = rng.choice([0, 1, 7, 100, 4096, 65536, 1 << 20, 3 << 20])
    kind = rng.randrange(5)
    if kind == 0:
        return np.zeros(n, np.uint8)
    if kind == 1:
        return bytearray(n)
    if kind == 2:
        return bytes(n)  # read-only
    if kind == 3:
        a = np.zeros(n + 64, np.uint8)
        return a[rng.randrange(64) :][:n]  # an offset view
    return memoryview(bytearray(n + 8))[3 : 3 + n]


def span(rng: random.Random, size: int) -> dict[str, Any]:
    """offset/length, mostly in bounds, sometimes not."""
    r = rng.random()
    if r < 0.7 or size == 0:
        off = rng.randrange(size + 1)
        return {"offset": off, "length": rng.randrange(size - off + 1)}
    if r < 0.85:
        return {}
    return {"offset": rng.choice([size, size + 1, 2**63, 2**64 - 1]), "length": rng.randrange(9)}


def act(w: World, rng: random.Random) -> str:
    r = rng.random()
    if r < 0.06:
        a, b = w.live_endpoint(rng), w.live_endpoint(rng)
        if a is None or b is None:
            return "none"
        c = a.connect(b.planes[0][0], w.ports[id(b)], timeout=1.0, name=w.name(a))
        with w.lock:
            w.conns.append(c)  # and the acceptor keeps the other end
        return "connect"
    if r < 0.14:
        ep = w.live_endpoint(rng)
        if ep is None:
            return "none"
        obj = buffer(rng)
        if isinstance(obj, np.ndarray) and rng.random() < 0.2:  # raw memory, its owner
            mr = ep.register_address(obj.ctypes.data, obj.nbytes, obj, remote_write=True)
        else:
            mr = ep.register(obj, remote_write=not isinstance(obj, bytes) and rng.random() < 0.9)
        with w.lock:
            w.regions.append(mr)
            w.owners.append(obj)
            if not mr.readonly:
                w.remotes.append((ep, mr.descriptor()))
        return "register"
    if r < 0.18:
        mr = w.pick(w.regions, rng)
        if mr is None:
            return "none"
        if rng.random() < 0.5:
            mr.close()
        else:
            with w.lock:
                if mr in w.regions:
                    w.regions.remove(mr)  # dropped: freed when its ops are done
        return "region_close"
    if r < 0.21:
        obj = w.pick(w.owners, rng)
        if isinstance(obj, bytearray):
            obj.extend(b"x")  # BufferError while a region holds it
        return "resize"
    if r < 0.50:
        c = w.pick(w.conns, rng)
        mr = w.pick(w.regions, rng, same=c.endpoint if c is not None else None)
        if c is None or mr is None:
            return "none"
        kind = rng.choice(["write", "write", "send", "recv", "recv"])
        if kind == "recv" and mr.readonly and rng.random() < 0.9:
            kind = "send"
        kw = span(rng, mr.size)
        if rng.random() < 0.3:
            cq = w.pick(w.cqs, rng, same=c.endpoint)
            if cq is not None:
                kw["cq"], kw["ctx"] = cq, rng.randrange(2**64)
        if kind == "write":
            # Mostly a region of the peer's: a rejected key fails the connection (as a
            # remote access error does an RDMA queue pair).
            peer = w.names.get(c.peer_name)
            with w.lock:
                theirs = [d for e, d in w.remotes if e is peer]
                remote = rng.choice(
                    theirs
                    if theirs and rng.random() < 0.95
                    else [d for _, d in w.remotes] or [None]
                )
            if remote is None or rng.random() < 0.03:  # a forged one
                remote = mrc.RemoteRegion(rng.randrange(2**64), rng.choice([0, 1, 4096]))
            if remote.size:
                kw["remote_offset"] = rng.randrange(remote.size)
            n = kw.get("length", mr.size)
            if rng.random() < 0.3:
                kw["imm"] = rng.randrange(2**32)
            if remote.size and rng.random() < 0.9:
                kw["length"] = min(n, remote.size - kw.get("remote_offset", 0))
            op = c.write(mr, remote, **kw)
        elif kind == "send":
            op = c.send(mr, tag=rng.randrange(4), **kw)
        else:
            op = c.recv(mr, tag=rng.choice([None, 0, 1, 2, 3]), **kw)
        if op is not None:
            with w.lock:
                w.ops.append(op)
                w.all_ops.append(op)
        return kind
    if r < 0.62:
        op = w.pick(w.ops, rng)
        if op is None:
            return "none"
        x = rng.random()
        if x < 0.5:
            op.wait(timeout=rng.choice([0, 0.001, 0.02, 0.1]))
        elif x < 0.8:
            _ = op.done, op.status, op.kind, op.nbytes, op.tag
        else:
            with w.lock:
                if op in w.ops:
                    w.ops.remove(op)  # dropped while maybe pending
        return "op"
    if r < 0.68:
        x = rng.random()
        if x < 0.3:
            ep = w.pick(w.eps, rng)
            if ep is None:
                return "none"
            cq = ep.create_cq()
            with w.lock:
                w.cqs.append(cq)
            return "cq_make"
        cq = w.pick(w.cqs, rng)
        if cq is None:
            return "none"
        if x < 0.55:
            cq.poll(rng.choice([1, 8, 64]))
        elif x < 0.75:
            cq.wait(timeout=rng.choice([0, 0.01, 0.05]), max=rng.choice([1, 64]))
        elif x < 0.9:
            c = w.pick(w.conns, rng)
            if c is not None:
                c.set_cq(rng.choice([cq, None]), ctx=rng.randrange(100))
        else:
            cq.close()
        return "cq"
    if r < 0.72:
        c = w.pick(w.conns, rng)
        if c is None:
            return "none"
        x = rng.random()
        if x < 0.4:
            c.wait_imm(timeout=rng.choice([0, 0.01]))
        elif x < 0.8:
            _ = c.ids, c.peer_name, c.npaths, c.peer_planes, c.error, c.closed, c.handle
        else:
            c.close()
        return "conn"
    if r < 0.76:
        ep = w.pick(w.eps, rng)
        if ep is None:
            return "none"
        x = rng.random()
        if x < 0.4:
            ep.stats()
        elif x < 0.5:
            ep.progress_cpu_ns()
        elif x < 0.6:
            # The stats socket's thread reads ep.stats() while others close ep.
            with w.lock:
                w.made_socks += 1
                path = f"{w.tmp}/s{w.made_socks}.sock"
            srv = ep.serve_stats(path)
            try:
                doc = telemetry.fetch(path)
                if "stats" not in doc and "error" not in doc:
                    raise AssertionError(f"stats socket answered {doc}")
            finally:
                srv.close()
            return "telemetry"
        elif x < 0.8:
            ep.inject(rng.randrange(2), loss=rng.choice([0.0, 0.0, 0.05]), down=False)
        else:
            ep.inject(rng.randrange(2), down=rng.random() < 0.5)  # pull or plug a plane
        return "ep"
    if r < 0.78:
        gc.collect()
        return "gc"
    if r < 0.7790:
        w.prune()
        return "prune"
    if r < 0.7805:
        ep = w.live_endpoint(rng)
        if ep is None:
            return "none"
        ep.close()  # under everything the other threads are doing
        with w.lock:
            live = sum(not e.closed for e in w.eps)
        if live < 3:
            w.new_endpoint()
        w.prune()
        return "ep_close"
    return "none"


def worker(w: World, seed: int, steps: int) -> None:
    rng = random.Random(seed)
    for _ in range(steps):
        try:
            what = act(w, rng)
        except EXPECTED as e:
            what = type(e).__name__
            if DEBUG:
                tb = [f for f in traceback.extract_tb(e.__traceback__) if f.name == "act"]
                what += f"@{tb[-1].lineno}" if tb else ""
                w.counts["msg:" + str(e)[:60]] += 1
        except BaseException:
            w.unexpected.append(traceback.format_exc())
            what = "UNEXPECTED"
        w.counts[what] += 1


def main() -> int:
    seed, steps = int(sys.argv[1]), int(sys.argv[2])
    nthreads = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    faulthandler.dump_traceback_later(240, exit=True)  # a hang: every thread's stack
    w = World(seed)
    for _ in range(3):
        w.new_endpoint()
    ts = [
        threading.Thread(target=worker, args=(w, seed * 1000 + i, steps)) for i in range(nthreads)
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    w.stop.set()
    for ep in list(w.eps):
        ep.close()
    for t in w.acceptors:
        t.join()
    shutil.rmtree(w.tmp, ignore_errors=True)
    pending = [op for op in w.all_ops if not op.done]
    for op in pending:
        w.unexpected.append(f"{op!r} still pending after every endpoint closed")
    for u in w.unexpected:
        print(u, file=sys.stderr)
    print(
        f"seed {seed}: {sum(w.counts.values())} calls, {len(w.all_ops)} ops posted, "
        f"{w.made} endpoints, {len(w.unexpected)} unexpected;",
        dict(sorted(w.counts.items())),
    )
    return 1 if w.unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
