"""Hostile input: packets crafted with the scapy layer (mrc.scapy), sent at a live
endpoint through the real receive path (`_rx_inject`, for exact accounting) and over
real UDP on loopback. Every one must be dropped and counted by its reason, change no
byte outside a registered region (guard bytes, an unregistered buffer) and leave the
connection healthy; a transfer under attack still completes byte-exact.

Learning the live PSNs needs a sniffer on loopback (root); without it those tests skip.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from helpers import Pair, connected_pair, pattern, sha, wait_for

import mrc

scapy_all = pytest.importorskip("scapy.all")
ms = pytest.importorskip("mrc.scapy")

REGION = 1 << 16
GUARD = 4096
A_ADDR, B_ADDR = "127.0.0.1", "127.0.1.1"  # plane 0 of each side in connected_pair(1)
STRANGER = "127.0.9.9"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to sniff loopback")


@dataclass
class Live:
    """A connected pair, a guarded region on b, and the last real WRITE packet seen."""

    p: Pair
    whole: np.ndarray  # guard + region + guard
    region: np.ndarray
    unreg: np.ndarray  # never registered
    mr: mrc.MemoryRegion
    src: mrc.MemoryRegion
    last: Any  # MRC layer of the last data packet of the warm-up write
    first_raw: bytes  # a real WRITE datagram, for replays

    @property
    def b_conn(self) -> int:  # `conn` of packets arriving at b
        return int(self.p.cb.ids[0])

    @property
    def a_conn(self) -> int:
        return int(self.p.ca.ids[0])

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return self.whole.copy(), self.unreg.copy()


def drops(ep: mrc.Endpoint) -> dict[str, int]:
    return dict(ep.stats()["drops"])


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def inject(ep: mrc.Endpoint, pkt: bytes, src: str, port: int = 40000) -> dict[str, int]:
    """Runs pkt through ep's receive path; returns the drop counters it moved."""
    before = drops(ep)
    ep._rx_inject(0, pkt, src, port)
    return delta(before, drops(ep))


def hdr(**fields: Any) -> Any:
    """An MRC header; psn taken modulo 2^32 (the live PSNs start anywhere)."""
    if "psn" in fields:
        fields["psn"] &= 0xFFFFFFFF
    return ms.MRC(**fields)


def write_pkt(
    conn: int,
    psn: int,
    msn: int,
    key: int,
    offset: int,
    payload: bytes,
    msg_len: int | None = None,
    length: int | None = None,
    kind: int = 1,  # 1 WRITE (key: the region's), 2 SEND (key: the tag)
    flags: str = "FIRST+LAST",
) -> bytes:
    h = hdr(
        type=kind,
        flags=flags,
        conn=conn,
        psn=psn & 0xFFFFFFFF,
        len=length,
        ts=time.monotonic_ns(),
    )
    ext = ms.MRCData(
        msn=msn & 0xFFFFFFFF,
        key=key,
        offset=offset,
        msg_len=len(payload) if msg_len is None else msg_len,
    )
    return bytes(h / ext / payload)


def sniff_udp(ports: set[int]) -> tuple[Any, threading.Event]:
    """A sniffer on lo for mrc packets to `ports`, open when this returns, and an event
    set once it has seen a message's last DATA packet."""
    opened, last = threading.Event(), threading.Event()

    def see(k: Any) -> None:
        if any(m.type == 1 and int(m.flags) & 0x02 for m in ms.decode_all(k)):
            last.set()

    sn = scapy_all.AsyncSniffer(
        iface="lo",
        store=True,
        lfilter=lambda k: scapy_all.UDP in k and k[scapy_all.UDP].dport in ports,
        prn=see,
        started_callback=opened.set,
    )
    sn.start()
    assert opened.wait(10), "the sniffer did not open its socket"
    return sn, last


@contextmanager
def live(nplanes: int = 1) -> Iterator[Live]:
    with connected_pair(nplanes) as p:
        whole = np.full(REGION + 2 * GUARD, 0xA5, np.uint8)
        region = whole[GUARD:-GUARD]
        region[:] = 0
        unreg = np.full(REGION, 0x5A, np.uint8)
        mr = p.b.register(region)
        src = p.a.register(pattern(REGION, 9))
        sn, seen_last = sniff_udp({port for _, port in p.b.planes})
        p.ca.write(src, mr.descriptor(), length=3 * 8192 + 5).wait(timeout=10)
        # the write is one message: the packet tap on lo sees its packets in send order,
        # so once it has the last one it has them all
        assert seen_last.wait(10), "the sniffer missed the warm-up write's last packet"
        pkts = [m for k in sn.stop() for m in ms.decode_all(k)]
        data = [m for m in pkts if m.type == 1]
        assert data, "the sniffer saw none of the warm-up write's packets"
        last = max(data, key=lambda m: (m.psn - data[0].psn) & 0xFFFFFFFF)
        yield Live(p, whole, region, unreg, mr, src, last, bytes(data[0]))


def assert_untouched(lv: Live, snap: tuple[np.ndarray, np.ndarray]) -> None:
    whole, unreg = snap
    assert np.array_equal(lv.whole, whole), "bytes changed in or around the region"
    assert np.array_equal(lv.unreg, unreg), "the unregistered buffer changed"


def assert_healthy(lv: Live, size: int = 100_000) -> None:
    """The connection still carries a byte-exact write."""
    assert lv.p.ca.error is None and lv.p.cb.error is None
    dst = np.zeros(size, np.uint8)
    md = lv.p.b.register(dst)
    data = pattern(size, 77)
    lv.p.ca.write(lv.p.a.register(data), md.descriptor()).wait(timeout=10)
    assert sha(dst) == sha(data)


# ---- forged DATA at the receiver ---------------------------------------------------


@needs_root
def test_bad_key_and_bounds_are_dropped_and_counted() -> None:
    with live() as lv:
        nxt, msn = lv.last.psn + 1, lv.last[ms.MRCData].msn + 1
        key = lv.mr.key
        body = b"\xee" * 100
        cases = [
            # (what, packet, reason)
            ("wrong key", write_pkt(lv.b_conn, nxt, msn, key ^ (1 << 40), 0, body), "bad_key"),
            ("unknown slot", write_pkt(lv.b_conn, nxt, msn, 0xFFFF, 0, body), "bad_key"),
            ("past the end", write_pkt(lv.b_conn, nxt, msn, key, REGION - 99, body), "bad_bounds"),
            ("offset at the end", write_pkt(lv.b_conn, nxt, msn, key, REGION, b"x"), "bad_bounds"),
            (
                "offset near 2^64",
                write_pkt(lv.b_conn, nxt, msn, key, 2**64 - 50, body),
                "bad_bounds",
            ),
            (
                "offset+len wraps to 0",
                write_pkt(lv.b_conn, nxt, msn, key, 2**64 - 100, body),
                "bad_bounds",
            ),
            (
                "offset+len wraps into the region",
                write_pkt(lv.b_conn, nxt, msn, key, 2**64 - 1, body),
                "bad_bounds",
            ),
            ("len > msg_len", write_pkt(lv.b_conn, nxt, msn, key, 0, body, msg_len=10), "bad_msg"),
            ("msn far ahead", write_pkt(lv.b_conn, nxt, msn + 5000, key, 0, body), "bad_msg"),
        ]
        for what, pkt, reason in cases:
            snap = lv.snapshot()
            got = inject(lv.p.b, pkt, A_ADDR)
            assert got == {reason: 1}, what
            assert_untouched(lv, snap)
        # The NAKs reached the real sender, which had nothing in flight there.
        wait_for(lambda: drops(lv.p.a)["bad_ack"] >= 1, timeout=10)
        assert_healthy(lv)


@needs_root
def test_a_carried_ack_is_held_to_a_lone_acks_rules() -> None:
    """DATA may carry an ACK (flag ACKS, wire v4). One of another connection, one that
    is no ACK, or one whose echoes run past the datagram drops the whole packet (its
    data is not written). One whose path the connection lacks is dropped as a lone ACK
    would be, while its DATA, which is good, lands."""
    with live() as lv:
        nxt, msn = lv.last.psn + 1, lv.last[ms.MRCData].msn + 1
        body = b"\xee" * 100

        def carrying(conn: int, kind: int = 3, path: int = 0, ack_len: int | None = None) -> bytes:
            h = hdr(type=1, flags="FIRST+LAST+ACKS", conn=lv.b_conn, psn=nxt, ts=1)
            ext = ms.MRCData(msn=msn & 0xFFFFFFFF, key=lv.mr.key, offset=0, msg_len=len(body))
            ack = hdr(type=kind, conn=conn, path=path, len=ack_len) / ms.MRCAck()
            return bytes(h / ext / ack / body)

        cases = [
            ("another connection's ACK", carrying(lv.a_conn), "bad_ack"),
            ("no ACK inside", carrying(lv.b_conn, kind=2), "bad_ack"),
            ("echoes past the datagram", carrying(lv.b_conn, ack_len=7 * 24), "truncated"),
            ("echoes not whole", carrying(lv.b_conn, ack_len=20), "bad_length"),
        ]
        for what, pkt, reason in cases:
            snap = lv.snapshot()
            assert inject(lv.p.b, pkt, A_ADDR) == {reason: 1}, what
            assert_untouched(lv, snap)
        assert_healthy(lv)
        # Last, as it takes a PSN of the real sender's: one past assert_healthy's write
        # (one message, fewer than 64 packets), placed on arrival (no reorder buffer).
        nxt, msn = nxt + 64, msn + 1
        assert inject(lv.p.b, carrying(lv.b_conn, path=40), A_ADDR) == {"bad_ack": 1}
        assert bytes(lv.region[:100]) == body


@needs_root
def test_header_checks_in_order() -> None:
    with live() as lv:
        good = write_pkt(
            lv.b_conn, lv.last.psn + 1, lv.last[ms.MRCData].msn + 1, lv.mr.key ^ 1, 0, b"abc"
        )
        mss = lv.p.b.mss
        cases = [
            ("runt", good[:10], "truncated"),
            ("header only, DATA type", good[:24], "truncated"),
            ("magic", b"\x00\x00" + good[2:], "bad_magic"),
            ("version", good[:2] + bytes([ms.VERSION + 1]) + good[3:], "bad_version"),
            ("type 0", good[:3] + b"\x00" + good[4:], "bad_type"),
            ("type 200", good[:3] + b"\xc8" + good[4:], "bad_type"),
            ("payload cut short", good[:-1], "bad_length"),
            ("trailing garbage", good + b"\x00", "bad_length"),
            ("len says more", write_pkt(lv.b_conn, 0, 0, 1, 0, b"abc", length=300), "bad_length"),
            (
                "payload > mss",
                write_pkt(lv.b_conn, lv.last.psn + 1, 0, lv.mr.key, 0, b"\x01" * (mss + 1)),
                "bad_length",
            ),
            (
                "ACK with part of an echo",
                bytes(hdr(type=3, conn=lv.a_conn, len=4) / ms.MRCAck()) + b"abcd",
                "bad_length",
            ),
            (
                "ACK with more echoes than the format allows",
                bytes(
                    hdr(type=3, conn=lv.a_conn)
                    / ms.MRCAck(echoes=[ms.MRCAckEcho(path=0)] * 8)  # 1 + 7 at most
                ),
                "bad_length",
            ),
            (
                "unknown connection",
                write_pkt(lv.b_conn ^ 0x10000, lv.last.psn + 1, 0, lv.mr.key, 0, b"abc"),
                "unknown_conn",
            ),
            ("unknown path", bytes(hdr(type=5, conn=lv.b_conn, path=63)), "bad_path"),
        ]
        for what, pkt, reason in cases:
            snap = lv.snapshot()
            assert inject(lv.p.b, pkt, A_ADDR) == {reason: 1}, what
            assert_untouched(lv, snap)
        assert_healthy(lv)


@needs_root
def test_psn_outside_the_window() -> None:
    with live() as lv:
        msn, key = lv.last[ms.MRCData].msn + 1, lv.mr.key
        for far in (1 << 12, 1 << 20, (1 << 31) - 1):
            snap = lv.snapshot()
            pkt = write_pkt(lv.b_conn, lv.last.psn + 1 + far, msn, key, 0, b"\x77" * 64)
            assert inject(lv.p.b, pkt, A_ADDR) == {"psn_window": 1}
            assert_untouched(lv, snap)
        # Behind the cumulative ack is "already received": counted as a duplicate.
        for back in (1, 100, 1 << 30):
            snap = lv.snapshot()
            pkt = write_pkt(lv.b_conn, lv.last.psn - back, msn, key, 0, b"\x77" * 64)
            assert inject(lv.p.b, pkt, A_ADDR) == {"duplicate": 1}
            assert_untouched(lv, snap)
        assert_healthy(lv)


def send_pkt(lv: Live, psn: int, msn: int, off: int, flags: str, msg_len: int, n: int) -> bytes:
    """A SEND packet of n bytes (tag 0x5EED) on the live connection into b."""
    return write_pkt(lv.b_conn, psn, msn, 0x5EED, off, b"\x11" * n, msg_len, kind=2, flags=flags)


@needs_root
def test_send_packets_must_follow_from_their_psn() -> None:
    """Staging is not zeroed, so a SEND may never be delivered with holes: a packet
    whose offset does not follow from its PSN (at the connection's mss from the
    message's first packet) is dropped, and a message whose PSNs all arrived but whose
    bytes do not add up (one of its PSNs sent as another message's) fails the
    connection as a protocol error instead of delivering old heap contents."""
    with live() as lv:
        nxt, msn, mss = lv.last.psn + 1, lv.last[ms.MRCData].msn + 1, lv.p.b.mss
        # A two-packet message whose second packet claims the first one's bytes, then
        # one a byte off its place.
        cases = [
            (send_pkt(lv, nxt, msn, 0, "FIRST", 2 * mss, mss), {}),
            (send_pkt(lv, nxt + 1, msn, 0, "LAST", 2 * mss, mss), {"bad_msg": 1}),
            (send_pkt(lv, nxt + 1, msn, mss + 1, "LAST", 2 * mss, mss - 1), {"bad_msg": 1}),
        ]
        for pkt, reason in cases:
            assert inject(lv.p.b, pkt, A_ADDR) == reason
        assert lv.p.cb.error is None  # a dropped packet fails nothing
    with live() as lv:
        nxt, msn, mss = lv.last.psn + 1, lv.last[ms.MRCData].msn + 1, lv.p.b.mss
        # Three packets' worth whose middle PSN carries the next message: every packet
        # is in its place, yet the first message would have a hole of mss bytes.
        cases = [
            (send_pkt(lv, nxt, msn, 0, "FIRST", 3 * mss, mss), {}),
            (send_pkt(lv, nxt + 1, msn + 1, 0, "FIRST+LAST", 10, 10), {}),
            (send_pkt(lv, nxt + 2, msn, 2 * mss, "LAST", 3 * mss, mss), {"bad_msg": 1}),
        ]
        for pkt, reason in cases:
            assert inject(lv.p.b, pkt, A_ADDR) == reason
        wait_for(lambda: lv.p.cb.error is not None)
        assert isinstance(lv.p.cb.error, mrc.ProtocolError), lv.p.cb.error


@needs_root
def test_messages_far_out_of_order_grow_the_table() -> None:
    """A connection's message table starts at 16 entries and doubles as messages
    arrive ahead of one still missing (up to the 1024 a sender may have open): 200
    one-packet SENDs injected last first are all held (no drop), the table grows, and
    when the first arrives every RECV completes in order with its own bytes."""
    n = 200
    with live() as lv:
        nxt, msn = lv.last.psn + 1, lv.last[ms.MRCData].msn + 1
        dst = np.zeros((n, 16), np.uint8)
        md = lv.p.b.register(dst)
        recvs = [lv.p.cb.recv(md, offset=16 * i, length=16, tag=0x5EED) for i in range(n)]
        table_before = lv.p.b.stats()["conn_bytes"]
        for i in reversed(range(n)):
            pkt = write_pkt(lv.b_conn, nxt + i, msn + i, 0x5EED, 0, bytes([i]) * 16, kind=2)
            assert inject(lv.p.b, pkt, A_ADDR) == {}
            if i == 1:  # 199 held behind the first: 256 entries (72 bytes each)
                assert lv.p.b.stats()["conn_bytes"] - table_before >= (256 - 16) * 64
                assert not any(r.done for r in recvs)
        for r in recvs:
            r.wait(timeout=10)
        assert np.array_equal(dst, np.repeat(np.arange(n, dtype=np.uint8)[:, None], 16, 1))
        assert lv.p.cb.error is None


@needs_root
def test_packet_from_a_stranger_is_refused() -> None:
    """A perfectly valid WRITE (right conn, key, PSN) from a host that is not the peer."""
    with live() as lv:
        pkt = write_pkt(
            lv.b_conn, lv.last.psn + 1, lv.last[ms.MRCData].msn + 1, lv.mr.key, 0, b"\x66" * 1000
        )
        snap = lv.snapshot()
        assert inject(lv.p.b, pkt, STRANGER) == {"bad_peer": 1}
        assert_untouched(lv, snap)
        # The same over real UDP, from a socket bound to the stranger's address.
        before = drops(lv.p.b)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((STRANGER, 0))
            s.sendto(pkt, lv.p.b.planes[0])
            s.sendto(bytes(hdr(type=7, conn=lv.b_conn, psn=lv.last.psn + 1)), lv.p.b.planes[0])
        wait_for(lambda: delta(before, drops(lv.p.b)).get("bad_peer", 0) == 2)
        assert_untouched(lv, snap)
        assert_healthy(lv)


@needs_root
def test_forged_close_needs_the_psn() -> None:
    """Regression: any CLOSE with the right conn id used to close the connection."""
    with live() as lv:
        for psn in (0, lv.last.psn - 5, lv.last.psn + (1 << 20)):
            pkt = bytes(hdr(type=7, conn=lv.b_conn, psn=psn & 0xFFFFFFFF))
            assert inject(lv.p.b, pkt, A_ADDR) == {"psn_window": 1}
        assert_healthy(lv)
        # The real close still works: b sees a's CLOSE.
        lv.p.ca.close()
        wait_for(lambda: lv.p.cb.error is not None)


# ---- forged ACK / NAK / PROBE_ACK at the sender --------------------------------------


@needs_root
def test_forged_acks_at_the_sender() -> None:
    with live() as lv:
        nxt = lv.last.psn + 1  # the sender's next PSN: nothing at or above was sent
        m = lv.last[ms.MRCData].msn

        def ack(
            cum: int, base: int, echo: int, sack: list[int] | None = None, more: Any = ()
        ) -> bytes:
            return bytes(
                hdr(type=3, conn=lv.a_conn, psn=cum & 0xFFFFFFFF, ts=0)
                / ms.MRCAck(
                    sack_base=base & 0xFFFFFFFF,
                    echo_psn=echo & 0xFFFFFFFF,
                    sack=sack or [0] * 8,
                    echoes=[ms.MRCAckEcho(path=p, psn=q & 0xFFFFFFFF) for p, q in more],
                )
            )

        cases = [
            ("cumulative ack beyond what was sent", ack(nxt + 10, nxt, nxt - 1), "bad_ack"),
            ("echo of a psn never sent", ack(nxt, nxt, nxt + 3), "bad_ack"),
            (
                "further echo of a psn never sent",
                ack(nxt, nxt, nxt - 1, more=[(0, nxt)]),
                "bad_ack",
            ),
            ("further echo of a path it lacks", ack(nxt, nxt, nxt - 1, more=[(40, 1)]), "bad_ack"),
            ("sack of a psn never sent", ack(nxt, nxt, nxt - 1, [1] + [0] * 7), "bad_ack"),
            ("sack far ahead", ack(nxt, nxt + 1000, nxt - 1, [0] * 7 + [1 << 63]), "bad_ack"),
            (
                "nak for nothing in flight",
                bytes(hdr(type=4, conn=lv.a_conn, psn=nxt) / ms.MRCNak(msn=m + 1, code=1)),
                "bad_ack",
            ),
            (
                "nak for an acknowledged packet",
                bytes(hdr(type=4, conn=lv.a_conn, psn=lv.last.psn) / ms.MRCNak(msn=m, code=2)),
                "bad_ack",
            ),
            (
                "probe answer for a probe never sent",
                bytes(hdr(type=6, conn=lv.a_conn, ts=2**63)),
                "bad_ack",
            ),
        ]
        for what, pkt, reason in cases:
            assert inject(lv.p.a, pkt, B_ADDR) == {reason: 1}, what
        # An in-range ACK with a wild sack_base and no bits is harmless (no drop).
        assert inject(lv.p.a, ack(nxt, nxt + (1 << 31) - 1, nxt - 1), B_ADDR) == {}
        # So is one whose further echo names a path it has and a psn it sent.
        assert inject(lv.p.a, ack(nxt, nxt, nxt - 1, more=[(0, nxt - 1)]), B_ADDR) == {}
        assert lv.p.a.stats()["lost_rack"] == 0
        assert_healthy(lv)


# ---- replay --------------------------------------------------------------------------


@needs_root
def test_replayed_packet_is_a_duplicate_then_closed() -> None:
    with live() as lv:
        lv.region[:] = 0  # what the replay would overwrite
        snap = lv.snapshot()
        assert inject(lv.p.b, lv.first_raw, A_ADDR) == {"duplicate": 1}
        before = drops(lv.p.b)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # real UDP, from a's host
            s.bind((A_ADDR, 0))
            s.sendto(lv.first_raw, lv.p.b.planes[0])
        wait_for(lambda: delta(before, drops(lv.p.b)).get("duplicate", 0) == 1)
        assert_untouched(lv, snap)
        lv.p.ca.close()
        wait_for(lambda: lv.p.cb.error is not None)
        got = inject(lv.p.b, lv.first_raw, A_ADDR)
        assert got in ({"closed_conn": 1}, {"unknown_conn": 1}), got
        lv.p.cb.close()
        assert inject(lv.p.b, lv.first_raw, A_ADDR) == {"unknown_conn": 1}
        assert_untouched(lv, snap)


# ---- a transfer under attack ---------------------------------------------------------


@needs_root
def test_large_write_completes_under_attack() -> None:
    size = 32 << 20
    with live(nplanes=2) as lv:
        data = pattern(size, 3)
        whole = np.full(size + 2 * GUARD, 0xA5, np.uint8)
        dst = whole[GUARD:-GUARD]
        dst[:] = 0
        md = lv.p.b.register(dst)
        nxt, m = lv.last.psn + 1, lv.last[ms.MRCData].msn
        body = b"\xde\xad" * 2000
        attack = [
            (lv.p.b, write_pkt(lv.b_conn, nxt + 5, m + 1, md.key, 0, body), STRANGER),
            (lv.p.b, write_pkt(lv.b_conn ^ 0x30000, nxt, m + 1, md.key, 0, body), A_ADDR),
            (lv.p.b, write_pkt(lv.b_conn, nxt + (1 << 24), m + 1, md.key, 0, body), A_ADDR),
            (lv.p.b, write_pkt(lv.b_conn, nxt + 9, m + 1, md.key, 2**64 - 8, body), STRANGER),
            (lv.p.b, lv.first_raw, A_ADDR),  # replay: a duplicate
            (lv.p.b, lv.first_raw[:30], A_ADDR),
            (lv.p.b, bytes(hdr(type=7, conn=lv.b_conn, psn=nxt - 1000)), A_ADDR),
            (
                lv.p.a,
                bytes(hdr(type=3, conn=lv.a_conn, psn=nxt + (1 << 30)) / ms.MRCAck()),
                B_ADDR,
            ),
            (lv.p.a, bytes(hdr(type=7, conn=lv.a_conn, psn=0)), STRANGER),
        ]
        stop = threading.Event()
        sent = [0]

        def attacker() -> None:
            # At least five rounds, however fast the write completes on this machine.
            while not stop.is_set() or sent[0] < 5 * len(attack):
                for ep, pkt, src in attack:
                    ep._rx_inject(0, pkt, src, 4793)
                    sent[0] += 1

        t = threading.Thread(target=attacker)
        before = drops(lv.p.b)
        t.start()
        try:
            lv.p.ca.write(lv.p.a.register(data), md.descriptor()).wait(timeout=60)
        finally:
            stop.set()
            t.join()
        assert sha(dst) == sha(data)
        assert (whole[:GUARD] == 0xA5).all() and (whole[-GUARD:] == 0xA5).all()
        assert (lv.unreg == 0x5A).all()
        d = delta(before, drops(lv.p.b))
        assert (
            sent[0] >= 5 * len(attack) and d.get("bad_peer", 0) > 0 and d.get("unknown_conn", 0) > 0
        )
        assert d.get("bad_key", 0) == 0 and d.get("bad_bounds", 0) == 0
        assert_healthy(lv)


def test_garbage_over_udp_needs_no_root() -> None:
    """Random datagrams and truncated/oversized headers at every plane, over real UDP."""
    with connected_pair(2) as p:
        region = np.zeros(REGION, np.uint8)
        p.b.register(region)
        rnd = np.random.default_rng(5)
        ca_id = p.cb.ids[0]
        pkts = [bytes(rnd.integers(0, 256, int(n), dtype=np.uint8)) for n in range(0, 200, 7)]
        pkts += [bytes(hdr(type=1, conn=ca_id, len=8000) / ms.MRCData())]  # len lies
        pkts += [b"\x52\x4d" + bytes([ms.VERSION, 1]) + bytes(70_000 - 4)]  # > any valid packet
        before = drops(p.b)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((A_ADDR, 0))
            for pkt in pkts:
                s.sendto(pkt[:65_000], p.b.planes[0])
        wait_for(lambda: sum(delta(before, drops(p.b)).values()) >= len(pkts) - 1)
        d = delta(before, drops(p.b))
        assert d.get("bad_length", 0) >= 2 and not region.any()
        src = pattern(1 << 20, 1)
        dst = np.zeros(1 << 20, np.uint8)
        md = p.b.register(dst)  # held: a dropped region is deregistered
        p.ca.write(p.a.register(src), md.descriptor()).wait(timeout=10)
        assert sha(src) == sha(dst)
