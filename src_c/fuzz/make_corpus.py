"""Records the packets of a real transfer into src_c/fuzz/corpus/ (fuzz_rx seeds).

Run as root from the repository root: `.venv/bin/python src_c/fuzz/make_corpus.py`.
Sniffs loopback while two endpoints do WRITEs and SENDs with loss (so ACKs with
SACK holes and retransmissions appear), then keeps a few dozen distinct packets.
Each seed is one mode byte (see fuzz_rx.c) and the datagram: mode 2 rewrites the
header for the fuzzer's live connection, so real layouts reach the deep checks.
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from helpers import connected_pair, pattern  # noqa: E402

from mrc.scapy import F_ACKS, MRC, PKT_TYPES, decode  # noqa: E402

OUT = Path(__file__).resolve().parent / "corpus"
PER_TYPE = 8


def main() -> None:
    from scapy.all import UDP, AsyncSniffer

    with connected_pair(2, mss=1024) as p:
        ports = {port for _, port in p.a.planes + p.b.planes}
        sniffer = AsyncSniffer(
            iface="lo",
            lfilter=lambda k: UDP in k and (k[UDP].sport in ports or k[UDP].dport in ports),
            store=True,
        )
        sniffer.start()
        time.sleep(0.5)
        p.a.inject(0, loss=0.05)
        p.b.inject(0, loss=0.05)
        src, dst = pattern(64 * 1024, 1), np.zeros(64 * 1024, np.uint8)
        ms, md = p.a.register(src), p.b.register(dst)
        p.ca.write(ms, md.descriptor(), length=20000, imm=7).wait(timeout=10)
        r = p.cb.recv(md, offset=32768, length=4096, tag=3)
        p.ca.send(ms, offset=0, length=3000, tag=3).wait(timeout=10)
        r.wait(timeout=10)
        p.ca.send(ms, offset=0, length=0, tag=4).wait(timeout=10)
        time.sleep(0.3)
        pkts = sniffer.stop()
    OUT.mkdir(exist_ok=True)
    kept: dict[str, int] = {}
    seen: set[bytes] = set()
    for k in pkts:
        m = decode(k)
        if m is None or bytes(k[UDP].payload) in seen:  # lo shows each packet twice
            continue
        seen.add(bytes(k[UDP].payload))
        name = PKT_TYPES.get(m[MRC].type, "x")
        if kept.get(name, 0) >= PER_TYPE:
            continue
        kept[name] = kept.get(name, 0) + 1
        data = bytes(k[UDP].payload)
        for mode in (2, 0):
            seed = bytes([mode]) + data
            digest = hashlib.sha1(seed).hexdigest()[:12]
            (OUT / f"{name.lower()}-{digest}").write_bytes(seed)
    # DATA carrying an ACK (wire v4, flag ACKS), from a real SEND and a real ACK: the
    # plain transfer above sends none (its operations are not MRC_POST_LAZY_ACK).
    sends = [d for d in seen if d[3] == 2]
    acks = [d for d in seen if d[3] == 3]
    for d, a in list(zip(sorted(sends), sorted(acks), strict=False))[:PER_TYPE]:
        carried = a[:4] + bytes([0]) + a[5:8] + d[8:12] + a[12:]  # the SEND's connection
        data = d[:4] + bytes([d[4] | F_ACKS]) + d[5:56] + carried + d[56:]
        for mode in (2, 0):
            seed = bytes([mode]) + data
            digest = hashlib.sha1(seed).hexdigest()[:12]
            (OUT / f"send_ack-{digest}").write_bytes(seed)
        kept["SEND+ACK"] = kept.get("SEND+ACK", 0) + 1
    print(f"{sum(kept.values())} packets kept ({kept}) in {OUT}")


if __name__ == "__main__":
    main()
