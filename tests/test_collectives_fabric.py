"""Collectives on the namespace fabric (root): 4 ranks on the 4 hosts of the
4-plane SRv6 fabric, every pair connected over the route table's paths. Every
collective bit-exact against numpy in rank order; an all_reduce with h1's
plane-1 cable pulled mid-operation gives the healthy run's bits."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from coll_helpers import fabric_mesh, ok, run_ranks

from mrc.collectives import simulate as M
from mrc.collectives import soak
from mrc.collectives.soak import bits, data
from mrc.fabric.testing import Faults, fabric_up

pytestmark = pytest.mark.root
F4 = str(Path(__file__).resolve().parent.parent / "routing" / "4host-4plane.toml")
HOSTS = ["h0", "h1", "h2", "h3"]


def test_collectives_on_the_fabric_and_a_cable_pulled_mid_all_reduce() -> None:
    n = len(HOSTS)
    with fabric_up(F4) as fab, fabric_mesh(fab, HOSTS) as rs:
        assert all(p.npaths > 1 for rk in rs for p in rk.peers if p is not None)
        for dtype, op in (("float32", "sum"), ("bfloat16", "max"), ("int64", "prod")):
            ins = [data(dtype, 10_001, r, op) for r in range(n)]
            dt = "bfloat16" if dtype == "bfloat16" else None
            want = M.reference(ins, dtype, op)

            def ar(rk, ins=ins, op=op, dt=dt):
                return rk.all_reduce(ins[rk.rank].copy(), op=op, dtype=dt)

            def rsc(rk, ins=ins, op=op, dt=dt):  # every block of rank r's send is ins[r]
                send = np.concatenate([ins[rk.rank]] * n)
                return rk.reduce_scatter(send, np.empty_like(ins[0]), op=op, dtype=dt)

            for fn in (ar, rsc):
                out = ok(run_ranks(rs, fn))
                assert all(bits(o) == bits(want) for o in out), (fn.__name__, dtype, op)
        x = [data("int8", 70_000, r) for r in range(n)]
        out = ok(run_ranks(rs, lambda rk: rk.broadcast(x[rk.rank].copy(), root=2)))
        assert all(bits(o) == bits(x[2]) for o in out)
        out = ok(run_ranks(rs, lambda rk: rk.all_gather(x[rk.rank], np.empty(n * 70_000, "int8"))))
        assert all(bits(o) == bits(np.concatenate(x)) for o in out)
        out = ok(run_ranks(rs, lambda rk: rk.all_to_all(x[rk.rank][:4000], np.empty(4000, "int8"))))
        for r, o in enumerate(out):
            assert bits(o) == bits(
                np.concatenate([x[k][r * 1000 : (r + 1) * 1000] for k in range(n)])
            )

        count = 4 << 20  # 16 MiB of float32
        ins = [data("float32", count, 10 + r) for r in range(n)]
        want = bits(M.reference(ins, "float32", "sum"))
        healthy = ok(run_ranks(rs, lambda rk: rk.all_reduce(ins[rk.rank].copy())))
        ep = rs[1].endpoint
        tx0 = ep.stats()["tx_bytes"]
        works = [rk.all_reduce(ins[rk.rank].copy(), async_op=True) for rk in rs]
        deadline = time.monotonic() + 30
        while ep.stats()["tx_bytes"] - tx0 < 4 << 20 and time.monotonic() < deadline:
            time.sleep(0.001)  # until a sixth of rank 1's 24 MiB has gone
        fab.fail("h1-p1l0")
        assert not works[1].done(), "the cable must be pulled while the all_reduce runs"
        pulled = [w.wait(timeout=60) for w in works]
        assert all(bits(h) == want for h in healthy)
        assert all(bits(p) == want for p in pulled)


def test_random_collectives_while_links_drop_fail_and_heal() -> None:
    """A short collective soak (benchmarks/coll_soak.py runs the long one): random
    calls of every collective, op and dtype, sizes from 0 to 1 MiB, on the 4 hosts while
    every link drops 2% and random links fail and heal every 60-300 ms (never cutting a
    pair of hosts off); every rank's every result bit-exact against numpy."""
    seed, calls = 7, 250
    with fabric_up(F4) as fab, fabric_mesh(fab, HOSTS) as rs:
        with Faults(fab, loss=2.0, flap_s=0.3, seed=seed) as faults:
            for i in range(calls):
                c = soak.call(seed, i, len(rs), 1 << 20)
                got = ok(run_ranks(rs, lambda rk, c=c: soak.run(rk, seed, c)))
                assert all(got), (c.describe(), got)
        assert faults.failures >= 3, faults.events  # the calls did run under faults
        assert sum(rk.endpoint.stats()["retx"] for rk in rs) > 0
