"""A verified bulk transfer between two hosts of a fabric, one process per host.

Run in each host's namespace (tests, benchmarks and the demo drive it, through
`RunningFabric.xfer` in mrc.fabric.testing):

    python -m mrc.fabric.xfer server --fabric F --host h1 [--port P] --size N --mode M
    python -m mrc.fabric.xfer client --fabric F --host h0 --peer h1 --port P --size N --mode M

Both print JSON lines on stdout: the server {"event": "listening", "port": P}, the
client {"event": "progress", ...} every `--progress` fraction, and both end with
{"event": "done", "sha256": ..., "stats": ...}. The client's data is a seeded
pattern; the server hashes what landed, so equal hashes mean byte-exact delivery.
WRITE mode: `--chunk`-sized writes, `--depth` in flight, into one region. SEND mode:
a stream of `--chunk`-sized SENDs into RECVs posted ahead. STREAM mode (soaks of any
size in bounded memory): chunk i is a SEND with tag i, drawn from 32 distinct source
chunks; the server receives into a ring of buffers, posting the RECV for tag i itself
(so order is checked too), and both sides hash the stream as it goes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click  # noqa: E402
import numpy as np  # noqa: E402

import mrc  # noqa: E402
from mrc.paths import FabricEndpoint, fabric_endpoint  # noqa: E402

# Control tags live above every data tag (stream mode tags chunk i with i + 1): a
# 4 MiB chunk once matched the 8-byte "done" RECV at tag 0xD0E = 3342 (the soak stalled).
DONE_TAG = 1 << 62
DESC_TAG = DONE_TAG + 1


def emit(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def data(size: int, seed: int) -> np.ndarray:
    """A pattern in which every 8-byte word depends on its position and the seed, so a
    misplaced, lost or duplicated chunk changes the hash; fast for gigabytes."""
    words = np.arange((size + 7) // 8, dtype=np.uint64)
    words += np.uint64(seed) << np.uint64(40)
    words *= np.uint64(0x9E3779B97F4A7C15)
    words ^= words >> np.uint64(29)
    return words.view(np.uint8)[:size]


@click.group()
@click.version_option(package_name="mrc", prog_name="mrc.fabric.xfer")
def cli() -> None:
    """Verified transfers between fabric hosts."""


@dataclass
class Job:
    """What both ends are given: the fabric, this host and the transfer."""

    fabric: str
    host: str
    port: int
    size: int
    mode: str
    chunk: int
    timeout: float
    stats_socket: str | None
    linger: bool

    def close(self, fe: FabricEndpoint) -> None:
        """Closes fe; with --linger, once stdin closes. Until then an observer of the
        stats socket sees the paths of a live connection, still probed: a closed
        connection's paths stop changing, and one being failed when the transfer ended
        would stay 'suspect'."""
        if self.linger:
            sys.stdin.read()
        fe.close()

    def endpoint(self) -> FabricEndpoint:
        fe = fabric_endpoint(self.fabric, self.host, timeout=self.timeout)
        if self.stats_socket:
            fe.endpoint.serve_stats(self.stats_socket)
        return fe


def common(f: Any) -> Any:
    """The options of a Job, handed to the command as its first argument."""
    names = [fld.name for fld in dataclasses.fields(Job)]

    @functools.wraps(f)
    def with_job(**kw: Any) -> Any:
        return f(Job(**{n: kw.pop(n) for n in names}), **kw)

    for opt in reversed(
        [
            click.option("--fabric", required=True, help="Fabric file."),
            click.option("--host", required=True, help="This host's name in the fabric."),
            click.option("--port", default=0, help="TCP port of the connection hello."),
            click.option("--size", default=1 << 30, help="Bytes to transfer."),
            click.option("--mode", type=click.Choice(["write", "send", "stream"]), default="write"),
            click.option("--chunk", default=4 << 20, help="Bytes per operation."),
            click.option("--timeout", default=5.0, help="Endpoint timeout, seconds."),
            click.option("--stats-socket", default=None, help="Serve stats here (mrc-route live)."),
            click.option(
                "--linger",
                is_flag=True,
                help="After the result, keep the endpoint (and stats) until stdin closes.",
            ),
        ]
    ):
        with_job = opt(with_job)
    return with_job


@cli.command()
@common
def server(job: Job) -> None:
    """Receive one verified transfer on --host: print {"event": "listening", "port": P},
    accept one client, then print {"event": "done", "sha256": ...} of what landed."""
    size, mode, chunk = job.size, job.mode, job.chunk
    fe = job.endpoint()
    emit(event="listening", port=fe.listen(job.port))
    conn = fe.accept(timeout=60)
    if mode == "stream":
        stream_server(job, fe, conn)
        return
    done = np.zeros(8, np.uint8)
    done_op = conn.recv(fe.endpoint.register(done), tag=DONE_TAG)  # before the peer can close
    buf = np.zeros(size, np.uint8)
    region = fe.endpoint.register(buf)
    desc = np.frombuffer(region.descriptor().pack(), np.uint8).copy()
    conn.send(fe.endpoint.register(desc), tag=DESC_TAG).wait(timeout=30)
    recvs = []
    if mode == "send":
        recvs = [
            conn.recv(region, offset=off, length=min(chunk, size - off), tag=1)
            for off in range(0, size, chunk)
        ]
    done_op.wait(timeout=None)
    for r in recvs:
        r.wait(timeout=60)
    emit(event="done", sha256=hashlib.sha256(buf).hexdigest(), stats=fe.endpoint.stats())
    job.close(fe)


RING = 64  # stream mode: receive buffers on the server
SOURCES = 32  # stream mode: distinct source chunks on the client


def stream_server(job: Job, fe: Any, conn: mrc.Connection) -> None:
    size, chunk = job.size, job.chunk
    nchunks = -(-size // chunk)
    ring = np.zeros(RING * chunk, np.uint8)
    region = fe.endpoint.register(ring)
    h = hashlib.sha256()

    def post(i: int) -> mrc.Operation:
        n = min(chunk, size - i * chunk)
        return conn.recv(region, offset=(i % RING) * chunk, length=n, tag=i + 1)

    done = np.zeros(8, np.uint8)
    done_op = conn.recv(fe.endpoint.register(done), tag=DONE_TAG)  # before the peer can close
    pending = [post(i) for i in range(min(RING, nchunks))]
    for i in range(nchunks):
        op = pending[i % RING].wait(timeout=None)
        slot = (i % RING) * chunk
        h.update(ring[slot : slot + op.nbytes])
        if i + RING < nchunks:
            pending[i % RING] = post(i + RING)
    done_op.wait(timeout=None)
    emit(event="done", sha256=h.hexdigest(), stats=fe.endpoint.stats())
    job.close(fe)


@cli.command()
@common
@click.option("--peer", required=True, help="The server's host name.")
@click.option("--depth", default=16, help="Operations in flight.")
@click.option("--progress", default=0.05, help="Report every this fraction of the size.")
@click.option("--timeline", is_flag=True, help="Report each operation's completion time.")
@click.option("--seed", default=1, help="Seed of the data pattern (the server needs none).")
def client(
    job: Job,
    peer: str,
    depth: int,
    progress: float,
    timeline: bool,
    seed: int,
) -> None:
    """Send a seeded pattern from --host to the server on --peer (port --port), printing
    progress events and {"event": "done", "sha256": ...} of what was sent."""
    size, mode, chunk = job.size, job.mode, job.chunk
    fe = job.endpoint()
    conn = fe.connect(peer, job.port, timeout=30)
    remote = None
    if mode != "stream":
        desc = np.zeros(16, np.uint8)
        conn.recv(fe.endpoint.register(desc), tag=DESC_TAG).wait(timeout=30)
        remote = mrc.RemoteRegion.unpack(desc.tobytes())
    if mode == "stream":
        src = np.concatenate([data(chunk, seed + k) for k in range(SOURCES)])
        stream_hash = hashlib.sha256()
    else:
        src = data(size, seed)
    local = fe.endpoint.register(src, remote_write=False)
    offsets = list(range(0, size, chunk))
    pending: list[tuple[int, mrc.Operation]] = []
    done_bytes, next_report, times = 0, progress * size, []
    samples: list[tuple[float, int]] = []
    sampling = threading.Event()

    def sample() -> None:
        # Goodput as the transport sees it: bytes acknowledged, every millisecond.
        while not sampling.wait(0.001):
            samples.append((time.monotonic() - start, fe.endpoint.stats()["acked_bytes"]))

    sampler = threading.Thread(target=sample, daemon=True)
    start = time.monotonic()
    if timeline:
        sampler.start()

    def post(off: int) -> mrc.Operation:
        n = min(chunk, size - off)
        if mode == "stream":
            i = off // chunk
            at = (i % SOURCES) * chunk
            stream_hash.update(src[at : at + n])
            return conn.send(local, offset=at, length=n, tag=i + 1)
        if mode == "write":
            assert remote is not None
            return conn.write(local, remote, offset=off, length=n, remote_offset=off)
        return conn.send(local, offset=off, length=n, tag=1)

    for off in offsets:
        if len(pending) >= depth:
            o, op = pending.pop(0)
            op.wait(timeout=None)
            done_bytes += op.length
            times.append(time.monotonic() - start)
            if done_bytes >= next_report:
                emit(event="progress", bytes=done_bytes, t=times[-1])
                next_report += progress * size
        pending.append((off, post(off)))
    for _, op in pending:
        op.wait(timeout=None)
        done_bytes += op.length
        times.append(time.monotonic() - start)
    elapsed = time.monotonic() - start
    sampling.set()
    if timeline:
        sampler.join()
    conn.send(fe.endpoint.register(np.zeros(8, np.uint8)), tag=DONE_TAG).wait(timeout=30)
    out: dict[str, Any] = {
        "event": "done",
        "sha256": (stream_hash if mode == "stream" else hashlib.sha256(src)).hexdigest(),
        "bytes": done_bytes,
        "elapsed": elapsed,
        "gbps": done_bytes * 8 / elapsed / 1e9,
        "stats": fe.endpoint.stats(),
    }
    if timeline:
        out["t0"] = start  # CLOCK_MONOTONIC: comparable across namespaces of one host
        out["times"] = times
        out["chunk"] = chunk
        out["acked"] = samples
    emit(**out)
    job.close(fe)


def main() -> None:
    try:
        cli(standalone_mode=False)
    except mrc.MrcError as e:
        emit(event="error", error=type(e).__name__, message=str(e))
        sys.exit(1)
    except click.ClickException as e:
        e.show()
        sys.exit(2)


if __name__ == "__main__":
    main()
