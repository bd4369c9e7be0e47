"""A local stats socket: a running endpoint's counters and path states, on request.

`Endpoint.serve_stats(path)` starts a small Unix-socket server in the endpoint's
process; each client that connects gets one JSON document (``{"time": ..., "pid":
..., "planes": [...], "stats": {...}}``) and the connection closes. `mrc-route live
PATH` polls it. Nothing is served unless asked for.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrc import Endpoint


class StatsServer:
    """Serves `ep.stats()` on a Unix socket until closed (or the endpoint closes)."""

    def __init__(self, ep: Endpoint, path: str) -> None:
        self.path = path
        self._ep = ep
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            from mrc.errors import UsageError

            raise UsageError(
                f"serve_stats: cannot create {path}: directory {parent} does not exist"
            )
        if os.path.exists(path):
            # A stale socket from a dead process is replaced; a live one is not.
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)
            else:
                raise OSError(f"stats socket {path} is in use by another process")
            finally:
                probe.close()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(8)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="mrc-stats", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError:
                return  # closed
            with client:
                try:
                    doc = snapshot(self._ep)
                except Exception as e:  # the endpoint closed under us
                    doc = {"error": str(e)}
                try:
                    client.sendall(json.dumps(doc).encode() + b"\n")
                except OSError:
                    pass

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        # close() alone does not wake a thread blocked in accept() on Linux: the join
        # below then waited its whole 5 s on every close. shutdown() does (EINVAL).
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> StatsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def snapshot(ep: Endpoint) -> dict[str, Any]:
    return {
        "time": time.time(),
        "pid": os.getpid(),
        "planes": [{"addr": a, "port": p} for a, p in ep.planes],
        "stats": ep.stats(),
    }


def fetch(path: str, timeout: float = 2.0) -> dict[str, Any]:
    """One snapshot from a stats socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return json.loads(data)
