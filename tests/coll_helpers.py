"""In-process ranks for collective tests: N endpoints on loopback planes, every
pair connected, each rank a small class providing what the Collectives mixin
needs (rank, size, endpoint, peers, timeout). Each rank's collective runs in
its own Python thread; the executor releases the GIL, so they really run in
parallel in C."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import mrc
from mrc.collectives.ops import Collectives

_net = [40]  # a fresh 127.0.X.0/24 block per mesh and rank (no port clashes)


class Rank(Collectives):
    def __init__(
        self, rank: int, size: int, endpoint: mrc.Endpoint, peers: list[Any], timeout: float,
        chunk_bytes: int, slots: int,
    ) -> None:  # fmt: skip
        self.rank, self.size, self.endpoint, self.peers = rank, size, endpoint, peers
        self.timeout = timeout
        self.chunk_bytes, self.slots = chunk_bytes, slots
        self._collectives_init()

    def close(self) -> None:
        self._collectives_close()
        for p in self.peers:
            if p is not None:
                p.close()
        self.endpoint.close()


def _connect(a: mrc.Endpoint, b: mrc.Endpoint, port: int) -> tuple[mrc.Connection, mrc.Connection]:
    got: dict[str, Any] = {}

    def serve() -> None:
        try:
            got["conn"] = b.accept(timeout=10)
        except BaseException as e:  # re-raised below
            got["error"] = e

    t = threading.Thread(target=serve)
    t.start()
    try:
        ca = a.connect(b.planes[0][0], port, timeout=10)
    finally:
        t.join()
    if "error" in got:
        raise got["error"]
    return ca, got["conn"]


@contextmanager
def mesh(
    n: int, *, nplanes: int = 2, timeout: float = 10.0, ep_timeout: float = 5.0,
    chunk_bytes: int = 0, slots: int = 0,
) -> Iterator[list[Rank]]:  # fmt: skip
    """n connected ranks; all closed afterwards."""
    base = _net[0]
    _net[0] += n
    if _net[0] > 250:
        _net[0] = 40
    eps = [
        mrc.Endpoint([f"127.0.{base + r}.{i + 1}" for i in range(nplanes)], timeout=ep_timeout)
        for r in range(n)
    ]
    ranks: list[Rank] = []
    try:
        peers: list[list[Any]] = [[None] * n for _ in range(n)]
        for j in range(1, n):
            port = eps[j].listen()
            for i in range(j):
                peers[i][j], peers[j][i] = _connect(eps[i], eps[j], port)
        ranks = [Rank(r, n, eps[r], peers[r], timeout, chunk_bytes, slots) for r in range(n)]
        yield ranks
    finally:
        for rk in ranks:
            rk.close()
        for ep in eps:
            ep.close()


def run_ranks(ranks: Sequence[Rank], fn: Callable[[Rank], Any]) -> list[Any]:
    """fn(rank) on one thread per rank; returns the results, or the exceptions raised."""
    out: list[Any] = [None] * len(ranks)

    def go(i: int) -> None:
        try:
            out[i] = fn(ranks[i])
        except BaseException as e:  # returned to the test
            out[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def ok(results: list[Any]) -> list[Any]:
    for r, x in enumerate(results):
        if isinstance(x, BaseException):
            raise AssertionError(f"rank {r} raised {type(x).__name__}: {x}") from x
    return results


_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _enter_netns(name: str) -> None:
    """Moves the calling thread (only) into network namespace `name`: sockets it
    creates from now on live there, whichever thread uses them later."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


@contextmanager
def fabric_mesh(
    fab: Any,
    hosts: Sequence[str],
    *,
    timeout: float = 20.0,
    ep_timeout: float = 5.0,
    chunk_bytes: int = 0,
    slots: int = 0,
) -> Iterator[list[Rank]]:
    """Ranks on fabric hosts (rank r on hosts[r]) in one process: each rank's
    endpoint and connections are made by a thread inside its host's namespace,
    with the route table's SRv6 paths between every pair."""
    from mrc.paths import FabricEndpoint

    n = len(hosts)
    pools = [ThreadPoolExecutor(1, initializer=_enter_netns, initargs=(fab.ns(h),)) for h in hosts]
    fes: list[Any] = []
    ranks: list[Rank] = []
    try:
        fes = [
            pools[r].submit(FabricEndpoint, fab.fabric, hosts[r], timeout=ep_timeout).result()
            for r in range(n)
        ]
        peers: list[list[Any]] = [[None] * n for _ in range(n)]
        for j in range(1, n):
            port = pools[j].submit(fes[j].listen).result()
            for i in range(j):
                accepted = pools[j].submit(fes[j].accept, timeout=10)
                peers[i][j] = pools[i].submit(fes[i].connect, hosts[j], port, 10).result()
                peers[j][i] = accepted.result()
        ranks = [
            Rank(r, n, fes[r].endpoint, peers[r], timeout, chunk_bytes, slots) for r in range(n)
        ]
        yield ranks
    finally:
        for rk in ranks:
            rk.close()
        for fe in fes:
            fe.close()
        for p in pools:
            p.shutdown()
