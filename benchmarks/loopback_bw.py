"""Loopback WRITE bandwidth of mrc on 1 and 4 planes, side by side with iperf3 -u.

For each (planes, message size): mrc keeps a window of WRITEs in flight for a fixed
time between two endpoints (two progress threads, as iperf3 has a client and a
server process); iperf3 sends UDP as fast as it can with the same datagram size to
the same loopback addresses (one iperf3 pair per plane, concurrently). Reported:
receive rates and the ratio mrc / iperf3, to results/loopback_bw.json and a PNG.

    python benchmarks/loopback_bw.py [--seconds 3]
"""

from __future__ import annotations

import json
import subprocess
import threading
import time

import click
import numpy as np
from common import RESULTS, ensure_tool, record_load, save

import mrc

MIB = 1 << 20


def mrc_write_bw(nplanes: int, msg: int, seconds: float, mss: int) -> dict[str, float]:
    a = mrc.Endpoint([f"127.0.0.{i + 1}" for i in range(nplanes)], mss=mss)
    b = mrc.Endpoint([f"127.0.1.{i + 1}" for i in range(nplanes)], mss=mss)
    try:
        port = b.listen()
        box: dict[str, mrc.Connection] = {}
        t = threading.Thread(target=lambda: box.setdefault("c", b.accept(timeout=10)))
        t.start()
        conn = a.connect("127.0.1.1", port, timeout=10)
        t.join()
        depth = max(4, min(128, (64 * MIB) // msg))
        src = np.ones(msg * depth, np.uint8)
        dst = np.zeros(msg * depth, np.uint8)
        ms, md = a.register(src), b.register(dst)
        remote = md.descriptor()
        ops = [
            conn.write(ms, remote, offset=i * msg, length=msg, remote_offset=i * msg)
            for i in range(depth)
        ]
        done_bytes = 0
        start = time.perf_counter()
        i = 0
        while True:
            ops[i].wait(timeout=30)
            done_bytes += msg
            now = time.perf_counter()
            if now - start >= seconds:
                break
            ops[i] = conn.write(ms, remote, offset=i * msg, length=msg, remote_offset=i * msg)
            i = (i + 1) % depth
        elapsed = time.perf_counter() - start
        for op in ops:
            if op is not ops[i]:
                op.wait(timeout=30)
        st = a.stats()
        return {
            "gbps": done_bytes * 8 / elapsed / 1e9,
            "retx": st["retx"],
            "pkts": st["tx_pkts"],
            "depth": depth,
        }
    finally:
        a.close()
        b.close()


def iperf3_udp(nplanes: int, dgram: int, seconds: float) -> dict[str, float]:
    iperf = ensure_tool("iperf3", "iperf3")
    servers, clients = [], []
    try:
        for i in range(nplanes):
            port = 15201 + i
            servers.append(
                subprocess.Popen(
                    [iperf, "-s", "-1", "-B", f"127.0.1.{i + 1}", "-p", str(port)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        time.sleep(0.3)  # iperf3 has no readiness signal; the client retries below anyway
        for i in range(nplanes):
            clients.append(
                subprocess.Popen(
                    [
                        iperf,
                        "-c",
                        f"127.0.1.{i + 1}",
                        "-B",
                        f"127.0.0.{i + 1}",
                        "-p",
                        str(15201 + i),
                        "-u",
                        "-b",
                        "0",
                        "-l",
                        str(dgram),
                        "-t",
                        str(seconds),
                        "-J",
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        total = 0.0
        lost = []
        for c in clients:
            out, err = c.communicate(timeout=seconds + 30)
            res = json.loads(out)
            if "error" in res:
                raise SystemExit(f"iperf3 failed: {res['error']}")
            s = res["end"]["sum"]
            total += s["bits_per_second"] * (1 - s["lost_percent"] / 100.0)
            lost.append(s["lost_percent"])
        return {"gbps": total / 1e9, "lost_percent": max(lost)}
    finally:
        for p in servers + clients:
            p.kill()
            p.wait()


@click.command()
@click.option("--seconds", default=3.0, show_default=True, help="Duration of each run.")
@click.option(
    "--mss",
    default=8192,
    show_default=True,
    help="mrc payload per packet (iperf3 uses the same datagram size).",
)
def main(seconds: float, mss: int) -> None:
    record_load()
    rows = []
    for nplanes in (1, 4):
        for msg in (64 * 1024, MIB):
            m = mrc_write_bw(nplanes, msg, seconds, mss)
            ip = iperf3_udp(nplanes, mss, seconds)
            row = {
                "planes": nplanes,
                "msg_bytes": msg,
                "mss": mss,
                "mrc_gbps": round(m["gbps"], 3),
                "iperf3_udp_gbps": round(ip["gbps"], 3),
                "ratio": round(m["gbps"] / ip["gbps"], 3),
                "mrc_retx": m["retx"],
                "iperf3_lost_percent": ip["lost_percent"],
            }
            rows.append(row)
            click.echo(
                f"planes={nplanes} msg={msg >> 10:>5} KiB  mrc {m['gbps']:6.2f} Gb/s  "
                f"iperf3 -u {ip['gbps']:6.2f} Gb/s  ratio {row['ratio']:.2f}"
            )
    out = save(
        "loopback_bw",
        {
            "benchmark": "loopback WRITE bandwidth vs iperf3 -u",
            "seconds": seconds,
            "target_ratio_1plane": 0.8,
            "rows": rows,
        },
    )
    plot(rows)
    click.echo(f"wrote {out}")


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        f"{r['planes']} plane{'s' if r['planes'] > 1 else ''}\n{r['msg_bytes'] >> 10} KiB"
        for r in rows
    ]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(x - 0.2, [r["mrc_gbps"] for r in rows], 0.4, label="mrc WRITE")
    ax.bar(x + 0.2, [r["iperf3_udp_gbps"] for r in rows], 0.4, label="iperf3 -u (received)")
    for xi, r in zip(x, rows, strict=False):
        ax.text(
            xi, max(r["mrc_gbps"], r["iperf3_udp_gbps"]) * 1.02, f"{r['ratio']:.2f}x", ha="center"
        )
    ax.set_xticks(x, labels)
    ax.set_ylabel("Gbit/s")
    ax.set_title(f"Loopback bandwidth, {rows[0]['mss']} B packets")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "loopback_bw.png", dpi=100)


if __name__ == "__main__":
    main()
