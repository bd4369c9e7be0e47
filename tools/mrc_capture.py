"""Summarise the mrc packets of a pcap: per connection and per path, packets, bytes,
retransmissions (a DATA PSN seen again), ACKs with their SACK ranges, NAKs, probes.

    tcpdump -i lo -w run.pcap udp          # while mrc runs
    python tools/mrc_capture.py run.pcap   # table
    python tools/mrc_capture.py --json run.pcap

mrc has no fixed port: packets are recognised on any UDP port by magic and version
(mrc.scapy.install_heuristic); --port also binds the layer to a port.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

import click
from rich.console import Console
from rich.table import Table


@dataclass
class PathStats:
    data_pkts: int = 0
    data_bytes: int = 0
    retx: int = 0
    acks: int = 0  # ACK datagrams, counted on the first path they answer
    echoes: int = 0  # paths answered: an ACK echoes every path that delivered
    sack_ranges: int = 0
    naks: int = 0
    probes: int = 0
    probe_acks: int = 0
    closes: int = 0


@dataclass
class ConnStats:
    conn: int
    paths: dict[int, PathStats] = field(default_factory=lambda: defaultdict(PathStats))
    psns: set[int] = field(default_factory=set)
    max_cum_ack: int | None = None

    def total(self) -> PathStats:
        t = PathStats()
        for p in self.paths.values():
            for k, v in asdict(p).items():
                setattr(t, k, getattr(t, k) + v)
        return t


def sack_ranges(psns: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive PSNs, as (first, last)."""
    out: list[tuple[int, int]] = []
    for p in psns:
        if out and p == (out[-1][1] + 1) & 0xFFFFFFFF:
            out[-1] = (out[-1][0], p)
        else:
            out.append((p, p))
    return out


def summarise(packets: Any, port: int | None = None) -> dict[int, ConnStats]:
    """Per-connection statistics of the mrc packets among `packets` (scapy packets)."""
    from mrc import scapy as ms

    ms.install_heuristic()
    if port is not None:
        ms.bind_port(port)
    conns: dict[int, ConnStats] = {}
    for m in (m for pkt in packets for m in ms.decode_all(pkt)):
        c = conns.setdefault(m.conn, ConnStats(m.conn))
        p = c.paths[m.path]
        if m.type in (1, 2):
            p.data_pkts += 1
            p.data_bytes += m.len
            if m.psn in c.psns:
                p.retx += 1
            c.psns.add(m.psn)
        elif m.type == 3:
            p.acks += 1
            p.echoes += 1
            if m.haslayer(ms.MRCAck):
                p.sack_ranges += len(sack_ranges(ms.sack_psns(m[ms.MRCAck])))
                for e in m[ms.MRCAck].echoes:
                    c.paths[e.path].echoes += 1
            c.max_cum_ack = m.psn
        elif m.type == 4:
            p.naks += 1
        elif m.type == 5:
            p.probes += 1
        elif m.type == 6:
            p.probe_acks += 1
        elif m.type == 7:
            p.closes += 1
    return conns


def as_json(conns: dict[int, ConnStats]) -> dict[str, Any]:
    return {
        f"{cid:08x}": {
            "total": asdict(c.total()),
            "paths": {str(k): asdict(v) for k, v in sorted(c.paths.items())},
        }
        for cid, c in conns.items()
    }


@click.command()
@click.argument("pcap", type=click.Path(exists=True, dir_okay=False))
@click.option("--port", type=int, default=None, help="Also bind the mrc layer to this UDP port.")
@click.option("--json", "as_json_out", is_flag=True, help="Print JSON instead of a table.")
def main(pcap: str, port: int | None, as_json_out: bool) -> None:
    """Summarise the mrc traffic in PCAP."""
    from scapy.all import rdpcap  # all layers: Ethernet, IP, ... must be known

    conns = summarise(rdpcap(pcap), port)
    if as_json_out:
        click.echo(json.dumps(as_json(conns), indent=2))
        return
    table = Table(title=f"mrc traffic in {pcap}")
    cols = [f.name for f in PathStats.__dataclass_fields__.values()]
    table.add_column("conn")
    table.add_column("path")
    for col in cols:
        table.add_column(col, justify="right")
    for cid, c in sorted(conns.items()):
        for pid, p in sorted(c.paths.items()):
            table.add_row(f"{cid:08x}", str(pid), *(str(getattr(p, k)) for k in cols))
        t = c.total()
        table.add_row(f"{cid:08x}", "all", *(f"[bold]{getattr(t, k)}" for k in cols))
    Console().print(table)


if __name__ == "__main__":
    main()
