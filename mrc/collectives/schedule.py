"""The planner: collective algorithms as data.

A schedule is one rank's list of steps (SEND/RECV a byte range to/from a peer,
REDUCE sources into a destination in a given order, COPY), with dependencies
on earlier steps. The C executor (src_c/coll.c) runs any schedule: it cuts
each step into chunks, pipelines them, and applies dependencies chunk by chunk
(chunk i of a step waits for chunk i of the steps it depends on). Buffers are
the call's send and recv buffers (the same memory when in place) and scratch
rings: a RECV into ring k puts chunk i in slot i % slots, so scratch is bounded
by the pipeline (nrings * slots * chunk bytes), not by the message; and a stage,
a contiguous area of stage_bytes (the tree's gathered inputs, small calls only).

Fixed reduction order: every REDUCE lists its sources in rank order 0..n-1,
and each element is reduced by exactly one REDUCE (its owner's), so every
schedule here gives the same bits for the same inputs, whatever the shares,
chunk size, arrival order or path failures.

Message matching between two ranks is by order: the k-th SEND step from a to
b (pair_seq k) meets the k-th RECV step from a at b, chunk by chunk, and must
have the same length and lag. Within a direction, chunk i of a step is message
number i + lag (ties: lower pair_seq first): the all-gather phase has lag =
the ring depth, so its chunks interleave with the reduce-scatter's instead of
queueing behind all of them, and its RECVs are posted before its data comes.
``check_pair`` verifies a set of schedules pairs up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from mrc.errors import UsageError

SEND, RECV, REDUCE, COPY = 1, 2, 3, 4
KIND_NAMES = {SEND: "send", RECV: "recv", REDUCE: "reduce", COPY: "copy"}
BUF_SEND, BUF_RECV, BUF_SCRATCH, BUF_STAGE = 0, 1, 2, 3
BUF_NAMES = {BUF_SEND: "send", BUF_RECV: "recv", BUF_SCRATCH: "scratch", BUF_STAGE: "stage"}
FINISH = 0x1  # REDUCE: AVG divides by n after the last source

# Mirrors struct mrc_coll_step / mrc_coll_ref in src_c/include/mrc.h (the
# binding checks the item sizes against the C structs).
STEP_DTYPE = np.dtype(
    [
        ("kind", "<u4"),
        ("peer", "<i4"),
        ("pair_seq", "<u4"),
        ("flags", "<u4"),
        ("len", "<u8"),
        ("src", "<u4"),
        ("nsrc", "<u4"),
        ("dst", "<u4"),
        ("dep", "<u4"),
        ("ndeps", "<u4"),
        ("lag", "<u4"),
    ]
)
REF_DTYPE = np.dtype([("buf", "<u4"), ("pad", "<u4"), ("off", "<u8")])


@dataclass(frozen=True)
class Ref:
    """A place in a buffer: byte offset in send/recv/stage, or a scratch ring index."""

    buf: int
    off: int

    def __repr__(self) -> str:
        return f"{BUF_NAMES[self.buf]}[{self.off}]"


@dataclass
class Step:
    kind: int
    length: int  # bytes
    peer: int = -1
    pair_seq: int = 0
    srcs: tuple[Ref, ...] = ()
    dst: Ref | None = None
    deps: tuple[int, ...] = ()
    flags: int = 0
    lag: int = 0  # SEND/RECV: chunk i is this pair's message i + lag

    def __repr__(self) -> str:
        what = KIND_NAMES[self.kind]
        where = f" peer {self.peer}#{self.pair_seq}" if self.peer >= 0 else ""
        return f"{what}{where} {self.length}B {list(self.srcs)}->{self.dst} deps={list(self.deps)}"


@dataclass
class Packed:
    """The C executor's input: three contiguous arrays and the ring count."""

    steps: np.ndarray
    refs: np.ndarray
    deps: np.ndarray
    nrings: int
    name: str = ""
    info: dict = field(default_factory=dict)  # e.g. all_reduce's share bounds
    stage_bytes: int = 0
    raw: tuple[np.ndarray, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # The three arrays as bytes, made once: the executor takes them on every call.
        self.raw = tuple(a.view("u1").reshape(-1) for a in (self.steps, self.refs, self.deps))


@dataclass
class Schedule:
    """One rank's steps for one call. send_bytes/recv_bytes: the buffer sizes
    it addresses (the caller's buffers must be at least that big)."""

    name: str
    rank: int
    nranks: int
    send_bytes: int
    recv_bytes: int
    steps: list[Step] = field(default_factory=list)
    nrings: int = 0
    stage_bytes: int = 0
    info: dict = field(default_factory=dict)
    _seq: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)
    _packed: Packed | None = field(default=None, repr=False)

    # -- building --
    def add(self, step: Step) -> int:
        if step.kind in (SEND, RECV):
            key = (step.peer, step.kind)
            step.pair_seq = self._seq.get(key, 0)
            self._seq[key] = step.pair_seq + 1
        self.steps.append(step)
        return len(self.steps) - 1

    def send(self, peer: int, src: Ref, length: int, deps: Sequence[int] = (), lag: int = 0) -> int:
        return self.add(Step(SEND, length, peer=peer, srcs=(src,), deps=tuple(deps), lag=lag))

    def recv(self, peer: int, dst: Ref, length: int, deps: Sequence[int] = (), lag: int = 0) -> int:
        return self.add(Step(RECV, length, peer=peer, dst=dst, deps=tuple(deps), lag=lag))

    def reduce(
        self, dst: Ref, srcs: Sequence[Ref], length: int, deps: Sequence[int], finish: bool
    ) -> int:
        return self.add(
            Step(
                REDUCE,
                length,
                srcs=tuple(srcs),
                dst=dst,
                deps=tuple(deps),
                flags=FINISH if finish else 0,
            )
        )

    def copy(self, dst: Ref, src: Ref, length: int, deps: Sequence[int] = ()) -> int:
        return self.add(Step(COPY, length, srcs=(src,), dst=dst, deps=tuple(deps)))

    def ring(self) -> Ref:
        self.nrings += 1
        return Ref(BUF_SCRATCH, self.nrings - 1)

    def stage(self, nbytes: int) -> Ref:
        """nbytes more of the stage, contiguous with what was asked before."""
        self.stage_bytes += nbytes
        return Ref(BUF_STAGE, self.stage_bytes - nbytes)

    # -- checking and packing --
    def check(self) -> None:
        """The rules the executor relies on (it checks them again in C)."""
        producers: dict[int, int] = {}
        for i, s in enumerate(self.steps):
            if any(d >= i or d < 0 for d in s.deps):
                raise UsageError(f"{self.name}: step {i} depends on a later step: {s}")
            if s.kind in (SEND, RECV) and not (0 <= s.peer < self.nranks and s.peer != self.rank):
                raise UsageError(f"{self.name}: step {i} has a bad peer: {s}")
            refs = [*s.srcs, *([s.dst] if s.dst else [])]
            for r in refs:
                if r.buf == BUF_SCRATCH:
                    if not 0 <= r.off < self.nrings:
                        raise UsageError(f"{self.name}: step {i} names ring {r.off}")
                    continue
                size = {BUF_SEND: self.send_bytes, BUF_STAGE: self.stage_bytes}.get(
                    r.buf, self.recv_bytes
                )
                if r.off + s.length > size:
                    raise UsageError(f"{self.name}: step {i} is outside the {size}-byte buffer")
            if s.dst is not None and s.dst.buf == BUF_SCRATCH:
                if s.dst.off in producers:
                    raise UsageError(f"{self.name}: ring {s.dst.off} has two producers")
                producers[s.dst.off] = i
        for i, s in enumerate(self.steps):
            for r in s.srcs:
                if r.buf == BUF_SCRATCH:
                    p = producers.get(r.off)
                    if p is None or p not in s.deps or self.steps[p].length != s.length:
                        raise UsageError(
                            f"{self.name}: step {i} reads ring {r.off} without depending "
                            "on its producer chunk for chunk"
                        )

    def pack(self) -> Packed:
        if self._packed is not None:
            return self._packed
        self.check()
        steps = np.zeros(len(self.steps), STEP_DTYPE)
        refs: list[tuple[int, int]] = []
        deps: list[int] = []
        for i, s in enumerate(self.steps):
            row = steps[i]
            row["kind"], row["peer"], row["pair_seq"] = s.kind, s.peer, s.pair_seq
            row["flags"], row["len"] = s.flags, s.length
            row["src"], row["nsrc"] = len(refs), len(s.srcs)
            refs.extend((r.buf, r.off) for r in s.srcs)
            if s.dst is not None:
                row["dst"] = len(refs)
                refs.append((s.dst.buf, s.dst.off))
            row["dep"], row["ndeps"], row["lag"] = len(deps), len(s.deps), s.lag
            deps.extend(s.deps)
        ref_arr = np.zeros(len(refs), REF_DTYPE)
        for i, (b, o) in enumerate(refs):
            ref_arr[i]["buf"], ref_arr[i]["off"] = b, o
        self._packed = Packed(
            steps,
            ref_arr,
            np.asarray(deps, dtype="<u4"),
            self.nrings,
            self.name,
            self.info,
            self.stage_bytes,
        )
        return self._packed


def check_pair(schedules: Sequence[Schedule]) -> None:
    """Across ranks: every SEND has its RECV, in the same order, with the same
    (length, lag)."""
    n = len(schedules)
    for a in range(n):
        for b in range(n):
            if a == b:
                continue
            sends = [
                (s.length, s.lag) for s in schedules[a].steps if s.kind == SEND and s.peer == b
            ]
            recvs = [
                (s.length, s.lag) for s in schedules[b].steps if s.kind == RECV and s.peer == a
            ]
            if sends != recvs:
                raise UsageError(
                    f"{schedules[a].name}: rank {a} sends {sends} to rank {b}, "
                    f"which receives {recvs}"
                )


# ---- shares ---------------------------------------------------------------


def share_bounds(count: int, n: int, shares: Sequence[float] | None = None) -> list[int]:
    """Element boundaries of each rank's share: rank k owns [b[k], b[k+1]).

    Equal by default (the remainder spread over the first ranks); otherwise
    in proportion to `shares` (any non-negative weights, e.g. bandwidths).
    Exact rational arithmetic, so every rank computes the same bounds."""
    if shares is None:
        q, r = divmod(count, n)
        out = [0]
        for k in range(n):
            out.append(out[-1] + q + (1 if k < r else 0))
        return out
    if len(shares) != n:
        raise UsageError(f"shares has {len(shares)} entries for {n} ranks")
    if not all(math.isfinite(s) for s in shares):
        raise UsageError(f"shares must be finite numbers, got {list(shares)}")
    w = [Fraction(s) for s in shares]
    if any(x < 0 for x in w) or sum(w) <= 0:
        raise UsageError(f"shares must be >= 0 with a positive sum, got {list(shares)}")
    total = sum(w)
    out, acc = [0], Fraction(0)
    for x in w:
        acc += x
        out.append(int(count * acc / total))
    out[-1] = count
    return out


# ---- the algorithms -------------------------------------------------------


def _reduce_scatter_phase(
    sch: Schedule, bounds: list[int], esize: int, out: Ref | None, finish: bool
) -> tuple[int, dict[int, int]]:
    """Direct reduce-scatter: every rank sends each owner the raw share of its
    send buffer; the owner reduces all n contributions in rank order into
    `out` (None: a scratch ring). Returns (the REDUCE step, send step per peer)."""
    r, n = sch.rank, sch.nranks
    mine = (bounds[r + 1] - bounds[r]) * esize
    sends: dict[int, int] = {}
    rings: dict[int, Ref] = {}
    recvs: list[int] = []
    # Start with the next rank: n-1 senders spread over owners, not all on rank 0.
    for d in range(1, n):
        j = (r + d) % n
        sends[j] = sch.send(
            j, Ref(BUF_SEND, bounds[j] * esize), (bounds[j + 1] - bounds[j]) * esize
        )
        k = (r - d) % n
        rings[k] = sch.ring()
        recvs.append(sch.recv(k, rings[k], mine))
    srcs = [Ref(BUF_SEND, bounds[r] * esize) if i == r else rings[i] for i in range(n)]
    dst = out if out is not None else sch.ring()
    red = sch.reduce(dst, srcs, mine, recvs, finish)
    return red, sends


def all_reduce(
    rank: int,
    n: int,
    count: int,
    esize: int,
    *,
    shares: Sequence[float] | None = None,
    avg: bool = False,
    lag: int = 4,
    algo: str = "direct",
    groups: Sequence[int] | None = None,
) -> Schedule:
    """Direct all_reduce: reduce-scatter to owners (each reduces the raw
    contributions in rank order), then all-gather of the owners' shares.
    Bytes per rank 2(n-1)/n of the data, as a ring, with two sequential steps.
    `shares`: each rank's fraction of the elements (issue 13's resilient
    schedule is this one with bandwidth-proportional shares). lag: the
    executor's ring depth (slots), so that the all-gather of chunk i is sent
    as the reduce-scatter of chunk i + lag frees the ring."""
    nbytes = count * esize
    if algo == "gather":
        return _all_reduce_gather(rank, n, nbytes, avg)
    if algo == "chain":
        return _all_reduce_chain(rank, n, nbytes, avg)
    if algo == "hier":
        return _all_reduce_hier(rank, n, count, esize, groups or [1] * n, avg, lag)
    if algo == "tree":
        return _all_reduce_tree(rank, n, nbytes, avg)
    if algo != "direct":
        raise UsageError(
            f"all_reduce algorithm must be direct, gather, chain, hier or tree, got {algo!r}"
        )
    sch = Schedule("all_reduce", rank, n, nbytes, nbytes)
    if n == 1:
        sch.reduce(Ref(BUF_RECV, 0), [Ref(BUF_SEND, 0)], nbytes, (), avg)
        return sch
    b = share_bounds(count, n, shares)
    sch.info["share_bounds"] = b
    mine = (b[rank + 1] - b[rank]) * esize
    red, rs_sends = _reduce_scatter_phase(sch, b, esize, Ref(BUF_RECV, b[rank] * esize), avg)
    for d in range(1, n):
        j = (rank + d) % n
        sch.send(j, Ref(BUF_RECV, b[rank] * esize), mine, [red], lag)
        k = (rank - d) % n
        # In place, recv[share k] is also what this rank is sending to k.
        ln = (b[k + 1] - b[k]) * esize
        sch.recv(k, Ref(BUF_RECV, b[k] * esize), ln, [rs_sends[k]], lag)
    return sch


# all_reduce "auto": "gather" (one exchange, (n-1) x the bytes out) while that beats "direct"
# (two exchanges, 2(n-1)/n x the bytes). With alpha per exchange and B a rank's rate,
# alpha + (n-1)S/B < 2 alpha + 2(n-1)S/(nB) while S < alpha B n / ((n-1)(n-2)).
# GATHER_ALPHA_B is alpha B as measured on the shaped 4 x 1 Gbit/s fabric (2 cores, where
# an exchange costs about 250 us): gather was faster at n = 4 up to 64 KiB (657-669 vs
# 723-905 us), direct from 128 KiB (931 vs 1057-1193 us); at n = 3 gather up to 128 KiB,
# at n = 2 always. Faster fabrics have a larger alpha B (a NIC's microseconds times its
# rate), so this errs towards direct there. The bound keeps both copies of an in-place
# call in one bounce slot, where its sends need not wait for their ACKs (src_c/coll.c).
GATHER_ALPHA_B = 144 << 10
GATHER_CAP = 128 << 10


def gather_max_bytes(n: int) -> int:
    """The largest all_reduce (bytes per rank) that "auto" runs as "gather" at n ranks."""
    if n <= 2:
        return GATHER_CAP
    return min(GATHER_CAP, GATHER_ALPHA_B * n // ((n - 1) * (n - 2)))


def _all_reduce_gather(rank: int, n: int, nbytes: int, avg: bool) -> Schedule:
    """Small all_reduce: every rank sends its whole input to every other and
    reduces all n in rank order itself. One dependent exchange instead of two
    (latency), (n-1) x the bytes (nothing at these sizes); the same bits as
    "direct", since each element is still reduced in rank order."""
    sch = Schedule("all_reduce_gather", rank, n, nbytes, nbytes)
    rings: dict[int, Ref] = {}
    recvs, sends = [], []
    for d in range(1, n):
        sends.append(sch.send((rank + d) % n, Ref(BUF_SEND, 0), nbytes))
        k = (rank - d) % n
        rings[k] = sch.ring()
        recvs.append(sch.recv(k, rings[k], nbytes))
    srcs = [Ref(BUF_SEND, 0) if i == rank else rings[i] for i in range(n)]
    # In place the destination is the buffer being sent: wait for the sends.
    sch.reduce(Ref(BUF_RECV, 0), srcs, nbytes, recvs + sends, avg)
    return sch


def _all_reduce_chain(rank: int, n: int, nbytes: int, avg: bool) -> Schedule:
    """Pipelined chain: the partial result goes up the chain 0 -> 1 -> ... -> n-1,
    each rank adding its own input to what it received (so every element is
    folded in rank order, as the other algorithms fold it), and the result comes
    back down n-1 -> ... -> 0, chunk by chunk, both directions at once. A rank
    talks to two neighbours only: no (n-1)-way incast, one scratch ring, 2x the
    bytes out per rank (direct: 2(n-1)/n x) and about 2n chunk hops of pipeline
    fill. For many ranks, where the direct schedule's fan-out is what costs."""
    sch = Schedule("all_reduce_chain", rank, n, nbytes, nbytes)
    send, recv = Ref(BUF_SEND, 0), Ref(BUF_RECV, 0)
    if n == 1:
        sch.reduce(recv, [send], nbytes, (), avg)
        return sch
    if rank == 0:
        up = sch.send(1, send, nbytes)
        # In place, recv is the buffer being sent up: each chunk waits for its send.
        sch.recv(1, recv, nbytes, [up])
        return sch
    partial = sch.ring()
    got = sch.recv(rank - 1, partial, nbytes)
    folded = sch.reduce(recv, [partial, send], nbytes, [got], avg and rank == n - 1)
    if rank < n - 1:
        up = sch.send(rank + 1, recv, nbytes, [folded])
        folded = sch.recv(rank + 1, recv, nbytes, [up])  # the result, over the partial
    sch.send(rank - 1, recv, nbytes, [folded])
    return sch


def binomial(rank: int, n: int, root: int = 0) -> tuple[int, list[int], int]:
    """The binomial tree over n ranks rooted at root: (parent or -1, children, span).

    In virtual ranks v = (rank - root) mod n, v's parent is v less its lowest set bit,
    its children are v + 1, v + 2, v + 4, ... below that bit (and below n), and its
    subtree is the virtual ranks [v, v + span): each child's subtree follows the one
    before, so a subtree's inputs gathered in child order are contiguous and in
    virtual rank order. Depth: the most set bits of any v, at most ceil(log2 n)."""
    v = (rank - root) % n
    low = v & -v if v else 1 << max(n - 1, 1).bit_length()
    parent = (v - low + root) % n if v else -1
    children = [(v + (1 << j) + root) % n for j in range(low.bit_length() - 1) if v + (1 << j) < n]
    return parent, children, min(low, n - v)


# Latency-bound calls at many ranks go up and down a binomial tree: a small all_reduce
# or reduce ("tree": inputs gathered up to the root, which folds them in rank order),
# a small broadcast (down the tree), a small all_gather (up and down it) and the barrier
# (dissemination, log2 n rounds), from TREE_MIN_RANKS ranks; all_reduce and reduce up to
# TREE_MAX_STAGE / n bytes per rank (the root's stage holds n inputs), all_gather up to
# TREE_MAX_STAGE gathered. Measured on one 2-core host under mrc-run
# (benchmarks/tree_loopback.py, the busy poll as the host gets it: on at 8 ranks, off
# from 9): 8 B all_reduce tree / gather 0.98 / 0.60 ms at 8 ranks, 1.9 / 3.1 at 16,
# 6.8 / 22.3 at 32; broadcast and barrier 1.2-1.7x faster by tree from 16 ranks, slower
# at 8; tree also beat the chain at 16-64 KiB at 16-32 ranks (mrc-perf). Gather's n - 1
# messages out and in per rank are what it costs; the tree's 2 log2(n) dependent hops are
# cheap where a message's CPU dominates, as here. On a fabric whose hops cost more than a
# message's CPU the crossover moves up (LogP with a hop's latency 5x a message's CPU:
# about 32 ranks): a communicator's tree_min_ranks (MRC_TREE_MIN_RANKS) moves it.
TREE_MIN_RANKS = 16
TREE_MAX_STAGE = 1 << 20


def tree_fits(n: int, nbytes: int, min_ranks: int = TREE_MIN_RANKS) -> bool:
    """Whether "auto" gathers an input of nbytes per rank up a tree at n ranks."""
    return n >= min_ranks and nbytes <= TREE_MAX_STAGE // n


def small_all_reduce(n: int, nbytes: int, min_ranks: int = TREE_MIN_RANKS) -> str | None:
    """What "auto" runs an all_reduce of nbytes per rank as at n ranks when it is small:
    "tree", "gather", or None past both (then direct, or the hosts' layout rule)."""
    if tree_fits(n, nbytes, min_ranks):
        return "tree"
    return "gather" if nbytes <= gather_max_bytes(n) else None


def small_max_bytes(n: int, min_ranks: int = TREE_MIN_RANKS) -> tuple[str, int]:
    """The small algorithm "auto" takes at n ranks, and up to how many bytes per rank."""
    if n >= min_ranks:
        return "tree", TREE_MAX_STAGE // n
    return "gather", gather_max_bytes(n)


def _tree_up(sch: Schedule, root: int, nbytes: int) -> tuple[list[Ref], list[int], int]:
    """The inputs gathered up the binomial tree to root: each rank sends its parent one
    message, its subtree's inputs in virtual rank order (binomial). At root: (the n
    inputs' places in rank order, the RECVs they wait for, -1); elsewhere ([], [], the
    step after which this rank's input has been read).

    Chunk for chunk: the SEND up (span inputs) and root's fold (one input) read stage
    bytes that RECVs of other lengths wrote. A step waits for chunk i of a dependency
    only where their chunk counts are equal, else for all of it; with a child's subtree
    at most half its parent's, the counts are equal only when both are one chunk (or
    the child's is one input at root, whose chunks line up)."""
    rank, n = sch.rank, sch.nranks
    parent, children, span = binomial(rank, n, root)
    v = (rank - root) % n
    send = Ref(BUF_SEND, 0)
    skip = 1 if rank == root else 0  # root reads its own input in place
    if children:
        sch.stage((span - skip) * nbytes)
    own = sch.copy(Ref(BUF_STAGE, 0), send, nbytes) if children and rank != root else -1
    got = []
    for c in children:
        vc = (c - root) % n
        dst = Ref(BUF_STAGE, (vc - v - skip) * nbytes)
        got.append(sch.recv(c, dst, min(vc - v, n - vc) * nbytes))
    if rank == root:
        srcs = [
            send if q == root else Ref(BUF_STAGE, ((q - root) % n - 1) * nbytes) for q in range(n)
        ]
        return srcs, got, -1
    if children:
        sch.send(parent, Ref(BUF_STAGE, 0), span * nbytes, [own, *got])
        return [], [], own
    return [], [], sch.send(parent, send, nbytes)


def _tree_down(sch: Schedule, root: int, nbytes: int, deps: Sequence[int]) -> None:
    """recv[0:nbytes] from root down the binomial tree: each rank gets it from its
    parent (after deps) and passes it to its children, the biggest subtree first (it
    is the deepest)."""
    parent, children, _ = binomial(sch.rank, sch.nranks, root)
    recv = Ref(BUF_RECV, 0)
    if parent >= 0:
        deps = [sch.recv(parent, recv, nbytes, deps)]
    for c in reversed(children):
        sch.send(c, recv, nbytes, deps)


def _all_reduce_tree(rank: int, n: int, nbytes: int, avg: bool) -> Schedule:
    """Small all_reduce at many ranks: the raw inputs gathered up a binomial tree to
    rank 0, which reduces all n in rank order, and the result back down the tree.
    2 ceil(log2 n) dependent hops and about 2 messages per rank, where "gather" needs
    n - 1 messages out and in per rank; rank 0 receives (n - 1) x the input, so it is
    for small inputs. The same bits as every other algorithm: one rank folds every
    element in rank order."""
    sch = Schedule("all_reduce_tree", rank, n, nbytes, nbytes)
    if n == 1:
        sch.reduce(Ref(BUF_RECV, 0), [Ref(BUF_SEND, 0)], nbytes, (), avg)
        return sch
    srcs, got, read = _tree_up(sch, 0, nbytes)
    if rank == 0:
        _tree_down(sch, 0, nbytes, [sch.reduce(Ref(BUF_RECV, 0), srcs, nbytes, got, avg)])
    else:
        _tree_down(sch, 0, nbytes, [read])  # in place, the result lands where it was read
    return sch


def host_groups(hosts: Sequence[str]) -> list[int]:
    """Sizes of the runs of consecutive ranks on one host: [2, 2] for a, a, b, b."""
    out: list[int] = []
    for i, h in enumerate(hosts):
        if i and h == hosts[i - 1]:
            out[-1] += 1
        else:
            out.append(1)
    return out


def _all_reduce_hier(
    rank: int, n: int, count: int, esize: int, groups: Sequence[int], avg: bool, lag: int
) -> Schedule:
    """The chain over groups of consecutive ranks (a host's ranks), direct inside each.

    The elements are cut into k shares, k the smallest group. In group j, member s
    (s < k) folds share s: it receives the raw share from every other member of its group
    and the partial sum of groups 0..j-1 from member s of group j-1, reduces them in rank
    order (the partial first: it holds every lower rank), and sends the result up to
    member s of group j+1; the last group's fold is the result, which goes back down the
    same members and, from each, to the rest of its group. So every element is folded in
    rank order, the bits of every other algorithm. A host's links carry the chain's
    bytes (D up and D down per boundary, split over k members), while the dependent hops
    are 2(m-1) for m groups instead of the chain's 2(n-1). One group is the direct
    schedule; groups of one rank are the chain.

    Pair order: a folder sends another member of its group raw data (for that member's
    share) and, later, its result; the results go with lag + 2(m-1) (the chain's round
    trip, in chunks), so that raw chunks keep flowing while a result is up the chain."""
    nbytes = count * esize
    sizes = list(groups)
    if sum(sizes) != n or any(g < 1 for g in sizes):
        raise UsageError(f"groups {sizes} do not cut {n} ranks into runs")
    sch = Schedule("all_reduce_hier", rank, n, nbytes, nbytes)
    if n == 1:
        sch.reduce(Ref(BUF_RECV, 0), [Ref(BUF_SEND, 0)], nbytes, (), avg)
        return sch
    m, k = len(sizes), min(sizes)
    starts = [sum(sizes[:j]) for j in range(m)]
    j = max(g for g in range(m) if starts[g] <= rank)
    first, size, i = starts[j], sizes[j], rank - starts[j]
    members = range(first, first + size)
    b = share_bounds(count, k)
    span = [(b[s] * esize, (b[s + 1] - b[s]) * esize) for s in range(k)]
    res_lag = lag + 2 * (m - 1)
    raw: dict[int, int] = {}
    for s in range(k):  # the raw shares this rank does not fold, to their folders
        if first + s != rank:
            raw[s] = sch.send(first + s, Ref(BUF_SEND, span[s][0]), span[s][1])
    if i < k:
        off, ln = span[i]
        mine = Ref(BUF_RECV, off)
        got: list[int] = []
        srcs: list[Ref] = []
        if j > 0:
            partial = sch.ring()
            got.append(sch.recv(starts[j - 1] + i, partial, ln))
            srcs.append(partial)
        for r in members:
            if r == rank:
                srcs.append(Ref(BUF_SEND, off))
            else:
                ring = sch.ring()
                got.append(sch.recv(r, ring, ln))
                srcs.append(ring)
        res = sch.reduce(mine, srcs, ln, got, avg and j == m - 1)
        if j < m - 1:
            up = sch.send(starts[j + 1] + i, mine, ln, [res])
            res = sch.recv(starts[j + 1] + i, mine, ln, [up])  # the result, over the partial
        if j > 0:
            sch.send(starts[j - 1] + i, mine, ln, [res])
        for r in members:
            if r != rank:
                sch.send(r, mine, ln, [res], res_lag)
    for s in range(k):  # the other shares' results, from their folders
        if first + s != rank:
            # In place, the result lands where the raw share was sent from: after it.
            sch.recv(first + s, Ref(BUF_RECV, span[s][0]), span[s][1], [raw[s]], res_lag)
    return sch


def reduce(
    rank: int,
    n: int,
    count: int,
    esize: int,
    root: int,
    *,
    avg: bool = False,
    lag: int = 4,
    algo: str = "direct",
) -> Schedule:
    """ "direct": reduce-scatter, then every owner sends its reduced share to root;
    "tree": the inputs gathered up a binomial tree to root, which folds them in rank
    order (small inputs at many ranks: tree_fits)."""
    nbytes = count * esize
    if algo not in ("direct", "tree"):
        raise UsageError(f"reduce algorithm must be direct or tree, got {algo!r}")
    name = "reduce_tree" if algo == "tree" else "reduce"
    sch = Schedule(name, rank, n, nbytes, nbytes if rank == root else 0)
    if n == 1:
        sch.reduce(Ref(BUF_RECV, 0), [Ref(BUF_SEND, 0)], nbytes, (), avg)
        return sch
    if algo == "tree":
        srcs, got, _ = _tree_up(sch, root, nbytes)
        if rank == root:
            sch.reduce(Ref(BUF_RECV, 0), srcs, nbytes, got, avg)
        return sch
    b = share_bounds(count, n)
    out = Ref(BUF_RECV, b[rank] * esize) if rank == root else None
    red, rs_sends = _reduce_scatter_phase(sch, b, esize, out, avg)
    if rank != root:
        mine = (b[rank + 1] - b[rank]) * esize
        dst = sch.steps[red].dst
        assert dst is not None
        sch.send(root, dst, mine, [red], lag)
    else:
        for k in range(n):
            if k != root:
                ln = (b[k + 1] - b[k]) * esize
                sch.recv(k, Ref(BUF_RECV, b[k] * esize), ln, [rs_sends[k]], lag)
    return sch


SCATTER_MIN_BYTES = 64 << 10  # below this, broadcast sends the whole buffer from root


def broadcast(
    rank: int,
    n: int,
    count: int,
    esize: int,
    root: int,
    algo: str = "auto",
    min_ranks: int = TREE_MIN_RANKS,
) -> Schedule:
    """In place on one buffer (send = recv). "direct": root sends everything to
    every rank; "scatter": root sends share k to rank k (the root's own share
    is empty), then the other ranks all-gather the shares: root's egress is the
    data once instead of n-1 times; "tree": down a binomial tree (log2 n hops,
    at most log2 n sends per rank); "auto": scatter from SCATTER_MIN_BYTES,
    below it tree from min_ranks ranks, else direct."""
    nbytes = count * esize
    if algo == "auto":
        big = nbytes >= SCATTER_MIN_BYTES and n > 2
        algo = "scatter" if big else "tree" if n >= min_ranks else "direct"
    if algo not in ("direct", "scatter", "tree"):
        raise UsageError(f"broadcast algorithm must be auto, direct, scatter or tree, got {algo!r}")
    sch = Schedule("broadcast_tree" if algo == "tree" else "broadcast", rank, n, nbytes, nbytes)
    if n == 1:
        return sch
    if algo == "tree":
        _tree_down(sch, root, nbytes, [])
        return sch
    if algo == "direct":
        if rank == root:
            for d in range(1, n):
                sch.send((root + d) % n, Ref(BUF_RECV, 0), nbytes)
        else:
            sch.recv(root, Ref(BUF_RECV, 0), nbytes)
        return sch
    b = share_bounds(count, n, [0 if k == root else 1 for k in range(n)])
    ln = [(b[k + 1] - b[k]) * esize for k in range(n)]
    if rank == root:
        for d in range(1, n):
            k = (root + d) % n
            sch.send(k, Ref(BUF_RECV, b[k] * esize), ln[k])
        return sch
    got = sch.recv(root, Ref(BUF_RECV, b[rank] * esize), ln[rank])
    for d in range(1, n):
        j = (rank + d) % n
        if j != root:
            sch.send(j, Ref(BUF_RECV, b[rank] * esize), ln[rank], [got])
    for d in range(1, n):
        k = (rank - d) % n
        if k != root:
            sch.recv(k, Ref(BUF_RECV, b[k] * esize), ln[k])
    return sch


def all_gather(rank: int, n: int, count: int, esize: int, algo: str = "direct") -> Schedule:
    """send (count) -> recv (n * count): rank k's block at k * count. "direct": every
    rank sends its block to every other; "tree": the blocks gathered up the binomial
    tree to rank 0 in recv itself (a subtree's blocks are contiguous there, in their
    final places), the whole of recv back down (log2 n hops each way, for small blocks
    at many ranks)."""
    blk = count * esize
    if algo == "tree":
        return _all_gather_tree(rank, n, blk)
    if algo != "direct":
        raise UsageError(f"all_gather algorithm must be direct or tree, got {algo!r}")
    sch = Schedule("all_gather", rank, n, blk, n * blk)
    sch.copy(Ref(BUF_RECV, rank * blk), Ref(BUF_SEND, 0), blk)
    for d in range(1, n):
        sch.send((rank + d) % n, Ref(BUF_SEND, 0), blk)
        k = (rank - d) % n
        sch.recv(k, Ref(BUF_RECV, k * blk), blk)
    return sch


def _all_gather_tree(rank: int, n: int, blk: int) -> Schedule:
    """Chunk for chunk as _tree_up: a SEND or RECV of a whole subtree (or of recv) and
    the steps it depends on differ in length by 2x or more, so their chunk counts are
    equal only when both are one chunk; otherwise a step waits for its dependencies
    whole (a RECV of the result never overwrites bytes a SEND up still reads)."""
    sch = Schedule("all_gather_tree", rank, n, blk, n * blk)
    own = sch.copy(Ref(BUF_RECV, rank * blk), Ref(BUF_SEND, 0), blk)
    if n == 1:
        return sch
    parent, children, span = binomial(rank, n)
    got = [sch.recv(c, Ref(BUF_RECV, c * blk), min(c - rank, n - c) * blk) for c in children]
    if rank:
        got = [sch.send(parent, Ref(BUF_RECV, rank * blk), span * blk, [own, *got])]
    _tree_down(sch, 0, n * blk, [own, *got])
    return sch


def reduce_scatter(rank: int, n: int, count: int, esize: int, *, avg: bool = False) -> Schedule:
    """send (n * count) -> recv (count): rank k gets the reduction of block k."""
    sch = Schedule("reduce_scatter", rank, n, n * count * esize, count * esize)
    if n == 1:
        sch.reduce(Ref(BUF_RECV, 0), [Ref(BUF_SEND, 0)], count * esize, (), avg)
        return sch
    b = [k * count for k in range(n + 1)]
    # recv holds only this rank's block: its offset there is 0.
    _reduce_scatter_phase(sch, b, esize, Ref(BUF_RECV, 0), avg)
    return sch


def all_to_all(
    rank: int, n: int, esize: int, send_counts: Sequence[int], recv_counts: Sequence[int]
) -> Schedule:
    """Block k of send (send_counts[k] elements, packed in rank order) goes to
    rank k; block k of recv comes from rank k."""
    if len(send_counts) != n or len(recv_counts) != n:
        raise UsageError(f"all_to_all needs {n} send and recv counts")
    so = np.concatenate([[0], np.cumsum(send_counts)]).astype(int).tolist()
    ro = np.concatenate([[0], np.cumsum(recv_counts)]).astype(int).tolist()
    sch = Schedule("all_to_all", rank, n, so[-1] * esize, ro[-1] * esize)
    if send_counts[rank] != recv_counts[rank]:
        raise UsageError(
            f"all_to_all: rank {rank} sends itself {send_counts[rank]} elements "
            f"but expects {recv_counts[rank]}"
        )
    sch.copy(
        Ref(BUF_RECV, ro[rank] * esize), Ref(BUF_SEND, so[rank] * esize), send_counts[rank] * esize
    )
    for d in range(1, n):
        j = (rank + d) % n
        sch.send(j, Ref(BUF_SEND, so[j] * esize), send_counts[j] * esize)
        k = (rank - d) % n
        sch.recv(k, Ref(BUF_RECV, ro[k] * esize), recv_counts[k] * esize)
    return sch


def barrier(rank: int, n: int, min_ranks: int = TREE_MIN_RANKS) -> Schedule:
    """Below min_ranks a zero-byte message to and from every rank; from it the
    dissemination barrier: in round k a rank sends to rank + 2^k and receives from
    rank - 2^k, its send waiting for every earlier round's receive, so after
    ceil(log2 n) rounds every rank has heard, through some chain, from every rank."""
    if n < min_ranks:
        sch = Schedule("barrier", rank, n, 0, 0)
        for d in range(1, n):
            sch.send((rank + d) % n, Ref(BUF_SEND, 0), 0)
            sch.recv((rank - d) % n, Ref(BUF_RECV, 0), 0)
        return sch
    sch = Schedule("barrier_dissemination", rank, n, 0, 0)
    heard: list[int] = []
    d = 1
    while d < n:  # the 2^k are distinct mod n: a peer once per direction
        sch.send((rank + d) % n, Ref(BUF_SEND, 0), 0, heard)
        heard.append(sch.recv((rank - d) % n, Ref(BUF_RECV, 0), 0))
        d *= 2
    return sch


def send(rank: int, n: int, peer: int, nbytes: int) -> Schedule:
    sch = Schedule("send", rank, n, nbytes, 0)
    sch.send(peer, Ref(BUF_SEND, 0), nbytes)
    return sch


def recv(rank: int, n: int, peer: int, nbytes: int) -> Schedule:
    sch = Schedule("recv", rank, n, 0, nbytes)
    sch.recv(peer, Ref(BUF_RECV, 0), nbytes)
    return sch
