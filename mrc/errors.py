"""The exceptions mrc raises. Every datapath error code maps to one of these."""

from __future__ import annotations


class MrcError(Exception):
    """Base class of every mrc error."""


class UsageError(MrcError, ValueError):
    """A call was made with arguments that can never work (bad size, bad address...)."""


class TimeoutError(MrcError, TimeoutError):  # noqa: A001 - deliberately shadows the builtin
    """An operation did not complete in time: the peer stopped answering on every path."""


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
