"""The control channel: small JSON messages as mrc SENDs on the first connection.

perftest exchanges QP numbers and keys over a TCP socket ("Data ex. method: Ethernet");
mrc-perf uses the transport it measures instead, on a tag of its own that data never
uses. A receive is always posted for the next message, so the peer can send at any time.
"""

from __future__ import annotations

import json
import time
from typing import Any

import mrc

CTRL_TAG = 0x6D72_6370_6572_6600  # "mrcperf\0": control messages
DATA_TAG = 0x0100  # + the step index (one tag per message size, see runner)
MAX_MSG = 64 << 10


class PeerGone(Exception):
    """The peer closed the connection or stopped answering."""


class Control:
    def __init__(self, ep: mrc.Endpoint, conn: mrc.Connection) -> None:
        self.conn = conn
        self._rbuf = bytearray(MAX_MSG)
        self._sbuf = bytearray(MAX_MSG)
        self._rmr = ep.register(self._rbuf)
        self._smr = ep.register(self._sbuf)
        self._gone: mrc.MrcError | None = None
        self._pending: mrc.Operation | None = self._post()

    def _post(self) -> mrc.Operation:
        return self.conn.recv(self._rmr, tag=CTRL_TAG)

    def _op(self) -> mrc.Operation:
        if self._pending is None:
            raise PeerGone(f"the peer went away: {self._gone}")
        return self._pending

    def send(self, msg: dict[str, Any], timeout: float = 10.0) -> None:
        data = json.dumps(msg).encode()
        if len(data) > MAX_MSG:
            raise ValueError(f"control message of {len(data)} bytes (max {MAX_MSG})")
        self._sbuf[: len(data)] = data
        try:
            self.conn.send(self._smr, length=len(data), tag=CTRL_TAG).wait(timeout)
        except mrc.MrcError as e:
            raise PeerGone(f"could not send to the peer: {e}") from e

    def poll(self) -> dict[str, Any] | None:
        """The next message if one has arrived, else None."""
        op = self._op()
        if not op.done:
            return None
        try:
            op.wait(0)
        except mrc.MrcError as e:
            raise PeerGone(f"the peer went away: {e}") from e
        msg: dict[str, Any] = json.loads(bytes(self._rbuf[: op.nbytes]))
        try:
            self._pending = self._post()
        except mrc.MrcError as e:
            # A peer may close right after its last message (the server after its
            # "result"): that message still counts; the next poll says it is gone.
            self._pending, self._gone = None, e
        return msg

    def wait(self, timeout: float) -> None:
        """Block until a message is there or `timeout` passes (then just return)."""
        try:
            self._op().wait(timeout)
        except mrc.TimeoutError:
            return
        except mrc.MrcError as e:
            raise PeerGone(f"the peer went away: {e}") from e

    def recv(self, timeout: float | None = 30.0, expect: str | None = None) -> dict[str, Any]:
        """Wait for the next message (of type `expect`, if given)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            msg = self.poll()
            if msg is not None:
                if expect is not None and msg.get("type") != expect:
                    raise PeerGone(f"expected a {expect!r} message, got {msg.get('type')!r}")
                return msg
            left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if left <= 0:
                raise PeerGone(f"the peer sent nothing for {timeout} s")
            try:
                self._op().wait(left)
            except mrc.TimeoutError:
                continue
            except mrc.MrcError as e:
                raise PeerGone(f"the peer went away: {e}") from e
