"""Usage: staging_blame.py direct|staged [N]

Do staging copies/first-touch on the progress thread cause spurious path blame?
SEND-heavy, 4 loopback planes, no injected loss: pre-posted RECVs (direct placement)
vs RECVs posted behind the data (every message staged, copied out on the progress
thread). Counts the sender's losses/retransmits/path state changes."""

import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers import connected_pair, sha  # noqa: E402

N, SZ = (int(sys.argv[2]) if len(sys.argv) > 2 else 48), 4 << 20
mode = sys.argv[1]
with connected_pair(4, max_unexpected=1 << 30) as p:
    src = np.random.default_rng(1).integers(0, 256, SZ, dtype=np.uint8)
    ms = p.a.register(src)
    dsts = [np.zeros(SZ, np.uint8) for _ in range(N)]
    mds = [p.b.register(d) for d in dsts]
    t0 = time.monotonic()
    recvs = []
    if mode == "direct":
        recvs = [p.cb.recv(md, tag=1) for md in mds]
        sends = [p.ca.send(ms, tag=1) for _ in range(N)]
    else:
        sends = [p.ca.send(ms, tag=1) for _ in range(N)]

        def poster():
            for i, md in enumerate(mds):
                # message i+3 acknowledged: i was staged (no stats() polling:
                # each call scans every slot on the progress thread)
                sends[min(N - 1, i + 3)].wait(timeout=60)
                recvs.append(p.cb.recv(md, tag=1))

        th = threading.Thread(target=poster)
        th.start()
        th.join()
    for s in sends:
        s.wait(timeout=120)
    for r in recvs:
        r.wait(timeout=120)
    dt = time.monotonic() - t0
    st, sb = p.a.stats(), p.b.stats()
    assert all(sha(d) == sha(src) for d in dsts)
    changes = sum(x["state_changes"] for x in st["paths"])
    print(
        f"{mode}: {N}x4MiB in {dt:.2f}s ({N * SZ * 8 / dt / 1e9:.2f} Gb/s) "
        f"staged={sb['staged_msgs']} "
        f"retx={st['retx']} lost_rack={st['lost_rack']} lost_rto={st['lost_rto']} "
        f"lost_flush={st['lost_flush']} path_state_changes={changes} rnr={st['rnr_naks']}"
    )
