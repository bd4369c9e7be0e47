"""The runs: connection set-up, the option check, the four tests on both sides.

Flow (perftest's, over mrc):

    client                                   server
      connect (connection 0)  ------------->  accept
      hello {options, client region}  ---->  compare options
      <----------------  verdict {ok | mismatches, server region}
      connect connections 1..q-1  --------->  accept them
      for each message size (one, or 2 B..8 MiB with -a):
        data: WRITEs / SENDs / ping-pong  -->  (send_bw: keeps RECVs posted; lat: answers)
        done {results, sent counts, hash} ->  hash its buffer, print the client's row
        <--------------------  result {hash, verdict}
      both print the same table, verify verdict and their own paths table.

Control messages travel as SENDs on connection 0 (see control.py). Every wait has a
deadline or watches the connection's error, so a dead or mismatched peer ends the run
with a message, never a hang.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # its spinning threads steal the 2 cores

import numpy as np  # noqa: E402

import mrc  # noqa: E402
from mrc.perf import report  # noqa: E402
from mrc.perf.control import DATA_TAG, Control, PeerGone  # noqa: E402
from mrc.perf.options import PerfOptions, mismatches  # noqa: E402
from mrc.perf.stats import BwResult, CpuUtil, LatResult, bw_result, lat_result  # noqa: E402

PROTO = 1
BUF_CAP = 64 << 20  # bytes of slots per side for bandwidth tests (see slots())
SEED = 0x6D7263  # --verify pattern seed
SAMPLE_EVERY = 0.5  # seconds between per-plane samples (--paths timeline)


class PerfError(Exception):
    """A run failed for a reason the user must hear about; exit status `code`."""

    def __init__(self, msg: str, code: int = 1) -> None:
        super().__init__(msg)
        self.code = code


def slots(opts: PerfOptions, size: int) -> int:
    """Bandwidth tests cycle through this many message-sized slots in the registered
    buffers (perftest reuses one buffer per QP; distinct slots let --verify check every
    byte). Writes in flight to one slot carry the same bytes, so overlap is harmless."""
    return max(1, min(opts.tx_depth * opts.qps, BUF_CAP // size))


def buffer_bytes(opts: PerfOptions) -> int:
    if opts.is_bw:
        return max(slots(opts, s) * s for s in opts.sizes())
    return max(opts.sizes())


def make_buffer(nbytes: int, pattern: bool) -> np.ndarray:
    if pattern:
        return np.frombuffer(bytearray(np.random.default_rng(SEED).bytes(nbytes)), np.uint8)
    return np.zeros(nbytes, np.uint8)


def digest(buf: np.ndarray, nbytes: int) -> str:
    return hashlib.sha256(buf[:nbytes].tobytes()).hexdigest()


def op_timeout(opts: PerfOptions) -> float:
    return max(30.0, 6 * opts.timeout)


# ----------------------------------------------------------------------------------------
# Endpoints: plain planes or a fabric file


@dataclass
class Link:
    """How this side reaches the other: an endpoint plus connect/accept."""

    ep: mrc.Endpoint
    listen: Callable[[int], int]
    accept: Callable[[float], mrc.Connection]
    connect: Callable[[float], mrc.Connection]
    where: str  # the peer, in words, for messages


def open_link(opts: PerfOptions, fabric: tuple[str, str] | None) -> Link:
    if fabric is not None:
        return _fabric_link(opts, *fabric)
    try:
        ep = mrc.Endpoint(opts.planes, mss=opts.mss, timeout=opts.timeout)
    except mrc.MrcError as e:
        raise PerfError(str(e)) from e
    server = opts.server or ""
    return Link(
        ep=ep,
        listen=lambda port: ep.listen(port),
        accept=lambda t: ep.accept(timeout=t),
        connect=lambda t: ep.connect(server, opts.port, timeout=t),
        where=f"{server} port {opts.port}",
    )


def _fabric_link(opts: PerfOptions, fabric_file: str, host: str) -> Link:
    try:
        from mrc import paths  # type: ignore[attr-defined]  # written on another branch
    except ImportError as e:
        raise PerfError(
            f"--fabric needs the mrc.paths module (fabric routing), which this build lacks: {e}",
            code=2,
        ) from e
    try:
        fe: Any = paths.fabric_endpoint(fabric_file, host, mss=opts.mss, timeout=opts.timeout)
    except mrc.MrcError as e:  # a bad fabric file is bad input (2), as in mrc-route
        code = 2 if isinstance(e, mrc.UsageError) else 1
        raise PerfError(f"--fabric {fabric_file} --host {host}: {e}", code=code) from e
    except (OSError, ValueError, KeyError) as e:
        why = e.args[0] if isinstance(e, KeyError) and e.args else e  # not KeyError's quotes
        raise PerfError(f"--fabric {fabric_file} --host {host}: {why}", code=2) from e
    ep: mrc.Endpoint = fe.endpoint
    peer = opts.server or ""

    def listen(port: int) -> int:
        if hasattr(fe, "listen"):
            return int(fe.listen(port))
        return ep.listen(port)

    return Link(
        ep=ep,
        listen=listen,
        accept=lambda t: fe.accept(timeout=t),
        connect=lambda t: fe.connect(peer, opts.port, timeout=t),
        where=f"host {peer} port {opts.port}",
    )


# ----------------------------------------------------------------------------------------
# Faults and the per-plane sampler


@dataclass
class Observer:
    """Injects this side's faults on schedule and samples per-plane bytes for --paths."""

    ep: mrc.Endpoint
    opts: PerfOptions
    conn_ids: set[int]
    t0: float = 0.0
    samples: list[tuple[float, list[int]]] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)  # planes taken down, in that order
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _timers: list[threading.Timer] = field(default_factory=list)

    def start(self) -> None:
        self.t0 = time.monotonic()
        for plane, seconds in self.opts.fail_plane:
            t = threading.Timer(seconds, self._fail, args=(plane,))
            t.daemon = True
            t.start()
            self._timers.append(t)
        if self.opts.show_paths or self.opts.out_json or self.opts.out_json_file:
            self.sample()
            th = threading.Thread(target=self._sampler, daemon=True, name="mrc-perf-sampler")
            th.start()
            self._threads.append(th)

    def _fail(self, plane: int) -> None:
        if self._stop.is_set():
            return  # the run has ended: the summary says the plane was not taken down
        self.ep.inject(plane, down=True)
        self.failed.append(plane)
        self.events.append((time.monotonic() - self.t0, f"plane {plane} down"))

    def sample(self) -> None:
        nplanes = len(self.ep.planes)
        per = [0] * nplanes
        for p in self.paths():
            if p["plane"] < nplanes:
                per[p["plane"]] += p["tx_bytes"] + p["rx_bytes"]
        self.samples.append((time.monotonic() - self.t0, per))

    def _sampler(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY):
            self.sample()

    def paths(self) -> list[dict[str, Any]]:
        return [p for p in self.ep.stats()["paths"] if p["conn_id"] in self.conn_ids]

    def stop(self) -> None:
        self._stop.set()
        for t in self._timers:
            t.cancel()
            if t.is_alive() and t is not threading.current_thread():
                t.join()  # one taking its plane down now: in the summary or not, not half
        for th in self._threads:
            th.join()
        if self.opts.show_paths or self.opts.out_json or self.opts.out_json_file:
            self.sample()


# ----------------------------------------------------------------------------------------
# One side of a run


@dataclass
class Session:
    opts: PerfOptions
    link: Link
    out: TextIO
    conns: list[mrc.Connection] = field(default_factory=list)
    ctrl: Control | None = None
    observer: Observer | None = None
    results: list[BwResult | LatResult] = field(default_factory=list)
    verify_ok: bool | None = None
    verify_note: str = ""
    peer_mss: int | None = None  # from the hello/verdict; the connection uses the smaller
    peer_planes: list[str] = field(default_factory=list)

    @property
    def mss(self) -> int:
        """The payload bytes per packet the connection uses: the smaller side's."""
        return min(self.opts.mss, self.peer_mss or self.opts.mss)

    @property
    def ep(self) -> mrc.Endpoint:
        return self.link.ep

    def print(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def control(self) -> Control:
        assert self.ctrl is not None
        return self.ctrl

    def apply_loss(self) -> None:
        for plane, pct in self.opts.loss:
            self.ep.inject(plane, loss=pct / 100.0)

    def begin(self, peer_planes: list[str], local_key: int | None, remote_key: int | None) -> None:
        """Prints the header. local_key: the key of this side's region the peer writes
        into (the peer prints it as its remote key)."""
        self.peer_planes = peer_planes
        self.print(
            report.header_block(
                self.opts,
                self.ep.planes,
                peer_planes,
                self.conns[0].npaths,
                local_key,
                remote_key,
                mss=(self.mss, self.opts.mss, self.peer_mss),
            )
        )
        self.print(report.table_header(self.opts))
        self.observer = Observer(self.ep, self.opts, {c.ids[0] for c in self.conns})
        self.observer.start()

    def row(self, r: BwResult | LatResult) -> None:
        self.results.append(r)
        self.print(
            report.bw_row(r, self.opts.cpu_util) if isinstance(r, BwResult) else report.lat_row(r)
        )

    def finish(self) -> int:
        obs = self.observer
        if obs is not None:
            obs.stop()
        self.print(report.RULE)
        if self.verify_ok is not None:
            verdict = "PASS" if self.verify_ok else "FAIL"
            self.print(f" Verify          : {verdict} ({self.verify_note})")
            self.print(report.RULE)
        paths = obs.paths() if obs is not None else []
        if self.opts.show_paths and obs is not None:
            self.print(report.paths_table(paths, self.ep.planes))
            tl = report.timeline_table(obs.samples, len(self.ep.planes), obs.events)
            if tl:
                self.print(tl)
        if self.opts.fail_plane and obs is not None:
            self.print(
                report.failover_summary(
                    paths, self.opts.fail_plane, obs.failed, self.ep.planes, self.verify_ok
                )
            )
        if self.opts.out_json or self.opts.out_json_file:
            data = {
                "test": self.opts.test,
                "role": "client" if self.opts.server is not None else "server",
                "options": self.opts.wire(),
                "units": "Gb/sec" if self.opts.report_gbits else "MB/sec",
                "results": [r.as_dict() for r in self.results],
                "verify": None
                if self.verify_ok is None
                else ("PASS" if self.verify_ok else "FAIL"),
                "paths": paths,
                "mss": {"used": self.mss, "local": self.opts.mss, "peer": self.peer_mss},
                "planes": {
                    "local": [report.hostport(a, p) for a, p in self.ep.planes],
                    "peer": self.peer_planes,
                },
                "timeline": {
                    "interval_s": SAMPLE_EVERY,
                    "samples": [{"t": t, "plane_bytes": per} for t, per in obs.samples]
                    if obs is not None
                    else [],
                    "events": [{"t": t, "event": e} for t, e in obs.events]
                    if obs is not None
                    else [],
                },
                "mrc_version": mrc.__version__,
                "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            }
            try:
                report.write_json(data, self.opts.out_json_file, self.out)
            except OSError as e:  # checked before the run; the directory may have gone since
                self.out.write(json.dumps(data, indent=2) + "\n")
                where = self.opts.out_json_file
                raise PerfError(f"cannot write {where}: {e} (the JSON is printed above)") from e
        return 0 if self.verify_ok is not False else 1

    def close(self) -> None:
        self.ep.close()


def _mismatch_text(diff: list[tuple[str, Any, Any]], me: str, peer: str) -> str:
    parts = [f"{opt}: {me} {mine}, {peer} {theirs}" for opt, mine, theirs in diff]
    return "options differ between client and server: " + "; ".join(parts)


# ----------------------------------------------------------------------------------------
# Server


def run_server(
    opts: PerfOptions,
    out: TextIO,
    fabric: tuple[str, str] | None = None,
    on_listen: Callable[[int], None] | None = None,
) -> int:
    link = open_link(opts, fabric)
    s = Session(opts, link, out)
    try:
        return _serve(s, on_listen)
    except PeerGone as e:
        raise PerfError(f"client went away: {e}") from e
    except mrc.MrcError as e:  # any other datapath error: a message, not a traceback
        raise PerfError(f"the run failed: {e}") from e
    finally:
        s.close()


def _accept(s: Session, timeout: float | None) -> mrc.Connection:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            return s.link.accept(0.5)
        except mrc.TimeoutError:
            if deadline is not None and time.monotonic() > deadline:
                raise PerfError(f"no client connected within {timeout} s") from None
        except mrc.MrcError as e:
            raise PerfError(f"failed to accept a client: {e}") from e


def _serve(s: Session, on_listen: Callable[[int], None] | None) -> int:
    opts = s.opts
    try:
        port = s.link.listen(opts.port)
    except mrc.MrcError as e:
        raise PerfError(f"cannot listen on port {opts.port}: {e}") from e
    s.print("\n************************************")
    s.print("* Waiting for client to connect... *")
    s.print("************************************")
    where = ",".join(a for a, _ in s.ep.planes)
    s.print(f" mrc-perf server listening on {where} port {port}")
    if all(_is_loopback(a) for a, _ in s.ep.planes) and not opts.planes_given:
        s.print(" (loopback only: start with --planes ADDR,... to be reachable from other hosts)")
    if on_listen is not None:
        on_listen(port)
    s.conns.append(_accept(s, None))
    s.ctrl = Control(s.ep, s.conns[0])
    hello = s.control().recv(30.0, expect="hello")
    s.peer_mss = hello.get("mss")
    _check_reach([a for a, _ in s.ep.planes], list(hello.get("planes", [])), "server")
    diff = mismatches(opts.wire(), hello.get("options", {}))
    if hello.get("version") != PROTO:
        diff.insert(0, ("protocol version", PROTO, hello.get("version")))
    buf = make_buffer(buffer_bytes(opts), pattern=False)
    mr = s.ep.register(buf)
    s.control().send(
        {
            "type": "verdict",
            "ok": not diff,
            "mismatch": diff,
            "region": mr.descriptor().pack().hex(),
            "planes": [a for a, _ in s.ep.planes],
            "mss": opts.mss,
        }
    )
    if diff:
        raise PerfError(_mismatch_text(diff, "server", "client"))
    for _ in range(opts.qps - 1):
        s.conns.append(_accept(s, 30.0))
    s.apply_loss()
    client_region = mrc.RemoteRegion.unpack(bytes.fromhex(hello["region"]))
    s.begin(list(hello.get("planes", [])), mr.key, client_region.key)
    for step, size in enumerate(opts.sizes()):
        if opts.test == "send_bw":
            done = _send_bw_server(s, step, size, mr)
        elif opts.test == "write_bw":
            done = s.control().recv(None, expect="done")
        else:
            done = _lat_server(s, step, size, mr, client_region)
        _server_step_end(s, done, buf)
    return s.finish()


def _server_step_end(s: Session, done: dict[str, Any], buf: np.ndarray) -> None:
    r = done["result"]
    res: BwResult | LatResult = BwResult(**r) if s.opts.is_bw else LatResult(**r)
    reply: dict[str, Any] = {"type": "result"}
    if s.opts.verify:
        used = int(done["used"])
        mine = digest(buf, used)
        ok = mine == done["hash"]
        s.verify_ok = ok if s.verify_ok is None else (s.verify_ok and ok)
        s.verify_note = f"sha256 of the received data at both ends, last {used} bytes"
        reply["hash"] = mine
        buf[:used] = 0  # the next size must write every byte again to match
    s.control().send(reply)
    s.row(res)


def _send_bw_server(s: Session, step: int, size: int, mr: mrc.MemoryRegion) -> dict[str, Any]:
    """Keep tx-depth RECVs posted on every connection until the client says how many it
    sent and all have arrived."""
    opts, conns, tag = s.opts, s.conns, DATA_TAG + step
    nq, nslots = len(conns), slots(s.opts, size)
    posted: list[deque[mrc.Operation]] = [deque() for _ in conns]
    nposted, got = [0] * nq, [0] * nq
    done: dict[str, Any] | None = None

    def post(c: int) -> None:
        slot = (c + nposted[c] * nq) % nslots  # the client's op index for this RECV
        posted[c].append(conns[c].recv(mr, offset=slot * size, length=size, tag=tag))
        nposted[c] += 1

    for c in range(nq):
        for _ in range(opts.tx_depth):
            post(c)
    while True:
        for c in range(nq):
            dq = posted[c]
            while dq and dq[0].done:
                dq.popleft().wait(0)
                got[c] += 1
                if done is None or nposted[c] < done["sent"][c]:
                    post(c)
        if done is None:
            done = s.control().poll()
            if done is not None:
                for c in range(nq):
                    while nposted[c] < done["sent"][c]:
                        post(c)
        if done is not None and all(got[c] >= done["sent"][c] for c in range(nq)):
            return done
        oldest = _oldest_owed(posted, got, done["sent"] if done is not None else None)
        try:
            if done is None:
                # Block on the oldest RECV; wake now and then to look for "done".
                if oldest is not None:
                    oldest.wait(0.05)
                else:
                    s.control().wait(0.05)
            else:
                assert oldest is not None  # some connection is still owed data
                oldest.wait(op_timeout(opts))
        except mrc.TimeoutError:
            if done is not None:
                owed = ", ".join(
                    f"connection {c} got {got[c]} of {n}"
                    for c, n in enumerate(done["sent"])
                    if got[c] < n
                )
                raise PerfError(
                    f"the client's SENDs did not all arrive within {op_timeout(opts):g} s: {owed}"
                ) from None
        except mrc.MrcError as e:
            raise PerfError(f"receive failed: {e}") from e


def _oldest_owed(
    posted: list[deque[mrc.Operation]], got: list[int], sent: list[int] | None
) -> mrc.Operation | None:
    """The RECV the send_bw server blocks on: the oldest of the first connection still
    owed data. Before "done" (sent is None) every connection keeps RECVs ahead of the
    data, so one that got all its SENDs early holds RECVs that never complete; blocking
    on those once "done" said all was sent stalled the run for the whole timeout."""
    for c, dq in enumerate(posted):
        if dq and (sent is None or got[c] < sent[c]):
            return dq[0]
    return None


def _lat_server(
    s: Session, step: int, size: int, mr: mrc.MemoryRegion, client_region: mrc.RemoteRegion
) -> dict[str, Any]:
    """Answer each ping with a pong of the same size from the same buffer (an echo),
    until the client's "done" arrives."""
    conn, ctrl, tmo = s.conns[0], s.control(), op_timeout(s.opts)
    prev: mrc.Operation | None = None
    tag = DATA_TAG + step
    r = conn.recv(mr, length=size, tag=tag) if s.opts.test == "send_lat" else None
    while True:
        try:
            if r is None:
                imm, _ = conn.wait_imm(0.05)
            else:
                r.wait(0.05)
        except mrc.TimeoutError:
            done = ctrl.poll()
            if done is not None:
                return done
            if conn.error is not None:
                raise PerfError(f"connection failed: {conn.error}") from None
            continue
        if prev is not None:
            prev.wait(tmo)
        if r is None:
            prev = conn.write(mr, client_region, length=size, imm=imm)
        else:
            r = conn.recv(mr, length=size, tag=tag)  # posted before the pong leaves
            prev = conn.send(mr, length=size, tag=tag)


# ----------------------------------------------------------------------------------------
# Client


def run_client(opts: PerfOptions, out: TextIO, fabric: tuple[str, str] | None = None) -> int:
    link = open_link(opts, fabric)
    s = Session(opts, link, out)
    try:
        return _client(s)
    except PeerGone as e:
        raise PerfError(f"server went away: {e}") from e
    except mrc.MrcError as e:  # any other datapath error: a message, not a traceback
        raise PerfError(f"the run failed: {e}") from e
    finally:
        s.close()


def _connect(s: Session) -> mrc.Connection:
    try:
        return s.link.connect(10.0)
    except (mrc.UnreachableError, mrc.TimeoutError) as e:
        hint = ""
        if s.opts.server and not _is_loopback(s.opts.server):
            hint = (
                "; a server on another host must be started with --planes naming its "
                "addresses (without --planes it listens on 127.0.0.1 only)"
            )
        raise PerfError(f"no mrc-perf server at {s.link.where} ({e}){hint}") from e
    except mrc.MrcError as e:
        raise PerfError(f"cannot connect to the mrc-perf server at {s.link.where}: {e}") from e


def _is_loopback(addr: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _check_reach(mine: list[str], peer: list[str], me: str) -> None:
    """Loopback planes cannot talk to another host's: say --planes, not "invalid argument"."""
    lo_mine = all(_is_loopback(a) for a in mine)
    lo_peer = all(_is_loopback(a) for a in peer)
    if peer and lo_mine != lo_peer:
        raise PerfError(
            f"the {me}'s planes ({', '.join(mine)}) and the peer's ({', '.join(peer)}) "
            "cannot reach each other (loopback on one side only): give --planes with "
            "each host's own addresses on both sides"
        )


def _client(s: Session) -> int:
    opts = s.opts
    s.conns.append(_connect(s))
    s.ctrl = Control(s.ep, s.conns[0])
    nbuf = buffer_bytes(opts)
    src = make_buffer(nbuf, pattern=opts.verify)
    smr = s.ep.register(src)
    rx = make_buffer(nbuf if not opts.is_bw else 1, pattern=False)  # lat: the pongs land here
    rmr = s.ep.register(rx)
    s.control().send(
        {
            "type": "hello",
            "version": PROTO,
            "options": opts.wire(),
            "region": rmr.descriptor().pack().hex(),
            "planes": [a for a, _ in s.ep.planes],
            "mss": opts.mss,
        }
    )
    verdict = s.control().recv(30.0, expect="verdict")
    s.peer_mss = verdict.get("mss")
    _check_reach([a for a, _ in s.ep.planes], list(verdict.get("planes", [])), "client")
    if not verdict["ok"]:
        diff = [(o, theirs, mine) for o, mine, theirs in verdict["mismatch"]]
        raise PerfError(_mismatch_text(diff, "client", "server"))
    for _ in range(opts.qps - 1):
        s.conns.append(_connect(s))
    s.apply_loss()
    remote = mrc.RemoteRegion.unpack(bytes.fromhex(verdict["region"]))
    # rmr is the region the server writes into (its pongs): the key the server's header
    # shows as remote.
    s.begin(list(verdict.get("planes", [])), rmr.key, remote.key)
    progress = report.ProgressLine(not opts.quiet, opts.test)
    try:
        for step, size in enumerate(opts.sizes()):
            res: BwResult | LatResult
            if opts.is_bw:
                res, sent = _bw_client(s, step, size, smr, remote, progress)
                used = min(slots(opts, size), sum(sent)) * size
                hashes = {"src": digest(src, used)} if opts.verify else {}
                done = {"type": "done", "result": res.as_dict(), "sent": sent, "used": used}
            else:
                res = _lat_client(s, step, size, smr, rmr, remote, progress)
                used = size
                hashes = {"src": digest(src, size), "rx": digest(rx, size)} if opts.verify else {}
                done = {"type": "done", "result": res.as_dict(), "sent": [res.iterations]}
                done["used"] = used
            if opts.verify:
                done["hash"] = hashes["src"]
            s.control().send(done)
            reply = s.control().recv(op_timeout(opts), expect="result")
            if opts.verify:
                ok = reply.get("hash") == hashes["src"]
                if "rx" in hashes:  # the echo came back intact too
                    ok = ok and hashes["rx"] == hashes["src"]
                    rx[:size] = 0
                s.verify_ok = ok if s.verify_ok is None else (s.verify_ok and ok)
                s.verify_note = f"sha256 of the data at both ends, last {used} bytes"
            s.row(res)
    finally:
        progress.close()
    return s.finish()


def _bw_client(
    s: Session,
    step: int,
    size: int,
    smr: mrc.MemoryRegion,
    remote: mrc.RemoteRegion,
    progress: report.ProgressLine,
) -> tuple[BwResult, list[int]]:
    """Keep tx-depth operations in flight per connection, spread round-robin; record when
    each one is seen complete (reaped oldest first, as perftest polls its CQ)."""
    opts, conns = s.opts, s.conns
    nq, nslots, tag = len(conns), slots(opts, size), DATA_TAG + step
    window, tmo = opts.tx_depth * nq, op_timeout(opts)
    write = opts.is_write
    inflight: deque[mrc.Operation] = deque()
    comps: list[float] = []
    sent = [0] * nq
    i = 0
    cpu = CpuUtil() if opts.cpu_util else None
    if cpu:
        cpu.start()
    t0 = time.perf_counter()
    deadline = t0 + opts.duration if opts.duration else None
    try:
        while True:
            if deadline is not None:
                if time.perf_counter() >= deadline:
                    break
            elif i >= opts.iters:
                break
            if len(inflight) >= window:
                inflight.popleft().wait(tmo)
                comps.append(time.perf_counter())
                progress.update(len(comps) * size)
            off = (i % nslots) * size
            c = i % nq
            if write:
                op = conns[c].write(smr, remote, offset=off, length=size, remote_offset=off)
            else:
                op = conns[c].send(smr, offset=off, length=size, tag=tag)
            inflight.append(op)
            sent[c] += 1
            i += 1
        while inflight:
            inflight.popleft().wait(tmo)
            comps.append(time.perf_counter())
    except mrc.MrcError as e:
        raise PerfError(f"{opts.test} of {size} bytes failed after {len(comps)} ops: {e}") from e
    used = cpu.stop() if cpu else None
    return bw_result(size, t0, comps, opts.report_gbits, window, used), sent


def _lat_client(
    s: Session,
    step: int,
    size: int,
    smr: mrc.MemoryRegion,
    rmr: mrc.MemoryRegion,
    remote: mrc.RemoteRegion,
    progress: report.ProgressLine,
) -> LatResult:
    """Ping-pong: one message out, wait for the echo; each round trip timed."""
    opts, conn, tag, tmo = s.opts, s.conns[0], DATA_TAG + step, op_timeout(s.opts)
    write = opts.is_write
    rtts: list[int] = []
    t_end = time.perf_counter() + opts.duration if opts.duration else None
    i = 0
    clock = time.perf_counter_ns
    try:
        while (i < opts.iters) if t_end is None else (time.perf_counter() < t_end):
            if write:
                t0 = clock()
                op = conn.write(smr, remote, length=size, imm=i & 0x7FFFFFFF)
                conn.wait_imm(tmo)
                t1 = clock()
            else:
                r = conn.recv(rmr, length=size, tag=tag)
                t0 = clock()
                op = conn.send(smr, length=size, tag=tag)
                r.wait(tmo)
                t1 = clock()
            op.wait(tmo)
            rtts.append(t1 - t0)
            i += 1
            progress.update(i * size * 2)
    except mrc.MrcError as e:
        raise PerfError(f"{opts.test} of {size} bytes failed after {i} round trips: {e}") from e
    return lat_result(size, rtts)


# ----------------------------------------------------------------------------------------
# --local: both sides in one process


LOCAL_SERVER_NET = "127.0.1"
LOCAL_CLIENT_NET = "127.0.0"


def run_local(opts: PerfOptions, nplanes: int, out: TextIO) -> int:
    """Server in a thread on planes 127.0.1.1..N, client here on 127.0.0.1..N; only the
    client prints (the faults given apply to the client's endpoint)."""
    srv_opts = replace(
        opts,
        planes=[f"{LOCAL_SERVER_NET}.{i + 1}" for i in range(nplanes)],
        port=0,
        server=None,
        fail_plane=[],
        loss=[],
        show_paths=False,
        out_json=False,
        out_json_file=None,
        quiet=True,
    )
    ready = threading.Event()
    box: dict[str, Any] = {}

    def on_listen(port: int) -> None:
        box["port"] = port
        ready.set()

    def serve() -> None:
        try:
            box["rc"] = run_server(srv_opts, io.StringIO(), on_listen=on_listen)
        except BaseException as e:  # reported by the main thread
            box["error"] = e
            ready.set()

    th = threading.Thread(target=serve, name="mrc-perf-local-server", daemon=True)
    th.start()
    ready.wait(30)
    if "error" in box:
        raise box["error"]
    cli_opts = replace(
        opts,
        planes=[f"{LOCAL_CLIENT_NET}.{i + 1}" for i in range(nplanes)],
        server=srv_opts.planes[0],
        port=int(box["port"]),
    )
    rc = run_client(cli_opts, out)
    th.join(op_timeout(opts))
    if "error" in box:
        err = box["error"]
        raise PerfError(f"local server: {err}") if not isinstance(err, PerfError) else err
    return rc
