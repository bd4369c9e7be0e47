"""The planner without a network: every schedule runs in the numpy simulator
(random arrival orders, tiny chunks, 2-slot rings), which also checks that
messages pair up and that no buffer being sent is changed in flight; results
must equal the rank-order reference bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from mrc.collectives import schedule as S
from mrc.collectives import simulate as M
from mrc.errors import UsageError


def f32(count: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(count) * 1e3).astype(np.float32)


def run(schedules, ins, outs, op="sum", dtype="float32", seed=0, chunk=8):
    S.check_pair(schedules)
    for s in schedules:
        s.check()
    M.simulate(schedules, ins, outs, dtype, op, chunk=chunk, slots=2, seed=seed)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("count", [0, 1, 13])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("shares", [None, "ramp", "zero", "gather", "chain"])
def test_all_reduce_any_order_same_bits(n, count, in_place, shares) -> None:
    sh = None if shares is None else [float(k + 1) for k in range(n)]
    if shares == "zero":
        sh = [0.0] + [1.0] * (n - 1)  # rank 0 owns nothing (a failed rank's share)
    xs = [f32(count, r) for r in range(n)]
    want = M.reference(xs, "float32", "avg").tobytes()
    for seed in range(3):
        ins = [x.view(np.uint8).copy() for x in xs]
        outs = ins if in_place else [np.zeros_like(i) for i in ins]
        algo = shares if shares in ("gather", "chain") else "direct"
        if algo != "direct":
            sh = None
        sch = [S.all_reduce(r, n, count, 4, shares=sh, avg=True, algo=algo) for r in range(n)]
        run(sch, ins, outs, op="avg", seed=seed)
        assert all(o.tobytes() == want for o in outs)


def same_bits_any_order(n: int, count: int, in_place: bool, **kw) -> None:
    """all_reduce(**kw) on n simulated ranks, 3 arrival orders: the reference's bits, for
    float32 avg and for bfloat16 sum (rounded after every source, so a different order
    shows)."""
    for dtype, esize, op in (("float32", 4, "avg"), ("bfloat16", 2, "sum")):
        xs = [f32(count, r) for r in range(n)]
        if dtype == "bfloat16":
            xs = [M.f32_to_bf16(x) for x in xs]
        want = M.reference(xs, dtype, op).tobytes()
        for seed in range(3):
            ins = [x.view(np.uint8).copy() for x in xs]
            outs = ins if in_place else [np.zeros_like(i) for i in ins]
            sch = [S.all_reduce(r, n, count, esize, avg=op == "avg", **kw) for r in range(n)]
            run(sch, ins, outs, op=op, dtype=dtype, seed=seed)
            assert all(o.tobytes() == want for o in outs), (kw, dtype, seed)


@pytest.mark.parametrize(
    "groups", [[1], [3], [1, 1, 1], [2, 2], [2, 1], [1, 2], [3, 2, 1], [2, 2, 2], [1, 3, 2]]
)
@pytest.mark.parametrize("count", [0, 1, 13, 40])
@pytest.mark.parametrize("in_place", [False, True])
def test_hier_all_reduce_any_order_same_bits(groups, count, in_place) -> None:
    """ "hier" (the chain over groups of consecutive ranks, direct inside each): the
    reference's bits in any arrival order, in and out of place, for groups of any sizes;
    bfloat16 too, where the rounding after every source shows a different order."""
    same_bits_any_order(sum(groups), count, in_place, algo="hier", groups=groups)
    with pytest.raises(UsageError, match=r"groups \[2, 2\] do not cut 3 ranks"):
        S.all_reduce(0, 3, 4, 4, algo="hier", groups=[2, 2])


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 13, 16])
@pytest.mark.parametrize("count", [0, 1, 13, 40])
@pytest.mark.parametrize("in_place", [False, True])
def test_tree_all_reduce_any_order_same_bits(n, count, in_place) -> None:
    """ "tree" (inputs gathered up a binomial tree, rank 0 folds, the result back down):
    the reference's bits in any arrival order with 8-byte chunks (so a subtree's
    gathered inputs span chunks that the RECVs which brought them cut elsewhere)."""
    same_bits_any_order(n, count, in_place, algo="tree")


def test_binomial_tree_shape() -> None:
    """Every rank but the root has one parent, subtrees are contiguous in virtual
    rank order, the depth at most ceil(log2 n); a rank sends at most one message up
    and one down per child."""
    for n in range(1, 40):
        for root in (0, n // 2, n - 1):
            depth = {root: 0}
            for v in range(n):
                r = (v + root) % n
                parent, children, span = S.binomial(r, n, root)
                assert (parent == -1) == (r == root)
                if parent >= 0:
                    assert r in S.binomial(parent, n, root)[1]
                    depth[r] = depth[parent] + 1
                assert 1 + sum(S.binomial(c, n, root)[2] for c in children) == span
            assert max(depth.values()) == max(bin(v).count("1") for v in range(n))
            assert max(depth.values()) <= (n - 1).bit_length()
    msgs = [
        sum(st.peer >= 0 for st in S.all_reduce(r, 64, 2, 4, algo="tree").steps) for r in range(64)
    ]
    assert sum(msgs) == 4 * 63  # each tree edge: one message up, one down, both ends count it


def test_hier_is_direct_in_one_group_and_the_chain_in_groups_of_one() -> None:
    """The two ends of "hier": the same transfers as direct (one group) and as the
    chain (every group one rank), and the host runs of a layout."""

    def transfers(sch):
        return sorted((st.kind, st.peer, st.length) for st in sch.steps if st.peer >= 0)

    for r in range(4):
        one = S.all_reduce(r, 4, 1000, 4, algo="hier", groups=[4])
        assert transfers(one) == transfers(S.all_reduce(r, 4, 1000, 4))
        ones = S.all_reduce(r, 4, 1000, 4, algo="hier", groups=[1, 1, 1, 1])
        assert transfers(ones) == transfers(S.all_reduce(r, 4, 1000, 4, algo="chain"))
    assert S.host_groups(list("aabbbca")) == [2, 3, 1, 1]


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_every_other_schedule(n) -> None:
    count = 11
    xs = [f32(count * n, r) for r in range(n)]
    red = M.reference(xs, "float32", "max")
    for root in range(n):
        for algo in ("direct", "tree"):
            ins = [x.view(np.uint8).copy() for x in xs]
            outs = [
                np.zeros_like(x) if r == root else np.zeros(0, np.uint8) for r, x in enumerate(ins)
            ]
            sch = [S.reduce(r, n, count * n, 4, root, algo=algo) for r in range(n)]
            run(sch, ins, outs, op="max")
            assert outs[root].tobytes() == red.tobytes()
            # In place at root: the fold writes the input it reads first.
            run(
                sch,
                ins,
                [x if r == root else o for r, (x, o) in enumerate(zip(ins, outs, strict=True))],
                op="max",
            )
            assert ins[root].tobytes() == red.tobytes()
        for algo in ("direct", "scatter", "tree"):
            bufs = [x.view(np.uint8).copy() for x in xs]
            run([S.broadcast(r, n, count * n, 4, root, algo) for r in range(n)], bufs, bufs)
            assert all(b.tobytes() == xs[root].tobytes() for b in bufs)
    ins = [x.view(np.uint8).copy() for x in xs]
    outs = [np.zeros(count * 4, np.uint8) for _ in range(n)]
    run([S.reduce_scatter(r, n, count, 4) for r in range(n)], ins, outs, op="max")
    for r in range(n):
        assert outs[r].tobytes() == red[r * count : (r + 1) * count].tobytes()
    outs = [np.zeros(n * n * count * 4, np.uint8) for _ in range(n)]
    run([S.all_gather(r, n, n * count, 4) for r in range(n)], ins, outs)
    assert all(o.tobytes() == np.concatenate(xs).tobytes() for o in outs)
    cnt = [[(3 * a + b) % 4 for b in range(n)] for a in range(n)]
    ins = [f32(sum(cnt[a]), a).view(np.uint8) for a in range(n)]
    outs = [np.zeros(sum(cnt[k][b] for k in range(n)) * 4, np.uint8) for b in range(n)]
    sch = [S.all_to_all(a, n, 4, cnt[a], [cnt[k][a] for k in range(n)]) for a in range(n)]
    run(sch, ins, outs)
    for b in range(n):
        want = [ins[k][sum(cnt[k][:b]) * 4 : sum(cnt[k][: b + 1]) * 4] for k in range(n)]
        assert outs[b].tobytes() == np.concatenate(want).tobytes()
    empty = [np.zeros(0, np.uint8) for _ in range(n)]
    run([S.barrier(r, n) for r in range(n)], empty, empty)


@pytest.mark.parametrize("n", [9, 16, 21])
def test_tree_reduce_and_broadcast_from_any_root(n) -> None:
    """reduce, broadcast and all_gather as "auto" runs them from schedule.TREE_MIN_RANKS ranks (up
    and down a binomial tree rooted anywhere), in the simulator with 8-byte chunks: the
    rank-order fold's bits at root, root's buffer everywhere; and whether auto takes
    them at this rank count."""
    count = 5
    xs = [f32(count, r) for r in range(n)]
    red = M.reference(xs, "float32", "sum").tobytes()
    for root in (0, 1, n // 2, n - 1):
        ins = [x.view(np.uint8).copy() for x in xs]
        outs = [np.zeros_like(x) if r == root else np.zeros(0, np.uint8) for r, x in enumerate(ins)]
        run([S.reduce(r, n, count, 4, root, algo="tree") for r in range(n)], ins, outs, seed=root)
        assert outs[root].tobytes() == red
        bufs = [x.view(np.uint8).copy() for x in xs]
        run([S.broadcast(r, n, count, 4, root, "tree") for r in range(n)], bufs, bufs, seed=root)
        assert all(b.tobytes() == xs[root].tobytes() for b in bufs)
    for count in (0, 1, 5):  # all_gather: up to rank 0 in recv itself, all of recv down
        ins = [f32(count, r).view(np.uint8) for r in range(n)]
        outs = [np.zeros(n * count * 4, np.uint8) for _ in range(n)]
        run([S.all_gather(r, n, count, 4, "tree") for r in range(n)], ins, outs, seed=count)
        assert all(o.tobytes() == np.concatenate(ins).tobytes() for o in outs)
    tree = n >= S.TREE_MIN_RANKS
    assert S.broadcast(0, n, count, 4, 0).name == ("broadcast_tree" if tree else "broadcast")
    assert S.tree_fits(n, 4 * count) == tree
    assert S.small_all_reduce(n, 4) == ("tree" if tree else "gather")


def _heard_from(schedules) -> list[set[int]]:
    """Per rank, the ranks some step of which must have run before this rank's call can
    end: through its own steps' dependencies and, for each RECV, the matching SEND's
    (a call ends when its RECVs have their data, which comes only once posted)."""
    send_of = {}
    for q, sch in enumerate(schedules):
        for i, st in enumerate(sch.steps):
            if st.kind == S.SEND:
                send_of[(q, st.peer, st.pair_seq)] = i
    memo: dict[tuple[int, int], set[int]] = {}

    def before(r: int, i: int) -> set[int]:
        if (r, i) not in memo:
            st = schedules[r].steps[i]
            got = {r}
            for d in st.deps:
                got |= before(r, d)
            if st.kind == S.RECV:
                got |= before(st.peer, send_of[(st.peer, r, st.pair_seq)])
            memo[(r, i)] = got
        return memo[(r, i)]

    return [
        set().union(*(before(r, i) for i in range(len(s.steps)))) for r, s in enumerate(schedules)
    ]


@pytest.mark.parametrize("n", [2, 3, 5, 15, 16, 17, 31, 33, 64, 100])
def test_barrier_waits_for_every_rank(n) -> None:
    """No rank can leave the barrier before every rank entered it: each rank's call
    ends only after a step of every rank (dissemination from schedule.TREE_MIN_RANKS
    ranks: ceil(log2 n) rounds, one message each way per round)."""
    schedules = [S.barrier(r, n) for r in range(n)]
    S.check_pair(schedules)
    assert all(h == set(range(n)) for h in _heard_from(schedules))
    rounds = (n - 1).bit_length() if n >= S.TREE_MIN_RANKS else n - 1
    assert all(sum(st.kind == S.SEND for st in s.steps) == rounds for s in schedules)
    # One round short would not do: the check can fail.
    short = [S.barrier(r, n) for r in range(n)]
    if n >= S.TREE_MIN_RANKS:
        for s in short:
            s.steps = s.steps[:-2]
        assert any(h != set(range(n)) for h in _heard_from(short))


def test_share_bounds() -> None:
    assert S.share_bounds(10, 3) == [0, 4, 7, 10]
    assert S.share_bounds(10, 4, [1, 1, 1, 1]) == [0, 2, 5, 7, 10]
    assert S.share_bounds(100, 2, [0.25, 0.75]) == [0, 25, 100]
    assert S.share_bounds(5, 3, [0, 0, 1]) == [0, 0, 0, 5]
    with pytest.raises(UsageError, match="3 entries for 2 ranks"):
        S.share_bounds(5, 2, [1, 1, 1])
    with pytest.raises(UsageError, match="positive sum"):
        S.share_bounds(5, 2, [0, 0])


def test_bytes_per_rank_match_a_ring() -> None:
    """Direct all_reduce moves 2(n-1)/n of the data per rank, as a ring does."""
    n, count = 4, 4000
    sch = S.all_reduce(1, n, count, 4)
    sent = sum(s.length for s in sch.steps if s.kind == S.SEND)
    got = sum(s.length for s in sch.steps if s.kind == S.RECV)
    assert sent == got == 2 * (n - 1) * count * 4 // n


def test_checks_catch_bad_schedules() -> None:
    sch = S.all_reduce(0, 3, 30, 4)
    sch.steps[-1].deps = (len(sch.steps),)
    with pytest.raises(UsageError, match="depends on a later step"):
        sch.check()
    sch = S.all_reduce(0, 3, 30, 4)
    red = next(s for s in sch.steps if s.kind == S.REDUCE)
    red.deps = ()
    with pytest.raises(UsageError, match="without depending"):
        sch.check()
    a, b = S.send(0, 2, 1, 10), S.recv(1, 2, 0, 12)
    want = r"sends \[\(10, 0\)\] to rank 1, which receives \[\(12, 0\)\]"
    with pytest.raises(UsageError, match=want):
        S.check_pair([a, b])


def test_simulator_catches_a_send_buffer_overwritten_in_flight() -> None:
    """A COPY into a range that is still being sent, with no dependency on the
    send: some arrival order shows the hazard."""
    a = S.Schedule("hazard", 0, 2, 16, 16)
    a.send(1, S.Ref(S.BUF_RECV, 0), 8)
    a.copy(S.Ref(S.BUF_RECV, 0), S.Ref(S.BUF_RECV, 8), 8)
    b = S.recv(1, 2, 0, 8)
    with pytest.raises(AssertionError, match="changed while in flight"):
        for seed in range(50):
            buf = np.arange(16, dtype=np.uint8)
            M.simulate(
                [a, b],
                [buf, np.zeros(0, np.uint8)],
                [buf, np.zeros(8, np.uint8)],
                "uint8",
                "sum",
                chunk=8,
                seed=seed,
            )


def test_gather_threshold_follows_the_alpha_beta_model() -> None:
    """auto's gather/direct line: at the threshold gather is no slower than direct in the
    model the constant comes from (alpha B = GATHER_ALPHA_B), past it (below the cap)
    direct is faster; it falls with n, and 2 ranks always gather up to the cap."""
    k = S.GATHER_ALPHA_B  # alpha B; times below in units of alpha

    def gather(n: int, s: int) -> float:
        return 1 + (n - 1) * s / k

    def direct(n: int, s: int) -> float:
        return 2 + 2 * (n - 1) * s / (n * k)

    assert S.gather_max_bytes(2) == S.GATHER_CAP
    last = S.GATHER_CAP
    for n in range(3, 257):
        t = S.gather_max_bytes(n)
        assert 0 < t <= last and t <= S.GATHER_CAP, n
        last = t
        assert gather(n, t) <= direct(n, t) + 1e-9, n
        if t < S.GATHER_CAP:
            assert gather(n, t + 8) > direct(n, t + 8), n
    assert S.gather_max_bytes(4) == 96 << 10
