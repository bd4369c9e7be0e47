"""Collectives end to end: in-process ranks (one endpoint and thread each,
every pair connected on loopback planes) run the C executor; results are
compared bit for bit with numpy reductions in rank order."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from coll_helpers import mesh, ok, run_ranks
from helpers import wait_for

from mrc import _datapath
from mrc.collectives import ops as O
from mrc.collectives import schedule as S
from mrc.collectives import simulate as M
from mrc.collectives.soak import bits, data  # inputs that show the order of additions
from mrc.errors import CollectiveError, UsageError

DTYPES = list(O.DTYPES)
OPS = list(O.OPS)


@pytest.fixture(scope="module", params=[2, 3, 4, 5])
def ranks(request):
    with mesh(request.param) as rs:
        yield rs


# ---- the C kernels from Python, against numpy ------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_kernels_match_numpy(dtype: str, op: str) -> None:
    srcs = [data(dtype, 513, s, op) for s in range(3)]
    if dtype == "float16":  # subnormals and values that round
        srcs[1][:4] = np.array([6e-8, -6e-8, 1e-5, 65504], np.float16)
    acc = srcs[0].copy()
    for s in srcs[1:]:
        _datapath.reduce_into(acc, s, O.DTYPES[dtype], O.OPS[op])
    _datapath.reduce_finish(acc, O.DTYPES[dtype], O.OPS[op], 3)
    assert bits(acc) == bits(M.reference(srcs, dtype, op))


# ---- every collective x op x dtype ------------------------------------------


@pytest.mark.parametrize("algo", ["direct", "gather", "chain", "tree"])
def test_all_reduce_every_op_and_dtype(ranks, algo: str) -> None:
    n = len(ranks)
    case = 0
    for dtype in DTYPES:
        for op in OPS:
            for count in (0, 1, 7 * n + 3):
                case += 1
                ins = [data(dtype, count, 100 * case + r, op) for r in range(n)]
                want = bits(M.reference(ins, dtype, op))
                in_place = case % 2 == 0
                dt = "bfloat16" if dtype == "bfloat16" else None

                def go(rk, ins=ins, in_place=in_place, op=op, dt=dt):
                    mine = ins[rk.rank].copy()
                    if in_place:
                        return rk.all_reduce(mine, op=op, dtype=dt, algo=algo)
                    return rk.all_reduce(mine, np.empty_like(mine), op=op, dtype=dt, algo=algo)

                for r, got in enumerate(ok(run_ranks(ranks, go))):
                    assert bits(got) == want, f"{dtype} {op} count {count} rank {r}"


@pytest.mark.parametrize("hosts", ["aabbb", "abbb", "aab"])
def test_hier_every_op_and_dtype(hosts: str) -> None:
    """ "hier" on ranks whose hosts make groups (a communicator's hosts; these meshes are
    told them): every op and dtype, in and out of place, the reference's bits."""
    n = len(hosts)
    with mesh(n) as rs:
        for rk in rs:
            rk.hosts = list(hosts)
        case = 0
        for dtype in DTYPES:
            for op in OPS:
                for count in (0, 1, 7 * n + 3, 5000):
                    case += 1
                    ins = [data(dtype, count, 100 * case + r, op) for r in range(n)]
                    want = bits(M.reference(ins, dtype, op))
                    dt = "bfloat16" if dtype == "bfloat16" else None

                    def go(rk, ins=ins, in_place=case % 2 == 0, op=op, dt=dt):
                        mine = ins[rk.rank].copy()
                        out = None if in_place else np.empty_like(mine)
                        got = rk.all_reduce(mine, out, op=op, dtype=dt, algo="hier")
                        return got, rk.collective_stats()["last"]["schedule"]

                    for r, (got, sched) in enumerate(ok(run_ranks(rs, go))):
                        assert bits(got) == want, f"{dtype} {op} count {count} rank {r}"
                        assert sched == "all_reduce_hier"


def test_small_calls_go_up_and_down_a_tree_from_its_rank_count() -> None:
    """From tree_min_ranks ranks (schedule.TREE_MIN_RANKS, lowered here so that 5
    in-process ranks reach it) "auto" runs small all_reduces and reduces up a binomial
    tree, small broadcasts down one, from any root, small all_gathers up and down one
    (in place too: send a view of this rank's block of recv), and the barrier by
    dissemination: the reference's bits for every op and dtype, in and out of place."""
    n = 5
    names = {"all_reduce_tree", "reduce_tree", "broadcast_tree", "all_gather_tree"}
    names.add("barrier_dissemination")
    with mesh(n) as rs:
        for rk in rs:
            rk.tree_min_ranks = 3
        for case, (dtype, op) in enumerate((d, o) for d in DTYPES for o in OPS):
            count, root = 1 + case % 9, case % n
            ins = [data(dtype, count, 10 * case + r, op) for r in range(n)]
            want = bits(M.reference(ins, dtype, op))
            dt = "bfloat16" if dtype == "bfloat16" else None

            def go(rk, ins=ins, op=op, dt=dt, root=root, in_place=case % 2 == 0, count=count):
                mine = ins[rk.rank].copy()
                ran = []
                out = rk.all_reduce(
                    mine, None if in_place else np.empty_like(mine), op=op, dtype=dt
                )
                ran.append(rk.collective_stats()["last"]["schedule"])
                src = ins[rk.rank].copy()
                red = src if in_place else np.empty_like(src)
                rk.reduce(src, None if in_place else red, op=op, root=root, dtype=dt)
                ran.append(rk.collective_stats()["last"]["schedule"])
                b = ins[rk.rank].copy()
                rk.broadcast(b, root=root, dtype=dt)
                ran.append(rk.collective_stats()["last"]["schedule"])
                g = np.zeros(n * count, ins[0].dtype)
                me = slice(rk.rank * count, (rk.rank + 1) * count)
                if in_place:
                    g[me] = ins[rk.rank]
                rk.all_gather(g[me] if in_place else ins[rk.rank], g, dtype=dt)
                ran.append(rk.collective_stats()["last"]["schedule"])
                rk.barrier()
                ran.append(rk.collective_stats()["last"]["schedule"])
                return out, red, b, g, ran

            for r, (out, red, b, g, ran) in enumerate(ok(run_ranks(rs, go))):
                assert bits(out) == want, f"all_reduce {dtype} {op} rank {r}"
                if r == root:
                    assert bits(red) == want, f"reduce {dtype} {op} root {root}"
                assert bits(b) == bits(ins[root]), f"broadcast {dtype} root {root} rank {r}"
                assert bits(g) == bits(np.concatenate(ins)), f"all_gather {dtype} rank {r}"
                assert set(ran) == names


def test_tree_all_gather_in_many_chunks_under_loss() -> None:
    """The tree all_gather with 4 KiB chunks and 5% loss on a plane of every rank: a
    subtree's blocks go up as one message of many chunks and the whole of recv comes back
    down over the bytes each rank sent up (the RECV of the result waits for that SEND)."""
    n, count = 5, 20_001
    ins = [data("float32", count, 300 + r) for r in range(n)]
    with mesh(n, chunk_bytes=4096, slots=2, timeout=30) as rs:
        for rk in rs:
            rk.tree_min_ranks = 3
            rk.endpoint.inject(0, loss=0.05)

        def go(rk):
            out = np.zeros(n * count, np.float32)
            rk.all_gather(ins[rk.rank], out)
            ran = rk.collective_stats()["last"]["schedule"]
            g = np.zeros(n * count, np.float32)
            g[rk.rank * count : (rk.rank + 1) * count] = ins[rk.rank]
            rk.all_gather(g[rk.rank * count : (rk.rank + 1) * count], g)  # in place
            return out, g, ran

        for out, g, ran in ok(run_ranks(rs, go)):
            assert bits(out) == bits(g) == bits(np.concatenate(ins)) and ran == "all_gather_tree"


def test_auto_gathers_up_to_the_threshold_for_its_rank_count(ranks) -> None:
    """algo="auto": "gather" up to schedule.gather_max_bytes(n), "direct" past it, on
    every rank alike (the call's signature holds the choice), with the same bits."""
    n = len(ranks)
    top = S.gather_max_bytes(n) // 4
    for count, want in ((top, "all_reduce_gather"), (top + 1, "all_reduce")):
        ins = [data("float32", count, 50 + r) for r in range(n)]

        def go(rk, ins=ins):
            out = rk.all_reduce(ins[rk.rank], np.empty_like(ins[rk.rank]))
            return out, rk.collective_stats()["last"]["schedule"]

        got = ok(run_ranks(ranks, go))
        ref = bits(M.reference(ins, "float32", "sum"))
        assert all(bits(o) == ref and sched == want for o, sched in got), (count, want)


def test_auto_takes_the_chain_where_ranks_share_hosts() -> None:
    """Past gather's sizes "auto" asks model.layout_algo: ranks two per host (a, a, b, b)
    run the chain of hosts ("hier"), ranks one per host direct, and explicit
    algo="direct" stays direct; the same bits every time. Ranks that know no hosts
    (these meshes, by default) run direct; collective_stats says what auto ran and why."""
    n = 4
    count = S.gather_max_bytes(n) // 4 + 1000
    ins = [data("float32", count, 70 + r) for r in range(n)]
    ref = bits(M.reference(ins, "float32", "sum"))
    for hosts, algo, want in (
        (None, "auto", "all_reduce"),
        ("aabb", "auto", "all_reduce_hier"),
        ("aabb", "direct", "all_reduce"),
        ("abcd", "auto", "all_reduce"),
    ):
        with mesh(n) as rs:  # a communicator's hosts are set once, where it is made
            for rk in rs:
                rk.hosts = None if hosts is None else list(hosts)

            def go(rk, algo=algo):
                out = rk.all_reduce(ins[rk.rank], np.empty_like(ins[rk.rank]), algo=algo)
                return out, rk.collective_stats()

            got = ok(run_ranks(rs, go))
            assert all(bits(o) == ref for o, _ in got), (hosts, algo)
            assert [st["last"]["schedule"] for _, st in got] == [want] * n, (hosts, algo)
    layout = got[0][1]["auto_layout"]  # one rank per host: 2 D against 1.5 D
    assert layout["algo"] == "direct" and "hier 1.33 x direct's" in layout["why"]


def test_mrc_algo_sets_what_auto_means(monkeypatch: Any) -> None:
    """MRC_ALGO (NCCL_ALGO's counterpart, for callers that cannot pass algo, such as
    the torch backend) makes algo="auto" one algorithm at every size; a value that is
    none of them is refused where the communicator is made, naming the variable."""
    monkeypatch.setenv("MRC_ALGO", "chain")
    with mesh(3) as rs:
        for count in (1, 100_000):
            ins = [data("float32", count, 9 + r) for r in range(3)]

            def go(rk, ins=ins):
                out = rk.all_reduce(ins[rk.rank].copy())
                return out, rk.collective_stats()

            got = ok(run_ranks(rs, go))
            ref = bits(M.reference(ins, "float32", "sum"))
            assert all(bits(o) == ref for o, _ in got)
            assert all(st["last"]["schedule"] == "all_reduce_chain" for _, st in got)
            assert got[0][1]["all_reduce_algo"] == "chain"
        # shares= are the direct schedule's: they take it over MRC_ALGO, and an explicit
        # other algo with them is refused
        x = data("float32", 10, 1)
        got = ok(run_ranks(rs, lambda rk: rk.all_reduce(x.copy(), shares=[1, 1, 2])))
        assert bits(got[0]) == bits(M.reference([x] * 3, "float32", "sum"))
        assert rs[0].collective_stats()["last"]["schedule"] == "all_reduce"
        with pytest.raises(UsageError, match="shares= is for the direct schedule, not 'chain'"):
            rs[0].all_reduce(x.copy(), shares=[1, 1, 2], algo="chain")
    monkeypatch.setenv("MRC_ALGO", "ring")
    with pytest.raises(UsageError, match="MRC_ALGO .*'ring'.*chain"):
        with mesh(2):
            pass


def test_reduce_and_reduce_scatter(ranks) -> None:
    n = len(ranks)
    root = n - 1
    case = 0
    for dtype in DTYPES:
        for op in OPS:
            case += 1
            dt = "bfloat16" if dtype == "bfloat16" else None
            count = 3 + case % 4
            ins = [data(dtype, count * n, 7 * case + r, op) for r in range(n)]
            want = M.reference(ins, dtype, op)

            def red(rk, ins=ins, op=op, dt=dt):
                return rk.reduce(ins[rk.rank].copy(), op=op, root=root, dtype=dt)

            def rs(rk, ins=ins, op=op, dt=dt, count=count):
                out = np.empty(count, ins[0].dtype)
                return rk.reduce_scatter(ins[rk.rank], out, op=op, dtype=dt)

            got = ok(run_ranks(ranks, red))
            assert bits(got[root]) == bits(want), f"reduce {dtype} {op}"
            assert all(g is None for r, g in enumerate(got) if r != root)
            for r, g in enumerate(ok(run_ranks(ranks, rs))):
                assert bits(g) == bits(want[r * count : (r + 1) * count]), f"rs {dtype} {op} {r}"


@pytest.mark.parametrize("count", [0, 1, 1000, 40000])
def test_broadcast_all_gather_all_to_all(ranks, count: int) -> None:
    n = len(ranks)
    for dtype in ("int8", "float16", "float64"):
        ins = [data(dtype, count, 11 * r + count) for r in range(n)]
        for root in {0, n - 1}:
            out = ok(
                run_ranks(
                    ranks, lambda rk, root=root, ins=ins: rk.broadcast(ins[rk.rank].copy(), root)
                )
            )
            assert all(bits(o) == bits(ins[root]) for o in out)
        gathered = bits(np.concatenate(ins))
        out = ok(
            run_ranks(
                ranks,
                lambda rk, ins=ins, dt=dtype: rk.all_gather(ins[rk.rank], np.empty(n * count, dt)),
            )
        )
        assert all(bits(o) == gathered for o in out)
    # all_to_all: equal blocks, then counts that differ per pair
    blk = max(count // 8, 1)
    sends = [data("int32", n * blk, r) for r in range(n)]
    out = ok(run_ranks(ranks, lambda rk: rk.all_to_all(sends[rk.rank], np.empty(n * blk, "int32"))))
    for r, o in enumerate(out):
        want = np.concatenate([sends[k][r * blk : (r + 1) * blk] for k in range(n)])
        assert bits(o) == bits(want)
    cnt = [[(a * 3 + b + count) % 5 for b in range(n)] for a in range(n)]  # a sends cnt[a][b] to b
    vs = [data("float32", sum(cnt[a]), 50 + a) for a in range(n)]

    def a2av(rk):
        a = rk.rank
        rc = [cnt[k][a] for k in range(n)]
        return rk.all_to_all(vs[a], np.empty(sum(rc), "float32"), cnt[a], rc)

    for b, o in enumerate(ok(run_ranks(ranks, a2av))):
        parts = [vs[k][sum(cnt[k][:b]) : sum(cnt[k][: b + 1])] for k in range(n)]
        assert bits(o) == bits(np.concatenate(parts))


def test_send_recv_barrier_and_buffer_protocol(ranks) -> None:
    n = len(ranks)
    msg = bytes(range(256)) * 300

    def go(rk):
        rk.barrier()
        if rk.rank == 0:
            for peer in range(1, n):
                rk.send(msg, peer, tag=5)
            return None
        buf = bytearray(len(msg))
        rk.recv(memoryview(buf), 0, tag=5)
        rk.barrier()
        return bytes(buf)

    def go0(rk):
        out = go(rk)
        if rk.rank == 0:
            rk.barrier()
        return out

    out = ok(run_ranks(ranks, go0))
    assert all(o == msg for o in out[1:])


def test_async_ops_run_in_issue_order(ranks) -> None:
    n = len(ranks)
    ins = [[data("float32", 3001, 10 * k + r) for r in range(n)] for k in range(4)]

    def go(rk):
        works = [rk.all_reduce(ins[k][rk.rank].copy(), async_op=True) for k in range(4)]
        last = rk.all_reduce(ins[0][rk.rank].copy())  # sync: waits behind the async ones
        return [w.wait(timeout=30) for w in works] + [last]

    for got in ok(run_ranks(ranks, go)):
        for k in range(4):
            assert bits(got[k]) == bits(M.reference(ins[k], "float32", "sum"))
        assert bits(got[4]) == bits(got[0])


# ---- the same bits whatever the chunk size and shares ------------------------


def test_chunk_sizes_and_shares_give_identical_bits() -> None:
    n, count = 4, 100_003
    ins = [data("float32", count, r) for r in range(n)]
    want = bits(M.reference(ins, "float32", "sum"))
    results = []
    for chunk, slots, shares in ((0, 0, None), (4096, 2, [1, 2, 3, 4]), (1000, 3, [0, 1, 1, 2])):
        with mesh(n, chunk_bytes=chunk, slots=slots) as rs:
            out = ok(
                run_ranks(rs, lambda rk, sh=shares: rk.all_reduce(ins[rk.rank].copy(), shares=sh))
            )
            results += [bits(o) for o in out]
            st = rs[0].collective_stats()
    assert all(r == want for r in results)
    assert st["ops"] == 1 and st["by_kind"] == {"all_reduce": 1}  # the last mesh's
    assert st["last"]["share_bounds"] == [0, 0, count // 4, count // 2, count]
    assert st["scratch_bytes"] == 3 * 3 * 1000 and st["failure"] is None


@pytest.mark.parametrize("algo", ["chain", "hier", "tree"])
def test_chain_gives_the_same_bits_at_any_chunk_size_and_under_loss(algo: str) -> None:
    """The chain folds each element hop by hop up the ranks (bfloat16 rounded at every
    hop, as a REDUCE rounds at every source), so it gives the direct schedule's bits:
    many chunks through a 2-slot ring, in place and out of place, with 5% loss on a
    plane of every rank. So does "hier" (ranks on hosts a, a, b, b, b: the chain of the
    two hosts' shares, direct inside each). So does "tree", whose gathered inputs
    (a subtree's, sent up as one message) span chunks that the RECVs which brought them
    cut elsewhere."""
    n = 5
    for dtype, count in (("float32", 300_001), ("bfloat16", 200_003), ("int32", 70_001)):
        ins = [data(dtype, count, 7 * r + 1) for r in range(n)]
        want = bits(M.reference(ins, dtype, "sum"))
        for chunk, slots, loss in ((0, 0, 0.0), (4096, 2, 0.05)):
            with mesh(n, chunk_bytes=chunk, slots=slots, timeout=30) as rs:
                for rk in rs:
                    rk.endpoint.inject(0, loss=loss)
                    rk.hosts = list("aabbb")
                dt = "bfloat16" if dtype == "bfloat16" else None

                def go(rk, ins=ins, dt=dt):
                    a, b = ins[rk.rank].copy(), ins[rk.rank].copy()
                    out = rk.all_reduce(a, np.empty_like(a), dtype=dt, algo=algo)
                    rk.all_reduce(b, dtype=dt, algo=algo)  # in place
                    direct = rk.all_reduce(ins[rk.rank].copy(), dtype=dt, algo="direct")
                    return out, b, direct

                for r, got in enumerate(ok(run_ranks(rs, go))):
                    assert all(bits(g) == want for g in got), f"{dtype} chunk {chunk} rank {r}"


def test_scratch_slots_follow_the_budget() -> None:
    """Ring depth by default: what 16 MiB of scratch holds for n-1 rings, 4 to 16."""
    scratch_slots, CHUNK_BYTES, SCRATCH_BUDGET = O.scratch_slots, O.CHUNK_BYTES, O.SCRATCH_BUDGET
    assert scratch_slots(2) == scratch_slots(4) == 16
    assert scratch_slots(8) == 9
    assert scratch_slots(17) == scratch_slots(1024) == 4
    assert scratch_slots(4, 1 << 20) == 5
    for n in range(2, 18):
        s = scratch_slots(n)
        assert 4 <= s <= 16
        assert s == 4 or (n - 1) * s * CHUNK_BYTES <= SCRATCH_BUDGET


def test_plane_failed_mid_all_reduce_gives_identical_bits() -> None:
    """Rank 1 loses plane 1 (fault injection: a dead cable, both directions)
    while the all_reduce is moving data: the transport carries on over the
    other planes and the result is bit-identical to the healthy run."""
    n, count = 4, 4 << 20  # 16 MiB of float32
    ins = [data("float32", count, r) for r in range(n)]
    want = bits(M.reference(ins, "float32", "sum"))
    with mesh(n, nplanes=4, timeout=30) as rs:
        healthy = ok(run_ranks(rs, lambda rk: rk.all_reduce(ins[rk.rank].copy())))
        ep = rs[1].endpoint
        tx0 = ep.stats()["tx_bytes"]
        works = [rk.all_reduce(ins[rk.rank].copy(), async_op=True) for rk in rs]
        deadline = time.monotonic() + 20
        while ep.stats()["tx_bytes"] - tx0 < 4 << 20 and time.monotonic() < deadline:
            time.sleep(0.001)  # until a sixth of rank 1's 24 MiB has gone
        ep.inject(1, down=True)
        assert not works[1].done(), "the plane must fail while the all_reduce runs"
        failed = [w.wait(timeout=60) for w in works]
        assert any(p["plane"] == 1 and p["state"] != "good" for p in ep.stats()["paths"])
    assert all(bits(h) == want for h in healthy)
    assert all(bits(f) == want for f in failed)


def test_back_to_back_small_calls_under_loss_give_identical_bits() -> None:
    """Small calls return once their RECVs are in: their SENDs (from a bounce
    copy, the direct schedule's all-gather SENDs of the reduced share too) are
    acknowledged in the background, and the next call uses the other bounce
    slot. Under 20% loss those SENDs are retransmitted after their call
    returned, from the copy, so a slot reused too early would show in the bits:
    every call here has other inputs and its result is checked."""
    n, calls = 3, 60
    with mesh(n, timeout=30) as rs:
        for rk in rs:
            for plane in range(2):
                rk.endpoint.inject(plane, loss=0.2)

        def go(rk):
            outs = []
            for i in range(calls):
                count = (0, 1, 7, 1000, 5000)[i % 5]
                x = data("float32", count, 1000 * i + rk.rank)
                if i % 4 == 0:
                    outs.append(rk.all_reduce(x))  # in place
                elif i % 4 == 1:
                    outs.append(rk.all_reduce(x, np.empty_like(x)))
                elif i % 4 == 2:  # the all-gather's SENDs of the reduced share are early too
                    outs.append(rk.all_reduce(x, np.empty_like(x), algo="direct"))
                else:
                    outs.append(rk.all_reduce(x, algo="direct"))
                if i % 7 == 6:
                    rk.barrier()
            return outs

        results = ok(run_ranks(rs, go))
    for i in range(calls):
        count = (0, 1, 7, 1000, 5000)[i % 5]
        want = bits(M.reference([data("float32", count, 1000 * i + r) for r in range(n)],
                                "float32", "sum"))  # fmt: skip
        for r in range(n):
            assert bits(results[r][i]) == want, f"call {i} rank {r}"


def test_small_calls_carry_each_others_acks() -> None:
    """A small call's SENDs are LAZY (wire v4): the receiver holds their ACKs for a
    moment and the DATA of its next call carries them, one datagram instead of two.
    Over a loop of calls most ACKs go that way, every call's bits are right, and the
    carried ACKs do what a lone one does: the SENDs complete (the next calls could not
    reuse their bounce slots otherwise), none is refused."""
    n, calls = 3, 300
    with mesh(n) as rs:
        before = [rk.endpoint.stats() for rk in rs]

        def go(rk):
            outs = []
            for i in range(calls):
                x = data("float32", 1 + i % 5, 7 * i + rk.rank)
                outs.append(rk.all_reduce(x, np.empty_like(x)))
            return outs

        results = ok(run_ranks(rs, go))
        after = [rk.endpoint.stats() for rk in rs]
    for i in range(calls):
        ins = [data("float32", 1 + i % 5, 7 * i + r) for r in range(n)]
        want = bits(M.reference(ins, "float32", "sum"))
        assert all(bits(results[r][i]) == want for r in range(n)), f"call {i}"
    for r in range(n):
        carried = after[r]["acks_carried"] - before[r]["acks_carried"]
        alone = after[r]["acks_tx"] - before[r]["acks_tx"]
        # (n - 1) messages in per call; a held ACK that found no DATA within
        # MRC_ACK_DELAY_NS went alone (a slow start, the last call)
        assert carried >= calls * (n - 1) // 4, (r, carried, alone)
        assert after[r]["drops"]["bad_ack"] == before[r]["drops"]["bad_ack"]


# ---- misuse and failures -----------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda rk: rk.all_reduce(np.ones(100 + (rk.rank == 1), np.float32)),  # size
        lambda rk: rk.all_reduce(np.ones(100, np.float32 if rk.rank else np.int32)),  # dtype
        lambda rk: rk.all_reduce(np.ones(100, np.int32), op="max" if rk.rank else "sum"),
        lambda rk: rk.all_reduce(np.ones(9, np.int8), algo="gather" if rk.rank else "direct"),
        lambda rk: rk.reduce(np.ones(64, np.int8), root=rk.rank % 2),  # root
        lambda rk: rk.barrier() if rk.rank else rk.all_reduce(np.ones(8, np.int8)),  # kind
    ],
    ids=["count", "dtype", "op", "algo", "root", "kind"],
)
def test_mismatch_is_an_error_on_every_rank(call) -> None:
    with mesh(3, timeout=10) as rs:
        t0 = time.monotonic()
        out = run_ranks(rs, call)
        assert time.monotonic() - t0 < 10, "detected by the tags, not by a timeout"
        for r, e in enumerate(out):
            assert isinstance(e, CollectiveError), f"rank {r} got {e!r}"
        assert any(e.code == _datapath.MISMATCH for e in out)
        for e in out:
            if e.code == _datapath.MISMATCH:
                assert "does not match" in str(e) and e.rank is not None
        # the communicator is over: later calls raise too
        with pytest.raises(CollectiveError):
            rs[0].barrier()


def test_broadcast_root_mismatch_fails_the_next_collective() -> None:
    """Ranks 0 and 1 both think they are root: both only send, so neither can
    see it in that call; their stray messages fail the next collective, on
    every rank (a mismatch where a stray message is seen first, else the
    connection the detecting rank closed), never as corrupt data."""
    with mesh(3, timeout=10) as rs:

        def go(rk):
            buf = np.full(64, rk.rank, np.int8)
            rk.broadcast(buf, root=rk.rank % 2)
            rk.barrier()

        out = run_ranks(rs, go)
        assert all(isinstance(e, CollectiveError) for e in out), out
        assert any(e.code == _datapath.MISMATCH for e in out), out


def test_abort_from_another_thread() -> None:
    with mesh(3, timeout=60) as rs:
        work = rs[0].all_reduce(np.ones(1 << 16, np.float32), async_op=True)  # peers never join
        t = threading.Thread(target=rs[0].abort, args=("test",))
        t0 = time.monotonic()
        t.start()
        with pytest.raises(CollectiveError, match="aborted"):
            work.wait(timeout=10)
        t.join()
        assert time.monotonic() - t0 < 10
        with pytest.raises(CollectiveError):
            rs[0].barrier()


@pytest.mark.parametrize("what", ["endpoint", "connection"])
def test_closing_under_a_running_collective_is_safe(what: str) -> None:
    """Closing the endpoint, or one connection, of a rank whose collective is
    running (waiting for peers that never join) ends it with CollectiveError;
    nothing is freed under the executor."""
    with mesh(3, timeout=30) as rs:
        x = np.ones(1 << 20, np.float32)
        work = rs[0].all_reduce(x, async_op=True)
        deadline = time.monotonic() + 10
        while rs[0].endpoint.stats()["tx_bytes"] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)  # until it has posted its sends
        if what == "endpoint":
            rs[0].endpoint.close()
        else:
            rs[0].peers[2].close()
        with pytest.raises(CollectiveError):
            work.wait(timeout=10)
        with pytest.raises(CollectiveError):
            rs[0].all_reduce(x)
        x[:] = 2  # the buffer is the caller's again


def test_peer_closed_mid_collective_is_named() -> None:
    """Rank 2's endpoint closes while ranks 0 and 1 are in an all_reduce with it:
    both raise within the timeout, and the first to notice names rank 2. (A
    rank that fails closes its connections, so the other may see that close
    first and name the rank that closed; the communicator's rendezvous, which
    knows rank 2 went, gives every rank the root cause.)"""
    timeout = 3.0
    with mesh(3, timeout=timeout, ep_timeout=1.0) as rs:
        x = [data("float32", 1 << 20, r) for r in range(3)]
        works = [rs[r].all_reduce(x[r], async_op=True) for r in (0, 1)]
        # rank 2 never calls: wait until the others' data reaches it, then close it
        deadline = time.monotonic() + 10
        while rs[2].endpoint.stats()["rx_bytes"] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert rs[2].endpoint.stats()["rx_bytes"] > 0
        t0 = time.monotonic()
        rs[2].close()
        errs = []
        for w in works:
            with pytest.raises(CollectiveError) as ei:
                w.wait(timeout=timeout + 5)
            errs.append(ei.value)
        assert time.monotonic() - t0 < timeout + 2
        assert any(e.rank == 2 and "rank 2" in str(e) for e in errs), errs
        for r, e in enumerate(errs):
            assert e.rank in (2, 1 - r), e  # rank 2, or the other survivor that closed


def test_bad_arguments_are_named() -> None:
    with mesh(2) as rs:
        rk = rs[0]
        with pytest.raises(UsageError, match="100 and 99 elements"):
            rk.all_reduce(np.ones(100, np.float32), np.ones(99, np.float32))
        with pytest.raises(UsageError, match="different dtypes"):
            rk.all_reduce(np.ones(4, np.float32), np.ones(4, np.float64))
        with pytest.raises(UsageError, match="op must be one of"):
            rk.all_reduce(np.ones(4, np.float32), op="xor")
        with pytest.raises(UsageError, match="root must be a rank 0..1, got 5"):
            rk.broadcast(np.ones(4, np.float32), root=5)
        for bad in (0.5, "0", True):  # before anything is sent: the communicator lives on
            with pytest.raises(UsageError, match=f"got {bad!r}"):
                rk.reduce(np.ones(4, np.float32), root=bad)
        with pytest.raises(UsageError, match="peer 1.0 must be another rank"):
            rk.send(np.ones(4, np.float32), 1.0)
        with pytest.raises(UsageError, match="shares must be finite"):
            rk.all_reduce(np.ones(4, np.float32), shares=[float("nan"), 1.0])
        with pytest.raises(UsageError, match="C-contiguous"):
            rk.all_reduce(np.ones((4, 4), np.float32)[:, 0])
        with pytest.raises(UsageError, match="read-only"):
            rk.all_reduce(np.frombuffer(b"abcd", np.uint8))
        with pytest.raises(UsageError, match="bool is not one of"):
            rk.all_reduce(np.ones(4, bool))
        with pytest.raises(UsageError, match="2 x 4 elements"):
            rk.all_gather(np.ones(4, np.int8), np.ones(4, np.int8))
        with pytest.raises(UsageError, match="peer 0 must be another rank"):
            rk.send(b"x", 0)
        with pytest.raises(UsageError, match="not a multiple of 2"):
            rk.all_to_all(np.ones(3, np.int8), np.ones(3, np.int8))
        with pytest.raises(UsageError, match="bfloat16 needs 2-byte"):
            rk.all_reduce(np.ones(4, np.float32), dtype="bfloat16")
        with pytest.raises(UsageError, match="not this host's byte order"):
            rk.all_reduce(np.ones(4, ">i4"))
        # still usable: nothing was sent
        out = ok(run_ranks(rs, lambda r: r.all_reduce(np.full(5, r.rank + 1, np.int64))))
        assert all((o == 3).all() for o in out)


def test_a_repeated_call_checks_its_buffers_again() -> None:
    """A call of a shape seen before skips the checks of its arguments (ops._repeat),
    not those of its buffers: each misuse below follows a good call of the same shape
    and is still named; the good calls around them give the reference bits."""
    with mesh(2) as rs:

        def good(rk: Any, seed: int, in_place: bool) -> np.ndarray:
            mine = data("float32", 5, seed + rk.rank)
            if in_place:
                return rk.all_reduce(mine)
            return rk.all_reduce(mine, np.empty_like(mine))

        for seed in range(6):
            in_place = seed % 2 == 1
            ins = [data("float32", 5, seed + r) for r in range(2)]
            want = bits(M.reference(ins, "float32", "sum"))
            got = ok(run_ranks(rs, lambda rk, s=seed, i=in_place: good(rk, s, i)))
            assert all(bits(g) == want for g in got), seed
        rk = rs[0]
        x = np.ones(5, np.float32)
        with pytest.raises(UsageError, match="read-only"):
            rk.all_reduce(np.frombuffer(x.tobytes(), np.float32))
        with pytest.raises(UsageError, match="C-contiguous"):
            rk.all_reduce(x, np.ones((5, 2), np.float32)[:, 0])
        with pytest.raises(UsageError, match="read-only"):
            rk.all_reduce(x, np.frombuffer(x.tobytes(), np.float32))
        with pytest.raises(UsageError, match="different dtypes"):
            rk.all_reduce(x, np.ones(5, np.int32))
        with pytest.raises(UsageError, match="5 and 6 elements"):
            rk.all_reduce(x, np.ones(6, np.float32))
        with pytest.raises(UsageError, match="C-contiguous"):
            rk.all_reduce(np.ones((5, 2), np.float32)[:, 0], np.empty(5, np.float32))
        with pytest.raises(UsageError, match="different dtypes"):  # not an array at all
            rk.all_reduce(x, bytearray(20))
        with pytest.raises(UsageError, match="byte order"):
            rk.all_reduce(x, np.ones(5, ">f4"))
        # Empty arrays, twice (the second from the remembered call).
        for _ in range(2):
            out = ok(
                run_ranks(rs, lambda rk: rk.all_reduce(np.ones(0, np.int8), np.ones(0, np.int8)))
            )
            assert all(o.size == 0 for o in out)
        # still usable, and the remembered calls are the ones it took
        got = ok(run_ranks(rs, lambda rk: good(rk, 0, False)))
        ins = [data("float32", 5, r) for r in range(2)]
        assert all(bits(g) == bits(M.reference(ins, "float32", "sum")) for g in got)
        assert rk._coll_calls, "the repeated calls took the remembered path"


def test_small_calls_drive_the_progress_or_ask_for_a_busy_poll(monkeypatch: Any) -> None:
    """A call of up to 4 KiB runs the endpoint's progress passes on the calling thread
    (ep.stats()["caller_passes"]); a larger one that fits the bounce slots asks the
    progress thread to poll its sockets instead of sleeping (["busy_polls"]), both for
    busy_poll_us. MRC_BUSY_POLL_US=0 does neither, with the same bits; a bad value is
    refused. MRC_TREE_MIN_RANKS, read the same way, moves where the tree schedules
    start."""
    tiny = [data("float32", 1000, r) for r in range(2)]  # 4000 B: the caller drives
    small = [data("float32", 10_000, r) for r in range(2)]  # 40 KB: the thread polls
    want = [bits(M.reference(ins, "float32", "sum")) for ins in (tiny, small)]
    for env, on in (("0", False), (None, True)):
        if env is None:
            monkeypatch.delenv("MRC_BUSY_POLL_US")
        else:
            monkeypatch.setenv("MRC_BUSY_POLL_US", env)
        with mesh(2) as rs:
            assert rs[0].collective_stats()["busy_poll_us"] == (O.BUSY_POLL_US if on else 0)
            for k, ins in enumerate((tiny, small)):
                for _ in range(5):
                    got = ok(run_ranks(rs, lambda rk, ins=ins: rk.all_reduce(ins[rk.rank].copy())))
                    assert all(bits(g) == want[k] for g in got)
                if k == 0:
                    passes = [rk.endpoint.stats()["caller_passes"] for rk in rs]
                    assert all(passes) if on else passes == [0, 0]
            polls = [rk.endpoint.stats()["busy_polls"] for rk in rs]
            if on:
                wait_for(lambda rs=rs: all(rk.endpoint.stats()["busy_polls"] for rk in rs))
            else:
                assert polls == [0, 0]
    monkeypatch.setenv("MRC_BUSY_POLL_US", "soon")
    with pytest.raises(UsageError, match="MRC_BUSY_POLL_US"), mesh(2):
        pass
    monkeypatch.delenv("MRC_BUSY_POLL_US")
    monkeypatch.setenv("MRC_TREE_MIN_RANKS", "3")
    with mesh(3) as rs:
        ok(run_ranks(rs, lambda rk: rk.barrier()))
        assert rs[0].collective_stats()["last"]["schedule"] == "barrier_dissemination"
    for bad in ("1", "many"):
        monkeypatch.setenv("MRC_TREE_MIN_RANKS", bad)
        with pytest.raises(UsageError, match="MRC_TREE_MIN_RANKS"), mesh(2):
            pass


def test_busy_poll_is_off_where_a_host_has_more_ranks_than_cores_can_spin(
    monkeypatch: Any,
) -> None:
    """The default busy poll (ops.BUSY_POLL_US) goes to 0 where the communicator's hosts
    put more than ops.BUSY_POLL_MAX_RANKS_PER_CORE ranks per core on this rank's host
    (spinning callers would take the cores from ranks that have work); as many or fewer,
    or hosts unknown, keep it."""
    monkeypatch.setattr(O.os, "cpu_count", lambda: 1)  # so 5 ranks on one host crowd it
    assert O.BUSY_POLL_MAX_RANKS_PER_CORE == 4
    with mesh(5) as rs:
        assert [rk._default_busy_poll() for rk in rs] == [O.BUSY_POLL_US] * 5  # no hosts
        for rk in rs:
            rk.hosts = list("aaaaa")
        assert [rk._default_busy_poll() for rk in rs] == [0] * 5
        for rk in rs:
            rk.hosts = list("aabbb")
        assert [rk._default_busy_poll() for rk in rs] == [O.BUSY_POLL_US] * 5


def test_large_buffers_keep_a_bounded_number_of_regions() -> None:
    """Buffers above the bounce size stay registered for the next calls (a training loop
    reduces the same buckets every step), at most 8 per communicator; buffers freed and
    allocated again (at reused addresses) and more buffers in turn than that still give
    the reference bits."""
    n = 100_000  # 400 KB: above the 256 KiB bounce slot, so registered
    with mesh(2) as rs:
        before = rs[0].endpoint.stats()["regions"]
        for i in range(20):
            ins = [data("float32", n, 100 * i + r) for r in range(2)]
            want = bits(M.reference(ins, "float32", "sum"))
            got = ok(
                run_ranks(rs, lambda rk, s=i: rk.all_reduce(data("float32", n, 100 * s + rk.rank)))
            )
            assert all(bits(g) == want for g in got), i
            # 8 cached buffers and the executor's scratch rings (one region). Under
            # AddressSanitizer no freed buffer's address comes back: all 8 are in use.
            assert before < rs[0].endpoint.stats()["regions"] <= before + 8 + 1
        keep = [data("float32", n, r) for r in range(2)]
        outs = [np.empty(n, np.float32) for _ in range(2)]
        ok(run_ranks(rs, lambda rk: rk.all_reduce(keep[rk.rank], outs[rk.rank])))
        settled = rs[0].endpoint.stats()["regions"]
        for _ in range(3):  # the same buffers again: nothing registered
            ok(run_ranks(rs, lambda rk: rk.all_reduce(keep[rk.rank], outs[rk.rank])))
            assert rs[0].endpoint.stats()["regions"] == settled
        assert bits(outs[0]) == bits(M.reference(keep, "float32", "sum"))
