"""UDP GRO on receive, seen from Python: the sender's GSO batches arrive as one read
each on loopback, are cut back into packets, and the bytes land exactly; with
MRC_GRO=0 the same transfer is read datagram by datagram. (The cutting itself, at odd
segment sizes and with a hand-made foreign batch: src_c/tests/test_gro.c.)"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import connected_pair, pattern, sha

SIZE = (4 << 20) + 12345  # not a multiple of the MSS: a short last packet


def transfer() -> tuple[dict, dict]:
    with connected_pair(nplanes=2, mss=8192) as p:
        src = pattern(SIZE, 7)
        dst = np.zeros(SIZE, np.uint8)
        ms = p.a.register(src, remote_write=False)
        md = p.b.register(dst)
        p.ca.write(ms, md.descriptor()).wait(timeout=30)
        assert sha(dst) == sha(src)
        return p.a.stats(), p.b.stats()


def test_gso_batches_are_read_whole_and_cut_back() -> None:
    tx, rx = transfer()
    assert tx["tx_sends"] < tx["tx_pkts"]  # the sender used UDP GSO
    assert rx["rx_gro_reads"] > 0
    assert rx["rx_reads"] < rx["rx_pkts"]
    # Nothing read out of a GRO batch is malformed. Duplicates are legal: on a loaded
    # machine a packet can time out and be sent again while its first copy is queued,
    # so each duplicate must be one of the sender's retransmissions.
    drops = dict(rx["drops"])
    duplicates = drops.pop("duplicate")
    assert sum(drops.values()) == 0, drops
    assert duplicates <= tx["retx"]
    assert tx["sockets"] == rx["sockets"] == 2  # plain IP paths: the plane sockets only


def test_gro_off_reads_every_datagram(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MRC_GRO", "0")
    _, rx = transfer()
    assert rx["rx_gro_reads"] == 0
    assert rx["rx_reads"] >= rx["rx_pkts"]
