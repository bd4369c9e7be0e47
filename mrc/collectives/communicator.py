"""The communicator: bootstrap, endpoint and connection mesh (the NCCL model).

    uid = mrc.get_unique_id()                      # rank 0; the framework distributes it
    comm = mrc.Communicator(rank, size, uid)       # every rank
    comm = mrc.Communicator.from_env()             # torchrun, mpirun, srun, mrc-run

Bootstrap: every rank makes its endpoint and listens on plane 0, joins rank 0's
rendezvous (rendezvous.py) with its planes, port and host, and gets the table of all
ranks. Then the mesh: for every pair the lower rank accepts and the higher connects,
naming itself by its rank, so accept knows who called. All of a rank's connects run at
once (one thread each) beside its accept loop, so setting up n ranks costs about one
round of hellos, not n-1. On a fabric every connection gets every route-table path
between the two hosts. The rendezvous connection stays open as the failure detector.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path as FsPath
from typing import Any

from mrc import Connection, Endpoint
from mrc.collectives import rendezvous
from mrc.collectives.ops import Collectives
from mrc.collectives.rendezvous import RendezvousClient, RendezvousServer, UniqueId
from mrc.collectives.resilient import Resilience
from mrc.errors import CollectiveError, MrcError, UsageError
from mrc.routing import Fabric, load_fabric
from mrc.routing import paths as route_paths

DEFAULT_LOOPBACK_PLANES = 4
DEFAULT_PORT = 29501  # rendezvous port when no launcher variable names one
MAX_LOOPBACK_RANKS = 254  # 127.<1 + rank>.0.x: the second octet runs 1..254
VERDICT_GRACE_S = 2.0  # how long a transport error waits for the rendezvous' verdict (peer_error)


def loopback_planes(rank: int, nplanes: int = DEFAULT_LOOPBACK_PLANES) -> list[str]:
    """Rank r's default planes: 127.<1+r>.0.1 .. 127.<1+r>.0.<nplanes>. Every rank on one
    machine gets its own addresses (all of 127/8 is loopback on Linux), so the transport
    sees n distinct multi-plane endpoints, as on a fabric."""
    if not 0 <= rank < MAX_LOOPBACK_RANKS:
        raise UsageError(
            f"default loopback planes cover ranks 0..{MAX_LOOPBACK_RANKS - 1}, got rank {rank}:"
            " pass planes="
        )
    if not 1 <= nplanes <= 16:
        raise UsageError(f"loopback plane count must be 1..16, got {nplanes}")
    return [f"127.{1 + rank}.0.{i + 1}" for i in range(nplanes)]


def _parse_planes(value: str | int | Sequence[str] | None, rank: int) -> list[str]:
    """planes= / MRC_PLANES: a count of loopback planes, or the addresses themselves."""
    if value is None:
        return loopback_planes(rank)
    if isinstance(value, int):
        return loopback_planes(rank, value)
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit():
            return loopback_planes(rank, int(text))
        value = [a.strip() for a in text.split(",") if a.strip()]
    planes = [str(a) for a in value]
    if not planes:
        raise UsageError("planes: empty list of plane addresses")
    return planes


def _weak(method: Callable[..., None]) -> Callable[..., None]:
    """method, holding its object weakly: a call after the object is gone does nothing."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        m = ref()
        if m is not None:
            m(*args)

    return call


class Communicator(Collectives):
    """One rank of a group of `size`: an endpoint and a connection to every other rank.

    rank, size: this rank and the group size. unique_id: rank 0's get_unique_id() bytes.
    planes: this rank's plane addresses (or a count of loopback planes); default 4
    loopback planes 127.<1+rank>.0.1..4. fabric, host: a fabric file (or Fabric) and this
    rank's host in it (default: host number `rank`); the planes are the host's NICs and
    every connection gets the route table's paths. timeout: seconds for the bootstrap and
    for noticing a dead rank. endpoint: more mrc.Endpoint options (mss, window, ...).
    routes (on a fabric): "table" gives each connection the route table's SRv6 paths
    (every plane and spine); "planes" one plain-IPv6 path per plane (the fabric's own
    routing picks the spine); "auto" (default) the table where every rank's kernel puts
    the SRH on after UDP GSO (kernel seg6 routes: SRv6 lightweight tunnels and
    CAP_NET_ADMIN), else planes: with the socket's sticky header every GSO batch is cut
    into datagrams at the sender, and on a kernel without seg6 lwtunnels the 64 MiB
    all_reduce on the 4 x 1 Gbit/s fabric took 333-395 ms with the table against 224-237
    with planes. stats()["routes"] says which and why. MRC_ROUTES sets it in from_env().
    rendezvous_addrs: rank 0's other addresses (its other planes), tried in turn with the
    unique id's when that cannot be reached; MRC_MASTER_ADDRS in from_env() (mrc-run sets
    it on a fabric). Default on a fabric: the other planes of the fabric host that owns the
    unique id's address.
    stats_socket: serve this rank's endpoint stats on a Unix socket at this path ("{rank}"
    in it becomes the rank) for `mrc-route live PATH`, until close(); MRC_STATS_SOCKET in
    from_env() (so `MRC_STATS_SOCKET=/tmp/mrc-{rank}.sock mrc-run ...` serves every rank's).
    """

    def __init__(
        self,
        rank: int,
        size: int,
        unique_id: bytes | bytearray | memoryview | str,
        *,
        planes: str | int | Sequence[str] | None = None,
        fabric: str | FsPath | Fabric | None = None,
        host: str | None = None,
        timeout: float = 60.0,
        endpoint: dict[str, Any] | None = None,
        routes: str = "auto",
        rendezvous_addrs: Sequence[str] = (),
        stats_socket: str | None = None,
    ) -> None:
        self.rank, self.size = _check_rank(rank, size)
        if routes not in ("auto", "table", "planes"):
            raise UsageError(f"routes must be 'auto', 'table' or 'planes', got {routes!r}")
        self.routes = routes  # "auto" is settled from every rank's answer (_settle_routes)
        self.routes_why = "asked for"
        if not 0 < timeout < 2**31 / 1000:
            raise UsageError(f"timeout must be > 0 seconds, got {timeout}")
        self.timeout = float(timeout)
        self.uid = UniqueId.unpack(unique_id)
        self.peers: list[Connection | None] = [None] * size
        self.fabric_info: dict[str, Any] | None = None
        self.hosts: list[str] = []  # host name of every rank (from the table)
        self._failure: CollectiveError | None = None
        self._failed_ev = threading.Event()  # set with _failure
        self._fail_lock = threading.Lock()
        self._closed_ranks: set[int] = set()
        # rank -> collectives it had run with this rank when it closed (under _fail_lock)
        self._closed_runs: dict[int, int] = {}
        self._released = threading.Event()  # every rank reached close() (or failed)
        self._closed = False
        self._collectives_started = False
        self._server: RendezvousServer | None = None
        self._client: RendezvousClient | None = None
        self.endpoint: Endpoint
        self._fabric: Fabric | None = None
        self.host: str

        self._make_endpoint(planes, fabric, host, endpoint or {})
        if not rendezvous_addrs and self._fabric is not None:
            rendezvous_addrs = _server_planes(self._fabric, self.uid.addr)
        self.stats_socket = stats_socket.replace("{rank}", str(self.rank)) if stats_socket else None
        try:
            if self.stats_socket:  # closed with the endpoint
                self.endpoint.serve_stats(self.stats_socket)
            if self.rank == 0:
                self._server = rendezvous.take_server(self.uid) or rendezvous.try_serve(self.uid)
                if self._server is not None:
                    # Links on rank 0's other planes: a pulled cable under the rendezvous'
                    # own connection must not silence a healthy rank (rendezvous.py).
                    self._server.add_links([addr for addr, _ in self.endpoint.planes])
            self._client = RendezvousClient(self.uid, self.timeout, rendezvous_addrs)
            infos = self._client.join(self.rank, self.size, self._info())
            # Weakly: a monitor holding the communicator would keep a dropped one (and its
            # threads, sockets and endpoint) alive until the process exits.
            self._client.start_monitor(
                _weak(self._on_failed), _weak(self._on_closed), self._released.set
            )
            self._take_table(infos)
            self._settle_routes(infos)
            self._connect_mesh(infos)
            init = getattr(self, "_collectives_init", None)
            if init is not None:
                init()
                # Issue 13: all_reduce's shares from the agreed bandwidths (resilient.py).
                self._resilience = Resilience(self)
            with self._fail_lock:
                self._collectives_started = True
                early = dict(self._closed_runs)
            # Ranks that closed while this one was still connecting (a fast rank that
            # had nothing to do): their later calls fail at once, as they would have.
            for rank, runs in early.items():
                self._peer_gone(rank, runs)
            # A failure the monitor saw before the executor existed was not passed on.
            if self._failure is not None:
                raise self._failure
        except BaseException as e:
            message = f"rank {self.rank} failed to set up its communicator: {e}"
            self._teardown({"op": "abort", "message": message})
            raise

    # --- construction ------------------------------------------------------------------

    def _make_endpoint(
        self,
        planes: str | int | Sequence[str] | None,
        fabric: str | FsPath | Fabric | None,
        host: str | None,
        ep_options: dict[str, Any],
    ) -> None:
        if fabric is None:
            if host is not None:
                raise UsageError(f"host={host!r} names a fabric host, but no fabric= is given")
            self.host = socket.gethostname()
            self.endpoint = Endpoint(_parse_planes(planes, self.rank), **ep_options)
            return
        fab = fabric if isinstance(fabric, Fabric) else load_fabric(fabric)
        if host is None:
            if self.rank >= len(fab.hosts):
                raise UsageError(
                    f"rank {self.rank} has no default host: fabric {fab.name} has "
                    f"{len(fab.hosts)} hosts; pass host="
                )
            host = fab.hosts[self.rank].name
        try:
            h = fab.host(host)
        except KeyError:
            names = ", ".join(x.name for x in fab.hosts)
            raise UsageError(f"no host {host!r} in fabric {fab.name} (hosts: {names})") from None
        addrs = list(h.addrs) if planes is None else _parse_planes(planes, self.rank)
        self._fabric, self.host = fab, h.name
        self.endpoint = Endpoint(addrs, **ep_options)
        rates = [fab.host_link(h.name, p).rate_bps for p in range(len(h.addrs))]
        self.fabric_info = {"fabric": fab.name, "host": h.name, "planes": addrs, "rates_bps": rates}

    def _info(self) -> dict[str, Any]:
        port = self.endpoint.listen()
        return {
            "rank": self.rank,
            "host": self.host,
            "planes": [a for a, _ in self.endpoint.planes],
            "port": port,
            "pid": os.getpid(),
            "rates_bps": None if self.fabric_info is None else self.fabric_info["rates_bps"],
            # Only asked where it decides something (one route added and removed).
            "srh_offload": (
                self.endpoint.srh_offload()
                if self.routes == "auto" and self._fabric is not None
                else None
            ),
        }

    def _settle_routes(self, infos: list[dict[str, Any]]) -> None:
        """routes="auto": the route table when every rank's SRv6 paths keep UDP GSO, else
        one path per plane. Every rank reads the same table, so all choose alike (the
        two ends of a connection must build the same paths)."""
        if self.routes != "auto":
            return
        if self._fabric is None:
            self.routes, self.routes_why = "planes", "no fabric: the endpoint's own planes"
            return
        sticky = [r for r, i in enumerate(infos) if not i.get("srh_offload")]
        if not sticky:
            self.routes = "table"
            self.routes_why = "auto: every rank's kernel puts the SRH on after UDP GSO"
            return
        self.routes = "planes"
        self.routes_why = (
            f"auto: rank{'s' if len(sticky) > 1 else ''} {', '.join(map(str, sticky))} "
            "would send the SRH as a sticky socket header (no kernel seg6 routes: a kernel "
            "without SRv6 lightweight tunnels, or no CAP_NET_ADMIN), which cuts every UDP "
            "GSO batch into datagrams; routes='table' keeps the SRv6 paths anyway"
        )

    def _take_table(self, infos: list[dict[str, Any]]) -> None:
        self.hosts = [str(i["host"]) for i in infos]
        if self.fabric_info is not None:
            # The planner wants every rank's plane rates, not only this host's.
            self.fabric_info["ranks"] = [
                {"host": i["host"], "rates_bps": i["rates_bps"]} for i in infos
            ]

    def _paths_to(self, rank: int) -> list[Any] | None:
        if self._fabric is None or self.hosts[rank] == self.host or self.routes == "planes":
            return None  # loopback, two ranks of one host, or asked: the endpoint's own planes
        return route_paths(self._fabric, self.host, self.hosts[rank])

    def _connect_mesh(self, infos: list[dict[str, Any]]) -> None:
        deadline = time.monotonic() + self.timeout
        lower = list(range(self.rank))  # we connect to these
        higher = list(range(self.rank + 1, self.size))  # these connect to us
        errors: list[CollectiveError] = []

        def connect(peer: int) -> None:
            info = infos[peer]
            # Every plane of the peer at once (the first to answer carries the set-up):
            # a pulled cable on one does not keep the pair apart.
            addrs, port = list(info["planes"]), int(info["port"])
            addr = ", ".join(addrs)
            try:
                self.peers[peer] = self.endpoint.connect(
                    addrs,
                    port,
                    timeout=max(0.1, deadline - time.monotonic()),
                    paths=self._paths_to(peer),
                    name=str(self.rank),
                )
            except MrcError as e:
                errors.append(
                    CollectiveError(
                        f"rank {self.rank} could not connect to rank {peer} "
                        f"({info['host']}, {addr} port {port}): {e}",
                        rank=peer,
                    )
                )

        with ThreadPoolExecutor(max_workers=max(1, min(len(lower), 32))) as pool:
            futures = [pool.submit(connect, p) for p in lower]
            try:
                self._accept_all(higher, deadline)
            except CollectiveError as e:
                errors.append(e)
            for f in futures:
                f.result()
        if errors:
            raise errors[0]

    def _accept_all(self, expected: Iterable[int], deadline: float) -> None:
        waiting = set(expected)

        def paths_for(name: str) -> list[Any]:
            peer = _rank_of(name, self.size)  # empty: the endpoint's own plane pairs
            return (None if peer is None else self._paths_to(peer)) or []

        while waiting:
            left = deadline - time.monotonic()
            if left <= 0 or self._failure is not None:
                break
            try:
                conn = self.endpoint.accept(
                    timeout=min(left, 0.5), paths=paths_for, name=str(self.rank)
                )
            except MrcError as e:
                if isinstance(e, TimeoutError):
                    continue  # poll the failure flag between waits
                raise CollectiveError(f"rank {self.rank}: accepting a peer failed: {e}") from e
            peer = _rank_of(conn.peer_name, self.size)
            if peer not in waiting:
                # Not one we wait for (a stray, or a duplicate rank): refuse it.
                conn.close()
                continue
            self.peers[peer] = conn
            waiting.discard(peer)
        if self._failure is not None:
            raise self._failure
        if waiting:
            missing = sorted(waiting)
            raise CollectiveError(
                f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did "
                f"not connect to rank {self.rank} within {self.timeout:g} s",
                rank=missing[0] if len(missing) == 1 else None,
            )

    # --- failures ------------------------------------------------------------------------

    @property
    def failure(self) -> CollectiveError | None:
        """The error that ended this communicator (a dead rank, an abort), or None."""
        return self._failure

    def _on_failed(self, rank: int | None, message: str) -> None:
        self._set_failure(CollectiveError(message, rank=rank))
        self._released.set()  # close() waits for no one any more

    def _on_closed(self, rank: int | None, runs: list[int] | None = None) -> None:
        self._closed_ranks.add(0 if rank is None else rank)
        if rank is not None and runs is not None and len(runs) == self.size:
            with self._fail_lock:  # before the executor exists, kept for it (__init__)
                self._closed_runs[rank] = runs[self.rank]
                started = self._collectives_started
            if started:
                self._peer_gone(rank, runs[self.rank])
        if rank is None:
            self._released.set()  # the rendezvous is gone

    def _peer_gone(self, rank: int, runs: int) -> None:
        """A call it never made fails now, not at the timeout (the Collectives mixin)."""
        gone = getattr(self, "_collectives_peer_gone", None)
        if gone is not None:
            gone(rank, runs)

    def _set_failure(self, err: CollectiveError) -> bool:
        """Record the first failure and stop the collectives; later ones are ignored."""
        with self._fail_lock:
            if self._failure is not None:
                return False
            self._failure = err
            self._failed_ev.set()
            closed = self._closed
        abort = getattr(self, "_collectives_abort", None)
        if abort is not None and self._collectives_started and not closed:
            abort(err)
        return True

    def check_failure(self) -> None:
        """Raise the failure that ended this communicator, if any (for the collectives)."""
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise CollectiveError(f"rank {self.rank}: the communicator is closed", self.rank)

    def peer_error(self, peer: int, exc: BaseException) -> CollectiveError:
        """The CollectiveError for a transport error on the connection to `peer`: the
        rendezvous' verdict when it has one (it knows a rank died, not only that a
        connection broke), else one naming the peer and the transport's error.

        The verdict is waited for a moment (VERDICT_GRACE_S): when a rank dies, a survivor
        that heard of it first ends its collective and exits, and its connections close
        under the ranks still in theirs, which could otherwise blame it (clean-clone CI:
        rank 3 got "connection to rank 1 failed: connection closed" while the
        rendezvous' "rank 2 exited" was on its way)."""
        if self._failure is None and self._client is not None:
            self._failed_ev.wait(min(VERDICT_GRACE_S, self.timeout / 4))
        if self._failure is not None:
            return self._failure
        # No verdict, and rank 0's rendezvous has been silent for several beats: the
        # reasons of the ranks that gave up cannot reach this one, and rank 0 hanging is
        # as likely a cause as the peer. Said, and no rank blamed: when rank 0 hung, the
        # ranks that found it named it, and the others blamed a rank that closed its
        # connections on giving up (in one run 6 of the 7 survivors, each naming an
        # innocent one).
        silent = 0.0
        if self._client is not None and peer != 0:
            silent = self._client.silent_for()
        beat = rendezvous.heartbeat_interval(self.timeout, self.size)
        rank0 = silent > rendezvous.STALE_BEATS * beat
        hint = (
            f"; rank 0 (the rendezvous) has sent nothing for {silent:.1f} s, so no rank's "
            "reason can reach this one: rank 0 stopped or cut off would explain both"
            if rank0
            else ""
        )
        if isinstance(exc, CollectiveError):
            return CollectiveError(f"{exc}{hint}", rank=None, code=exc.code) if rank0 else exc
        code = int(getattr(exc, "code", 0) or 0)
        closed = " (it closed its communicator)" if peer in self._closed_ranks else ""
        return CollectiveError(
            f"rank {self.rank}: connection to rank {peer}{closed} failed: "
            f"{type(exc).__name__}: {exc}{hint}",
            rank=None if rank0 else peer,
            code=code,
        )

    def _tell_group(self, err: CollectiveError) -> None:
        """What ended this rank's communicator, found here (a peer unreachable, or silent
        for the timeout), to every other rank through the rendezvous, blaming the rank at
        fault: a rank waiting on this one would otherwise see only this rank go quiet or
        its connections close, and blame it (or wait its whole timeout)."""
        if self._client is not None:
            self._client.send({"op": "abort", "message": str(err), "blame": err.rank})

    def abort(self, reason: str = "aborted by the caller") -> None:
        """End the communicator from any thread: pending and later collectives raise
        CollectiveError, here and (through the rendezvous) on every other rank."""
        err = CollectiveError(f"rank {self.rank} aborted its communicator: {reason}", self.rank)
        if self._set_failure(err) and self._client is not None:
            self._client.send({"op": "abort", "message": str(err)})

    # --- life ----------------------------------------------------------------------------

    def close(self) -> None:
        """Collective and idempotent: stop the collectives, wait (up to the timeout) until
        every rank is in close() or has failed, then close every connection and the
        endpoint (rank 0: and the rendezvous). The wait is why closing is safe: a rank
        that tore its connections down at once could fail a peer's last SEND, whose data
        it holds but whose ACK it never sent."""
        self._teardown({"op": "bye"})

    def _teardown(self, goodbye: dict[str, Any]) -> None:
        with self._fail_lock:  # one teardown, also when two threads close at once
            if self._closed:
                return
            self._closed = True
        if self._collectives_started:
            close = getattr(self, "_collectives_close", None)
            if close is not None:
                close()
        if self._client is not None:
            if goodbye["op"] == "bye" and self._failure is None:
                runs = getattr(self, "_collectives_runs", None)
                if runs is not None and self._collectives_started:
                    goodbye = {**goodbye, "runs": runs()}
                self._client.send(goodbye)
                self._released.wait(self.timeout)
                self._client.close()
            else:
                self._client.close(goodbye)
        for i, conn in enumerate(self.peers):
            if conn is not None:
                conn.close()
                self.peers[i] = None
        self.endpoint.close()
        if self._server is not None:
            self._server.stop()
            self._server = None

    def stats(self) -> dict[str, Any]:
        """This rank's view: rank, size, host, the paths its connections use ("routes":
        "table" or "planes", and why), the resilient planner's agreed bandwidths and
        chosen schedule ("resilient"), and the endpoint's stats ("endpoint")."""
        res = getattr(self, "_resilience", None)
        return {
            "rank": self.rank,
            "size": self.size,
            "host": self.host,
            "routes": {"used": self.routes, "why": self.routes_why},
            "resilient": None if res is None else res.stats(),
            "endpoint": None if self.endpoint.closed else self.endpoint.stats(),
        }

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Dropped without close(): like an unclosed file, warn and let go at once (not
        # close()'s wait for the others, which could block whatever thread drops it); the
        # other ranks learn this rank is gone, as from an abort.
        if getattr(self, "_closed", True) or sys.is_finalizing():
            return  # closed, never built, or the process' exit ends it (as it did before)
        warnings.warn(f"unclosed {self!r}: close() it or use `with`", ResourceWarning, stacklevel=2)
        self._teardown(
            {"op": "abort", "message": f"rank {self.rank} dropped its communicator unclosed"}
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("failed" if self._failure else "up")
        return f"<mrc.Communicator rank {self.rank} of {self.size} on {self.host} {state}>"

    # --- launchers -------------------------------------------------------------------------

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **kwargs: Any) -> Communicator:
        """A communicator from the variables a launcher sets (see launch_env())."""
        cfg = launch_env(os.environ if env is None else env)
        for key in ("planes", "fabric", "host", "timeout", "rendezvous_addrs", "stats_socket"):
            if key in cfg and key not in kwargs:
                kwargs[key] = cfg[key]
        if "endpoint" in cfg:  # MRC_ENDPOINT_TIMEOUT, under the caller's endpoint options
            kwargs["endpoint"] = {**cfg["endpoint"], **(kwargs.get("endpoint") or {})}
        routes = (os.environ if env is None else env).get("MRC_ROUTES")
        if routes and "routes" not in kwargs:
            kwargs["routes"] = routes
        return cls(cfg["rank"], cfg["size"], cfg["unique_id"], **kwargs)


def _server_planes(fab: Fabric, addr: str) -> list[str]:
    """The other plane addresses of the fabric host that owns `addr` (rank 0's host, when
    the unique id names one of its planes), so a rank whose cable to that plane is down
    joins over another one without being told (torchrun, Slurm: no MRC_MASTER_ADDRS)."""
    try:
        want = ipaddress.ip_address(addr)
    except ValueError:
        return []  # a host name: not a fabric address
    for h in fab.hosts:
        mine = [ipaddress.ip_address(a) for a in h.addrs]
        if want in mine:
            return [a for a, ip in zip(h.addrs, mine, strict=True) if ip != want]
    return []


def _check_rank(rank: int, size: int) -> tuple[int, int]:
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise UsageError(f"rank must be an int, got {rank!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise UsageError(f"size must be an int >= 1, got {size!r}")
    if not 0 <= rank < size:
        raise UsageError(
            f"rank {rank} out of range for a communicator of {size} ranks (0..{size - 1})"
        )
    return rank, size


def _rank_of(name: str, size: int) -> int | None:
    try:
        r = int(name)
    except ValueError:
        return None
    return r if 0 <= r < size else None


# (rank variable, size variable, launcher): the first pair present wins.
RANK_VARS = (
    ("RANK", "WORLD_SIZE", "torchrun / mrc-run"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "Open MPI"),
    ("PMI_RANK", "PMI_SIZE", "MPICH / PMI"),
    ("SLURM_PROCID", "SLURM_NTASKS", "Slurm"),
)
# Variables naming the run: ranks of one run derive the same token, other runs another.
RUN_ID_VARS = (
    "MRC_RUN_ID",
    "TORCHELASTIC_RUN_ID",
    "OMPI_MCA_ess_base_jobid",
    "PMIX_NAMESPACE",
    "SLURM_JOB_ID",
)


def _int_var(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{name}={value!r} is not an integer") from None


def rendezvous_port(env: Mapping[str, str]) -> int:
    """MRC_PORT; else MASTER_PORT + 1 (torchrun's own store listens on MASTER_PORT);
    else 29501, plus SLURM_JOB_ID % 1000 under Slurm so jobs sharing a node differ."""
    if "MRC_PORT" in env:
        port = _int_var(env, "MRC_PORT")
    elif "MASTER_PORT" in env:
        port = _int_var(env, "MASTER_PORT") + 1
    elif "SLURM_JOB_ID" in env and env["SLURM_JOB_ID"].isdigit():
        port = DEFAULT_PORT + int(env["SLURM_JOB_ID"]) % 1000
    else:
        port = DEFAULT_PORT
    if not 0 < port < 65536:
        raise UsageError(f"rendezvous port {port} out of range 1..65535 (MRC_PORT/MASTER_PORT)")
    return port


def launch_env(env: Mapping[str, str]) -> dict[str, Any]:
    """What from_env() builds the communicator from: rank, size, unique_id and any of
    planes (MRC_PLANES), fabric (MRC_FABRIC), host (MRC_HOST), timeout (MRC_TIMEOUT),
    rendezvous_addrs (MRC_MASTER_ADDRS, comma-separated), stats_socket
    (MRC_STATS_SOCKET), endpoint={"timeout": MRC_ENDPOINT_TIMEOUT}."""
    for rank_var, size_var, _who in RANK_VARS:
        if rank_var in env and size_var in env:
            rank, size = _int_var(env, rank_var), _int_var(env, size_var)
            break
    else:
        names = ", ".join(f"{r}/{s}" for r, s, _ in RANK_VARS)
        raise UsageError(
            f"no launcher variables for the rank and size: set one of {names}, or start "
            "the ranks with a launcher (mrc-run -n N -- CMD, torchrun, mpirun, srun)"
        )
    _check_rank(rank, size)
    addr = env.get("MRC_MASTER_ADDR") or env.get("MASTER_ADDR") or "127.0.0.1"
    port = rendezvous_port(env)
    run_id = next((env[v] for v in RUN_ID_VARS if env.get(v)), "")
    token = rendezvous.env_token(addr, port, run_id)
    cfg: dict[str, Any] = {
        "rank": rank,
        "size": size,
        "unique_id": UniqueId(addr, port, token).pack(),
    }
    if env.get("MRC_FABRIC"):
        cfg["fabric"] = env["MRC_FABRIC"]
    if env.get("MRC_HOST"):
        cfg["host"] = env["MRC_HOST"]
    if env.get("MRC_PLANES"):
        cfg["planes"] = env["MRC_PLANES"]
    if env.get("MRC_MASTER_ADDRS"):  # rank 0's other addresses (mrc-run: its planes)
        cfg["rendezvous_addrs"] = [
            a.strip() for a in env["MRC_MASTER_ADDRS"].split(",") if a.strip()
        ]
    if env.get("MRC_STATS_SOCKET"):
        cfg["stats_socket"] = env["MRC_STATS_SOCKET"]
    if env.get("MRC_TIMEOUT"):
        cfg["timeout"] = seconds_var(env, "MRC_TIMEOUT")
    if env.get("MRC_ENDPOINT_TIMEOUT"):
        cfg["endpoint"] = {"timeout": seconds_var(env, "MRC_ENDPOINT_TIMEOUT")}
    return cfg


def seconds_var(env: Mapping[str, str], name: str) -> float:
    """env[name] as a timeout in seconds, or a UsageError naming the variable."""
    try:
        secs = float(env[name])
    except ValueError:
        raise UsageError(f"{name}={env[name]!r} is not a number") from None
    if not 0 < secs < 2**31 / 1000:
        raise UsageError(f"{name}={env[name]!r}: seconds > 0 expected")
    return secs


def get_unique_id(addr: str | None = None, port: int = 0) -> bytes:
    """Start rank 0's rendezvous in this process (on `addr`, default MASTER_ADDR or
    127.0.0.1; port 0: any free one) and return the opaque id every rank passes to
    Communicator(). The server lives until rank 0's communicator closes (or this process
    ends)."""
    return rendezvous.get_unique_id(
        addr or os.environ.get("MRC_MASTER_ADDR") or os.environ.get("MASTER_ADDR") or "127.0.0.1",
        port,
    )


__all__ = ["Communicator", "get_unique_id", "launch_env", "loopback_planes"]
