"""Helpers for tests: connected endpoint pairs on loopback planes."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

import mrc


@dataclass
class Pair:
    a: mrc.Endpoint
    b: mrc.Endpoint
    ca: mrc.Connection
    cb: mrc.Connection


def planes(n: int, net: int) -> list[str]:
    return [f"127.0.{net}.{i + 1}" for i in range(n)]


@contextmanager
def connected_pair(nplanes: int = 4, **ep_kwargs: object) -> Iterator[Pair]:
    """Two endpoints on loopback planes 127.0.{0,1}.1..n, connected; both closed after."""
    a = mrc.Endpoint(planes(nplanes, 0), **ep_kwargs)  # type: ignore[arg-type]
    b = mrc.Endpoint(planes(nplanes, 1), **ep_kwargs)  # type: ignore[arg-type]
    try:
        port = b.listen()
        got: dict[str, object] = {}

        def serve() -> None:
            try:
                got["conn"] = b.accept(timeout=10)
            except BaseException as e:  # surfaced in the main thread below
                got["error"] = e

        t = threading.Thread(target=serve)
        t.start()
        ca = a.connect(b.planes[0][0], port, timeout=10)
        t.join()
        if "error" in got:
            raise got["error"]  # type: ignore[misc]
        cb = got["conn"]
        assert isinstance(cb, mrc.Connection)
        yield Pair(a, b, ca, cb)
    finally:
        a.close()
        b.close()


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def sha(buf: object) -> str:
    return hashlib.sha256(memoryview(buf).cast("B")).hexdigest()  # type: ignore[arg-type]


def wait_for(cond: Callable[[], object], timeout: float = 5.0, what: str = "condition") -> None:
    """Polls cond (every 10 ms) until it holds; fails after timeout seconds. For events
    nothing can be waited on for (a peer's CLOSE arriving, a counter moving)."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"{what} not met in time")
        time.sleep(0.01)
