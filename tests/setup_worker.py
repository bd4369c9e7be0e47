"""Many connection set-ups between two fabric hosts, each checked with a transfer; run in
each host's namespace by tests/test_setup.py:

    python tests/setup_worker.py server --fabric F --host h1 --count N
    python tests/setup_worker.py client --fabric F --host h0 --peer h1 --port P --count N
        [--parallel K]

The server prints {"port": P} once it listens, then for each connection receives a
SEND and answers with its sha256; the client checks every answer. Both print a JSON
line {"ok": n, "errors": [...]}; the client then keeps its connections open until its
stdin closes, so the server's last SENDs complete (a closed peer would fail them)."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import mrc
from mrc.paths import fabric_endpoint

SIZE = 64 << 10


def serve_one(ep: mrc.Endpoint, conn: mrc.Connection) -> None:
    buf = np.zeros(SIZE, np.uint8)
    out = np.zeros(32, np.uint8)
    with ep.register(buf) as mr, ep.register(out) as omr:
        r = conn.recv(mr)
        r.wait(timeout=30)
        out[:] = np.frombuffer(hashlib.sha256(buf[: r.nbytes].tobytes()).digest(), np.uint8)
        conn.send(omr).wait(timeout=30)


def server(a: argparse.Namespace) -> None:
    fe = fabric_endpoint(a.fabric, a.host, timeout=5.0)
    print(json.dumps({"port": fe.listen(0)}), flush=True)
    errors: list[str] = []
    threads = []
    for _ in range(a.count):
        conn = fe.accept(timeout=120)

        def run(conn: mrc.Connection = conn) -> None:
            try:
                serve_one(fe.endpoint, conn)
            except mrc.MrcError as e:
                errors.append(str(e))

        t = threading.Thread(target=run)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    print(json.dumps({"ok": a.count - len(errors), "errors": errors}), flush=True)
    fe.close()


def client(a: argparse.Namespace) -> None:
    fe = fabric_endpoint(a.fabric, a.host, timeout=5.0)

    conns: list[mrc.Connection] = []

    def one(i: int) -> None:
        data = np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8)
        back = np.zeros(32, np.uint8)
        conn = fe.connect(a.peer, a.port, timeout=30)
        conns.append(conn)
        with fe.endpoint.register(data) as mr, fe.endpoint.register(back) as bmr:
            r = conn.recv(bmr)
            conn.send(mr).wait(timeout=30)
            r.wait(timeout=30)
        if back.tobytes() != hashlib.sha256(data.tobytes()).digest():
            raise AssertionError(f"set-up {i}: the server hashed other bytes")

    errors: list[str] = []
    with ThreadPoolExecutor(a.parallel) as pool:
        for f in [pool.submit(one, i) for i in range(a.count)]:
            try:
                f.result()
            except (mrc.MrcError, AssertionError) as e:
                errors.append(str(e))
    print(json.dumps({"ok": a.count - len(errors), "errors": errors}), flush=True)
    sys.stdin.read()
    fe.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["server", "client"])
    p.add_argument("--fabric", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--peer", default="")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--count", type=int, default=8)
    p.add_argument("--parallel", type=int, default=1)
    a = p.parse_args()
    (server if a.role == "server" else client)(a)


if __name__ == "__main__":
    main()
