"""mrc-fabric on real namespaces (root): SRv6 paths cross their spine, fail/heal feed the
route table, rate limits hold, loss drops, and `down` always leaves nothing behind."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path as FsPath
from subprocess import DEVNULL

import pytest
from click.testing import CliRunner

from mrc.fabric import netns
from mrc.fabric.cli import cli as fabric_cli
from mrc.fabric.state import state_path
from mrc.fabric.testing import (
    RunningFabric,
    UdpReceiver,
    fabric_up,
    namespaces_left,
    root_links,
    send_on_paths,
    unique_prefix,
    wait_tcp_listening,
)
from mrc.routing import check_table
from mrc.routing.cli import cli as route_cli

ROOT = FsPath(__file__).resolve().parent.parent
F2 = str(ROOT / "routing" / "2host-2plane.toml")
F4 = str(ROOT / "routing" / "4host-4plane.toml")

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def fab4() -> Iterator[RunningFabric]:
    from conftest import require_root  # the root marker only acts on tests, not fixtures

    require_root()
    with fabric_up(F4) as fab:
        yield fab


def _rx(fab: RunningFabric, element: str, iface: str, counters: dict) -> int:  # type: ignore[type-arg]
    return fab.counters(element)[iface]["rx_packets"] - counters[element][iface]["rx_packets"]


def test_every_path_crosses_its_spine(fab4: RunningFabric) -> None:
    ps = fab4.paths("h0", "h3")
    assert len(ps) == 8 and len({p.spine for p in ps}) == 8
    n = {p.id: 40 + 5 * p.id for p in ps}  # a different count per path: no mix-ups
    spines = [s.name for s in fab4.fabric.switches if s.tier == 1]
    before = {s: fab4.counters(s) for s in spines}
    addrs = sorted({p.dst_addr for p in ps})
    with UdpReceiver(fab4, "h3", addrs, expect={str(p.id): n[p.id] for p in ps}) as rx:
        send_on_paths(fab4, "h0", [(p, str(p.id), n[p.id]) for p in ps])
    for p in ps:
        assert rx.result.counts.get(str(p.id)) == n[p.id], p
        assert rx.result.srh[str(p.id)] == p.segments  # the SRH the datagram arrived with
        up_leaf = fab4.fabric.leaf_of("h0", p.plane).name
        # Spine p.spine received exactly its path's datagrams from h0's leaf (plus a few
        # ND/MLD packets). Every path sends a different count and uses its own spine, so a
        # datagram taking another spine would show up as a wrong count there.
        got = _rx(fab4, p.spine, up_leaf, before)
        assert n[p.id] <= got <= n[p.id] + 4, (p.spine, got)


def test_fail_and_heal_spine(fab4: RunningFabric) -> None:
    runner = CliRunner()
    ps = fab4.paths("h0", "h3")
    victim = next(p for p in ps if p.spine == "p0s1")
    fab4.fail("p0s1")
    try:
        table = fab4.table()
        assert not [p for p in table.rows() if "p0s1" in p.crosses]
        assert check_table(table) == []
        res = runner.invoke(route_cli, ["check", F4, "--state", fab4.prefix])
        assert res.exit_code == 0, res.output
        res = runner.invoke(route_cli, ["show", F4, "--state", fab4.prefix, "--json"])
        assert "p0s1" not in {r["spine"] for r in json.loads(res.stdout)["paths"]}
        assert [p.id for p in fab4.paths("h0", "h3")] == [0, 2, 3, 4, 5, 6, 7]
        # In the kernel: the failed path delivers nothing (h0 has no route to the SID of
        # p0s1 any more: sendto fails at once), the others still deliver (the "end"
        # marker goes last, over path 0, so the receiver knows when it is done).
        with UdpReceiver(fab4, "h3", [victim.dst_addr], expect={"end": 1}, timeout=3) as rx:
            errors = send_on_paths(fab4, "h0", [(victim, "dead", 20), (ps[0], "end", 1)])
        assert rx.result.counts == {"end": 1}
        assert errors == {"dead": {"Network is unreachable": 20}}
    finally:
        fab4.heal("p0s1")
    assert [p.id for p in fab4.paths("h0", "h3")] == list(range(8))
    assert any(p.spine == "p0s1" for p in fab4.table().rows())
    with UdpReceiver(fab4, "h3", [victim.dst_addr], expect={"back": 20}) as rx:
        assert send_on_paths(fab4, "h0", [(victim, "back", 20)]) == {}
    assert rx.result.counts == {"back": 20}


def test_fail_plane_keeps_plain_routing_on_others(fab4: RunningFabric) -> None:
    fab4.fail("plane1")
    try:
        assert {p.plane for p in fab4.paths("h1", "h2")} == {0, 2, 3}
        st = netns.status(fab4.prefix)
        assert len(st["down_links"]) == 8 and st["missing"] == []
        # Plain IPv6 (no SRH) between the hosts still works on plane 0.
        p0 = fab4.paths("h1", "h2")[0]
        plain = type(p0)(99, 0, "", p0.src_addr, [], p0.dst_addr)
        with UdpReceiver(fab4, "h2", [p0.dst_addr], expect={"plain": 10}) as rx:
            send_on_paths(fab4, "h1", [(plain, "plain", 10)])
        assert rx.result.counts == {"plain": 10}
    finally:
        fab4.heal("plane1")
    assert netns.status(fab4.prefix)["down_links"] == []


def test_a_healed_link_knows_its_neighbours_at_once(fab4: RunningFabric) -> None:
    """A link's down drops its ends' neighbour entries; heal seeds them again, as `up`
    does. Without that, the first packets after a heal asked for them while the other end
    was still down, and the kernel asked again only after 1 s (4 of 24 heals: mrc's
    healed paths came back after 1.04 s instead of 40-95 ms)."""

    def neighbours(node: str, dev: str) -> set[str]:
        out = subprocess.run(
            ["ip", "-j", "-6", "-n", netns.ns_name(fab4.prefix, node), "neigh", "show", "dev", dev],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        return {e["dst"] for e in json.loads(out) if e.get("lladdr")}

    link = fab4.fabric.link("h2-p1l1")
    ends = [(node, *link.end(node)) for node in (link.a, link.b)]  # node, dev, addr, peer
    fab4.fail(link.name)
    try:
        for node, dev, _addr, peer in ends:
            assert link.end(peer)[1] not in neighbours(node, dev)
    finally:
        fab4.heal(link.name)
    for node, dev, _addr, peer in ends:
        assert link.end(peer)[1] in neighbours(node, dev), (node, dev)


def test_loss_on_a_link(fab4: RunningFabric) -> None:
    p = fab4.paths("h0", "h3")[2]  # plane 1, spine p1s0
    # Warm the path first: a burst into unresolved neighbours (links were just down and up
    # in the test before) is partly dropped while ND runs (unres_qlen_bytes).
    with UdpReceiver(fab4, "h3", [p.dst_addr], expect={"warm": 5}) as rx:
        send_on_paths(fab4, "h0", [(p, "warm", 5)])
    assert rx.result.counts == {"warm": 5}
    fab4.loss("h3-p1l1", 30)
    try:
        # Bounded wait for all 400 (never reached at 30 % loss); then every datagram is
        # accounted for: received, or counted by the drop rule.
        with UdpReceiver(fab4, "h3", [p.dst_addr], expect={"x": 400}, timeout=1.5) as rx:
            assert send_on_paths(fab4, "h0", [(p, "x", 400)]) == {}
        got = rx.result.counts.get("x", 0)
        assert 200 <= got <= 340, got  # 280 expected; binomial sd ~9
        assert got + fab4.loss_drops("h3-p1l1") == 400
        # All of it travelled towards h3; the other direction's rule dropped nothing.
        assert fab4.loss_drops("h3-p1l1", towards="h3") == 400 - got
        assert fab4.loss_drops("h3-p1l1", towards="p1l1") == 0
    finally:
        fab4.loss("h3-p1l1", 0)
    with UdpReceiver(fab4, "h3", [p.dst_addr], expect={"y": 100}) as rx:
        send_on_paths(fab4, "h0", [(p, "y", 100)])
    assert rx.result.counts == {"y": 100}


def test_rate_limit_holds() -> None:
    with fabric_up(F2) as fab:
        rate = fab.fabric.link("h0-p0l0").rate_bps  # 200 Mbit/s, the slowest link on the path
        server_addr = fab.fabric.host("h1").addrs[0]
        server = fab.popen(
            "h1", ["iperf3", "-s", "-1", "-B", server_addr, "-p", "5201"], stdout=DEVNULL
        )
        try:
            wait_tcp_listening(fab, "h1", 5201)
            res = fab.run("h0", ["iperf3", "-c", server_addr, "-t", "2", "-J"], timeout=20)
        finally:
            server.kill()
            server.wait()
        bps = json.loads(res.stdout)["end"]["sum_received"]["bits_per_second"]
        print(f"iperf3: {bps / 1e6:.1f} of {rate / 1e6:.0f} Mbit/s")
        assert 0.7 * rate <= bps <= 1.05 * rate, bps / 1e6


def _ns_pids(ns: str) -> list[str]:
    return subprocess.run(
        ["ip", "netns", "pids", ns], capture_output=True, text=True
    ).stdout.split()


def test_down_after_failure_leaves_nothing() -> None:
    links_before = root_links()
    prefix = unique_prefix()
    with pytest.raises(RuntimeError, match="midway"):
        with fabric_up(F2, prefix) as fab:
            assert len(namespaces_left(prefix)) == 8
            fab.loss("h0-p0l0", 5)  # an nft table in p0l0
            busy = fab.popen("h0", ["sleep", "60"])  # a process keeping a namespace busy
            deadline = time.monotonic() + 5
            while str(busy.pid) not in _ns_pids(fab.ns("h0")):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            raise RuntimeError("test failed midway")
    assert namespaces_left(prefix) == []
    assert not state_path(prefix).exists()
    assert root_links() == links_before
    assert busy.wait(timeout=5) == -9  # down killed it


def test_cli_up_fail_status_down() -> None:
    runner = CliRunner()
    prefix = unique_prefix("c")
    try:
        res = runner.invoke(fabric_cli, ["up", F2, "--name", prefix])
        assert res.exit_code == 0, res.output
        res = runner.invoke(fabric_cli, ["up", F2, "--name", prefix])
        assert res.exit_code == 1 and "already up" in res.output
        assert runner.invoke(fabric_cli, ["fail", "p1s0", "-n", prefix]).exit_code == 0
        res = runner.invoke(fabric_cli, ["fail", "p7s7", "-n", prefix])
        assert res.exit_code == 2 and "p7s7" in res.output
        res = runner.invoke(fabric_cli, ["status", "-n", prefix, "--json"])
        st = json.loads(res.stdout)
        assert st["failed"] == ["p1s0"] and st["down_links"] == ["p1l0-p1s0", "p1l1-p1s0"]
        res = runner.invoke(route_cli, ["show", "--state", prefix, "--json"])
        assert {r["plane"] for r in json.loads(res.stdout)["paths"]} == {0}
        assert runner.invoke(fabric_cli, ["heal", "p1s0", "-n", prefix]).exit_code == 0
    finally:
        res = runner.invoke(fabric_cli, ["down", "-n", prefix])
    assert res.exit_code == 0 and "removed 8" in res.output
    assert namespaces_left(prefix) == []
