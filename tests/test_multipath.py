"""Multipath on the SRv6 namespace fabric (4 hosts, 4 planes, 2 spines per plane):
transfers complete byte-exact while planes, spines and links fail, flap and drop
packets; failed paths are detected quickly and come back after a heal.

One process per host (mrc.fabric.xfer); the client exposes its stats socket,
which the test polls to see path states as the transport sees them.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mrc import telemetry
from mrc.fabric.netns import kernel_has_seg6local

pytestmark = pytest.mark.root

ROOT = Path(__file__).resolve().parent.parent
FABRIC = ROOT / "tests" / "fabrics" / "4host-4plane-fast.toml"
SRC, DST = "h0", "h2"  # on different leaves: every path crosses leaf, spine, leaf
GIB = 1 << 30
# (size, chunk): the headline test moves 1 GiB; the others 256 MiB, which already
# spans hundreds of round trips around each fault, to keep the suite short.
MODES = {"write": (GIB // 4, 4 << 20), "send": (GIB // 4, 4 << 20), "stream": (GIB // 4, 4 << 20)}


@pytest.fixture(scope="module")
def fab() -> Iterator[Any]:
    from conftest import require_root

    require_root()
    from mrc.fabric.testing import fabric_up

    with fabric_up(FABRIC) as f:
        yield f


@pytest.fixture
def clean(fab: Any) -> Iterator[Any]:
    """The fabric with nothing failed and no loss, before and after the test."""

    def reset() -> None:
        for el in list(fab.failed):
            fab.heal(el)
        from mrc.fabric.state import load_state

        for link in list(load_state(fab.prefix).loss):
            fab.loss(link, 0)

    reset()
    yield fab
    reset()


class Transfer:
    """A verified transfer SRC -> DST running in the fabric's host namespaces."""

    def __init__(self, fab: Any, mode: str, timeout: float = 5.0, size: int | None = None):
        self.fab = fab
        self.size, chunk = MODES[mode]
        self.size = size or self.size
        self.sock = f"/tmp/mrc-test-{os.getpid()}-{id(self)}.sock"
        x = fab.xfer(
            SRC,
            DST,
            ["--size", str(self.size), "--mode", mode, "--chunk", str(chunk)]
            + ["--timeout", str(timeout)],
            client_args=["--progress", "0.02", "--stats-socket", self.sock, "--linger"],
            # The server keeps the connection too: a transfer that ends while a path is
            # being failed would otherwise freeze that path's state at 'suspect' (a
            # closed connection stops probing; seen in CI under load).
            server_args=["--linger"],
        )
        self.x, self.client = x, x.client
        self.done_bytes = 0
        self.result: dict[str, Any] = {}
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.client.stdout is not None
        for line in self.client.stdout:
            ev = json.loads(line)
            with self.cond:
                if ev["event"] == "progress":
                    self.done_bytes = ev["bytes"]
                else:
                    self.result = ev
                self.cond.notify_all()
        with self.cond:
            self.result = self.result or {"event": "error", "message": "client exited"}
            self.cond.notify_all()

    def wait_fraction(self, frac: float, timeout: float = 120) -> None:
        with self.cond:
            ok = self.cond.wait_for(
                lambda: self.done_bytes >= frac * self.size or self.result, timeout
            )
        assert ok and not self.result, f"transfer ended before {frac:.0%}: {self.result}"

    def finished(self) -> bool:
        with self.cond:
            return bool(self.result)

    def finish(self, timeout: float = 180) -> tuple[dict[str, Any], dict[str, Any]]:
        with self.cond:
            self.cond.wait_for(lambda: bool(self.result), timeout)
        # The server's result first: a client that is done has had its SENDs acknowledged,
        # not consumed (a stream server may still be hashing staged chunks), and its exit
        # closes the connection under them (seen once in CI: the server printed no result).
        server = self.x.server_result() if self.result.get("event") == "done" else {}
        assert self.client.stdin is not None
        self.client.stdin.close()  # the client lingers (stats socket) until this
        self.client.wait(timeout=30)
        self.x.kill()
        return self.result, server

    def paths(self) -> list[dict[str, Any]]:
        return telemetry.fetch(self.sock)["stats"]["paths"]

    def wait_paths(self, pred: Callable[[list[dict[str, Any]]], bool], timeout: float) -> float:
        """Seconds until pred(paths) holds (polling the stats socket); fails after timeout."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if pred(self.paths()):
                return time.monotonic() - t0
            time.sleep(0.005)  # polling interval of an external observer, not a sync point
        # With each path's smoothed RTT, probes sent and state changes: a path that stays
        # suspect waits 2 RTOs (2 srtt + 4 rttvar, at least 5 ms) for its probe's answer.
        seen = [
            (p["path"], p["state"], round(p["srtt_us"]), p["probes"], p["state_changes"])
            for p in self.paths()
        ]
        raise AssertionError(
            f"path states not reached in {timeout} s (path, state, srtt us, probes, changes): "
            f"{seen}; the transfer: {self.result.get('event', 'running')}"
        )

    def kill(self) -> None:
        self.x.kill()


def verified(t: Transfer) -> dict[str, Any]:
    client, server = t.finish()
    assert client["event"] == "done", f"an operation failed: {client}"
    assert client["bytes"] == t.size
    assert "sha256" in server, f"the server did not finish: {server}"
    assert client["sha256"] == server["sha256"], "data differs between the two ends"
    return client


def path_ids(fab: Any, pred: Callable[[Any], bool]) -> set[int]:
    return {p.id for p in fab.paths(SRC, DST, include_failed=True) if pred(p)}


def spine_bytes(fab: Any) -> dict[int, int]:
    """Bytes each SRC -> DST path's spine has received from SRC's leaf so far."""
    out = {}
    for p in fab.paths(SRC, DST, include_failed=True):
        leaf = fab.fabric.leaf_of(SRC, p.plane).name
        out[p.id] = fab.counters(p.spine)[leaf]["rx_bytes"]
    return out


def assert_on_their_spines(
    fab: Any, before: dict[int, int], client: dict[str, Any], kept: float = 1.0
) -> None:
    """Each path's bytes went through that path's spine (the route sockets' kernel seg6
    routes, not only the table, say where a path goes): the spine received at least
    `kept` (what loss before it leaves) of what the client sent on the path, and not
    much more (headers; a misrouted neighbour's bytes would be). A path whose packets
    left without their SRH would take whatever spine its leaf routes the host by."""
    after = spine_bytes(fab)
    seen = {
        q["path"]: (q["tx_bytes"], after[q["path"]] - before[q["path"]])
        for q in client["stats"]["paths"]
    }
    for p in client["stats"]["paths"]:
        sent, got = seen[p["path"]]
        # GSO batches cross as one skb: one IP/SRH/UDP header per batch, mrc's per packet.
        # The sticky header (a kernel without seg6 lwtunnels) cuts batches at the sender:
        # Ethernet, IPv6, SRH and UDP headers on every packet too (measured 154 B/packet).
        most = sent + p["tx_pkts"] * (128 if kernel_has_seg6local() else 192) + (1 << 20)
        assert kept * 0.9 * sent <= got <= most, (
            f"path {p['path']} sent {sent} B, its spine got {got} B; (sent, got) by path: {seen}"
        )


def states(paths: list[dict[str, Any]], ids: set[int]) -> set[str]:
    return {p["state"] for p in paths if p["path"] in ids}


def fails_mid_transfer(t: Transfer, fab: Any, element: str, ids: set[int]) -> None:
    """Fails `element` a quarter into t: the paths `ids` are marked failed within 1 s
    and the transfer still completes byte-exact."""
    try:
        assert ids
        t.wait_fraction(0.25)
        fab.fail(element)
        took = t.wait_paths(lambda ps: states(ps, ids) == {"failed"}, timeout=5)
        assert took < 1.0, f"paths through {element} took {took:.3f} s to be marked failed"
        verified(t)
    finally:
        t.kill()


@pytest.mark.parametrize("mode", list(MODES))
def test_plane_fails_mid_transfer(clean: Any, mode: str) -> None:
    t = Transfer(clean, mode, size=GIB if mode == "write" else GIB // 2)
    fails_mid_transfer(t, clean, "plane1", path_ids(clean, lambda p: p.plane == 1))


@pytest.mark.parametrize("mode", list(MODES))
def test_three_of_four_planes_fail(clean: Any, mode: str) -> None:
    t = Transfer(clean, mode)
    try:
        t.wait_fraction(0.25)
        for p in ("plane1", "plane2", "plane3"):
            clean.fail(p)
        client = verified(t)
        left = path_ids(clean, lambda p: p.plane == 0)
        assert states(client["stats"]["paths"], left) == {"good"}
    finally:
        t.kill()


@pytest.mark.parametrize("mode", list(MODES))
def test_spine_fails(clean: Any, mode: str) -> None:
    t = Transfer(clean, mode)
    fails_mid_transfer(t, clean, "p0s1", path_ids(clean, lambda p: p.spine == "p0s1"))


@pytest.mark.parametrize("mode", list(MODES))
def test_link_flaps_every_200ms(clean: Any, mode: str) -> None:
    t = Transfer(clean, mode, size=GIB)  # several flaps at 4-5 Gb/s
    stop = threading.Event()

    def flap() -> None:
        down = False
        while not stop.wait(0.2):  # the flap period itself, not a synchronisation
            (clean.heal if down else clean.fail)("h0-p2l0")
            down = not down

    flapper = threading.Thread(target=flap)
    try:
        t.wait_fraction(0.05)
        flapper.start()
        verified(t)
    finally:
        stop.set()
        if flapper.is_alive():
            flapper.join()
        t.kill()


@pytest.mark.parametrize("mode", list(MODES))
def test_one_link_drops_2_percent(clean: Any, mode: str) -> None:
    """2% of the packets on one leaf-spine link dropped: the transfer completes byte-exact,
    and the client detects and retransmits what the link dropped. That link is one path of
    eight and may carry little: a path that loses is out of service until a probe gets
    through, and delay-based windows share a busy host's paths unevenly (one path carried
    1.4% of a transfer's packets in a run here), so a transfer can cross it with no data
    packet dropped (CI saw that twice). Up to 3 transfers run until one had a drop."""
    link, spine = "p1l0-p1s0", "p1s0"
    clean.loss(link, 2)
    via = path_ids(clean, lambda p: p.spine == spine)
    for _attempt in range(3):
        spines = spine_bytes(clean)
        before = clean.loss_drops(link, towards=spine)  # the client's direction
        t = Transfer(clean, mode)
        try:
            client = verified(t)
        finally:
            t.kill()
        assert_on_their_spines(clean, spines, client, kept=0.98)
        dropped = clean.loss_drops(link, towards=spine) - before
        if dropped:
            break
    seen = [
        {k: p.get(k) for k in ("path", "state", "tx_pkts", "lost", "retx", "state_changes")}
        for p in client["stats"]["paths"]
        if p["path"] in via
    ]
    assert dropped > 0, f"3 transfers, no packet dropped towards {spine}; its paths: {seen}"
    assert sum(p["lost"] for p in seen) > 0, f"{dropped} dropped, none seen lost: {seen}"
    assert client["stats"]["retx"] > 0, f"{dropped} dropped, nothing retransmitted: {seen}"


@pytest.mark.parametrize("mode", list(MODES))
def test_all_links_drop_half_a_percent(clean: Any, mode: str) -> None:
    for link in clean.fabric.links:
        clean.loss(link.name, 0.5)
    t = Transfer(clean, mode)
    try:
        client = verified(t)
        assert client["stats"]["retx"] > 0
    finally:
        t.kill()


def test_healed_path_returns_and_carries_traffic(clean: Any) -> None:
    # Long enough to still run when the healed paths are back, on hosts that carry 5-30
    # Gb/s here: 16 GiB streamed in bounded memory (6 GiB of writes, in memory at each
    # end, ended before the healed paths carried traffic on a faster CI host; 2 GiB ended
    # before plane 1 was back once the SRv6 paths kept their GSO batches whole).
    spines = spine_bytes(clean)
    t = Transfer(clean, "stream", size=16 * GIB)
    try:
        plane1 = path_ids(clean, lambda p: p.plane == 1)
        t.wait_fraction(0.1)
        clean.fail("plane1")
        t.wait_paths(lambda ps: states(ps, plane1) == {"failed"}, timeout=5)
        clean.heal("plane1")
        took = t.wait_paths(lambda ps: states(ps, plane1) == {"good"}, timeout=10)
        before = sum(p["tx_pkts"] for p in t.paths() if p["path"] in plane1)
        t.wait_paths(
            lambda ps: sum(p["tx_pkts"] for p in ps if p["path"] in plane1) > before + 100,
            timeout=10,
        )
        # Setting nic1 down deleted the kernel seg6 routes of plane 1's route sockets;
        # the endpoint put them back when the link came up (each table has its route).
        # A kernel without seg6 lwtunnels has none: the sticky header, no tables.
        kernel = [sys.executable, "-m", "mrc.routing.cli", "kernel", "--json"]
        tables = json.loads(clean.run(SRC, kernel).stdout)["tables"]
        if kernel_has_seg6local():
            assert len(tables) == len(plane1) * 4 and all(t["dev"] for t in tables), tables
        else:
            assert tables == [], tables
        # ... and the healed paths' packets take their spines again.
        assert_on_their_spines(clean, spines, verified(t))
        assert took < 2.0, f"healed paths took {took:.3f} s to come back"
    finally:
        t.kill()


# The two tests below fail the four planes one after another (each `fail` is a few `ip`
# batches, 50-100 ms) while a transfer runs: it must still be running when the last plane
# goes. With 256 MiB from 20% on, a fast run finished first once in CI ("done" instead of
# the timeout); 1 GiB from 10% on still had 68% to go when the last plane went (1.2 s).
GONE_SIZE, GONE_AT = GIB, 0.1


def test_every_path_gone_fails_after_timeout(clean: Any) -> None:
    t = Transfer(clean, "write", timeout=2.0, size=GONE_SIZE)
    try:
        t.wait_fraction(GONE_AT)
        t0 = time.monotonic()
        for p in range(4):
            clean.fail(f"plane{p}")
        client, _ = t.finish(timeout=30)
        elapsed = time.monotonic() - t0
        assert client["event"] == "error"
        assert client["error"] == "PathDownError", client
        assert "every path" in client["message"]
        assert 1.5 < elapsed < 2.0 + 3.0, f"failed after {elapsed:.2f} s with a 2 s timeout"
    finally:
        t.kill()


def test_every_path_gone_then_one_heals_in_time(clean: Any) -> None:
    t = Transfer(clean, "write", timeout=5.0, size=GONE_SIZE)
    try:
        t.wait_fraction(GONE_AT)
        for p in range(4):
            clean.fail(f"plane{p}")
        t.wait_paths(lambda ps: {p["state"] for p in ps} == {"failed"}, timeout=5)
        clean.heal("plane2")
        verified(t)
    finally:
        t.kill()
