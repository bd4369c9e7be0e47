# cython: language_level=3, embedsignature=True
"""Thin binding of the C datapath (src_c). Every blocking call releases the GIL;
nothing here runs per packet."""

from cpython.buffer cimport PyBUF_WRITABLE, PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.exc cimport PyErr_CheckSignals
cimport cython
from libc.errno cimport ETIMEDOUT
from libc.stdint cimport uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset, strncpy

cimport mrc._mrc as c

import errno
import ipaddress
import operator
import os
import socket
import errno as _errno
import struct
import time
import threading
import weakref

from mrc import errors

TAG_ANY = c.MRC_TAG_ANY

_ERRORS = {
    c.MRC_EKEY: errors.KeyRejectedError,
    c.MRC_EBOUNDS: errors.KeyRejectedError,
    c.MRC_ETIMEOUT: errors.TimeoutError,
    c.MRC_EPATHDOWN: errors.PathDownError,
    c.MRC_ECLOSED: errors.ConnectionClosedError,
    c.MRC_EREMOTE: errors.ConnectionClosedError,
    c.MRC_EPROTO: errors.ProtocolError,
    c.MRC_ETRUNC: errors.TruncatedError,
    c.MRC_EUNREACH: errors.UnreachableError,
    c.MRC_EUSAGE: errors.UsageError,
    c.MRC_ENOTMRC: errors.ProtocolError,
    c.MRC_EBUSY: errors.BusyError,
    c.MRC_ERNR: errors.ReceiverNotReadyError,
}

# Slices of a blocking wait, so that close() from another thread is noticed.
cdef int _SLICE_MS = 100

_OP_KINDS = {c.MRC_OP_WRITE: "write", c.MRC_OP_SEND: "send", c.MRC_OP_RECV: "recv"}


def strerror(int rc) -> str:
    return c.mrc_strerror(rc).decode()


def error_for(int rc, str what) -> errors.MrcError:
    """The Python exception for a C return code, with what failed in its message."""
    if rc == c.MRC_ENOBUFS:
        exc = errors.system_error(_errno.ENOBUFS, f"{what}: {c.mrc_strerror(rc).decode()}")
    elif -4096 < rc < 0:  # -errno
        exc = errors.system_error(-rc, what)
    else:
        cls = _ERRORS.get(rc, errors.MrcError)
        exc = cls(f"{what}: {c.mrc_strerror(rc).decode()}")
    exc.code = rc
    return exc


# fork(): the child has the parent's memory but none of its threads, so an endpoint
# made before the fork has no progress thread there, and a lock held at the fork
# stays held. Every object of such an endpoint refuses its calls in the child, and
# closing or dropping it there lets go of it without touching the C side (the
# parent's copy goes on unaffected).
cdef unsigned long _fork_gen = 0


def _forked_child() -> None:
    global _fork_gen
    _fork_gen += 1


os.register_at_fork(after_in_child=_forked_child)


cdef inline bint _foreign(Endpoint ep):
    """ep was made in this process's parent, before a fork()."""
    return ep is not None and ep._gen != _fork_gen


cdef _fork_error(Endpoint ep):
    return errors.UsageError(
        f"this endpoint belongs to process {ep._pid}, which forked this one: a child "
        "cannot use its parent's endpoint; create one in the child")


cdef _wait_idle(obj, str what):
    """Blocks (GIL released in between) until obj._busy_count() is 0: calls of
    other threads that released the GIL with obj's C pointer have returned."""
    while obj._busy_count():
        time.sleep(0.001)


cdef inline int check(int rc, what) except -1:
    if rc != 0:
        raise error_for(rc, what() if callable(what) else what)
    return 0


cdef int _ms(timeout) except? -2:
    """Seconds (None: forever) to the C API's milliseconds."""
    if timeout is None:
        return -1
    try:
        t = float(timeout)
    except (TypeError, ValueError):
        raise errors.UsageError(f"timeout must be seconds or None, got {timeout!r}") from None
    if not t >= 0:  # also nan
        raise errors.UsageError(f"timeout must be >= 0 seconds, got {timeout}")
    return <int>min(t * 1000.0, 2**31 - 1)


cdef _copy_str(char *dst, str s, int size, what):
    b = s.encode()
    if len(b) >= size:
        raise errors.UsageError(f"{what} too long: {s!r}")
    strncpy(dst, b, size)


def _bad_loss_env(int nplanes) -> bool:
    """Whether MRC_LOSS is set and wrong for `nplanes` planes: then it, not the planes,
    failed mrc_ep_create (the same rules as ep.c's parser)."""
    v = os.environ.get("MRC_LOSS", "")
    if not v:
        return False
    for tok in v.split(","):
        plane, sep, pct = tok.partition(":")
        try:
            x = float(pct[:-1] if pct.endswith("%") else pct)
            if not sep or not 0 <= x <= 100:
                return True
            if plane != "all" and not 0 <= int(plane) < nplanes:
                return True
        except ValueError:
            return True
    return False


def _u64(value, str what, str name):
    """An unsigned 64-bit argument, or mrc's UsageError naming it (not Cython's bare
    OverflowError or TypeError)."""
    try:
        v = operator.index(value)  # ints and numpy integers
    except TypeError:
        v = -1
    if not 0 <= v < 2**64:
        raise errors.UsageError(f"{what}: {name} must be an integer 0..2^64-1, got {value!r}")
    return v


def hostport(addr: str, port: int) -> str:
    """addr:port, with IPv6 addresses in brackets ([::1]:80)."""
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def _ip_literal(addr: str, what: str) -> None:
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        raise errors.UsageError(f"{what}: {addr!r} is not an IPv4 or IPv6 address") from None


def _resolve(names: list) -> list:
    """IP literals as they are; host names through the resolver (every address,
    so they race like planes)."""
    if not names:
        raise errors.UsageError("connect: no address given")
    out = []
    for name in names:
        if not isinstance(name, str) or not name:
            raise errors.UsageError(f"connect: addresses are strings, got {name!r}")
        try:
            ipaddress.ip_address(name)
            found = [name]
        except ValueError:
            try:
                infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
            except socket.gaierror as e:
                raise errors.UnreachableError(
                    f"Failed to connect to {name}: cannot resolve host name {name!r}: "
                    f"{e.strerror}") from None
            found = [i[4][0] for i in infos]
        out += [a for a in found if a not in out]
    if len(out) > c.MRC_MAX_PLANES:
        raise errors.UsageError(
            f"connect: at most {c.MRC_MAX_PLANES} addresses, got {len(out)}: {', '.join(out)}")
    return out


def _connect_error(int rc, given, list addrs, int port, timeout, list errs):
    where = given if isinstance(given, str) else ", ".join(addrs)
    if isinstance(given, str) and addrs != [given]:
        where = f"{given} ({', '.join(addrs)})"
    what = f"Failed to connect to {where} port {port}"
    if rc == c.MRC_EUNREACH:
        tried = "; ".join(f"{hostport(a, port)}: {os.strerror(-e) if e < 0 else 'no answer'}"
                          for a, e in zip(addrs, errs))
        exc = errors.UnreachableError(f"{what}: peer unreachable (tried {tried})")
    elif rc == c.MRC_ENOTMRC:
        exc = errors.ProtocolError(
            f"{what}: not an mrc endpoint (the port answered in another protocol)")
    elif rc == c.MRC_ETIMEOUT:
        exc = errors.TimeoutError(
            f"{what}: the port accepted a TCP connection but sent no mrc hello within "
            f"{timeout} s (is it an mrc endpoint?)")
    elif rc == c.MRC_EPROTO:
        exc = errors.ProtocolError(
            f"{what}: the peer sent an invalid hello (another mrc version?)")
    elif rc == c.MRC_ECLOSED:
        exc = errors.UnreachableError(
            f"{what}: the peer hung up during set-up every time until the timeout "
            "(another mrc version, or its connection table is full?)")
    else:
        return error_for(rc, what)
    exc.code = rc
    return exc


class RemoteRegion:
    """What a peer needs to WRITE into a region: its key and size. Send it to the
    peer (``pack()`` gives 16 bytes) through any channel, e.g. a SEND."""

    __slots__ = ("key", "size")
    _FMT = struct.Struct("<QQ")

    def __init__(self, key: int, size: int) -> None:
        self.key = _u64(key, "RemoteRegion", "key")
        self.size = _u64(size, "RemoteRegion", "size")

    def pack(self) -> bytes:
        return self._FMT.pack(self.key, self.size)

    @classmethod
    def unpack(cls, data) -> "RemoteRegion":
        if len(data) != cls._FMT.size:
            raise errors.UsageError(
                f"a packed RemoteRegion is {cls._FMT.size} bytes, got {len(data)}")
        return cls(*cls._FMT.unpack(bytes(data)))

    def __repr__(self) -> str:
        return f"RemoteRegion(key={self.key:#x}, size={self.size})"

    def __eq__(self, other) -> bool:
        return isinstance(other, RemoteRegion) and (self.key, self.size) == (other.key, other.size)

    def __hash__(self) -> int:
        return hash((self.key, self.size))


cdef class Endpoint:
    """One per process: the local NIC planes, their sockets and the progress thread."""

    cdef c.mrc_ep *ep
    cdef object _children  # WeakSet of Connection, MemoryRegion, CompletionQueue
    cdef list _orphans     # regions of CQs collected with ops pending (CompletionQueue)
    cdef list _dropped     # Operations dropped while pending: _Orphan (op + its region)
    cdef list _late_regions  # registered while close() ran: views released after it
    cdef int _busy         # calls running without the GIL on self.ep
    cdef unsigned long _gen  # _fork_gen when made: another is a forked child's
    cdef bint _closing  # close() has begun
    cdef long _pid
    cdef Py_ssize_t _reap_at  # reap _dropped when this many: amortised O(1) per post
    cdef readonly tuple planes
    cdef readonly int mss
    cdef readonly double timeout

    def __cinit__(self):
        self.ep = NULL
        self._children = weakref.WeakSet()
        self._orphans = []
        self._dropped = []
        self._late_regions = []
        self._busy = 0
        self._reap_at = 64

    def __init__(self, planes=("127.0.0.1",), *, port=0, mss=8192,
                 timeout=5.0, window=4096, sockbuf=8 << 20,
                 max_unexpected=64 << 20, rnr_timeout=5.0):
        cdef c.mrc_ep_config cfg
        port = _u64(port, "Endpoint", "port")
        mss = _u64(mss, "Endpoint", "mss")
        window = _u64(window, "Endpoint", "window")
        sockbuf = _u64(sockbuf, "Endpoint", "sockbuf")
        max_unexpected = _u64(max_unexpected, "Endpoint", "max_unexpected")
        if not 0 <= sockbuf < 2**31:
            raise errors.UsageError(f"sockbuf must be 0 (8 MiB)..2^31-1 bytes, got {sockbuf}")
        try:
            timeout = float(timeout)
            rnr_timeout = None if rnr_timeout is None else float(rnr_timeout)
        except (TypeError, ValueError):
            raise errors.UsageError(
                f"timeout and rnr_timeout must be seconds, got {timeout!r}, {rnr_timeout!r}"
            ) from None
        planes = [planes] if isinstance(planes, str) else list(planes)
        if not 1 <= len(planes) <= c.MRC_MAX_PLANES:
            raise errors.UsageError(
                f"an endpoint needs 1 to {c.MRC_MAX_PLANES} planes, got {len(planes)}")
        seen = set()
        for a in planes:  # two planes on one address are one NIC counted twice
            if str(a) in seen:
                raise errors.UsageError(f"plane address {a} is given twice: one per plane")
            seen.add(str(a))
        if not 64 <= mss <= 65000:
            raise errors.UsageError(f"mss must be 64..65000 bytes, got {mss}")
        if window < 64 or window & (window - 1) or window > (1 << 20):
            raise errors.UsageError(f"window must be a power of two in 64..2^20, got {window}")
        if not 0 < timeout < 2**31 / 1000:
            raise errors.UsageError(f"timeout must be > 0 seconds, got {timeout}")
        if not 0 <= port < 65536:
            raise errors.UsageError(f"port must be 0..65535, got {port}")
        if rnr_timeout is not None and not 0 < rnr_timeout < 2**31 / 1000:
            raise errors.UsageError(
                f"rnr_timeout must be > 0 seconds (None: retry for ever), got {rnr_timeout}")
        c.mrc_ep_config_init(&cfg)
        cfg.nplanes = len(planes)
        for i, a in enumerate(planes):
            _copy_str(cfg.planes[i], str(a), c.MRC_ADDR_STRLEN, "plane address")
        cfg.udp_port = port
        cfg.mss = mss
        cfg.timeout_ms = <uint32_t>(timeout * 1000)
        cfg.window = window
        cfg.sockbuf = sockbuf
        cfg.max_unexpected = max_unexpected
        cfg.rnr_timeout_ms = -1 if rnr_timeout is None else max(1, <int>(rnr_timeout * 1000))
        cdef int rc
        with nogil:
            rc = c.mrc_ep_create(&cfg, &self.ep)
        if rc == c.MRC_EUSAGE and _bad_loss_env(len(planes)):
            raise errors.UsageError(
                f"MRC_LOSS={os.environ['MRC_LOSS']!r} is invalid: expected PLANE:PERCENT or "
                f"all:PERCENT, comma-separated, with PLANE 0..{len(planes) - 1} and PERCENT "
                "0..100 (e.g. MRC_LOSS=1:5 drops 5% on plane 1)")
        check(rc, lambda: f"Failed to create an endpoint on planes {', '.join(map(str, planes))}")
        self._gen = _fork_gen
        self._pid = os.getpid()
        self.mss = mss
        self.timeout = timeout
        cdef char buf[64]
        cdef uint16_t p
        out = []
        for i in range(len(planes)):
            c.mrc_ep_plane(self.ep, i, buf, sizeof(buf), &p)
            out.append((buf.decode(), p))
        self.planes = tuple(out)

    cdef c.mrc_ep *_ptr(self) except NULL:
        if self.ep == NULL:
            raise errors.ConnectionClosedError("endpoint is closed")
        if self._gen != _fork_gen:
            raise _fork_error(self)
        return self.ep

    cdef c.mrc_ep *_enter(self) except NULL:
        """_ptr() for a call that releases the GIL: close() waits for _leave()."""
        cdef c.mrc_ep *ep = self._ptr()
        self._busy += 1
        return ep

    cdef void _leave(self):
        self._busy -= 1

    def _busy_count(self) -> int:
        return self._busy

    def _reap(self) -> None:
        """Forget dropped operations that have completed (their regions may go)."""
        if len(self._dropped) >= self._reap_at:
            self._dropped = [o for o in self._dropped if not o.done]
            self._reap_at = max(64, 2 * len(self._dropped))

    def listen(self, port: int = 0, addr: str | None = None) -> int:
        """Accept connections on TCP `port` (0: an ephemeral one) of `addr`, by
        default of every plane's address (one port for all), so a client gets
        through while any plane is up. Returns the port."""
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise errors.UsageError(f"listen: port must be 0..65535 (0: any), got {port!r}")
        if addr:
            _ip_literal(addr, "listen")
        cdef uint16_t bound = 0
        cdef int rc
        cdef uint16_t p = port
        b = addr.encode() if addr else b""
        cdef const char *a = b  # empty: every plane
        cdef c.mrc_ep *ep = self._enter()
        try:
            with nogil:
                rc = c.mrc_ep_listen(ep, a, p, &bound)
        finally:
            self._leave()
        where = addr or ", ".join(sorted({pa for pa, _ in self.planes}))
        check(rc, lambda: f"Failed to listen on {where} port {port}")
        return bound

    def connect(self, addr, port: int, *, timeout=5.0, paths=None, str name="") -> Connection:
        """Connect to an endpoint listening on `port` of `addr`: an IP address, a
        host name (resolved here), or a list of them (the server's planes: TCP
        connects to all of them race and the first to answer carries the set-up).
        `paths` (optional) is a list of objects with id, plane, dst_addr and
        segments (mrc.routing.Path)."""
        if not isinstance(port, int) or not 1 <= port <= 65535:
            raise errors.UsageError(f"connect: port must be 1..65535, got {port!r}")
        addrs = _resolve([addr] if isinstance(addr, str) else list(addr))
        cdef c.mrc_ep *ep = self._ptr()
        cdef c.mrc_conn *cp = NULL
        cdef int ms = _ms(timeout)
        check(c.mrc_conn_create(ep, name.encode(), &cp), "Failed to create a connection")
        cdef Connection conn = Connection._wrap(self, cp)
        if paths:
            try:
                conn._add_paths(paths)
            except BaseException:
                conn.close()
                raise
        cdef int rc
        cdef int n = len(addrs)
        cdef uint16_t p = port
        cdef const char *av[16]
        cdef int errs[16]
        enc = [a.encode() for a in addrs]
        for i in range(n):
            av[i] = enc[i]
            errs[i] = 0
        cp = conn._enter()
        try:
            with nogil:
                rc = c.mrc_conn_connect_any(cp, av, n, p, ms, errs)
        finally:
            conn._leave()
        if rc:
            conn.close()
            if rc == c.MRC_ECLOSED and self._closing:
                raise errors.ConnectionClosedError(
                    f"connect to {addr} port {port}: the endpoint was closed meanwhile")
            raise _connect_error(rc, addr, addrs, port, timeout,
                                 [errs[i] for i in range(n)])
        return conn

    def accept(self, *, timeout=None, paths=None, str name="") -> Connection:
        """Wait up to `timeout` seconds (None: forever) for one connection.
        `paths` may be a list (as for connect) or a callable taking the peer's
        name and returning that list. `name`: this end's name, which the peer
        sees as its peer_name (as connect()'s name= is seen here). A client that
        hangs up or stalls during its set-up is dropped and the wait goes on."""
        name_b = name.encode()
        cdef const char *name_c = name_b
        cdef c.mrc_conn *cp = NULL
        cdef int rc
        cdef int ms
        # The rest of the set-up (our hello, the client's ready) gets the
        # endpoint's timeout, not what is left of the wait for a client.
        cdef int hs_ms = _ms(self.timeout)
        cdef Connection conn = None
        cdef c.mrc_ep *ep
        deadline = None if timeout is None else time.monotonic() + _ms(timeout) / 1000.0
        dropped = []
        while True:
            ms = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            ms = _SLICE_MS if ms < 0 or ms > _SLICE_MS else ms  # Ctrl-C between slices
            # close() from another thread stops the listener (mrc_ep_unlisten: the
            # accept returns ECLOSED) and waits for this call to leave.
            conn = None
            ep = self._enter()
            try:
                with nogil:
                    rc = c.mrc_ep_accept(ep, ms, &cp)
                if self.ep == NULL:  # closed meanwhile: mrc_ep_destroy frees cp
                    raise errors.ConnectionClosedError("endpoint closed while accepting")
                if rc == 0:  # a child before we leave: a racing close() then sees it
                    conn = Connection._wrap(self, cp)
            finally:
                self._leave()
            if rc == c.MRC_ETIMEOUT and (deadline is None or time.monotonic() < deadline):
                PyErr_CheckSignals()
                continue  # a slice
            if rc == c.MRC_ETIMEOUT:
                # Not dropped[-1]: this module is compiled with wraparound=False, where
                # a negative index reads outside the list.
                why = (f" ({len(dropped)} dropped during set-up, last: "
                       f"{dropped[len(dropped) - 1]})") if dropped else ""
                raise errors.WaitTimeout(f"no peer connected within {timeout} s{why}")
            if rc == c.MRC_EUSAGE:
                raise errors.UsageError("accept() before listen(): call listen() first")
            check(rc, "Failed to accept a connection")
            try:
                # Per client: after a dropped one, the next is another peer.
                mine = paths(conn.peer_name) if callable(paths) else paths
                if mine:
                    conn._add_paths(mine)
                if name:
                    check(c.mrc_conn_set_name(conn._ptr(), name_c), "accept(name=)")
            except BaseException:
                conn.close()
                raise
            cp = conn._enter()
            try:
                with nogil:
                    rc = c.mrc_conn_establish(cp, hs_ms)
            finally:
                conn._leave()
            if rc == 0:
                return conn
            peer = conn.peer_name or "a client"
            if rc in (c.MRC_ECLOSED, c.MRC_ETIMEOUT, -errno.EPIPE, -errno.ECONNRESET):
                # The client went away or stalled after its hello: its problem, not
                # this server's; wait for the next one.
                dropped.append(f"{peer}: {strerror(rc)}")
                conn.close()
                continue
            what = f"Failed to establish a connection with {peer}"
            if rc == c.MRC_EUSAGE:
                what += (f" (its planes {', '.join(conn.peer_planes)} and ours "
                         f"{', '.join(a for a, _ in self.planes)} do not pair up: "
                         "address families, or paths naming other addresses)")
            conn.close()
            raise error_for(rc, what)

    def register(self, obj, *, bint remote_write=True) -> MemoryRegion:
        """Register a buffer (bytearray, numpy array, memoryview, bytes...). With
        remote_write=True (the default) peers may WRITE into it, so it must be
        writable; with remote_write=False a read-only buffer is accepted too (it can
        then only be a SEND or WRITE source). The region keeps a reference to `obj`
        until closed."""
        return MemoryRegion._make(self, obj, remote_write, 0, 0)

    def register_address(self, address, length, owner, *,
                         bint remote_write=False, bint readonly=False) -> MemoryRegion:
        """Register `length` bytes of raw memory at `address` (a torch tensor's
        data_ptr(), a DLPack capsule's data, pinned host memory...). `owner` is kept
        referenced until the region is closed: it must keep the memory alive and
        in place. readonly=True: the memory is only read (a SEND or WRITE
        source; RECVs into it are refused)."""
        address = _u64(address, "register_address", "address")
        length = _u64(length, "register_address", "length")
        if address == 0 and length:
            raise errors.UsageError(f"register_address: address 0 with length {length}")
        if address + length > 2**64:  # uintptr_t is 64 bits wherever mrc builds
            raise errors.UsageError(
                f"register_address: {length} bytes at {address:#x} run past the end of "
                "the address space")
        if remote_write and readonly:
            raise errors.UsageError("register_address: a readonly region cannot allow "
                                    "remote_write")
        if owner is None:
            raise errors.UsageError("register_address: an owner that keeps the memory "
                                    "alive is required")
        return MemoryRegion._make(self, owner, remote_write, address, length,
                                  raw=True, readonly=readonly)

    def create_cq(self) -> CompletionQueue:
        """A completion queue on this endpoint (same as CompletionQueue(self))."""
        return CompletionQueue(self)

    def inject(self, int plane, double loss=0.0, bint down=False) -> None:
        """Fault injection on a local plane: drop each sent packet with probability
        `loss` (0..1: 0.05 is 5%; the command lines and MRC_LOSS take percent); `down`
        drops everything sent and received, like a pulled cable."""
        if not 0 <= plane < len(self.planes):
            raise errors.UsageError(f"plane {plane} does not exist (0..{len(self.planes) - 1})")
        if not 0.0 <= loss <= 1.0:
            raise errors.UsageError(f"loss must be a probability in [0, 1], got {loss}")
        check(c.mrc_ep_inject(self._ptr(), plane, loss, down), "Failed to inject a fault")

    def progress_cpu_ns(self) -> int:
        """CPU time the endpoint's progress thread has used, in nanoseconds (0: the
        kernel cannot say). Cheap (one clock read), for asking whether the datapath set
        an operation's pace."""
        return c.mrc_ep_progress_cpu_ns(self._ptr())  # the GIL held: close() waits

    def srh_offload(self) -> bool:
        """True when this endpoint's SRv6 route sockets get their header from kernel
        seg6 routes, so UDP GSO batches cross the fabric whole; False when they would
        carry it as the socket's sticky header (each batch cut into datagrams at the
        sender: MRC_SRH=socket, planes on lo, no CAP_NET_ADMIN, or a kernel without
        SRv6 lightweight tunnels). Asks the kernel (one route added and removed)."""
        return c.mrc_ep_srh_offload(self._ptr()) == 1

    def stats(self) -> dict:
        """Counters: totals, drops by reason, and one entry per path of every connection."""
        cdef c.mrc_ep_stats st
        cdef int cap = 1024
        cdef c.mrc_path_stats *ps = <c.mrc_path_stats *>malloc(cap * sizeof(c.mrc_path_stats))
        cdef int rc
        cdef c.mrc_ep *ep = self._enter()
        if ps == NULL:
            self._leave()
            raise MemoryError()
        try:
            try:
                with nogil:
                    rc = c.mrc_ep_get_stats(ep, &st, ps, cap)
            finally:
                self._leave()
            check(rc, "Failed to read endpoint stats")
            paths = []
            for i in range(st.npaths):
                p = &ps[i]
                paths.append({
                    "conn": p.conn_index, "conn_id": p.conn_id, "path": p.id,
                    "peer": p.peer.decode(errors="replace"),
                    "plane": p.plane, "state": c.mrc_path_state_str(p.state).decode(),
                    "dst": p.dst.decode(), "segments": p.nsegs,
                    "tx_pkts": p.tx_pkts, "tx_bytes": p.tx_bytes,
                    "rx_pkts": p.rx_pkts, "rx_bytes": p.rx_bytes,
                    "retx": p.retx, "lost": p.lost, "injected": p.injected,
                    "probes": p.probes, "srtt_us": p.srtt_ns / 1000.0,
                    "base_rtt_us": p.base_rtt_ns / 1000.0, "cwnd": p.cwnd_bytes,
                    "inflight": p.inflight_bytes, "state_changes": p.state_changes,
                    # None while the connection is up; else what ended it (its paths'
                    # states are then the last ones seen, no longer probed).
                    "conn_error": (None if p.conn_error == 0
                                   else c.mrc_strerror(p.conn_error).decode()),
                })
            return {
                "tx_pkts": st.tx_pkts, "rx_pkts": st.rx_pkts, "tx_bytes": st.tx_bytes,
                "rx_bytes": st.rx_bytes, "acked_bytes": st.acked_bytes,
                "rnr_naks": st.rnr_naks, "rnr_ready": st.rnr_ready,
                "staged_bytes": st.staged_bytes,
                "staged_msgs": st.staged_msgs, "retx": st.retx, "acks_tx": st.acks_tx,
                "acks_rx": st.acks_rx, "lost_rack": st.lost_rack, "lost_rto": st.lost_rto,
                "spurious_rto": st.spurious_rto,
                "lost_flush": st.lost_flush, "probe_timeouts": st.probe_timeouts,
                "link_events": st.link_events,
                "seg6route_failures": st.seg6route_failures,
                "loop_iters": st.loop_iters, "rx_reads": st.rx_reads,
                "rx_gro_reads": st.rx_gro_reads, "tx_sends": st.tx_sends,
                "acks_carried": st.acks_carried, "busy_polls": st.busy_polls,
                "acks_no_room": st.acks_no_room, "caller_passes": st.caller_passes,
                "conn_bytes": st.conn_bytes,
                "conns": st.nconns, "regions": st.nmrs, "sockets": st.nsocks,
                "sockets_seg6route": st.nsocks_seg6route,
                "drops": {c.mrc_drop_str(i).decode(): st.drops[i]
                          for i in range(1, c.MRC_DROP_MAX)},
                "paths": paths,
            }
        finally:
            free(ps)

    def serve_stats(self, str path):
        """Expose this endpoint's stats on a Unix socket at `path` (for
        `mrc-route live`). Returns the server; it stops when closed or when the
        endpoint closes."""
        from mrc.telemetry import StatsServer
        self._ptr()  # a closed endpoint serves nothing
        srv = StatsServer(self, path)
        self._children.add(srv)
        return srv

    def _rx_inject(self, int plane, const unsigned char[::1] pkt, str src_addr,
                   int src_port) -> None:
        """Testing hook: run one datagram through the receive path, as if it came
        from src_addr:src_port on `plane`; returns once it has been handled."""
        b = src_addr.encode()
        cdef const char *a = b
        cdef int rc
        cdef size_t n = pkt.shape[0]
        cdef const unsigned char *p = &pkt[0] if n else NULL
        cdef c.mrc_ep *ep = self._enter()
        try:
            with nogil:
                rc = c.mrc_ep_rx_inject(ep, plane, p, n, a, <uint16_t>src_port)
        finally:
            self._leave()
        check(rc, "rx_inject")

    def close(self) -> None:
        """Close every connection (their pending operations fail with
        ConnectionClosedError), then every region, then stop the progress thread.
        Completion queues are shut down first (a thread in cq.wait() gets
        ConnectionClosedError) and freed with the endpoint. Calls of other threads
        inside the endpoint end first (a blocked accept() is woken and raises
        ConnectionClosedError)."""
        if self.ep == NULL:
            return
        if _foreign(self):  # a forked child: let go, the parent's copy is not ours
            self.ep = NULL
            return
        # First: a connect() or accept() under way ends (ConnectionClosedError) within
        # a slice, so the connection close() waits for below is let go of.
        self._closing = True
        c.mrc_ep_unlisten(self.ep)
        children = list(self._children)
        cqs = [x for x in children if isinstance(x, CompletionQueue)]
        for q in cqs:
            (<CompletionQueue>q)._shutdown()
        # A waiter may have released the GIL and not yet entered C: it returns at
        # once now, but the CQ must not be freed before it has.
        while any((<CompletionQueue>q)._busy for q in cqs):
            time.sleep(0.001)
        regions = []
        for child in children:
            if isinstance(child, MemoryRegion):
                regions.append(child)
            elif not isinstance(child, CompletionQueue):
                child.close()
        for mr in regions:
            (<MemoryRegion>mr)._abandon()  # freed by mrc_ep_destroy, after every op
        cdef c.mrc_ep *ep = self.ep
        self.ep = NULL  # no new call from here on
        _wait_idle(self, "endpoint")
        for child in list(self._children):  # made by calls that were inside
            if isinstance(child, Connection):
                (<Connection>child).conn = NULL  # mrc_ep_destroy frees it
            elif isinstance(child, MemoryRegion) and (<MemoryRegion>child).mr != NULL:
                (<MemoryRegion>child)._abandon()
                regions.append(child)
            elif isinstance(child, CompletionQueue) and child not in cqs:
                (<CompletionQueue>child)._shutdown()  # made while the GIL was let go above
                cqs.append(child)
        # Waiters that entered a queue after the first wait above (while connections
        # closed) return at once from a shut-down queue: none may be inside when it is
        # freed. New ones are refused from here on (the endpoint is closed).
        while any((<CompletionQueue>q)._busy for q in cqs):
            time.sleep(0.001)
        with nogil:
            c.mrc_ep_destroy(ep)
        for q in cqs:
            (<CompletionQueue>q)._detach()
        # Every operation has completed: the buffers may go.
        for mr in regions + self._late_regions:
            (<MemoryRegion>mr)._release_view()
        self._late_regions = []
        self._dropped = []
        self._orphans.clear()

    @property
    def closed(self) -> bool:
        """True once close() has begun (another thread may still be inside it)."""
        return self.ep == NULL or self._closing

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __dealloc__(self):
        if self.ep != NULL and not _foreign(self):
            c.mrc_ep_destroy(self.ep)
        self.ep = NULL

    def __repr__(self) -> str:
        planes = ", ".join(hostport(a, p) for a, p in self.planes)
        return f"<mrc.Endpoint planes=[{planes}]{' closed' if self.ep == NULL else ''}>"


@cython.no_gc_clear  # __dealloc__ frees its region inside the endpoint: the
# collector must not drop the reference that keeps the endpoint alive until then
cdef class MemoryRegion:
    """A registered buffer. Peers may WRITE into it (with its key, inside its bounds)
    when registered with remote_write=True."""

    cdef c.mrc_mr *mr
    cdef object __weakref__
    cdef Py_buffer view
    cdef bint has_view
    cdef readonly Endpoint endpoint
    cdef readonly object obj
    cdef readonly uint64_t size
    cdef readonly bint readonly  # a SEND/WRITE source only (RECVs refused)

    def __cinit__(self):
        self.mr = NULL
        self.has_view = False

    @staticmethod
    cdef MemoryRegion _make(Endpoint ep, object obj, bint remote_write, uintptr_t address,
                            uint64_t length, bint raw=False, bint readonly=False):
        cdef MemoryRegion self = MemoryRegion.__new__(MemoryRegion)
        ep._ptr()
        cdef void *buf
        if raw:
            buf = <void *>address
            self.size = length
            self.readonly = readonly
        else:
            try:
                PyObject_GetBuffer(obj, &self.view, PyBUF_WRITABLE)
            except (BufferError, ValueError):  # numpy says read-only with a ValueError
                if remote_write:
                    raise errors.UsageError(
                        f"cannot register {type(obj).__name__} with remote_write=True: it "
                        "must be a writable, contiguous buffer (bytearray, numpy array, "
                        "writable memoryview); use remote_write=False for a read-only "
                        "source") from None
                try:
                    PyObject_GetBuffer(obj, &self.view, PyBUF_SIMPLE)
                except (BufferError, ValueError):
                    raise errors.UsageError(
                        f"cannot register {type(obj).__name__}: it must be a contiguous "
                        "buffer (bytes, bytearray, numpy array, memoryview)") from None
                self.readonly = True
            self.has_view = True
            buf = self.view.buf
            self.size = self.view.len
        self.endpoint = ep
        self.obj = obj
        cdef int rc
        cdef int access = c.MRC_ACCESS_REMOTE_WRITE if remote_write else 0
        if self.readonly:
            access |= c.MRC_ACCESS_READONLY
        cdef size_t n = self.size
        cdef c.mrc_ep *e = ep._enter()
        try:
            with nogil:
                rc = c.mrc_mr_reg(e, buf, n, access, &self.mr)
            if rc == 0 and ep.ep == NULL:  # closed meanwhile: mrc_ep_destroy frees it
                self.mr = NULL
                ep._late_regions.append(self)  # the view goes after mrc_ep_destroy
                raise errors.ConnectionClosedError("endpoint closed while registering")
            if rc == 0:  # a child before we leave: a racing close() then sees it
                ep._children.add(self)
        finally:
            ep._leave()
        if rc:
            self._release_view()
            raise error_for(rc, f"Failed to register region of {self.size} bytes")
        return self

    cdef void _abandon(self):
        """The endpoint is closing and frees the C region itself, after every op."""
        self.mr = NULL

    cdef void _release_view(self):
        if self.has_view:
            PyBuffer_Release(&self.view)
            self.has_view = False

    cdef c.mrc_mr *_ptr(self) except NULL:
        if self.mr == NULL:
            raise errors.UsageError("memory region is closed")
        if _foreign(self.endpoint):
            raise _fork_error(self.endpoint)
        return self.mr

    @property
    def key(self) -> int:
        return c.mrc_mr_key(self._ptr())

    def descriptor(self) -> RemoteRegion:
        """What a peer needs to WRITE here."""
        return RemoteRegion(self.key, self.size)

    def close(self) -> None:
        """Deregister: once this returns, no remote WRITE lands here any more and the
        transport no longer reads the buffer. Raises BusyError (and stays
        registered) while operations posted with it are pending: wait for them, or
        close their connection, first."""
        if self.mr == NULL or _foreign(self.endpoint):
            self.mr = NULL
            self._release_view()
            return
        # With the GIL held: no post from another thread can slip in between.
        cdef int rc = c.mrc_mr_dereg(self.mr)
        if rc == c.MRC_EBUSY:
            n = c.mrc_mr_pending(self.mr)
            raise errors.BusyError(
                f"cannot close a region of {self.size} bytes: {n} operation"
                f"{'' if n == 1 else 's'} using it {'is' if n == 1 else 'are'} still pending "
                "(wait for them or close their connection first)")
        self.mr = NULL
        self._release_view()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __dealloc__(self):
        # Every pending op holds a reference to its region (Operation.region, or
        # the endpoint's orphan list), so a region being freed is idle; should it
        # not be, the buffer is leaked rather than freed under the transport.
        if self.mr != NULL and not _foreign(self.endpoint):
            if c.mrc_mr_dereg(self.mr) != 0:
                return
            self.mr = NULL
        self._release_view()

    @property
    def closed(self) -> bool:
        """True once closed, or once its endpoint closed (as Connection.closed)."""
        return self.mr == NULL

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        key = f"{c.mrc_mr_key(self.mr):#x}" if self.mr != NULL else "closed"
        ro = " readonly" if self.readonly else ""
        return f"<mrc.MemoryRegion {self.size} bytes{ro} key={key}>"


@cython.no_gc_clear  # __dealloc__ frees its connection inside the endpoint: the
# collector must not drop the reference that keeps the endpoint alive until then
cdef class Connection:
    """A reliable multipath connection. Operations return an Operation to wait on."""

    cdef c.mrc_conn *conn
    cdef object __weakref__
    cdef readonly Endpoint endpoint
    cdef int _busy  # calls running without the GIL on self.conn
    cdef object _cq  # the CompletionQueue bound with set_cq: kept alive while bound
    cdef object _users  # WeakSet of CollExecutor holding this connection's pointer

    def __cinit__(self):
        self.conn = NULL
        self._busy = 0
        self._cq = None
        self._users = None

    @staticmethod
    cdef Connection _wrap(Endpoint ep, c.mrc_conn *cp):
        cdef Connection self = Connection.__new__(Connection)
        self.conn = cp
        self.endpoint = ep
        ep._children.add(self)
        return self

    cdef c.mrc_conn *_ptr(self) except NULL:
        if self.conn == NULL:
            raise errors.ConnectionClosedError("connection is closed")
        if _foreign(self.endpoint):
            raise _fork_error(self.endpoint)
        return self.conn

    cdef c.mrc_conn *_enter(self) except NULL:
        """_ptr() for a call that releases the GIL: close() waits for _leave()."""
        cdef c.mrc_conn *cp = self._ptr()
        self._busy += 1
        return cp

    cdef void _leave(self):
        self._busy -= 1

    def _busy_count(self) -> int:
        return self._busy

    def _add_paths(self, paths) -> None:
        cdef c.mrc_path_spec spec
        for p in paths:
            memset(&spec, 0, sizeof(spec))
            spec.id = p.id
            spec.plane = p.plane
            _copy_str(spec.dst, str(p.dst_addr), c.MRC_ADDR_STRLEN, "path destination")
            segs = list(p.segments or ())
            if len(segs) > c.MRC_MAX_SEGS:
                raise errors.UsageError(
                    f"path {p.id}: {len(segs)} segments, at most {c.MRC_MAX_SEGS}")
            spec.nsegs = len(segs)
            for i, s in enumerate(segs):
                _copy_str(spec.segs[i], str(s), c.MRC_ADDR_STRLEN, "segment")
            check(c.mrc_conn_add_path(self._ptr(), &spec),
                  lambda: f"Bad path {p.id} (plane {p.plane} -> {p.dst_addr} via {segs})")

    cdef uint64_t _span(self, MemoryRegion mr, offset, length, str what) except? 0:
        offset = _u64(offset, what, "offset")
        length = None if length is None else _u64(length, what, "length")
        if mr is None:
            raise errors.UsageError(f"{what}: a MemoryRegion is required")
        if mr.endpoint is not self.endpoint:
            raise errors.UsageError(f"{what}: the region belongs to another endpoint")
        if what == "recv" and mr.readonly:
            raise errors.UsageError(f"recv: the {mr.size}-byte region is read-only")
        self.endpoint._reap()
        cdef uint64_t n = mr.size - offset if length is None else length
        if offset > mr.size or n > mr.size - offset:
            raise errors.UsageError(
                f"{what}: bytes [{offset}, {offset + n}) are outside the {mr.size}-byte region")
        return n

    cdef object _post(self, c.mrc_wr *wr, MemoryRegion local, uint64_t n, cq, uint64_t ctx,
                      str what):
        """Posts wr: to an Operation, or (cq given) to the CQ only, returning None."""
        cdef c.mrc_op *op = NULL
        cdef CompletionQueue q
        cdef c.mrc_conn *cp = self._ptr()
        wr.mr = local._ptr()
        if cq is None:
            check(c.mrc_post(cp, wr, &op), lambda: f"Failed to post a {n}-byte {what}")
            return Operation._wrap(self, op, local, n)
        if not isinstance(cq, CompletionQueue):
            raise errors.UsageError(
                f"{what}: cq must be a CompletionQueue, got {type(cq).__name__}")
        q = <CompletionQueue>cq
        if q.endpoint is not self.endpoint:
            raise errors.UsageError(f"{what}: the completion queue belongs to another endpoint")
        wr.cq = q._ptr()
        wr.ctx = ctx
        check(c.mrc_post(cp, wr, NULL), lambda: f"Failed to post a {n}-byte {what} to a CQ")
        q._regions.add(local)  # no Operation holds it: the CQ keeps it alive
        return None

    def write(self, MemoryRegion local, remote, *, offset=0, length=None,
              remote_offset=0, imm=None, cq=None, ctx=0):
        """RDMA WRITE local[offset:offset+length] to remote[remote_offset:...]. With
        `imm`, the peer's wait_imm() returns it once every byte is in place.
        With `cq`, the completion goes to that CompletionQueue with `ctx` and
        None is returned instead of an Operation."""
        if not isinstance(remote, RemoteRegion):
            raise errors.UsageError("write: remote must be a RemoteRegion (peer's descriptor())")
        cdef uint64_t n = self._span(local, offset, length, "write")
        remote_offset = _u64(remote_offset, "write", "remote_offset")
        imm = None if imm is None else _u64(imm, "write", "imm")  # 32 bits: checked below
        if remote_offset > remote.size or n > remote.size - remote_offset:
            raise errors.UsageError(
                f"write: remote bytes [{remote_offset}, {remote_offset + n}) are outside the "
                f"peer's {remote.size}-byte region")
        cdef c.mrc_wr wr
        memset(&wr, 0, sizeof(wr))
        wr.kind = c.MRC_OP_WRITE
        wr.loff = offset
        wr.len = n
        wr.rkey = remote.key
        wr.roff = remote_offset
        if imm is not None:
            if not 0 <= imm < 2**32:
                raise errors.UsageError(f"write: imm must be a 32-bit unsigned value, got {imm}")
            wr.imm = imm
            wr.flags = c.MRC_WRITE_IMM
        return self._post(&wr, local, n, cq, _u64(ctx, "write", "ctx"), "write")

    def send(self, MemoryRegion local, *, offset=0, length=None,
             tag=0, cq=None, ctx=0):
        """Two-sided SEND of local[offset:offset+length], matched by tag at the peer.
        `cq`, `ctx`: as for write()."""
        cdef uint64_t n = self._span(local, offset, length, "send")
        tag = _u64(tag, "send", "tag")
        cdef c.mrc_wr wr
        memset(&wr, 0, sizeof(wr))
        wr.kind = c.MRC_OP_SEND
        wr.loff = offset
        wr.len = n
        wr.tag = tag
        return self._post(&wr, local, n, cq, _u64(ctx, "send", "ctx"), "send")

    def recv(self, MemoryRegion local, *, offset=0, length=None,
             tag=None, cq=None, ctx=0):
        """Post a receive buffer for the next SEND with `tag` (None: any tag).
        `cq`, `ctx`: as for write()."""
        cdef uint64_t n = self._span(local, offset, length, "recv")
        tag = None if tag is None else _u64(tag, "recv", "tag")
        cdef c.mrc_wr wr
        memset(&wr, 0, sizeof(wr))
        wr.kind = c.MRC_OP_RECV
        wr.loff = offset
        wr.len = n
        wr.tag = c.MRC_TAG_ANY if tag is None else tag
        return self._post(&wr, local, n, cq, _u64(ctx, "recv", "ctx"), "recv")

    def set_cq(self, cq, ctx=0) -> None:
        """Deliver this connection's immediates (WRITE with imm from the peer) to
        `cq` as IMM entries carrying `ctx`, instead of to wait_imm(). None unbinds.
        Immediates already waiting move to the CQ."""
        cdef CompletionQueue q = None
        cdef c.mrc_cq *qp = NULL
        if cq is not None:
            if not isinstance(cq, CompletionQueue):
                raise errors.UsageError(
                    f"set_cq: cq must be a CompletionQueue or None, got {type(cq).__name__}")
            q = <CompletionQueue>cq
            if q.endpoint is not self.endpoint:
                raise errors.UsageError("set_cq: the completion queue belongs to another endpoint")
            qp = q._ptr()
        check(c.mrc_conn_set_cq(self._ptr(), qp, _u64(ctx, "set_cq", "ctx")),
              "Failed to bind a completion queue")
        if self._cq is not None:
            (<CompletionQueue>self._cq)._bound.discard(self)
        self._cq = q
        if q is not None:
            q._bound.add(self)

    @property
    def handle(self) -> int:
        """An integer naming this connection: the `conn` field of its CQ entries."""
        return <uintptr_t>self._ptr()

    def wait_imm(self, timeout=None) -> tuple:
        """The next WRITE-with-immediate that completed here: (imm, length)."""
        cdef uint32_t imm = 0
        cdef uint64_t n = 0
        cdef int ms = _ms(timeout)
        cdef int rc, slice_ms
        deadline = None if ms < 0 else time.monotonic() + ms / 1000.0
        # In slices, so that close() from another thread is seen within one.
        while True:
            slice_ms = _SLICE_MS
            if deadline is not None:
                slice_ms = max(0, min(slice_ms, <int>((deadline - time.monotonic()) * 1000)))
            cp = self._enter()
            try:
                with nogil:
                    rc = c.mrc_conn_wait_imm(cp, slice_ms, &imm, &n)
            finally:
                self._leave()
            if rc != -ETIMEDOUT or (deadline is not None and time.monotonic() >= deadline):
                break
            PyErr_CheckSignals()  # Ctrl-C
        if rc == -ETIMEDOUT:  # nothing yet: retryable
            raise errors.WaitTimeout(f"no immediate arrived within {timeout} s")
        check(rc, "Failed to wait for an immediate")
        return imm, n

    @property
    def ids(self) -> tuple:
        """(this side's connection id, the peer's): the `conn` field of packets
        arriving here, and of packets sent from here."""
        cdef c.mrc_conn *cp = self._ptr()
        return c.mrc_conn_id(cp), c.mrc_conn_peer_id(cp)

    @property
    def peer_name(self) -> str:
        return c.mrc_conn_peer_name(self._ptr()).decode(errors="replace")

    @property
    def npaths(self) -> int:
        return c.mrc_conn_npaths(self._ptr())

    @property
    def peer_planes(self) -> list:
        cdef char buf[64]
        out = []
        i = 0
        while c.mrc_conn_peer_plane(self._ptr(), i, buf, sizeof(buf)) == 0:
            out.append(buf.decode())
            i += 1
        return out

    @property
    def error(self):
        """None while usable, else the exception that ended the connection."""
        if self.conn == NULL:
            return errors.ConnectionClosedError("connection is closed")
        rc = c.mrc_conn_error(self.conn)
        return None if rc == 0 else error_for(rc, "connection failed")

    def close(self) -> None:
        """Close; pending operations fail with ConnectionClosedError. A collective
        executor using the connection is stopped first (its run ends, it is closed)."""
        users, self._users = self._users, None
        for u in list(users or ()):
            (<CollExecutor>u)._conn_closing()
        cdef c.mrc_conn *cp = self.conn
        if _foreign(self.endpoint):
            self.conn = NULL  # a forked child's copy: let go
            cp = NULL
        if cp != NULL:
            self.conn = NULL  # before the GIL goes: no other thread may use it now
            # Busy on the endpoint too, before the GIL can go: Endpoint.close() in
            # another thread waits for this destroy before it frees the endpoint.
            ep = self.endpoint
            (<Endpoint>ep)._busy += 1
            try:
                _wait_idle(self, "connection")  # wait_imm() sees it within a slice
                with nogil:
                    c.mrc_conn_destroy(cp)
            finally:
                (<Endpoint>ep)._busy -= 1
        if self._cq is not None:
            (<CompletionQueue>self._cq)._bound.discard(self)
            self._cq = None

    @property
    def closed(self) -> bool:
        return self.conn == NULL

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __dealloc__(self):
        if self.conn != NULL and not _foreign(self.endpoint):
            c.mrc_conn_destroy(self.conn)
        self.conn = NULL


@cython.no_gc_clear  # __dealloc__ frees its operation's connection and region inside the endpoint: the
# collector must not drop the reference that keeps the endpoint alive until then
cdef class Operation:
    """A posted WRITE, SEND or RECV. Completes exactly once, with a status."""

    cdef c.mrc_op *op
    cdef readonly Connection connection
    cdef readonly MemoryRegion region  # kept alive while the op may touch it
    cdef readonly uint64_t length
    cdef object _exc

    @staticmethod
    cdef Operation _wrap(Connection conn, c.mrc_op *op, MemoryRegion mr, uint64_t n):
        cdef Operation self = Operation.__new__(Operation)
        self.op = op
        self.connection = conn
        self.region = mr
        self.length = n
        return self

    cdef c.mrc_op_result _result(self):
        cdef c.mrc_op_result r
        c.mrc_op_get_result(self.op, &r)
        return r

    def wait(self, timeout=None):
        """Wait for completion (None: forever). Raises the operation's error, or
        mrc.TimeoutError if it is still pending after `timeout` seconds."""
        cdef int ms = _ms(timeout)
        cdef int rc, slice_ms
        if self.connection is not None and _foreign(self.connection.endpoint):
            raise _fork_error(self.connection.endpoint)
        # Safe after the endpoint closed: the op keeps the endpoint's core alive.
        # In slices past the first, so that Ctrl-C (a signal handler) gets its turn.
        deadline = None if ms < 0 else time.monotonic() + ms / 1000.0
        slice_ms = ms if 0 <= ms <= _SLICE_MS else _SLICE_MS
        while True:
            with nogil:
                rc = c.mrc_op_wait(self.op, slice_ms)
            if not rc or (deadline is not None and time.monotonic() >= deadline):
                break
            PyErr_CheckSignals()
            if deadline is not None:
                slice_ms = max(0, min(_SLICE_MS, <int>((deadline - time.monotonic()) * 1000)))
        if rc:
            raise errors.WaitTimeout(
                f"{self.kind} of {self.length} bytes still pending after {timeout} s "
                "(wait again to keep waiting)")
        r = self._result()
        if r.status:
            raise error_for(r.status, f"{self.kind} of {self.length} bytes failed")
        return self

    @property
    def done(self) -> bool:
        return c.mrc_op_done(self.op) != 0

    @property
    def kind(self) -> str:
        return _OP_KINDS.get(self._result().kind, "?")

    @property
    def status(self) -> int:
        """0 on success, a negative code on failure, -EINPROGRESS while pending."""
        return self._result().status

    @property
    def nbytes(self) -> int:
        """Bytes transferred (recv: the message's length)."""
        return self._result().bytes

    @property
    def tag(self) -> int:
        """recv: the tag of the message it matched."""
        return self._result().tag

    def __dealloc__(self):
        if self.op == NULL:
            return
        if self.connection is not None and _foreign(self.connection.endpoint):
            self.op = NULL  # a forked child's copy: let go
            return
        # Dropped while pending: its region (and buffer) must outlive it, so the
        # endpoint keeps both until the op completes (Endpoint._reap).
        # An endpoint the cyclic collector is clearing (_dropped None) goes next: its
        # region, busy, then keeps its buffer for ever rather than free it under the op.
        ep = self.connection.endpoint if self.connection is not None else None
        if (ep is not None and not (<Endpoint>ep).closed and self.region is not None
                and (<Endpoint>ep)._dropped is not None and not c.mrc_op_done(self.op)):
            (<Endpoint>ep)._dropped.append(_Orphan._make(self.op, self.region))
        else:
            c.mrc_op_release(self.op)
        self.op = NULL

    def __repr__(self) -> str:
        state = "done" if self.done else "pending"
        return f"<mrc.Operation {self.kind} {self.length} bytes {state}>"


@cython.no_gc_clear  # __dealloc__ frees its region inside the endpoint: the
# collector must not drop the reference that keeps the endpoint alive until then
cdef class _Orphan:
    """A pending operation whose Operation was dropped, and the region it uses."""

    cdef c.mrc_op *op
    cdef MemoryRegion region

    @staticmethod
    cdef _Orphan _make(c.mrc_op *op, MemoryRegion region):
        cdef _Orphan self = _Orphan.__new__(_Orphan)
        self.op = op
        self.region = region
        return self

    @property
    def done(self) -> bool:
        return c.mrc_op_done(self.op) != 0

    def __dealloc__(self):
        if self.op != NULL and not (self.region is not None and _foreign(self.region.endpoint)):
            c.mrc_op_release(self.op)
        self.op = NULL


cdef object _wc_dtype = None


cdef object _completion_dtype():
    """The numpy dtype of one completion: struct mrc_wc itself, so that C fills the
    array in place (conn: the pointer, as Connection.handle)."""
    global _wc_dtype
    cdef c.mrc_wc w
    cdef char *base = <char *>&w
    if _wc_dtype is None:
        import numpy as np

        _wc_dtype = np.dtype({
            "names": ["ctx", "status", "kind", "bytes", "tag", "imm", "conn"],
            "formats": ["<u8", "<i4", "<i4", "<u8", "<u8", "<u4", "<u8"],
            "offsets": [<char *>&w.ctx - base, <char *>&w.status - base,
                        <char *>&w.kind - base, <char *>&w.bytes - base,
                        <char *>&w.tag - base, <char *>&w.imm - base,
                        <char *>&w.conn - base],
            "itemsize": sizeof(c.mrc_wc),
        })
    return _wc_dtype


@cython.no_gc_clear  # __dealloc__ may hand its regions to the endpoint
cdef class CompletionQueue:
    """Completions of operations posted with cq=this queue, and immediates of
    connections bound with conn.set_cq(this queue), in completion order.

    poll()/wait() return a numpy structured array, one row per completion, filled
    by C in one call (no Python object per completion): fields ctx (the post's
    ctx; IMM: the set_cq ctx), status (0 or a negative code: mrc.strerror()),
    kind (WRITE, SEND, RECV, IMM below), bytes, tag (RECV: the message's), imm
    (IMM: the value), conn (Connection.handle of the connection)."""

    WRITE = c.MRC_WC_WRITE
    SEND = c.MRC_WC_SEND
    RECV = c.MRC_WC_RECV
    IMM = c.MRC_WC_IMM

    cdef c.mrc_cq *cq
    cdef object __weakref__
    cdef readonly Endpoint endpoint
    cdef set _regions  # regions posted through it: no Operation keeps them alive
    cdef object _bound  # WeakSet of the connections bound to it (set_cq)
    cdef int _busy     # threads in wait() (the GIL released)
    cdef object _dtype
    cdef object _empty
    cdef object _none  # the read-only 0-row array returned when nothing is there

    def __cinit__(self):
        self.cq = NULL
        self._busy = 0
        self._regions = set()
        self._bound = weakref.WeakSet()

    def __init__(self, Endpoint endpoint) -> None:
        cdef c.mrc_ep *e = endpoint._ptr()
        self._dtype = _completion_dtype()
        import numpy as np

        self._empty = np.empty
        self._none = np.empty(0, self._dtype)
        self._none.flags.writeable = False
        check(c.mrc_cq_create(e, &self.cq), "Failed to create a completion queue")
        self.endpoint = endpoint
        endpoint._children.add(self)

    @property
    def dtype(self):
        """The numpy dtype of the arrays poll() and wait() return."""
        return self._dtype

    cdef c.mrc_cq *_ptr(self) except NULL:
        # The endpoint closed (or closing: it frees this queue without the GIL, and
        # detaches it only after) comes first: a poll() racing that free read freed
        # memory (a segfault found by tests/api_chaos.py).
        if self.endpoint is not None and self.endpoint.closed:
            raise errors.ConnectionClosedError("completion queue: its endpoint is closed")
        if self.cq == NULL:
            raise errors.UsageError("completion queue is closed")
        if _foreign(self.endpoint):
            raise _fork_error(self.endpoint)
        return self.cq

    cdef int _wait(self, c.mrc_cq *q, c.mrc_wc *wc, int nmax, int timeout_ms) except? -9999:
        """mrc_cq_wait in slices past the first, so that Ctrl-C gets its turn."""
        cdef int n
        cdef int slice_ms = timeout_ms if 0 <= timeout_ms <= _SLICE_MS else _SLICE_MS
        deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000.0
        while True:
            with nogil:
                n = c.mrc_cq_wait(q, wc, nmax, slice_ms)
            if n != -ETIMEDOUT or (deadline is not None and time.monotonic() >= deadline):
                return n
            PyErr_CheckSignals()
            if deadline is not None:
                slice_ms = max(0, min(_SLICE_MS, <int>((deadline - time.monotonic()) * 1000)))

    cdef object _fill(self, int max, int timeout_ms, bint block):
        if max < 1:
            raise errors.UsageError(f"max must be >= 1 completion, got {max}")
        cdef c.mrc_cq *q = self._ptr()
        cdef c.mrc_wc small[64]
        cdef c.mrc_wc *wc = small
        cdef int n
        cdef Py_buffer view
        if max > 64:
            wc = <c.mrc_wc *>malloc(max * sizeof(c.mrc_wc))
            if wc == NULL:
                raise MemoryError()
        try:
            if block:
                self._busy += 1
                try:
                    n = self._wait(q, wc, max, timeout_ms)
                finally:
                    self._busy -= 1
            else:
                n = c.mrc_cq_poll(q, wc, max)
            if n == -ETIMEDOUT or n == 0:
                return self._none  # no array to allocate: polling an empty queue is cheap
            if n == c.MRC_ECLOSED:
                raise errors.ConnectionClosedError(
                    "completion queue shut down: its endpoint is closing")
            if n < 0:
                raise error_for(n, "Failed to read completions")
            arr = self._empty(n, self._dtype)
            PyObject_GetBuffer(arr, &view, PyBUF_WRITABLE)
            memcpy(view.buf, wc, n * sizeof(c.mrc_wc))
            PyBuffer_Release(&view)
            return arr
        finally:
            if wc != small:
                free(wc)

    def poll(self, int max=64):
        """Up to `max` completions waiting now (never blocks), as an array (a new
        one per batch; with none waiting, one shared read-only empty array)."""
        return self._fill(max, 0, False)

    def wait(self, timeout=None, int max=64):
        """Like poll(), but blocks until at least one completion is there or
        `timeout` seconds pass (None: forever); on timeout the array is empty."""
        return self._fill(max, _ms(timeout), True)

    def fileno(self) -> int:
        """An eventfd readable while completions wait (selectors, asyncio
        add_reader). Do not read it: the poll() that empties the queue resets it."""
        return c.mrc_cq_fd(self._ptr())

    def _shutdown(self) -> None:
        if self.cq != NULL:
            c.mrc_cq_shutdown(self.cq)

    def _detach(self) -> None:
        """The endpoint freed the C queue (mrc_ep_destroy)."""
        self.cq = NULL
        self._regions.clear()
        self._bound.clear()

    def close(self) -> None:
        """Free the queue; connections bound to it are unbound (their immediates go
        to wait_imm() again). BusyError while operations posted to it are pending or
        a thread waits on it."""
        if self.cq == NULL:
            return
        if _foreign(self.endpoint):
            self._detach()  # a forked child's copy: let go
            return
        if self.endpoint.closed:
            return  # the endpoint's close() frees the queue (maybe right now)
        if self._busy:
            raise errors.BusyError(
                f"Failed to close the completion queue: {self._busy} thread(s) in wait()")
        for conn in list(self._bound):
            if not conn.closed:
                conn.set_cq(None)
        cdef int rc = c.mrc_cq_destroy(self.cq)
        if rc == c.MRC_EBUSY:
            raise errors.BusyError(
                "Failed to close the completion queue: operations posted to it are still "
                "pending")
        check(rc, "Failed to close the completion queue")
        self.cq = NULL
        self._regions.clear()

    @property
    def closed(self) -> bool:
        return self.cq == NULL

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            self.close()
        except errors.BusyError:
            if exc_type is None:
                raise
            # Leaving on an error with ops still pending: do not hide that error;
            # the endpoint frees the queue when it closes.

    def __dealloc__(self):
        if self.cq == NULL or _foreign(self.endpoint):
            return
        if c.mrc_cq_destroy(self.cq) != 0:
            # Ops still pending: the endpoint frees the C queue when it goes, and
            # keeps the regions those ops use alive until then.
            # (An endpoint the collector is clearing has none: its busy regions then
            # keep their buffers for ever.)
            if (self.endpoint is not None and self._regions
                    and self.endpoint._orphans is not None):
                self.endpoint._orphans.append(self._regions)
        self.cq = NULL

    def __repr__(self) -> str:
        return f"<mrc.CompletionQueue{' closed' if self.cq == NULL else ''}>"


# ---- collectives: the schedule executor (src_c/coll.c) ----------------------

COLL_STEP_SIZE = sizeof(c.mrc_coll_step)
COLL_REF_SIZE = sizeof(c.mrc_coll_ref)
ABORTED = c.MRC_EABORT
MISMATCH = c.MRC_EMISMATCH
GONE = c.MRC_EGONE
STALLED = c.MRC_ESTALLED
ETIMEOUT = c.MRC_ETIMEOUT
EPATHDOWN = c.MRC_EPATHDOWN
ERNR = c.MRC_ERNR


def reduce_into(acc, src, int dtype, int op) -> None:
    """acc op= src with the C kernels (tests and tools; dtype/op: enum codes)."""
    cdef const unsigned char[::1] s = memoryview(src).cast("B")
    cdef unsigned char[::1] a = memoryview(acc).cast("B")
    cdef size_t es = c.mrc_dtype_size(dtype)
    if es == 0 or a.shape[0] != s.shape[0] or a.shape[0] % es:
        raise errors.UsageError(f"reduce_into: {a.shape[0]} and {s.shape[0]} bytes of dtype {dtype}")
    cdef size_t n = a.shape[0] // es
    cdef int rc
    with nogil:
        rc = c.mrc_reduce(&a[0] if n else NULL, &s[0] if n else NULL, n, dtype, op)
    check(rc, "reduce")


def reduce_finish(acc, int dtype, int op, int n) -> None:
    cdef unsigned char[::1] a = memoryview(acc).cast("B")
    cdef size_t es = c.mrc_dtype_size(dtype)
    if es == 0 or a.shape[0] % es:
        raise errors.UsageError(f"reduce_finish: {a.shape[0]} bytes of dtype {dtype}")
    cdef size_t count = a.shape[0] // es
    check(c.mrc_reduce_finish(&a[0] if count else NULL, count, dtype, op, n), "reduce_finish")


cdef int _coll_interrupted(void *arg) noexcept nogil:
    with gil:
        return (<CollExecutor>arg)._ask_signals()


@cython.no_gc_clear  # __dealloc__ needs its endpoint alive
cdef class CollExecutor:
    """The C executor of collective schedules for one rank (src_c/coll.c): run()
    takes a packed schedule (mrc.collectives.schedule.Packed) and the call's
    buffers and runs it to completion without the GIL. After a failure it
    closes its peers' connections (the communicator is over: operations may be
    pending on them) and waits for every operation to end, so no buffer is
    touched once run() returns."""

    cdef c.mrc_coll *coll
    cdef object __weakref__
    cdef readonly Endpoint endpoint
    cdef list _peers
    cdef object _lock  # held by run(); close() takes it, so it waits for a run
    cdef bint _closed
    cdef object _interrupt  # what a signal handler raised during run() (Ctrl-C)
    cdef list _final_runs
    cdef readonly int nranks

    def __cinit__(self):
        self.coll = NULL
        self._closed = False

    def __init__(self, Endpoint endpoint, int rank, int nranks, peers, *,
                 uint64_t chunk_bytes=0, int slots=0, int window=0,
                 uint32_t busy_poll_us=0):
        import threading
        cdef c.mrc_coll_config cfg
        peers = list(peers)
        if len(peers) != nranks:
            raise errors.UsageError(f"{nranks} ranks need {nranks} peers entries, got {len(peers)}")
        self.nranks = nranks
        self._final_runs = []
        if chunk_bytes % 8:
            raise errors.UsageError(f"chunk_bytes must be a multiple of 8, got {chunk_bytes}")
        cdef c.mrc_conn **ptrs = <c.mrc_conn **>malloc(max(nranks, 1) * sizeof(c.mrc_conn *))
        if ptrs == NULL:
            raise MemoryError()
        try:
            for i, p in enumerate(peers):
                if i == rank:
                    if p is not None:
                        raise errors.UsageError(f"peers[{rank}] (this rank) must be None")
                    ptrs[i] = NULL
                    continue
                if not isinstance(p, Connection):
                    raise errors.UsageError(f"peers[{i}] must be a Connection, got {p!r}")
                if (<Connection>p).endpoint is not endpoint:
                    raise errors.UsageError(f"peers[{i}] belongs to another endpoint")
                ptrs[i] = (<Connection>p)._ptr()
            cfg.rank = rank
            cfg.nranks = nranks
            cfg.peers = ptrs
            cfg.chunk_bytes = chunk_bytes
            cfg.slots = slots
            cfg.window = window
            cfg.busy_poll_us = busy_poll_us
            check(c.mrc_coll_create(endpoint._ptr(), &cfg, &self.coll),
                  lambda: f"Failed to create the collective executor of rank {rank}/{nranks}")
        finally:
            free(ptrs)
        self.endpoint = endpoint
        self._peers = peers
        self._lock = threading.RLock()
        for p in peers:
            if p is not None:
                if (<Connection>p)._users is None:
                    (<Connection>p)._users = weakref.WeakSet()
                (<Connection>p)._users.add(self)
        endpoint._children.add(self)

    def run(self, packed, send, recv, int dtype, int op, uint32_t sig, timeout) -> tuple:
        """Runs one schedule: (0, -1) or (error code, the peer involved or -1).
        send/recv: buffer-protocol objects or None (recv must be writable; they
        may be the same object)."""
        raw = packed.raw  # the arrays as bytes (schedule.Packed)
        cdef const unsigned char[::1] steps = raw[0]
        cdef const unsigned char[::1] refs = raw[1]
        cdef const unsigned char[::1] deps = raw[2]
        cdef c.mrc_coll_plan plan
        cdef c.mrc_coll_args a
        cdef Py_buffer sv, rv
        cdef bint has_s = False, has_r = False
        cdef int rc = 0, failed = -1
        memset(&a, 0, sizeof(a))
        plan.nsteps = <uint32_t>(steps.shape[0] // sizeof(c.mrc_coll_step))
        plan.steps = <const c.mrc_coll_step *>&steps[0] if plan.nsteps else NULL
        plan.nrefs = <uint32_t>(refs.shape[0] // sizeof(c.mrc_coll_ref))
        plan.refs = <const c.mrc_coll_ref *>&refs[0] if plan.nrefs else NULL
        plan.ndeps = <uint32_t>(deps.shape[0] // 4)
        plan.deps = <const uint32_t *>&deps[0] if plan.ndeps else NULL
        plan.nrings = packed.nrings
        plan.stage_bytes = packed.stage_bytes
        a.dtype = dtype
        a.op = op
        a.sig = sig
        a.timeout_ms = _ms(timeout)
        if _foreign(self.endpoint):  # before the lock: a thread of the parent may hold it
            raise _fork_error(self.endpoint)
        with self._lock:
            if self._closed or self.coll == NULL:
                return (c.MRC_EABORT, -1)
            try:
                if send is not None:
                    PyObject_GetBuffer(send, &sv, PyBUF_SIMPLE)
                    has_s = True
                    a.send = sv.buf
                    a.send_len = sv.len
                if recv is not None:
                    PyObject_GetBuffer(recv, &rv, PyBUF_WRITABLE)
                    has_r = True
                    a.recv = rv.buf
                    a.recv_len = rv.len
                # On the main thread a signal handler (Ctrl-C) gets its turn while
                # the run waits; what it raises ends the run and is raised here.
                if threading.current_thread() is threading.main_thread():
                    a.interrupted = _coll_interrupted
                    a.interrupt_arg = <void *>self
                with nogil:
                    rc = c.mrc_coll_run(self.coll, &plan, &a, &failed)
                if rc and rc != c.MRC_EUSAGE:
                    self._fail()
            finally:
                if has_s:
                    PyBuffer_Release(&sv)
                if has_r:
                    PyBuffer_Release(&rv)
            if self._interrupt is not None:
                exc, self._interrupt = self._interrupt, None
                raise exc
        return (rc, failed)

    cdef int _ask_signals(self) noexcept:
        try:
            PyErr_CheckSignals()
        except BaseException as e:
            self._interrupt = e
            return 1
        return 0

    cdef _fail(self):
        """After a failed run: close the peers' connections so that what is still
        pending fails, then wait until nothing is (buffers are held until then)."""
        cdef int rc
        for p in self._peers:
            if p is not None:
                p.close()
        with nogil:
            rc = c.mrc_coll_drain(self.coll, 10000)
        if rc:
            # Cannot happen with every connection closed; never leave a region
            # the datapath may still write to: keep the executor (and so its
            # regions) alive with the endpoint.
            self.endpoint._orphans.append(self)

    def abort(self) -> None:
        """Any thread: the running and every later run() returns ABORTED."""
        if self.coll != NULL and not _foreign(self.endpoint):
            c.mrc_coll_abort(self.coll)

    def peer_gone(self, int peer, uint32_t runs) -> None:
        """Any thread: `peer` closed after `runs` runs with this rank; a run it never
        made fails (GONE) when it waits on it, instead of at the timeout."""
        if self.coll != NULL and not _foreign(self.endpoint):
            check(c.mrc_coll_peer_gone(self.coll, peer, runs), "peer_gone")

    @property
    def final_runs(self) -> list:
        """Runs completed with each peer, as close() left them ([] before)."""
        return self._final_runs

    def _conn_closing(self) -> None:
        """A peer connection is about to be freed: end any run, then retire."""
        self.abort()
        with self._lock:
            self._closed = True

    @property
    def scratch_bytes(self) -> int:
        return 0 if self.coll == NULL else c.mrc_coll_scratch_bytes(self.coll)

    def close(self) -> None:
        if _foreign(self.endpoint):  # a forked child's copy: let go (not the lock)
            self.coll = NULL
            return
        self.abort()
        with self._lock:
            self._closed = True
            if self.coll != NULL and not _foreign(self.endpoint):
                self._final_runs = [c.mrc_coll_runs(self.coll, p) for p in range(self.nranks)]
                c.mrc_coll_destroy(self.coll)
            self.coll = NULL

    def __dealloc__(self):
        if self.coll != NULL and not _foreign(self.endpoint):
            c.mrc_coll_destroy(self.coll)
        self.coll = NULL
