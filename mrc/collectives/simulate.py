"""A pure-Python executor of schedules on numpy arrays: the test oracle.

It follows the C executor's rules (chunks, chunk-wise dependencies, scratch
ring reuse, per-pair message order) but picks the next action at random among
all that could run, so tests explore arrival orders the real network may never
produce. It also checks what the C executor trusts the planner for: matched
messages have equal lengths and pair positions, and a buffer range being sent
is not changed before the send completes.

`combine`/`finish` are the numpy statement of the reduction semantics of
src_c/reduce.c (float16/bfloat16 via float32, rounded every step).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence

import numpy as np

from mrc.collectives import schedule as S
from mrc.errors import UsageError

STORAGE = {
    "int8": np.int8,
    "uint8": np.uint8,
    "int32": np.int32,
    "int64": np.int64,
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float32": np.float32,
    "float64": np.float64,
}


def bf16_to_f32(u: np.ndarray) -> np.ndarray:
    return (u.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(f: np.ndarray) -> np.ndarray:
    """Round to nearest, ties to even; NaN stays a (quiet) NaN."""
    u = np.asarray(f, np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(f, np.float32))
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), r)


def _widen(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return bf16_to_f32(a)
    if dtype == "float16":
        return a.astype(np.float32)
    return a


def _narrow(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return f32_to_bf16(a)
    with np.errstate(over="ignore"):  # overflow is Inf, as in C
        return a.astype(STORAGE[dtype])


def combine(acc: np.ndarray, src: np.ndarray, dtype: str, op: str) -> np.ndarray:
    """acc op src, element-wise, as one step of src_c/reduce.c."""
    x, y = _widen(acc, dtype), _widen(src, dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        if op in ("sum", "avg"):
            r = x + y
        elif op == "prod":
            r = x * y
        elif op == "min":
            r = np.where(y < x, y, x)
        elif op == "max":
            r = np.where(y > x, y, x)
        else:
            raise UsageError(f"unknown op {op!r}")
    return _narrow(r, dtype)


def finish(acc: np.ndarray, dtype: str, op: str, n: int) -> np.ndarray:
    """AVG: divide by n once (integers truncate toward zero, as C does)."""
    if op != "avg" or n == 1:
        return acc
    if dtype in ("int8", "uint8", "int32", "int64"):
        a = acc.astype(np.int64)
        q = a // n
        q = q + ((a % n != 0) & (a < 0))
        return q.astype(STORAGE[dtype])
    x = _widen(acc, dtype)
    return _narrow(x / np.asarray(n, x.dtype), dtype)


def reference(inputs: Sequence[np.ndarray], dtype: str, op: str) -> np.ndarray:
    """Reduction of the ranks' arrays in rank order 0, 1, ... n-1."""
    acc = inputs[0].copy()
    for a in inputs[1:]:
        acc = combine(acc, a, dtype, op)
    return finish(acc, dtype, op, len(inputs))


# ---- the simulator --------------------------------------------------------


class _Rank:
    def __init__(self, sch: S.Schedule, send: np.ndarray, recv: np.ndarray, chunk: int, slots: int):
        self.sch, self.chunk, self.slots = sch, chunk, slots
        self.bufs = {
            S.BUF_SEND: send,
            S.BUF_RECV: recv,
            S.BUF_STAGE: np.zeros(sch.stage_bytes, np.uint8),
        }
        self.scratch = np.zeros(sch.nrings * slots * chunk, np.uint8)
        self.nch = [max(1, -(-s.length // chunk)) for s in sch.steps]
        self.done = [np.zeros(k, bool) for k in self.nch]
        self.next = [0] * len(sch.steps)
        self.producer = {}
        self.consumers: dict[int, list[int]] = {}
        for i, s in enumerate(sch.steps):
            if s.dst is not None and s.dst.buf == S.BUF_SCRATCH:
                self.producer[s.dst.off] = i
            for r in s.srcs:
                if r.buf == S.BUF_SCRATCH:
                    self.consumers.setdefault(r.off, []).append(i)
        self.lists: dict[tuple[int, int], list[int]] = {}
        for i, s in enumerate(sch.steps):
            if s.kind in (S.SEND, S.RECV):
                self.lists.setdefault((s.peer, s.kind), []).append(i)

    def span(self, s: S.Step, i: int) -> int:
        return max(0, min(self.chunk, s.length - i * self.chunk))

    def view(self, ref: S.Ref, s: S.Step, i: int) -> np.ndarray:
        n = self.span(s, i)
        if ref.buf == S.BUF_SCRATCH:
            o = (ref.off * self.slots + i % self.slots) * self.chunk
            return self.scratch[o : o + n]
        o = ref.off + i * self.chunk
        return self.bufs[ref.buf][o : o + n]

    def ready(self, si: int, i: int) -> bool:
        s = self.sch.steps[si]
        for d in s.deps:
            ok = self.done[d][i] if self.nch[d] == self.nch[si] else self.done[d].all()
            if not ok:
                return False
        if s.dst is not None and s.dst.buf == S.BUF_SCRATCH and i >= self.slots:
            return all(self.done[c][i - self.slots] for c in self.consumers.get(s.dst.off, []))
        return True

    def cursor_ok(self, si: int) -> bool:
        """Transfers of one peer and direction start in message order: chunk i
        of a step is message i + lag, ties to the lower pair_seq (coll.c)."""
        s = self.sch.steps[si]
        best, key = None, None
        for j in self.lists[(s.peer, s.kind)]:
            if self.next[j] >= self.nch[j]:
                continue
            k = self.next[j] + self.sch.steps[j].lag
            if key is None or k < key:
                best, key = j, k
        return best == si


def simulate(
    schedules: Sequence[S.Schedule],
    sends: Sequence[np.ndarray],
    recvs: Sequence[np.ndarray],
    dtype: str,
    op: str,
    *,
    chunk: int = 64,
    slots: int = 2,
    seed: int = 0,
) -> None:
    """Runs every rank's schedule on byte arrays (recvs are written; pass the
    same array as send and recv for in place). Raises AssertionError on a
    deadlock, a mismatched message or a send buffer changed in flight."""
    rng = random.Random(seed)
    ranks = [_Rank(sch, sends[r], recvs[r], chunk, slots) for r, sch in enumerate(schedules)]
    n = len(schedules)
    msgs: dict[tuple[int, int], deque] = {}
    posted: dict[tuple[int, int], deque] = {}
    while True:
        actions: list[tuple] = []
        for r, rk in enumerate(ranks):
            for si, s in enumerate(rk.sch.steps):
                i = rk.next[si]
                if i >= rk.nch[si] or not rk.ready(si, i):
                    continue
                if s.kind in (S.SEND, S.RECV) and not rk.cursor_ok(si):
                    continue
                actions.append(("step", r, si, i))
        for (a, b), q in msgs.items():
            if q and posted.get((b, a)):
                actions.append(("deliver", a, b))
        if not actions:
            break
        act = rng.choice(actions)
        if act[0] == "deliver":
            _, a, b = act
            sa, sseq, si, data, view = msgs[(a, b)].popleft()
            ra, rseq, ri = posted[(b, a)].popleft()
            rb = ranks[b]
            rs = rb.sch.steps[ri]
            dst = rb.view(rs.dst, rs, rseq)
            assert (sa, sseq) == (rs.pair_seq, rseq), f"rank {a}->{b}: message order differs"
            assert len(dst) == len(data), f"rank {a}->{b}: {len(data)} bytes into {len(dst)}"
            assert np.array_equal(view, data), f"rank {a}: send buffer changed while in flight"
            dst[:] = data
            rb.done[ri][rseq] = True
            ranks[a].done[si][sseq] = True
            continue
        _, r, si, i = act
        rk = ranks[r]
        s = rk.sch.steps[si]
        rk.next[si] += 1
        if s.kind == S.SEND:
            v = rk.view(s.srcs[0], s, i)
            msgs.setdefault((r, s.peer), deque()).append((s.pair_seq, i, si, v.copy(), v))
        elif s.kind == S.RECV:
            posted.setdefault((r, s.peer), deque()).append((s.pair_seq, i, si))
        else:
            srcs = [rk.view(x, s, i).view(STORAGE[dtype]).copy() for x in s.srcs]
            acc = srcs[0]
            if s.kind == S.REDUCE:
                for x in srcs[1:]:
                    acc = combine(acc, x, dtype, op)
                if s.flags & S.FINISH:
                    acc = finish(acc, dtype, op, n)
            dst = rk.view(s.dst, s, i)
            dst[:] = np.ascontiguousarray(acc).view(np.uint8)
            rk.done[si][i] = True
    for r, rk in enumerate(ranks):
        for si, d in enumerate(rk.done):
            assert d.all(), f"rank {r}: deadlock, step {si} ({rk.sch.steps[si]}) not done"
