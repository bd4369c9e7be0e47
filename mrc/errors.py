"""The exceptions mrc raises. Every datapath error code maps to one of these.

Each carries ``code`` (the C return code, negative) and, for system errors
(-errno from the C library), ``errno``; a system error is also an instance of
the OSError subclass Python uses for that errno (ConnectionRefusedError,
PermissionError, ...), so ``except OSError`` works as for a socket call.
"""

from __future__ import annotations

import errno as _errno
import os


class MrcError(Exception):
    """Base class of every mrc error. ``code``: the C return code (0 if none)."""

    code: int = 0
    errno: int | None = None


class UsageError(MrcError, ValueError):
    """A call was made with arguments that can never work (bad size, bad address...)."""


class TimeoutError(MrcError, TimeoutError):  # noqa: A001 - deliberately shadows the builtin
    """No progress on any path within the endpoint's timeout: the connection timed out."""


class WaitTimeout(TimeoutError):
    """``wait(timeout)`` ran out while the operation (or immediate, or peer) is still
    pending: nothing failed, wait again. A subclass of mrc.TimeoutError, so one
    ``except mrc.TimeoutError`` catches both; catch this one first to retry."""


class PathDownError(MrcError):
    """No path to the peer is usable (every path failed and none healed in time)."""


class KeyRejectedError(MrcError):
    """The peer refused a WRITE: unknown remote key, or outside the region's bounds."""


class ConnectionClosedError(MrcError):
    """The connection was closed (locally, by the peer, or after a fatal error)."""


class UnreachableError(MrcError, ConnectionError):
    """The peer could not be reached to set up a connection."""


class ProtocolError(MrcError):
    """The peer speaks another version of the mrc protocol or sent an invalid hello."""


class TruncatedError(MrcError):
    """A SEND carried more bytes than the matching RECV buffer holds."""


class CollectiveError(MrcError):
    """A collective (or the communicator) failed: a rank died or became unreachable, the
    communicator was aborted, or the ranks disagree about the call.

    rank: the rank that failed or disagreed (None when no single rank is to blame);
    code: the datapath code behind it (negative), or 0.
    """

    def __init__(self, message: str, rank: int | None = None, code: int = 0) -> None:
        super().__init__(message)
        self.rank = rank
        self.code = code


class BusyError(MrcError):
    """The object is still in use (operations pending on it, connections bound to it,
    a thread waiting on it): finish or close those first."""


class ReceiverNotReadyError(MrcError):
    """The peer kept answering receiver-not-ready (no RECV posted, or immediates not
    taken) for longer than the sender's ``rnr_timeout``."""


class SystemCallError(MrcError, OSError):
    """A system call in the datapath failed; ``errno`` says which error."""


class NoBuffersError(SystemCallError):
    """A fixed-size table is full (connections, regions), or the kernel is out of
    buffers (ENOBUFS)."""


_os_classes: dict[type[OSError], type[SystemCallError]] = {}


def system_error(err: int, message: str) -> SystemCallError:
    """The exception for a system error `err` (a positive errno): a SystemCallError
    that is also the OSError subclass Python picks for that errno."""
    if err == _errno.ENOBUFS:
        cls: type[SystemCallError] = NoBuffersError
    else:
        base = type(OSError(err, ""))  # e.g. ConnectionRefusedError for ECONNREFUSED
        if base is OSError:
            cls = SystemCallError
        else:
            cls = _os_classes.get(base) or _os_classes.setdefault(
                base, type(f"System{base.__name__}", (SystemCallError, base), {})
            )
    exc = cls(err, f"{message} [{_errno.errorcode.get(err, err)}: {os.strerror(err)}]")
    exc.errno = err
    exc.code = -err
    return exc
