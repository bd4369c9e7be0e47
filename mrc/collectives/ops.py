"""The collective operations: the `Collectives` mixin the Communicator inherits.

Every method validates its arguments, takes the schedule for the call from the
planner (mrc.collectives.schedule, cached per shape), and runs it in the C
executor (src_c/coll.c) in one call without the GIL. It needs from the class
it is mixed into: rank, size, endpoint (mrc.Endpoint), peers (list by rank of
mrc.Connection, None at rank) and timeout (seconds); the communicator calls
_collectives_init() once the mesh is up and _collectives_close() on close.

Errors are mrc.errors.CollectiveError with .rank (the peer that failed or
disagreed) and .code. After one, the communicator is over: its connections
are closed (operations may still have been pending on them) and every later
call raises the same error.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from mrc import _datapath
from mrc import gpu as _gpu
from mrc._datapath import CollExecutor, strerror
from mrc.collectives import model
from mrc.collectives import schedule as S
from mrc.collectives.resilient import env_int
from mrc.errors import CollectiveError, TimeoutError, UsageError

DTYPES = {
    "int8": 0,
    "uint8": 1,
    "int32": 2,
    "int64": 3,
    "float16": 4,
    "bfloat16": 5,
    "float32": 6,
    "float64": 7,
}
OPS = {"sum": 0, "prod": 1, "min": 2, "max": 3, "avg": 4}
_MISMATCH = _datapath.MISMATCH
_ABORTED = _datapath.ABORTED
_ETIMEOUT = _datapath.ETIMEOUT
_GONE = _datapath.GONE
_STALLED = _datapath.STALLED
# Failures that are this rank's own finding about a peer (the run's timeout, the
# connection's: no progress or every path failed, receiver not ready), not a
# consequence of another rank giving up.
_FINDINGS = (_STALLED, _ETIMEOUT, _datapath.EPATHDOWN, _datapath.ERNR)
# The transport's own give-up (the endpoint's timeout, 5 s by default: a hung peer is
# found long before the communicator's timeout), said as such.
_TRANSPORT_TIMEOUTS = (_ETIMEOUT, _datapath.EPATHDOWN)
_PLAN_CACHE = 256
CHUNK_BYTES = 256 << 10  # the executor's default chunk (src_c/coll.c)
SCRATCH_BUDGET = 16 << 20  # scratch rings per communicator, while 4 slots per ring fit
SLOTS_MIN, SLOTS_MAX = 4, 16
# Chunks in flight per peer and direction, 4 as before the rings grew: 16 with 16 slots
# was no faster (241 ms against 238-246, the degraded runs of scratch_slots) and staged
# no less (coll_memory: 5.5-17.5 MiB per rank against 1.0-14.5).
WINDOW = 4
ALL_REDUCE_ALGOS = ("auto", "direct", "gather", "chain", "hier", "tree")

log = logging.getLogger("mrc.collectives")
# Small calls (send + recv within the executor's 256 KiB bounce slots): the progress
# thread polls for this long from each one's start instead of sleeping, and calls of up
# to 4 KiB run the progress on the calling thread that long instead (MRC_BUSY_POLL_US;
# 0: neither, the thread sleeps). On the shaped fabric, 4 ranks on 2 cores, 8 rounds
# interleaved: 8 B all_reduce 109-182 us polling against 242-263 us sleeping (medians
# 135, 255); 2 ranks, 8 B 35 us on the calling thread against 58 polling; 1 MiB
# unchanged (docs/architecture.md, "Where a small collective's time goes").
BUSY_POLL_US = 1000
# ... unless this host runs more ranks than this many per core: then the spinning threads
# take the cores from the ranks that have work, and a schedule whose hops depend on each
# other (the tree) waits for them. One 2-core host under mrc-run, 8 B all_reduce: polling
# 430-560 us against 840-1030 sleeping at 8 ranks (4 per core); at 16 ranks the tree
# 2.8-5.9 ms polling against 2.0-2.9 sleeping, at 32 5.6-12.4 against 4.8-7.2, and the
# 32-rank dissemination barrier 25 against 11 ms.
BUSY_POLL_MAX_RANKS_PER_CORE = 4


def scratch_slots(n: int, chunk: int = 0) -> int:
    """Slots per scratch ring (the pipeline depth and the all-gather's lag): as many
    as SCRATCH_BUDGET holds for the n-1 rings of a direct schedule, 4 to 16.

    Deep rings let the senders that are ahead run further ahead of the slowest one:
    with h1's plane 1 down on the shaped fabric the resilient all_reduce of 64 MiB took
    258-264 ms with 4 slots, 251-254 with 8, 238-250 with 16 and 241 with 32; healthy
    ones 214 ms with any (docs/architecture.md, "The executor"). 4 ranks: 16 slots,
    12 MiB; 8 ranks: 9; from 14 ranks on 4, (n-1) MiB (over the budget from 18).
    chunk 0: the default."""
    rings = max(n - 1, 1)
    return max(SLOTS_MIN, min(SLOTS_MAX, SCRATCH_BUDGET // (rings * (chunk or CHUNK_BYTES))))


assert S.STEP_DTYPE.itemsize == _datapath.COLL_STEP_SIZE, "schedule.STEP_DTYPE != C struct"
assert S.REF_DTYPE.itemsize == _datapath.COLL_REF_SIZE, "schedule.REF_DTYPE != C struct"


class Work:
    """An operation started with async_op=True. Runs in issue order on the
    communicator's worker thread."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._event = threading.Event()
        self._exc: BaseException | None = None
        self._result: Any = None

    def _finish(self, result: Any, exc: BaseException | None) -> None:
        self._result, self._exc = result, exc
        self._event.set()

    def wait(self, timeout: float | None = None) -> Any:
        """The operation's result (its recv buffer); raises its error. timeout:
        seconds (None: until done); raises mrc.TimeoutError if still running."""
        if timeout is not None and not timeout >= 0:  # also nan: as Operation.wait
            raise UsageError(f"timeout must be >= 0 seconds, got {timeout}")
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self.what} still running after {timeout} s")
        if self._exc is not None:
            raise self._exc
        return self._result

    def done(self) -> bool:
        return self._event.is_set()

    def exception(self) -> BaseException | None:
        """The error once done (None if it succeeded or is still running)."""
        return self._exc if self._event.is_set() else None

    def result(self) -> Any:
        return self.wait()

    def __repr__(self) -> str:
        state = "failed" if self._exc else "done" if self.done() else "pending"
        return f"<mrc.collectives.Work {self.what} {state}>"


class _Buf:
    """A caller's buffer seen as bytes: the object to hand to C, dtype, count."""

    __slots__ = ("obj", "dtype", "count", "esize")

    def __init__(self, obj: Any, dtype: str, count: int, esize: int) -> None:
        self.obj, self.dtype, self.count, self.esize = obj, dtype, count, esize


def _torch_array(t: Any) -> tuple[np.ndarray, str | None]:
    import torch  # only when given a tensor

    if t.device.type != "cpu":
        raise UsageError(f"collectives take CPU tensors, got one on {t.device}")
    if not t.is_contiguous():
        raise UsageError("collectives take contiguous tensors (call .contiguous())")
    if t.dtype == torch.bfloat16:
        return t.detach().view(torch.int16).numpy(), "bfloat16"
    return t.detach().numpy(), None


def as_buffer(obj: Any, dtype: str | None, what: str, writable: bool) -> _Buf:
    """numpy arrays, torch CPU tensors, any buffer-protocol object (its format
    gives the dtype). bfloat16: dtype="bfloat16" with 2-byte storage (uint16)."""
    forced: str | None = None
    if type(obj) is np.ndarray:
        arr = obj
    elif type(obj).__module__.startswith("torch"):
        arr, forced = _torch_array(obj)
    elif isinstance(obj, np.ndarray):
        arr = obj
    else:
        try:
            arr = np.asarray(memoryview(obj))
        except TypeError:
            raise UsageError(
                f"{what}: {type(obj).__name__} is not a buffer (numpy array, tensor, bytearray...)"
            ) from None
    if not arr.flags.c_contiguous:
        raise UsageError(f"{what}: the array must be C-contiguous (np.ascontiguousarray)")
    if not arr.dtype.isnative:
        fix = "arr.astype(arr.dtype.newbyteorder('='))"
        raise UsageError(f"{what}: {arr.dtype.str} is not this host's byte order ({fix})")
    if writable and not arr.flags.writeable:
        raise UsageError(f"{what}: the buffer is read-only, and this call writes into it")
    name = dtype or forced or _dtype_name(arr.dtype)
    if name == "bfloat16":
        if arr.dtype.itemsize != 2:
            raise UsageError(f"{what}: bfloat16 needs 2-byte storage (uint16), got {arr.dtype}")
    elif name not in DTYPES:
        raise UsageError(f"{what}: dtype {name} is not one of {', '.join(DTYPES)}")
    elif dtype is not None and _dtype_name(arr.dtype) != dtype:
        raise UsageError(f"{what}: dtype={dtype} given for a {arr.dtype} array")
    esize = 2 if name == "bfloat16" else np.dtype(name).itemsize
    return _Buf(arr if arr.size else None, name, arr.size, esize)


_DTYPE_NAMES: dict[np.dtype, str] = {}


def _dtype_name(dt: np.dtype) -> str:
    """dt.name, remembered: numpy computes it in Python on every access."""
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = _DTYPE_NAMES[dt] = dt.name
    return name


def _op(op: str) -> int:
    code = OPS.get(op)
    if code is None:
        raise UsageError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    return code


@lru_cache(maxsize=1024, typed=True)
def signature(*parts: object) -> int:
    """19 bits naming the call (kind, count, dtype, op, root...): every rank
    computes the same value from the same arguments."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFF


def _coll_work(ref: weakref.ref[Collectives], jobs: queue.Queue[Any]) -> None:
    """The async calls' worker, in order. It holds its communicator only while a job
    runs (the job does): waiting for the next one it must not keep a dropped
    communicator alive."""
    while True:
        item = jobs.get()
        if item is None:
            return
        fn, work = item
        try:
            result, exc = fn(), None
        except BaseException as e:  # handed to the Work's waiter
            result, exc = None, e
        comm = ref()
        if comm is not None:
            with comm._coll_qlock:
                comm._coll_queued -= 1
        work._finish(result, exc)
        del item, fn, work, result, exc, comm  # nothing held while waiting


class Collectives:
    """The collective methods of mrc.Communicator (docs/architecture.md, "Collectives")."""

    rank: int
    size: int
    endpoint: Any
    peers: list[Any]
    timeout: float
    chunk_bytes: int = 0  # 0: the executor's default (256 KiB)
    slots: int = 0  # scratch slots per ring, the pipeline depth and lag; 0: scratch_slots()
    # None: MRC_BUSY_POLL_US, else BUSY_POLL_US (0 on a host with more ranks than
    # BUSY_POLL_MAX_RANKS_PER_CORE per core, as the communicator's hosts say)
    busy_poll_us: int | None = None
    all_reduce_algo: str | None = None  # what algo="auto" means; None: MRC_ALGO, else "auto"
    # From how many ranks small calls go up and down a binomial tree (schedule.tree_fits);
    # None: MRC_TREE_MIN_RANKS, else schedule.TREE_MIN_RANKS. The same on every rank.
    tree_min_ranks: int | None = None

    # -- life (called by the communicator) --
    def _collectives_init(self) -> None:
        if not self.slots:
            self.slots = scratch_slots(self.size, self.chunk_bytes)
        if self.busy_poll_us is None:
            self.busy_poll_us = env_int("MRC_BUSY_POLL_US", self._default_busy_poll())
        if not 0 <= self.busy_poll_us <= 1_000_000:
            raise UsageError(f"busy_poll_us = {self.busy_poll_us}: must be 0 to 1000000")
        if self.tree_min_ranks is None:
            self.tree_min_ranks = env_int("MRC_TREE_MIN_RANKS", S.TREE_MIN_RANKS)
        if self.tree_min_ranks < 2:
            raise UsageError(
                f"MRC_TREE_MIN_RANKS (or tree_min_ranks) = {self.tree_min_ranks}: must be >= 2"
            )
        if self.all_reduce_algo is None:
            self.all_reduce_algo = os.environ.get("MRC_ALGO", "") or "auto"
        if self.all_reduce_algo not in ALL_REDUCE_ALGOS:
            raise UsageError(
                f"MRC_ALGO (or all_reduce_algo) = {self.all_reduce_algo!r}: must be one of "
                + ", ".join(ALL_REDUCE_ALGOS)
            )
        self._coll_exec = CollExecutor(
            self.endpoint,
            self.rank,
            self.size,
            self.peers,
            chunk_bytes=self.chunk_bytes,
            slots=self.slots,
            window=WINDOW,
            busy_poll_us=self.busy_poll_us,
        )
        self._coll_failure: CollectiveError | None = None
        self._coll_plans: OrderedDict[tuple, S.Packed] = OrderedDict()
        self._layouts: dict[tuple, tuple[str, str]] = {}  # _layout_algo's answers
        self._layout_last: tuple[str, str] | None = None
        self._coll_calls: dict[tuple, tuple[str, S.Packed, int, int, int]] = {}
        self._coll_queue: queue.Queue[tuple[Callable[[], Any], Work] | None] = queue.Queue()
        self._coll_qlock = threading.Lock()
        self._coll_queued = 0
        self._coll_worker: threading.Thread | None = None
        self._coll_closed = False
        self._coll_stats: dict[str, Any] = {"ops": 0, "by_kind": {}, "last": None}
        self._coll_last: tuple[str, S.Packed, float] | None = None

    def _collectives_abort(self, err: CollectiveError) -> None:
        """The communicator failed (or was aborted): end the running collective."""
        if self._coll_failure is None:
            self._coll_failure = err
        self._coll_exec.abort()

    def _collectives_close(self) -> None:
        with self._coll_qlock:  # a racing _submit then starts no worker
            self._coll_closed = True
            worker = self._coll_worker
        self._coll_exec.abort()
        if worker is not None:
            self._coll_queue.put(None)
            if worker is not threading.current_thread():  # dropped by its own last job
                worker.join(timeout=max(self.timeout, 1.0))
        self._coll_exec.close()

    def _collectives_runs(self) -> list[int]:
        """Collectives completed with each rank (after _collectives_close)."""
        return list(self._coll_exec.final_runs)

    def _collectives_peer_gone(self, peer: int, runs: int) -> None:
        """Any thread: `peer` closed after `runs` collectives with this rank."""
        if peer != self.rank and 0 <= peer < self.size:
            self._coll_exec.peer_gone(peer, runs)

    def abort(self, reason: str = "aborted by the caller") -> None:
        """From any thread: the running and every later collective raise CollectiveError."""
        self._collectives_abort(
            CollectiveError(f"rank {self.rank} aborted its communicator: {reason}", self.rank)
        )

    # -- running --
    def _plan(self, key: tuple, build: Callable[[], S.Schedule]) -> S.Packed:
        plans = self._coll_plans
        packed = plans.get(key)
        if packed is None:
            packed = build().pack()
            plans[key] = packed
            if len(plans) > _PLAN_CACHE:
                plans.popitem(last=False)
        else:
            plans.move_to_end(key)
        return packed

    def _check_usable(self) -> None:
        check = getattr(self, "check_failure", None)
        if check is not None:
            check()
        if self._coll_failure is not None:
            raise self._coll_failure
        if self._coll_closed:
            raise CollectiveError(f"rank {self.rank}: the communicator is closed", self.rank)

    def _run(
        self,
        what: str,
        packed: S.Packed,
        send: _Buf | None,
        recv: _Buf | None,
        dtype: str,
        op: int,
        sig: int,
    ) -> None:
        self._run_raw(
            what,
            packed,
            None if send is None else send.obj,
            None if recv is None else recv.obj,
            DTYPES[dtype],
            op,
            sig,
        )

    def _run_raw(
        self, what: str, packed: S.Packed, send: Any, recv: Any, dtype: int, op: int, sig: int
    ) -> None:
        """_run on what the executor takes: buffer objects (None when empty), codes."""
        self._check_usable()
        t0 = time.perf_counter()
        try:
            rc, peer = self._coll_exec.run(packed, send, recv, dtype, op, sig, self.timeout)
        except KeyboardInterrupt:  # Ctrl-C while the run waited: it ended half-way
            if self._coll_failure is None:
                self._coll_failure = CollectiveError(
                    f"rank {self.rank}: {what} was interrupted (KeyboardInterrupt): the "
                    "communicator is over",
                    rank=self.rank,
                )
            raise
        if rc == 0:
            st = self._coll_stats
            st["ops"] += 1
            kinds = st["by_kind"]
            kinds[packed.name] = kinds.get(packed.name, 0) + 1
            self._coll_last = (what, packed, time.perf_counter() - t0)  # a dict when asked
            return
        raise self._failed(what, rc, peer)

    def _default_busy_poll(self) -> int:
        """BUSY_POLL_US, or 0 where this rank's host runs more than
        BUSY_POLL_MAX_RANKS_PER_CORE ranks per core (hosts as the rendezvous named them)."""
        hosts = self._known_hosts()
        here = 1 if hosts is None else hosts.count(hosts[self.rank])
        crowded = here > BUSY_POLL_MAX_RANKS_PER_CORE * (os.cpu_count() or 1)
        return 0 if crowded else BUSY_POLL_US

    def _known_hosts(self) -> list[str] | None:
        """Every rank's host (a Communicator's, from the rendezvous); None where they are
        not known (a bare Collectives, as the tests' meshes)."""
        hosts = getattr(self, "hosts", None)
        return hosts if hosts and len(hosts) == self.size else None

    def _host_groups(self) -> list[int] | None:
        """The runs of consecutive ranks on one host (schedule.host_groups), for "hier";
        None where the hosts are not known (hier is then the chain)."""
        hosts = self._known_hosts()
        return None if hosts is None else S.host_groups(hosts)

    def _layout_algo(self, shares: tuple[float, ...] | None, agreed: Any) -> str:
        """What algo="auto" runs past gather's sizes: "hier", "chain" or "direct", by this
        communicator's hosts (model.layout_algo), the direct schedule's shares and the
        agreed rates (None: equal). The same on every rank: the hosts come from the
        rendezvous's table, shares and rates from the agreement. Ranks that know no hosts
        (a bare Collectives, as the tests' meshes) run direct."""
        hosts = self._known_hosts()
        if hosts is None:
            return "direct"
        bw = (None, None) if agreed is None else (tuple(agreed.send), tuple(agreed.recv))
        key = (tuple(hosts), shares, bw)
        got = self._layouts.get(key)
        if got is None:
            got = model.layout_algo(hosts, shares, *bw)
            if len(self._layouts) >= _PLAN_CACHE:
                self._layouts.clear()
            self._layouts[key] = got
        if got != self._layout_last:
            log.debug("rank %d: all_reduce algo auto runs %s: %s", self.rank, *got)
            self._layout_last = got
        return got[0]

    def collective_stats(self) -> dict[str, Any]:
        """Collectives run (total and per schedule), the last one (its call,
        schedule, seconds, and for all_reduce the share bounds in elements),
        the executor's scratch bytes, the progress thread's poll time for small
        calls, and the failure that ended the communicator, if any."""
        st = dict(self._coll_stats)
        st["by_kind"] = dict(st["by_kind"])
        if self._coll_last is not None:
            what, packed, seconds = self._coll_last
            st["last"] = {"call": what, "schedule": packed.name, "seconds": seconds, **packed.info}
        st["scratch_bytes"] = self._coll_exec.scratch_bytes
        st["busy_poll_us"] = self.busy_poll_us
        st["all_reduce_algo"] = self.all_reduce_algo
        # What "auto" ran past gather's sizes at its last such call, and why.
        last = self._layout_last
        st["auto_layout"] = None if last is None else {"algo": last[0], "why": last[1]}
        st["failure"] = None if self._coll_failure is None else str(self._coll_failure)
        return st

    def _failed(self, what: str, rc: int, peer: int) -> CollectiveError:
        r = self.rank
        if rc == _ABORTED and self._coll_failure is not None:
            return self._coll_failure
        if rc == _MISMATCH:
            err = CollectiveError(
                f"rank {r}: {what} does not match the call of rank {peer} (the ranks "
                "disagree on the collective, its size, dtype, op or root, or on the "
                "order of collectives)",
                rank=peer,
                code=rc,
            )
        elif rc == _ABORTED:
            # Nothing recorded the failure: this rank's own endpoint or connection was
            # closed under the call (Connection.close() stops the executors using it).
            ep = getattr(self, "endpoint", None)
            peers = getattr(self, "peers", None) or []
            shut = [p for p, c in enumerate(peers) if c is not None and c.closed]
            why = (
                f": rank {r}'s endpoint was closed"
                if ep is not None and ep.closed
                else f": rank {r}'s connection to rank {shut[0]} was closed"
                if shut
                else ""
            )
            err = CollectiveError(f"rank {r}: {what} aborted{why}", rank=None, code=rc)
        elif rc == _GONE:
            err = CollectiveError(
                f"rank {r}: {what}: rank {peer} closed its communicator without making this "
                "call (close() while other ranks still call collectives)",
                rank=peer,
                code=rc,
            )
        elif rc == _STALLED:
            on = f" waiting for rank {peer}" if peer >= 0 else ""
            err = CollectiveError(
                f"rank {r}: {what}: no progress for {self.timeout:g} s{on}",
                rank=peer if peer >= 0 else None,
                code=rc,
            )
        else:
            why = strerror(rc)
            ep = getattr(self, "endpoint", None)
            if rc in _TRANSPORT_TIMEOUTS and ep is not None:
                why += f" (the endpoint's timeout: {ep.timeout:g} s)"
            err = CollectiveError(
                f"rank {r}: {what}: connection to rank {peer} failed: {why}",
                rank=peer if peer >= 0 else None,
                code=rc,
            )
            verdict = getattr(self, "peer_error", None)
            if verdict is not None and peer >= 0 and rc not in _FINDINGS:
                # A closed connection: the peer's own reason (or the group's verdict)
                # is on its way; peer_error waits a moment for it.
                err = verdict(peer, err)
        known = getattr(self, "failure", None)
        if rc in _FINDINGS and peer >= 0 and known is not None:
            err = known  # the group's verdict came first: it is the cause
        if self._coll_failure is None:
            self._coll_failure = err
        record = getattr(self, "_set_failure", None)
        if record is not None and record(err):
            # This rank's communicator has failed, by its own finding (a group verdict
            # would have come first, and record() refuses a second failure): told at
            # once. A finding about a peer (unreachable, silent, not receiving, closed
            # without the call, a call that does not match this one's, its connection
            # closed with no word from it) blames that peer, so the others learn it
            # from the group instead of blaming this rank, whose connections close as it
            # gives up; anything else (this rank's own connection or endpoint closed
            # under the call) blames this rank. Either way no rank waits its timeout for
            # one that has given up, and a rank waiting in close() for this one goes.
            # (Before, only findings were told: with a connection closed on rank 2, rank
            # 1 waited its whole timeout for rank 2 in 2 runs of 6 of tests/coll_chaos.py.)
            tell = getattr(self, "_tell_group", None)
            if tell is not None:
                tell(err)
        return err

    def _submit(self, what: str, fn: Callable[[], Any], async_op: bool) -> Any:
        """Runs fn now, or on the worker thread behind earlier async operations."""
        with self._coll_qlock:
            if self._coll_closed:  # no worker started for it (it would wait for ever)
                raise CollectiveError(f"rank {self.rank}: the communicator is closed", self.rank)
            # On the worker thread itself (a staged device collective runs its
            # host collectives from there), a blocking call runs now: queued
            # behind the job that makes it, it would wait for itself.
            on_worker = threading.current_thread() is self._coll_worker
            if not async_op and (self._coll_queued == 0 or on_worker):
                inline = True
            else:
                inline = False
                work = Work(what)
                self._coll_queued += 1
                self._coll_queue.put((fn, work))
                if self._coll_worker is None:
                    self._coll_worker = threading.Thread(
                        target=_coll_work,
                        args=(weakref.ref(self), self._coll_queue),
                        name=f"mrc-coll-{self.rank}",
                        daemon=True,
                    )
                    self._coll_worker.start()
        if inline:
            return fn()
        return work if async_op else work.wait()

    # -- the collectives --
    def all_reduce(
        self,
        send: Any,
        recv: Any = None,
        op: str = "sum",
        *,
        dtype: str | None = None,
        shares: Sequence[float] | None = None,
        algo: str = "auto",
        async_op: bool = False,
    ) -> Any:
        """recv = send[0] op send[1] op ... op send[n-1] (rank order, every element).
        recv None: in place. shares: each rank's fraction of the elements it
        reduces (the same on every rank; default equal). algo: "direct"
        (reduce-scatter + all-gather), "gather" (everyone sends everyone its
        input: one exchange, for small messages), "chain" (the partial result up the
        ranks in order and the result back down: two neighbours per rank, for many
        ranks), "hier" (that chain over the hosts' runs of consecutive ranks, each
        host's share split over its ranks, direct inside a host), "tree" (the inputs
        gathered up a binomial tree to rank 0, which reduces them, the result back
        down: 2 log2(n) hops, about 2 messages per rank, for small messages at many
        ranks) or "auto" (without shares: gather up to schedule.gather_max_bytes(n),
        96 KiB at 4 ranks, 27 KiB at 8; from 16 ranks tree instead, up to 1 MiB / n;
        past it direct, or hier / chain where the ranks' hosts favour it:
        model.layout_algo); every algo gives the same bits. Returns recv."""
        repeat_key = None  # the call's shape, when it may be remembered (_remember)
        if type(send) is np.ndarray and shares is None and dtype is None:
            repeat_key = ("all_reduce", send.dtype, send.size, op, algo)
            call = None if async_op else self._coll_calls.get(repeat_key)
            if call is not None and self._repeat(call, send, recv):
                return send if recv is None else recv
        if _gpu.is_device(send, recv):
            return _gpu.collective(self, "all_reduce", send=send, recv=recv, op=op, dtype=dtype,
                                   shares=shares, algo=algo, async_op=async_op)  # fmt: skip
        s = as_buffer(send, dtype, "all_reduce send", recv is None)
        r = s if recv is None else as_buffer(recv, dtype, "all_reduce recv", True)
        self._same(s, r, "all_reduce", 1)
        code = _op(op)
        sh = None if shares is None else tuple(float(x) for x in shares)
        if sh is not None and len(sh) != self.size:
            raise UsageError(f"all_reduce: shares has {len(sh)} entries for {self.size} ranks")
        if algo == "auto" and sh is None:  # shares are the direct schedule's
            algo = self.all_reduce_algo or "auto"
        auto = algo == "auto"  # past gather's sizes, the hosts' layout picks (_layout_algo)
        if algo == "auto":
            nbytes = s.count * s.esize
            least = self.tree_min_ranks
            small = None if sh is not None else S.small_all_reduce(self.size, nbytes, least)
            algo = small or "direct"
        if algo not in ALL_REDUCE_ALGOS:
            raise UsageError(
                f"all_reduce: algo must be one of {', '.join(ALL_REDUCE_ALGOS)}, got {algo!r}"
            )
        if sh is not None and algo != "direct":
            raise UsageError(f"all_reduce: shares= is for the direct schedule, not {algo!r}")
        what = f"all_reduce of {s.count} {s.dtype} ({op})"
        out = send if recv is None else recv
        resilience = getattr(self, "_resilience", None)
        if sh is None and algo == "direct" and resilience is not None:
            # Issue 13: the shares come from the bandwidths every rank agreed on, chosen
            # where the operation runs, in its place in the order (resilient.py).
            lag_ = self.slots

            def run() -> Any:
                how, chosen = resilience.plan_for(s.count * s.esize, auto)
                packed = resilience.packed(s.count, s.esize, chosen, op == "avg", lag_, how)
                sig = signature("all_reduce", s.count, s.dtype, op, chosen, how)
                if how != "direct":  # the same bits; the hosts' links carry less
                    return self._do(what, packed, s, r, s.dtype, code, sig, out)
                before = resilience.host_before(s.count * s.esize)
                t0 = time.perf_counter()
                result = self._do(what, packed, s, r, s.dtype, code, sig, out)
                resilience.observed(s.count * s.esize, time.perf_counter() - t0, before)
                return result

            return self._submit(what, run, async_op)
        if auto and algo == "direct" and sh is None:
            algo = self._layout_algo(None, None)
        key = ("all_reduce", s.count, s.esize, sh, op == "avg", algo)
        n, rank, lag = self.size, self.rank, self.slots
        packed = self._plan(
            key,
            lambda: S.all_reduce(
                rank,
                n,
                s.count,
                s.esize,
                shares=sh,
                avg=op == "avg",
                lag=lag,
                algo=algo,
                groups=self._host_groups(),
            ),
        )
        sig = signature("all_reduce", s.count, s.dtype, op, sh, algo)
        if repeat_key is not None:
            self._remember(repeat_key, what, packed, sig, DTYPES[s.dtype], code)
        return self._submit(
            what, lambda: self._do(what, packed, s, r, s.dtype, code, sig, out), async_op
        )

    def reduce(
        self,
        send: Any,
        recv: Any = None,
        op: str = "sum",
        root: int = 0,
        *,
        dtype: str | None = None,
        async_op: bool = False,
    ) -> Any:
        """The all_reduce result on root only (recv None: in place there); other
        ranks' recv is not written. Returns recv (root) or None."""
        if _gpu.is_device(send, recv):
            return _gpu.collective(self, "reduce", send=send, recv=recv, op=op, root=root,
                                   dtype=dtype, async_op=async_op)  # fmt: skip
        self._check_root(root, "reduce")
        s = as_buffer(send, dtype, "reduce send", recv is None and self.rank == root)
        r: _Buf | None = None
        if self.rank == root:
            r = s if recv is None else as_buffer(recv, dtype, "reduce recv", True)
            self._same(s, r, "reduce", 1)
        code = _op(op)
        what = f"reduce of {s.count} {s.dtype} ({op}, root {root})"
        n, rank, lag = self.size, self.rank, self.slots
        tree = S.tree_fits(n, s.count * s.esize, self.tree_min_ranks)
        algo = "tree" if tree else "direct"
        packed = self._plan(
            ("reduce", s.count, s.esize, root, op == "avg", algo),
            lambda: S.reduce(rank, n, s.count, s.esize, root, avg=op == "avg", lag=lag, algo=algo),
        )
        sig = signature("reduce", s.count, s.dtype, op, root, algo)
        out = (send if recv is None else recv) if rank == root else None
        return self._submit(
            what, lambda: self._do(what, packed, s, r, s.dtype, code, sig, out), async_op
        )

    def broadcast(
        self, buf: Any, root: int = 0, *, dtype: str | None = None, async_op: bool = False
    ) -> Any:
        """Root's buf to every rank's buf. Returns buf."""
        if _gpu.is_device(buf):
            return _gpu.collective(self, "broadcast", buf=buf, root=root, dtype=dtype,
                                   async_op=async_op)  # fmt: skip
        self._check_root(root, "broadcast")
        b = as_buffer(buf, dtype, "broadcast buf", self.rank != root)
        what = f"broadcast of {b.count} {b.dtype} (root {root})"
        n, rank, least = self.size, self.rank, self.tree_min_ranks
        packed = self._plan(
            ("broadcast", b.count, b.esize, root, least),
            lambda: S.broadcast(rank, n, b.count, b.esize, root, min_ranks=least),
        )
        sig = signature("broadcast", b.count, b.dtype, root, packed.name)
        return self._submit(
            what, lambda: self._do(what, packed, b, b, b.dtype, 0, sig, buf), async_op
        )

    def all_gather(
        self, send: Any, recv: Any, *, dtype: str | None = None, async_op: bool = False
    ) -> Any:
        """recv[k * len(send):(k+1) * len(send)] = rank k's send. Returns recv."""
        if _gpu.is_device(send, recv):
            return _gpu.collective(self, "all_gather", send=send, recv=recv, dtype=dtype,
                                   async_op=async_op)  # fmt: skip
        s = as_buffer(send, dtype, "all_gather send", False)
        r = as_buffer(recv, dtype, "all_gather recv", True)
        self._same(s, r, "all_gather", self.size)
        what = f"all_gather of {s.count} {s.dtype}"
        n, rank = self.size, self.rank
        algo = "tree" if S.tree_fits(n, s.count * s.esize, self.tree_min_ranks) else "direct"
        packed = self._plan(
            ("all_gather", s.count, s.esize, algo),
            lambda: S.all_gather(rank, n, s.count, s.esize, algo),
        )
        sig = signature("all_gather", s.count, s.dtype, algo)
        return self._submit(
            what, lambda: self._do(what, packed, s, r, s.dtype, 0, sig, recv), async_op
        )

    def reduce_scatter(
        self,
        send: Any,
        recv: Any,
        op: str = "sum",
        *,
        dtype: str | None = None,
        async_op: bool = False,
    ) -> Any:
        """recv = block `rank` of the reduction of every rank's send (n blocks of
        len(recv)). Returns recv."""
        if _gpu.is_device(send, recv):
            return _gpu.collective(self, "reduce_scatter", send=send, recv=recv, op=op,
                                   dtype=dtype, async_op=async_op)  # fmt: skip
        s = as_buffer(send, dtype, "reduce_scatter send", False)
        r = as_buffer(recv, dtype, "reduce_scatter recv", True)
        self._same(r, s, "reduce_scatter", self.size)
        code = _op(op)
        what = f"reduce_scatter of {r.count} {s.dtype} per rank ({op})"
        n, rank = self.size, self.rank
        packed = self._plan(
            ("reduce_scatter", r.count, s.esize, op == "avg"),
            lambda: S.reduce_scatter(rank, n, r.count, s.esize, avg=op == "avg"),
        )
        sig = signature("reduce_scatter", r.count, s.dtype, op)
        return self._submit(
            what, lambda: self._do(what, packed, s, r, s.dtype, code, sig, recv), async_op
        )

    def all_to_all(
        self,
        send: Any,
        recv: Any,
        send_counts: Sequence[int] | None = None,
        recv_counts: Sequence[int] | None = None,
        *,
        dtype: str | None = None,
        async_op: bool = False,
    ) -> Any:
        """Block k of send goes to rank k; block k of recv comes from rank k.
        Counts in elements (None: equal blocks). Returns recv."""
        if _gpu.is_device(send, recv):
            return _gpu.collective(self, "all_to_all", send=send, recv=recv,
                                   send_counts=send_counts, recv_counts=recv_counts, dtype=dtype,
                                   async_op=async_op)  # fmt: skip
        s = as_buffer(send, dtype, "all_to_all send", False)
        r = as_buffer(recv, dtype, "all_to_all recv", True)
        if s.dtype != r.dtype:
            raise UsageError(f"all_to_all: send is {s.dtype}, recv is {r.dtype}")
        n, rank = self.size, self.rank
        sc = self._counts(send_counts, s.count, "send")
        rc = self._counts(recv_counts, r.count, "recv")
        what = f"all_to_all of {s.count} {s.dtype}"
        packed = self._plan(
            ("all_to_all", sc, rc, s.esize), lambda: S.all_to_all(rank, n, s.esize, sc, rc)
        )
        sig = signature("all_to_all", s.dtype)
        return self._submit(
            what, lambda: self._do(what, packed, s, r, s.dtype, 0, sig, recv), async_op
        )

    def barrier(self, *, async_op: bool = False) -> Any:
        """Returns once every rank has entered the barrier."""
        n, rank, least = self.size, self.rank, self.tree_min_ranks
        packed = self._plan(("barrier", least), lambda: S.barrier(rank, n, least))
        sig = signature("barrier", packed.name)
        return self._submit(
            "barrier",
            lambda: self._do("barrier", packed, None, None, "uint8", 0, sig, None),
            async_op,
        )

    def send(self, buf: Any, peer: int, tag: int = 0, *, async_op: bool = False) -> Any:
        """buf to `peer`, whose recv(…, peer=this rank, tag) must have the same size."""
        return self._p2p("send", buf, peer, tag, async_op)

    def recv(self, buf: Any, peer: int, tag: int = 0, *, async_op: bool = False) -> Any:
        """Fills buf from `peer`'s send(…, this rank, tag). Returns buf."""
        return self._p2p("recv", buf, peer, tag, async_op)

    def _p2p(self, kind: str, buf: Any, peer: int, tag: int, async_op: bool) -> Any:
        """send or recv: one message with `peer`, matched by size and tag."""
        if _gpu.is_device(buf):
            return _gpu.collective(self, kind, buf=buf, peer=peer, tag=tag, async_op=async_op)
        self._check_peer(peer, kind)
        sending = kind == "send"
        b = as_buffer(buf, None, f"{kind} buf", not sending)
        nbytes = b.count * b.esize
        what = f"{kind} of {nbytes} bytes {'to' if sending else 'from'} rank {peer} (tag {tag})"
        n, rank = self.size, self.rank
        build = S.send if sending else S.recv
        packed = self._plan((kind, peer, nbytes), lambda: build(rank, n, peer, nbytes))
        sig = signature("p2p", nbytes, tag)
        s, r, out = (b, None, None) if sending else (None, b, buf)
        return self._submit(
            what, lambda: self._do(what, packed, s, r, "uint8", 0, sig, out), async_op
        )

    # -- helpers --
    # A call of a shape seen before (numpy arrays, same dtype, size, op, algo) skips what
    # the first one derived (checks of the arguments, dtype and op codes, the plan, its
    # signature): in a loop of small all_reduces that Python was 10 of 14 us a call, and
    # about a third of a rank's CPU on a loaded host. The buffers' own properties
    # (contiguous, writable, recv's dtype and size) are still checked every call.
    def _remember(
        self, key: tuple, what: str, packed: S.Packed, sig: int, dtype: int, op: int
    ) -> None:
        calls = self._coll_calls
        if len(calls) >= _PLAN_CACHE:
            calls.clear()
        calls[key] = (what, packed, sig, dtype, op)

    def _repeat(self, call: tuple[str, S.Packed, int, int, int], send: Any, recv: Any) -> bool:
        """Runs a call remembered by _remember, inline, when it may: no async work queued,
        buffers as the first call's checks demand. False: take the full path (which
        runs it, or names what is wrong)."""
        if self._coll_queued:
            return False
        sf = send.flags
        if recv is None:
            if not (sf.c_contiguous and sf.writeable):
                return False
            recv = send
        else:
            if type(recv) is not np.ndarray:
                return False
            rf = recv.flags
            if not (
                recv.dtype == send.dtype
                and recv.size == send.size
                and sf.c_contiguous
                and rf.c_contiguous
                and rf.writeable
            ):
                return False
        what, packed, sig, dtype, op = call
        if send.size:
            self._run_raw(what, packed, send, recv, dtype, op, sig)
        else:
            self._run_raw(what, packed, None, None, dtype, op, sig)
        return True

    def _do(
        self,
        what: str,
        packed: S.Packed,
        s: _Buf | None,
        r: _Buf | None,
        dtype: str,
        op: int,
        sig: int,
        out: Any,
    ) -> Any:
        self._run(what, packed, s, r, dtype, op, sig)
        return out

    def _same(self, small: _Buf, big: _Buf, what: str, factor: int) -> None:
        if small.dtype != big.dtype:
            raise UsageError(f"{what}: buffers of different dtypes ({small.dtype}, {big.dtype})")
        if big.count != small.count * factor:
            want = "the same size" if factor == 1 else f"{factor} x {small.count} elements"
            raise UsageError(
                f"{what}: {small.count} and {big.count} elements; the buffers need {want}"
            )

    def _check_root(self, root: int, what: str) -> None:
        if not _is_int(root) or not 0 <= root < self.size:
            raise UsageError(f"{what}: root must be a rank 0..{self.size - 1}, got {root!r}")

    def _check_peer(self, peer: int, what: str) -> None:
        if not _is_int(peer) or not 0 <= peer < self.size or peer == self.rank:
            raise UsageError(
                f"{what}: peer {peer!r} must be another rank (0..{self.size - 1}, not {self.rank})"
            )

    def _counts(self, counts: Sequence[int] | None, total: int, what: str) -> tuple[int, ...]:
        n = self.size
        if counts is None:
            if total % n:
                raise UsageError(
                    f"all_to_all: {what} has {total} elements, not a multiple of {n} ranks"
                )
            return (total // n,) * n
        out = tuple(int(c) for c in counts)
        if len(out) != n or any(c < 0 for c in out) or sum(out) > total:
            raise UsageError(
                f"all_to_all: {what}_counts {list(out)} must be {n} counts >= 0 summing to at "
                f"most {total}"
            )
        return out


def _is_int(x: object) -> bool:
    """An integer rank (numpy's too), not a bool, float or string."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)
