"""The communicator's bootstrap: a small TCP rendezvous that rank 0's process serves.

    uid = get_unique_id()      # starts the server thread here; bytes naming it
    RendezvousClient(uid, timeout).join(rank, size, info) -> every rank's info, by rank

The unique id is printable bytes, b"mrc-uid/1/<addr>/<port>/<token>": the server's
address and port, the protocol version and a random token (so a stray process with an
old id cannot join). Messages are JSON lines over one TCP connection per rank:

    rank -> server   {"op": "join", version, token, rank, size, info}
    server -> rank   {"op": "table", "infos": [...]}  once every rank has joined,
                     {"op": "error", message, rank}   the group cannot form (and why)
                     {"op": "waiting", missing (the first 16), count, waited, size,
                                     timeout}         every PROGRESS_S while it forms
    both ways        {"op": "hb"}                     liveness, every `interval` seconds
    rank -> server   {"op": "abort", message[, blame]} | {"op": "bye"[, runs]}  (bye: in close();
                     runs: the collectives it completed with each rank)
    server -> rank   {"op": "failed", rank, message} | {"op": "closed", rank[, runs]}
                     {"op": "released"}               every rank has said bye (or failed)

The connection stays open for the communicator's life: it is how a rank's death reaches
the others at once (its socket closes without a "bye") and how a stopped or cut-off rank
is noticed (no heartbeat for `timeout` seconds), independent of the transport's timers.
One selector thread serves every rank, so a slow rank never holds up the others.

Links: one TCP connection runs on one plane, so a pulled cable on it would silence a
healthy rank and, after `timeout`, fail the whole group, while the transport carries on
over the other planes. So the server also listens on rank 0's other plane addresses
(add_links; the table lists them) and every rank opens a second connection to each
({"op": "attach", token, rank} after the greeting). Every message goes out on every link
of a rank, and any of them keeps it alive; a link that breaks or closes is dropped alone.
A rank is lost when all its connections are silent for `timeout`, or at once when its
first one closes (its process closed it: EOF or a reset) without a "bye", as before the
links. Duplicates are harmless: every message is idempotent on both sides.

A link is kept, not only opened: the server beats on every connection, so a rank's
connections to an address that are all silent for STALE_BEATS intervals have a broken
path, or one that came back while TCP backs off (its retransmission timeout doubles while
the path is down: after 6 s down, the next try is about 6 s after the cable is back, 2
minutes after a long outage). Every interval the rank opens a fresh link to such an
address (a new connection's SYN goes out at once) and retires the silent links; the
first connection is never closed (its EOF is the rank's death), only joined by a fresh
link. So a plane that flaps, or fails and heals, gives its link back within an interval.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import secrets
import selectors
import socket
import struct
import termios
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mrc.errors import CollectiveError, UsageError

VERSION = 2  # 2: the server greets every connection first
MAGIC = "mrc-uid"
_MAX_LINE = 1 << 20  # a join carries a few addresses; a longer line is not one of ours
# A rendezvous greets a connection as it accepts it. Something else that holds the port
# (rank 0 could not bind it, and joins whoever listens there) is found out this soon,
# instead of every rank waiting the whole timeout for an answer that never comes.
GREETING_S = 10.0
# The server beats every interval on every connection (up to half an interval late): a
# connection silent for this many intervals has lost its path, for now.
STALE_BEATS = 3


# While a group forms, every this often: the server tells the ranks that joined which
# ranks it still waits for, and a rank that cannot reach rank 0 says so (log warnings):
# on a thousand ranks, a start that hangs must say who it waits for before the timeout.
PROGRESS_S = 10.0

log = logging.getLogger("mrc.collectives")

# A rendezvous end that closes, or a program that exits without close(), waits this long
# at most for its last words to be acknowledged (_flush).
LAST_WORDS_S = 1.0


def _unacked(sock: socket.socket) -> int:
    """Bytes written to sock that its peer has not acknowledged (TIOCOUTQ)."""
    try:
        got = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError):  # closed meanwhile
        return 0
    return int(struct.unpack("i", got)[0])


def _flush(socks: Callable[[], list[socket.socket]], wait: float) -> None:
    """Waits, up to `wait` seconds, until what was written to socks() is acknowledged. A
    socket closed with unread data in it (heartbeats) resets its connection and drops
    what it still held: behind a lossy path, the verdict naming a dead rank or this
    rank's abort, so the others would see only this end go."""
    deadline = time.monotonic() + wait
    while any(_unacked(s) for s in socks()) and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the kernel's send queues, with a deadline


# Servers and clients not closed yet: an exit flushes their sockets (_last_words_at_exit).
_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()


@atexit.register
def _last_words_at_exit() -> None:
    """A program that exits without close() (an exception ended it right after its
    collective failed) still delivers what its rendezvous end sent last."""
    ends = list(_OPEN)
    _flush(lambda: [s for end in ends for s in end._open_socks()], LAST_WORDS_S)


# Ranks up to which the interval stays at its base (1 s for timeouts of 5 s and more).
# Rank 0's rendezvous thread takes in a beat per rank and link every interval, and sends
# as many: measured on loopback with 4 links per rank, 0.3% of a core at 16 ranks and
# 1.7% at 64 (about 0.027% per rank), which at 4096 ranks would be a whole core, and the
# GIL, of rank 0's training process. Above this many ranks the interval grows with the
# group, up to a fifth of the timeout.
BEAT_RANKS = 256


def heartbeat_interval(timeout: float, size: int = 1) -> float:
    """Heartbeats at least five times per timeout, so one late beat never looks like a
    death; every second up to BEAT_RANKS ranks, less often in larger groups."""
    base = min(1.0, max(0.05, timeout / 5))
    return max(base, min(timeout / 5, base * size / BEAT_RANKS))


@dataclass(frozen=True)
class UniqueId:
    addr: str
    port: int
    token: str
    version: int = VERSION

    def pack(self) -> bytes:
        return f"{MAGIC}/{self.version}/{self.addr}/{self.port}/{self.token}".encode()

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview | str) -> UniqueId:
        text = data if isinstance(data, str) else bytes(data).decode("ascii", "replace")
        parts = text.split("/")
        if len(parts) != 5 or parts[0] != MAGIC:
            raise UsageError(
                f"not an mrc unique id: {text[:80]!r} (want the bytes of mrc.get_unique_id())"
            )
        try:
            version, port = int(parts[1]), int(parts[3])
        except ValueError:
            raise UsageError(f"malformed mrc unique id {text[:80]!r}") from None
        if version != VERSION:
            raise UsageError(
                f"unique id of protocol version {version}, this mrc speaks {VERSION}: "
                "every rank must run the same mrc"
            )
        if not 0 < port < 65536 or not parts[2] or not parts[4]:
            raise UsageError(f"malformed mrc unique id {text[:80]!r}")
        return cls(parts[2], port, parts[4], version)


def env_token(addr: str, port: int, run_id: str) -> str:
    """The token of an id built from launcher variables: every rank derives the same one,
    and a rank of another run (another run id or port) does not match it. Not the size:
    a rank given another WORLD_SIZE is then told so by the rendezvous, not "wrong id"."""
    key = f"{MAGIC}/{VERSION}/{addr}/{port}/{run_id}".encode()
    return hashlib.sha256(key).hexdigest()[:32]


# The servers this process runs, by token: rank 0's communicator takes over the one
# get_unique_id() started here (and stops it on close) instead of starting another.
_servers: dict[str, RendezvousServer] = {}
_servers_lock = threading.Lock()


def get_unique_id(addr: str = "127.0.0.1", port: int = 0) -> bytes:
    """Start a rendezvous server on addr:port (0: any free port) in this process and
    return the id naming it; give it to every rank's Communicator (rank 0 in this process,
    or in any process while this one lives)."""
    uid = UniqueId(addr, port, secrets.token_hex(16))
    server = RendezvousServer(uid)
    with _servers_lock:
        _servers[server.uid.token] = server
    return server.uid.pack()


def take_server(uid: UniqueId) -> RendezvousServer | None:
    with _servers_lock:
        return _servers.pop(uid.token, None)


def try_serve(uid: UniqueId) -> RendezvousServer | None:
    """Rank 0 with an id this process did not make: serve it at its address (from_env),
    or, when that port is taken, join whoever serves it (get_unique_id() in another
    process; a stranger there refuses our token, which is a clear error too)."""
    try:
        return RendezvousServer(uid)
    except PortInUse:
        return None


def _send(sock: socket.socket, msg: dict[str, Any] | bytes) -> None:
    """A message of the group's forming (the join, the table: large with many ranks);
    bytes: one already encoded (_encode), as a broadcast encodes once for every rank."""
    sock.sendall(msg if isinstance(msg, bytes) else _encode(msg))


_HB = json.dumps({"op": "hb"}).encode()  # a beat's line, as the server compares it


def _encode(msg: dict[str, Any]) -> bytes:
    return (json.dumps(msg) + "\n").encode()


def _offer(sock: socket.socket, msg: dict[str, Any] | bytes) -> bool:
    """A small message of the group's life, queued whole without blocking. False: the
    connection cannot take it, its send buffer full of heartbeats for a path down for
    minutes (TCP gives up after about 15); nothing more may go on it (part of a line may
    be in it). A blocking write there would stall every rank's messages behind it."""
    data = msg if isinstance(msg, bytes) else _encode(msg)
    try:
        return sock.send(data, socket.MSG_DONTWAIT) == len(data)
    except BlockingIOError:
        return False


class PortInUse(UsageError):
    """The rendezvous port is taken (by another server, perhaps the right one)."""


def _closed_by_peer(e: OSError) -> bool:
    """A socket error that says the other side's process closed the connection (a reset),
    as against its path breaking (a timeout, an unreachable host or network)."""
    return e.errno in (errno.ECONNRESET, errno.ECONNABORTED)


class _Peer:
    """One connection. A rank's first (the join) is its record; its links point at it."""

    def __init__(self, sock: socket.socket, where: str) -> None:
        self.sock = sock
        self.where = where
        self.buf = b""
        self.rank: int | None = None
        self.owner: _Peer | None = None  # a link: the rank's record
        self.last_seen = time.monotonic()  # the record's: any of the rank's links
        self.gone = False  # said bye or failed: no more heartbeats expected
        self.jammed = False  # a record whose socket cannot take more (_offer): not written
        self.info: dict[str, Any] = {}


class RendezvousServer:
    """Collects every rank's info, hands out the table, then watches the ranks live."""

    def __init__(self, uid: UniqueId) -> None:
        family = socket.AF_INET6 if ":" in uid.addr else socket.AF_INET
        self._lsock = socket.socket(family, socket.SOCK_STREAM)
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._lsock.bind((uid.addr, uid.port))
        except OSError as e:
            self._lsock.close()
            kind = PortInUse if e.errno == errno.EADDRINUSE else UsageError
            raise kind(
                f"cannot start the rendezvous on {uid.addr} port {uid.port}: {e.strerror} "
                "(the address must be one of rank 0's, the port free)"
            ) from None
        self._lsock.listen(256)
        self._lsock.setblocking(False)
        self.uid = UniqueId(uid.addr, self._lsock.getsockname()[1], uid.token, uid.version)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._lsock, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._peers: list[_Peer] = []
        self._by_rank: dict[int, _Peer] = {}
        self._size: int | None = None
        self._timeout = 60.0
        self._deadline: float | None = None
        self._progress = 0.0  # when the ranks that joined are next told who is missing
        self._error: dict[str, Any] | None = None  # the group failed to form: for everyone
        self._complete = False
        self._left: set[int] = set()  # ranks that closed, aborted or failed
        self._released = False
        self._stopping = False
        self._links: list[tuple[str, int]] = []  # (addr, port) of the extra listeners
        self._link_socks: list[socket.socket] = []
        self._links_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="mrc-rendezvous", daemon=True)
        self._thread.start()
        _OPEN.add(self)

    def add_links(self, addrs: list[str]) -> None:
        """Listen on these addresses too (rank 0's other planes; any port), for the ranks'
        extra links. Before the group is complete: the table lists them. An address that
        cannot be bound is left out (it only costs that link)."""
        for addr in addrs:
            if addr == self.uid.addr:
                continue
            family = socket.AF_INET6 if ":" in addr else socket.AF_INET
            ls = socket.socket(family, socket.SOCK_STREAM)
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                try:  # the rendezvous' own port, where a rank can also join (alternates)
                    ls.bind((addr, self.uid.port))
                except OSError:
                    ls.bind((addr, 0))
                ls.listen(256)
            except OSError:
                ls.close()
                continue
            ls.setblocking(False)
            with self._links_lock:
                self._links.append((addr, ls.getsockname()[1]))
                self._link_socks.append(ls)
            self._wake()  # the loop registers it

    def _register_links(self) -> None:
        with self._links_lock:
            for ls in self._link_socks:
                try:
                    self._sel.get_key(ls)
                except KeyError:
                    self._sel.register(ls, selectors.EVENT_READ, ls)

    # --- the loop ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as e:
            # A bug here must not leave the group waiting for verdicts that will never
            # come (each rank would hang until a timeout blaming someone else): fail it,
            # with the cause, at once.
            traceback.print_exc()
            message = (
                f"rank 0's rendezvous failed ({type(e).__name__}: {e}); the group cannot go on"
            )
            with contextlib.suppress(Exception):
                if self._complete:
                    self._broadcast({"op": "failed", "rank": None, "message": message})
                else:
                    self._group_error(message, None)
            with contextlib.suppress(Exception):
                self._shutdown()

    def _loop(self) -> None:
        last_beat = 0.0
        while not self._stopping:
            # The group's timeout (so the interval) arrives with the first join: the
            # beats keep to it from then on, the first one after the table included.
            interval = heartbeat_interval(self._timeout, self._size or 1)
            for key, _ in self._sel.select(timeout=interval / 2):
                if key.data is None:
                    self._accept(self._lsock)
                elif isinstance(key.data, socket.socket):
                    self._accept(key.data)
                elif key.data == "wake":
                    self._wake_r.recv(64)
                    self._register_links()
                else:
                    self._read(key.data)
            now = time.monotonic()
            if now >= last_beat + interval:
                last_beat = now
                self._beat(now)
        self._shutdown()

    def _accept(self, lsock: socket.socket) -> None:
        try:
            sock, addr = lsock.accept()
        except BlockingIOError:
            return
        sock.setblocking(True)  # small writes; reads only when the selector says so
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = _Peer(sock, f"{addr[0]}:{addr[1]}")
        try:
            _send(sock, {"op": "hello", "version": VERSION})
        except OSError:
            sock.close()
            return
        self._peers.append(peer)
        self._sel.register(sock, selectors.EVENT_READ, peer)

    def _read(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(65536)
        except OSError as e:
            if not _closed_by_peer(e):  # its path broke, not its process: this link only
                return self._drop(peer)
            data = b""
        if not data:
            if peer.owner is not None:  # a link: the rank is judged by its first connection
                return self._drop(peer)
            self._lost(peer, "exited or lost its rendezvous connection without close()")
            return
        (peer.owner or peer).last_seen = time.monotonic()
        peer.buf += data
        while b"\n" in peer.buf:
            line, peer.buf = peer.buf.split(b"\n", 1)
            if line == _HB:
                continue  # most of what arrives: its time is noted above, nothing to parse
            try:
                msg = json.loads(line)
            except (ValueError, RecursionError):
                self._drop(peer)
                return
            if not isinstance(msg, dict):  # valid JSON, not a message (a stray client)
                self._drop(peer)
                return
            try:
                self._handle(peer, msg)
            except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
                self._drop(peer)  # a field of the wrong kind: as a line that is not JSON
                return
        if len(peer.buf) > _MAX_LINE:
            self._drop(peer)

    def _handle(self, peer: _Peer, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        owner = peer.owner or peer
        if op == "join":
            self._join(peer, msg)
        elif op == "attach":
            self._attach(peer, msg)
        elif op in ("bye", "abort") and owner.gone:
            return  # the same goodbye again, on another link
        elif op == "bye":
            owner.gone = True
            if owner.rank is not None:
                closed: dict[str, Any] = {"op": "closed", "rank": owner.rank}
                runs = msg.get("runs")
                if isinstance(runs, list) and all(type(x) is int and x >= 0 for x in runs):
                    closed["runs"] = runs
                self._broadcast(closed, skip=owner)
                self._left_group(owner.rank)
        elif op == "abort" and owner.rank is not None:
            owner.gone = True
            # "blame": the rank the aborting one found at fault (unreachable, silent).
            blame = msg.get("blame")
            at_fault = blame if isinstance(blame, int) and 0 <= blame < (self._size or 0) else None
            self._fail(
                owner.rank if at_fault is None else at_fault,
                str(msg.get("message", "aborted")),
                skip=owner,
            )
            self._left_group(owner.rank)

    def _attach(self, peer: _Peer, msg: dict[str, Any]) -> None:
        """An extra link of a rank that has joined: messages to the rank go on it too."""
        rank = msg.get("rank")
        owner = self._by_rank.get(rank) if isinstance(rank, int) else None
        if msg.get("token") != self.uid.token or owner is None or owner.gone:
            return self._drop(peer)
        peer.rank, peer.owner = owner.rank, owner

    def _left_group(self, rank: int) -> None:
        """Once every rank has closed (or failed), release the ranks waiting in close():
        none of them tears its connections down while a peer may still need an ACK."""
        self._left.add(rank)
        if self._complete and not self._released and len(self._left) == self._size:
            self._released = True
            self._broadcast({"op": "released"})

    def _join(self, peer: _Peer, msg: dict[str, Any]) -> None:
        def refuse(message: str) -> None:
            self._reply_error(peer, message)

        if msg.get("version") != VERSION:
            return refuse(f"protocol version {msg.get('version')}, the rendezvous speaks {VERSION}")
        if msg.get("token") != self.uid.token:
            theirs = str(msg.get("token"))[:8]
            return refuse(
                f"wrong unique id: the rendezvous at {self.uid.addr} port {self.uid.port} "
                f"belongs to another communicator (token {self.uid.token[:8]}..., "
                f"the rank's {theirs}...)"
            )
        rank, size = int(msg["rank"]), int(msg["size"])
        if self._error is not None:
            return self._send_error(peer, self._error)
        if self._complete:
            return refuse(f"rank {rank} joined a communicator of {self._size} that is complete")
        if self._size is None:
            self._size = size
            self._timeout = float(msg.get("timeout", 60.0))
            self._deadline = time.monotonic() + self._timeout
            self._progress = time.monotonic() + PROGRESS_S
            self._wake()
        if size != self._size:
            said = ", ".join(str(r) for r in sorted(self._by_rank)) or "the first to join"
            return self._group_error(
                f"the ranks disagree on the communicator's size: rank {rank} says {size}, "
                f"rank(s) {said} said {self._size} (WORLD_SIZE or size= differs)",
                None,
            )
        if not 0 <= rank < size:
            return refuse(f"rank {rank} out of range for a communicator of {size} ranks")
        if rank in self._by_rank:
            first = self._by_rank[rank]
            return self._group_error(
                f"two processes joined as rank {rank} (from {first.where} and {peer.where})",
                rank,
            )
        peer.rank = rank
        peer.info = dict(msg.get("info", {}))
        self._by_rank[rank] = peer
        if rank == 0 and not self._links:
            # A server that get_unique_id() started outside rank 0's process did not know
            # rank 0's planes; where they are this process's too (the same host or
            # namespace: a launcher), it listens on them now, before the table lists them.
            planes = peer.info.get("planes")
            if isinstance(planes, list):
                self.add_links([a for a in planes if isinstance(a, str)])
        if len(self._by_rank) == self._size:
            self._complete = True
            infos = [self._by_rank[r].info for r in range(self._size)]
            with self._links_lock:
                links = [list(x) for x in self._links]
            self._broadcast({"op": "table", "infos": infos, "links": links})

    def _beat(self, now: float) -> None:
        if not self._complete and self._deadline is not None and now > self._deadline:
            if self._error is None and self._size is not None:
                missing = [r for r in range(self._size) if r not in self._by_rank]
                joined = sorted(self._by_rank)
                self._group_error(
                    f"rank{'s' if len(missing) > 1 else ''} {_ranks(missing)} of "
                    f"{self._size} did not join within {self._timeout:g} s "
                    f"(joined: {_ranks(joined)})",
                    missing[0] if len(missing) == 1 else None,
                )
            return
        if not self._complete:
            if self._size is not None and self._deadline is not None and now >= self._progress:
                self._progress = now + PROGRESS_S
                waited = now - (self._deadline - self._timeout)
                missing = [r for r in range(self._size) if r not in self._by_rank]
                # The first few and a count: small whatever the size, as an offered
                # message must be (one that does not fit at once jams its connection).
                msg = {"op": "waiting", "missing": missing[:16], "count": len(missing)}
                self._broadcast(
                    {**msg, "waited": waited, "size": self._size, "timeout": self._timeout}
                )
            return
        self._broadcast({"op": "hb"})
        for r, p in list(self._by_rank.items()):
            if r not in self._left and not p.gone and now - p.last_seen > self._timeout:
                self._lost(p, f"sent nothing for {now - p.last_seen:.1f} s (stopped or cut off)")

    # --- failures ---------------------------------------------------------------------

    def _lost(self, peer: _Peer, what: str) -> None:
        """peer: a rank's record (or a connection that never joined)."""
        rank, gone = peer.rank, peer.gone
        if rank is not None and self._complete and not gone and rank not in self._left:
            # A stopped rank (SIGSTOP) reads this when it runs again, before the hang-up
            # that would otherwise make it blame rank 0.
            # A rank that exited has no one to read it: the write fails (EPIPE), harmless.
            self._send_error(peer, {"op": "failed", "rank": rank, "message": f"rank {rank} {what}"})
        else:
            self._drop(peer)
        for link in [p for p in self._peers if p.owner is peer]:
            self._drop(link)
        if rank is None or gone or rank in self._left:
            return
        if not self._complete:
            # A rank that leaves before the table is out can never be part of it.
            self._group_error(f"rank {rank} {what} before every rank had joined", rank)
            return
        self._fail(rank, f"rank {rank} {what}")
        self._left_group(rank)

    def _fail(self, rank: int, message: str, skip: _Peer | None = None) -> None:
        self._broadcast({"op": "failed", "rank": rank, "message": message}, skip=skip)

    def _group_error(self, message: str, rank: int | None) -> None:
        self._error = {"op": "error", "message": message, "rank": rank}
        for p in list(self._peers):
            self._send_error(p, self._error)

    def _reply_error(self, peer: _Peer, message: str) -> None:
        self._send_error(peer, {"op": "error", "message": message, "rank": None})

    def _send_error(self, peer: _Peer, msg: dict[str, Any]) -> None:
        try:
            _offer(peer.sock, msg)
        except OSError:
            pass
        self._drop(peer)

    def _broadcast(self, msg: dict[str, Any], skip: _Peer | None = None) -> None:
        """To every connection of every joined rank but skip's (a record: all its links).
        The table (once, as the group forms) is sent whole; the rest offered (_offer): a
        link that cannot take it goes, a record is no longer written to (closing it would
        say its rank died) and the rank's fresh links carry on."""
        # Encoded once: the table of n ranks goes to n ranks (its encoding per rank took
        # rank 0's rendezvous 38.6 s of CPU for 4096 ranks, tools/rendezvous_load.py).
        data = _encode(msg)
        for p in list(self._peers):
            if p.rank is None or p.jammed or (skip is not None and (p is skip or p.owner is skip)):
                continue
            try:
                if msg["op"] == "table":
                    _send(p.sock, data)
                elif not _offer(p.sock, data):
                    if p.owner is not None:
                        self._drop(p)
                    else:
                        p.jammed = True
            except OSError:
                pass  # its death shows up as EOF on the next read

    def _drop(self, peer: _Peer) -> None:
        if peer in self._peers:
            self._peers.remove(peer)
            self._sel.unregister(peer.sock)
            peer.sock.close()

    # --- life -------------------------------------------------------------------------

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def stop(self) -> None:
        """Tell the ranks still connected that the rendezvous is gone, and stop."""
        self._stopping = True
        self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def _open_socks(self) -> list[socket.socket]:
        return [p.sock for p in list(self._peers)]

    def _shutdown(self) -> None:
        _OPEN.discard(self)
        self._broadcast({"op": "closed", "rank": None})
        _flush(self._open_socks, LAST_WORDS_S)
        for p in list(self._peers):
            self._drop(p)
        self._sel.close()
        self._lsock.close()
        with self._links_lock:
            for ls in self._link_socks:
                ls.close()
        self._wake_r.close()
        self._wake_w.close()


def _dial(
    targets: list[tuple[str, int]], wait: float
) -> list[tuple[socket.socket, tuple[str, int]]]:
    """Connect to every target at once, for at most `wait` seconds in all (a target whose
    path is down costs no more than the others): the connected sockets, blocking again."""
    pending: dict[socket.socket, tuple[str, int]] = {}
    for addr, port in targets:
        sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
        sock.setblocking(False)
        if sock.connect_ex((addr, port)) not in (0, errno.EINPROGRESS):
            sock.close()  # no route now (the cable is down): the next interval tries again
            continue
        pending[sock] = (addr, port)
    done: list[tuple[socket.socket, tuple[str, int]]] = []
    deadline = time.monotonic() + wait
    with selectors.DefaultSelector() as sel:
        for sock in pending:
            sel.register(sock, selectors.EVENT_WRITE)
        while pending and (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(left):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                sel.unregister(sock)
                target = pending.pop(sock)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    sock.setblocking(True)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    done.append((sock, target))
                else:
                    sock.close()
    for sock in pending:
        sock.close()
    return done


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks) if ranks else "none"


_RANK0_EXITED = "rank 0 exited or lost its rendezvous connection without close()"


class _Silent(Exception):
    """A connection that the server end accepted and has said nothing on."""

    def __init__(self, where: str, wait: float) -> None:
        super().__init__(where)
        self.where, self.wait = where, wait

    def error(self, addrs: int = 1) -> CollectiveError:
        """Silence has three causes a rank cannot tell apart, and says all three: rank 0
        stopped (SIGSTOP, a debugger) or too busy to answer (the kernel completes the TCP
        handshake for it), its path dead after the handshake, or a stranger on the port.
        (It said only the stranger, as a fact, when rank 0 was stopped mid-start.)"""
        on = "" if addrs == 1 else f" on each of {addrs} of rank 0's addresses"
        return CollectiveError(
            f"the rendezvous at {self.where} accepted the connection and said nothing for "
            f"{self.wait:g} s{on}: rank 0 is stopped or too busy to answer, no packet got "
            "through to it for that long, or the port is held by a program that is not an "
            "mrc rendezvous (rank 0 found the port taken in its namespace and joined whoever "
            "listens there: free the port, or give the ranks another MRC_PORT)",
            rank=0,
        )


class RendezvousClient:
    """A rank's side: join, then a monitor thread that beats and reports failures."""

    def __init__(self, uid: UniqueId, timeout: float, alternates: Sequence[str] = ()) -> None:
        """alternates: other addresses of the server (rank 0's other planes), tried in turn
        with the id's own when it cannot be reached (a rank whose plane-0 cable is down)."""
        self.uid = uid
        self.timeout = timeout
        self._addrs = [uid.addr, *(a for a in alternates if a != uid.addr)]
        self._joined_addr = uid.addr
        self._lock = threading.Lock()  # sendall from the monitor and the caller
        self._buf = b""
        deadline = time.monotonic() + timeout
        self._sock = self._connect(deadline)
        try:
            self._greeted(min(timeout, GREETING_S))
        except _Silent as e:
            self._sock.close()
            self._greeted_elsewhere(e, deadline)
        except BaseException:
            self._sock.close()
            raise
        self._socks = [self._sock]  # the join's connection, then the links
        self._links: list[tuple[str, int]] = []  # the server's other addresses (the table)
        # Per connection: the server address it goes to, when it was opened, when the
        # server was last heard on it (the monitor's reads); links the keeper retired,
        # for the monitor to close (the one thread that selects on them).
        self._where: dict[socket.socket, tuple[str, int]] = {
            self._sock: (self._joined_addr, uid.port)
        }
        self._born: dict[socket.socket, float] = {self._sock: time.monotonic()}
        self._heard: dict[socket.socket, float] = {}
        self._retired: list[socket.socket] = []
        self._jammed: set[socket.socket] = set()  # the first connection, if it jammed
        self._stop = threading.Event()
        self._rank: int | None = None
        self._size = 1  # the group's, once joined: the heartbeat interval depends on it
        self._closed = False
        self._last_line = time.monotonic()  # the monitor's: when rank 0 last said anything
        self._monitor: threading.Thread | None = None
        _OPEN.add(self)

    def silent_for(self) -> float:
        """Seconds since rank 0's rendezvous last said anything (it beats every interval)."""
        return time.monotonic() - self._last_line

    def _greeted_elsewhere(self, silent: _Silent, deadline: float) -> None:
        """The first connection heard nothing: a stranger holds the port, or that plane's
        path lost everything for that long (a cable pulled after the TCP handshake).
        Asks rank 0's other addresses at once; the first to greet is the join's."""
        others = [(a, self.uid.port) for a in self._addrs if a != self._joined_addr]
        wait = min(GREETING_S, deadline - time.monotonic())
        if not others or wait <= 0:
            raise silent.error()
        t_end = time.monotonic() + wait
        socks = _dial(others, wait)
        silent_ones = 1 + len(socks)  # those not unreachable, unless one of them greets
        try:
            with selectors.DefaultSelector() as sel:
                for sock, _ in socks:
                    sel.register(sock, selectors.EVENT_READ)
                while socks and (left := t_end - time.monotonic()) > 0:
                    ready = sel.select(left)
                    if not ready:
                        continue
                    sock = ready[0][0].fileobj
                    assert isinstance(sock, socket.socket)
                    target = next(t for s, t in socks if s is sock)
                    socks.remove((sock, target))
                    self._sock, self._buf, self._joined_addr = sock, b"", target[0]
                    try:
                        self._greeted(max(0.1, t_end - time.monotonic()))
                        return  # this one is the join's connection
                    except _Silent:
                        sel.unregister(sock)
                        sock.close()
                    except BaseException:
                        sock.close()
                        raise
        finally:
            for sock, _ in socks:
                sock.close()
        raise silent.error(silent_ones)

    def _greeted(self, wait: float) -> None:
        """The server's first line, within `wait` seconds, must be an mrc rendezvous'
        greeting."""
        where = f"{self.uid.addr} port {self.uid.port}"
        stranger = (
            f"the rendezvous address {where} is held by a program that is not an mrc "
            "rendezvous (rank 0 found the port taken in its namespace and joined whoever "
            "listens there): free the port, or give the ranks another MRC_PORT"
        )
        msg: Any
        try:
            msg = self._recv(time.monotonic() + wait)
        except TimeoutError:
            raise _Silent(where, wait) from None
        except ValueError:
            msg = "not JSON"  # refused below as not a greeting
        if msg is None:
            raise CollectiveError(
                f"the rendezvous at {where} closed the connection before greeting it "
                "(not an mrc rendezvous, or it is shutting down)",
                rank=0,
            )
        if not isinstance(msg, dict) or msg.get("op") != "hello":
            raise CollectiveError(f"{stranger}; its first line is not ours", rank=0)
        if msg.get("version") != VERSION:
            raise UsageError(
                f"the rendezvous at {where} speaks protocol version {msg.get('version')}, "
                f"this rank {VERSION} (different mrc versions on the ranks)"
            )

    def _connect(self, deadline: float) -> socket.socket:
        # Rank 0 may start its server after the others start (from_env): retry refusals.
        # With alternates, each attempt is short, so an unreachable one costs a second.
        delay, last = 0.02, "no attempt"
        start = time.monotonic()
        progress = start + PROGRESS_S
        while True:
            for addr in self._addrs:
                try:
                    left = max(0.1, deadline - time.monotonic())
                    if len(self._addrs) > 1:
                        left = min(left, 1.0)
                    sock = socket.create_connection((addr, self.uid.port), timeout=left)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self._joined_addr = addr
                    return sock
                except OSError as e:
                    last = e.strerror or str(e)
            if time.monotonic() + delay > deadline:
                raise CollectiveError(
                    f"could not reach the rendezvous of rank 0 at {' or '.join(self._addrs)} "
                    f"port {self.uid.port} within {self.timeout:g} s ({last}): is rank 0 running?",
                    rank=0,
                )
            now = time.monotonic()
            if now >= progress:
                progress = now + PROGRESS_S
                log.warning(
                    "the rendezvous of rank 0 at %s port %d: not reachable for %.0f s (%s); "
                    "trying for %.0f s more: is rank 0 running?",
                    " or ".join(self._addrs),
                    self.uid.port,
                    now - start,
                    last,
                    deadline - now,
                )
            time.sleep(delay)  # back-off between connection attempts, not a sync
            delay = min(delay * 2, 0.5)

    def _recv(self, deadline: float | None) -> dict[str, Any] | None:
        """The next message; None on EOF; raises socket.timeout past `deadline`."""
        while b"\n" not in self._buf:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self._sock.settimeout(left)
            else:
                self._sock.settimeout(None)
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                raise
            except OSError:
                data = b""
            if not data:
                return None
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        msg: dict[str, Any] = json.loads(line)
        return msg

    def send(self, msg: dict[str, Any]) -> None:
        """On every link: any one of them that gets through is enough. The join is sent
        whole; the rest offered (_offer): a link that cannot take it is retired, the
        first connection no longer written to (closing it would say this rank died)."""
        with self._lock:
            if self._closed:
                return
            for sock in list(self._socks):
                if sock in self._jammed:
                    continue
                try:
                    if msg["op"] == "join":
                        _send(sock, msg)
                    elif not _offer(sock, msg):
                        if sock is self._sock:
                            self._jammed.add(sock)
                        else:
                            self._socks.remove(sock)
                            self._retired.append(sock)
                except OSError:
                    pass  # the monitor sees the server or the link go

    def join(self, rank: int, size: int, info: dict[str, Any]) -> list[dict[str, Any]]:
        self._rank, self._size = rank, size
        msg = {"op": "join", "version": VERSION, "token": self.uid.token, "rank": rank}
        self.send({**msg, "size": size, "timeout": self.timeout, "info": info})
        # The server gives up at its own deadline and says who is missing; ours is later.
        deadline = time.monotonic() + self.timeout + 5
        where = f"{self.uid.addr} port {self.uid.port}"
        while True:
            try:
                reply = self._recv(deadline)
            except TimeoutError:
                raise CollectiveError(
                    f"rank {rank}: no answer from the rendezvous at {where} within "
                    f"{self.timeout:g} s",
                    rank=0,
                ) from None
            if reply is None:
                raise CollectiveError(
                    f"rank {rank}: the rendezvous at {where} closed before every rank joined",
                    rank=0,
                )
            if reply["op"] == "table":
                links = [(str(a), int(p)) for a, p in reply.get("links", [])]
                if self._joined_addr != self.uid.addr:  # joined over an alternate
                    links = [(self.uid.addr, self.uid.port), *links]
                self._links = [(a, p) for a, p in links if a != self._joined_addr]
                self._heard[self._sock] = time.monotonic()
                return list(reply["infos"])
            if reply["op"] == "waiting":
                missing, count = [int(r) for r in reply["missing"]], int(reply["count"])
                more = f" and {count - len(missing)} more" if count > len(missing) else ""
                log.warning(
                    "rank %d: waited %.0f s of %g for rank%s %s of %d to join the rendezvous at %s",
                    rank,
                    float(reply["waited"]),
                    float(reply["timeout"]),
                    "s" if count > 1 else "",
                    _ranks(missing) + more,
                    int(reply["size"]),
                    where,
                )
                continue
            if reply["op"] == "failed":
                raise CollectiveError(
                    f"rank {rank} cannot join: {reply['message']}", rank=reply.get("rank")
                )
            if reply["op"] == "error":
                message = f"rank {rank} cannot join: {reply['message']}"
                if reply.get("rank") is None and "wrong unique id" in reply["message"]:
                    raise UsageError(message)
                raise CollectiveError(message, rank=reply.get("rank"))

    def start_monitor(
        self,
        on_failed: Callable[[int | None, str], None],
        on_closed: Callable[[int | None, list[int] | None], None],
        on_released: Callable[[], None],
    ) -> None:
        """Beat every interval; call on_failed(rank, message) once when a rank (or the
        rendezvous itself) fails, on_closed(rank, runs) when a rank closes normally (None:
        the rendezvous closed; runs: what its bye said, or None), on_released() once every
        rank is in close()."""

        def run() -> None:
            interval = heartbeat_interval(self.timeout, self._size)
            last_heard = time.monotonic()
            next_beat = 0.0
            rank0_closing = False  # rank 0 said bye: its server goes with it, not a failure
            rechecked = False  # silence is judged after one more look at the sockets
            sel = selectors.DefaultSelector()
            bufs: dict[socket.socket, bytes] = {}
            try:
                while not self._closed:
                    with self._lock:  # links the keeper added or retired since
                        if self._closed:
                            return
                        retired, self._retired = self._retired, []
                        for sock in retired:
                            if sock in bufs:
                                sel.unregister(sock)
                                del bufs[sock]
                            self._forget(sock)
                            sock.close()
                        for sock in self._socks:
                            if sock not in bufs:
                                sock.settimeout(None)
                                bufs[sock] = self._buf if sock is self._sock else b""
                                sel.register(sock, selectors.EVENT_READ)
                    now = time.monotonic()
                    if now >= next_beat:
                        self.send({"op": "hb"})
                        next_beat = now + interval
                    wait = max(0.0, min(next_beat, last_heard + self.timeout) - now)
                    if not any(b"\n" in b for b in bufs.values()):
                        for key, _ in sel.select(wait):
                            sock = key.fileobj
                            assert isinstance(sock, socket.socket)
                            try:
                                data = sock.recv(65536)
                            except OSError as e:
                                if not _closed_by_peer(e):  # this link's path broke
                                    sel.unregister(sock)
                                    del bufs[sock]
                                    self._drop_link(sock)
                                    continue
                                data = b""
                            if not data and sock is not self._sock:  # a link: only it
                                sel.unregister(sock)
                                del bufs[sock]
                                self._drop_link(sock)
                                continue
                            if not data:  # rank 0's process closed it
                                if self._closed:
                                    return
                                if rank0_closing:
                                    on_closed(None, None)
                                    return
                                on_failed(0, _RANK0_EXITED)
                                return
                            self._heard[sock] = time.monotonic()
                            bufs[sock] += data
                    for sock, buf in list(bufs.items()):
                        while b"\n" in buf:
                            line, buf = buf.split(b"\n", 1)
                            bufs[sock] = buf
                            try:
                                msg = json.loads(line)
                            except ValueError:
                                on_failed(0, "rank 0's rendezvous sent a line that is not JSON")
                                return
                            last_heard = self._last_line = time.monotonic()
                            rechecked = False
                            if self._closed:
                                return
                            if not isinstance(msg, dict):
                                on_failed(0, "rank 0's rendezvous sent a non-message line")
                                return
                            op = msg.get("op")
                            if op == "failed":
                                on_failed(msg.get("rank"), str(msg.get("message")))
                                return
                            if op == "released":
                                on_released()
                                return
                            if op == "closed":
                                rank0_closing = rank0_closing or msg.get("rank") == 0
                                runs = msg.get("runs")
                                on_closed(msg.get("rank"), runs if isinstance(runs, list) else None)
                                if msg.get("rank") is None:
                                    return  # rank 0 closed its communicator: nothing to watch
                    silent = time.monotonic() - last_heard
                    if silent > self.timeout and not rank0_closing and not rechecked:
                        # Once more with a poll first: a process stopped (SIGSTOP) and
                        # resumed past the deadline returns from select() without
                        # having read what rank 0 sent meanwhile.
                        rechecked = True
                        continue
                    if silent > self.timeout and not rank0_closing and not self._closed:
                        on_failed(
                            0,
                            f"rank 0 (the rendezvous) sent nothing for {self.timeout:g} s "
                            "(stopped or cut off)",
                        )
                        return
            except Exception as e:
                if self._closed:  # close() shut the sockets under select(): expected
                    return
                # Anything else is a bug (here or in a callback): the communicator fails
                # with its cause now, instead of hearing nothing until a timeout.
                traceback.print_exc()
                on_failed(
                    None,
                    f"rank {self._rank}'s rendezvous monitor failed "
                    f"({type(e).__name__}: {e}); the communicator cannot go on",
                )
            finally:
                self._stop.set()  # nothing hears the links now: keeping them is moot
                sel.close()

        self._monitor = threading.Thread(target=run, name="mrc-comm-monitor", daemon=True)
        self._monitor.start()
        threading.Thread(target=self._keep_links, name="mrc-comm-links", daemon=True).start()

    def _keep_links(self) -> None:
        """Every interval: a link to each of the server's addresses (the join's and the
        table's) on which no connection was heard for STALE_BEATS intervals: at the
        start, one to each other plane, then a fresh one where a plane broke or came back
        (module doc, "A link is kept"). The silent links go; the first connection stays."""
        interval = heartbeat_interval(self.timeout, self._size)
        stale = STALE_BEATS * interval
        targets = [(self._joined_addr, self.uid.port), *self._links]
        while not self._stop.is_set():
            now = time.monotonic()
            dial = []
            with self._lock:
                if self._closed:
                    return
                for target in targets:
                    mine = [s for s in self._socks if self._where.get(s) == target]
                    if any(
                        now - self._heard.get(s, self._born[s]) < stale
                        for s in mine
                        if s not in self._jammed
                    ):
                        continue  # heard lately, or too new to tell
                    for sock in mine:
                        if sock is not self._sock:
                            self._socks.remove(sock)
                            self._retired.append(sock)
                    dial.append(target)
            # Half a second at least for a connect: a short timeout on a busy host would
            # give up on connections that were only slow.
            for sock, target in _dial(dial, max(interval, 0.5)):
                try:
                    _offer(sock, {"op": "attach", "token": self.uid.token, "rank": self._rank})
                except OSError:
                    sock.close()
                    continue
                with self._lock:
                    if self._closed:
                        sock.close()
                        return
                    self._where[sock], self._born[sock] = target, time.monotonic()
                    self._socks.append(sock)
            self._stop.wait(interval)

    def _drop_link(self, sock: socket.socket) -> None:
        """A link whose read failed (the monitor's): only it goes."""
        with self._lock:
            if sock in self._socks:
                self._socks.remove(sock)
            self._forget(sock)
        sock.close()

    def _forget(self, sock: socket.socket) -> None:
        self._where.pop(sock, None)
        self._born.pop(sock, None)
        self._heard.pop(sock, None)

    def _open_socks(self) -> list[socket.socket]:
        with self._lock:
            return [] if self._closed else list(self._socks)

    def close(self, message: dict[str, Any] | None = None) -> None:
        _OPEN.discard(self)
        if message is not None:
            self.send(message)
            _flush(self._open_socks, LAST_WORDS_S)
        self._stop.set()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            socks = [*self._socks, *self._retired]
            self._retired = []
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        if self._monitor is not None and threading.current_thread() is not self._monitor:
            self._monitor.join(timeout=5)
