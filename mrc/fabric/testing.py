"""Test helpers for namespace fabrics (root only): a fabric that is always torn down, and
SRv6 UDP senders/receivers that run inside host namespaces.

    from mrc.fabric.testing import fabric_up, UdpReceiver, send_on_paths

    @pytest.mark.root
    def test_x():
        with fabric_up("routing/2host-2plane.toml") as fab:
            p = fab.paths("h0", "h1")[0]
            with UdpReceiver(fab, "h1", [p.dst_addr], expect={"a": 10}) as rx:
                send_on_paths(fab, "h0", [(p, "a", 10)])
            assert rx.result.counts["a"] == 10
"""

from __future__ import annotations

import json
import random
import secrets
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path as FsPath
from typing import Any

from mrc.fabric import netns
from mrc.fabric.state import load_state
from mrc.routing.fabric import Fabric, load_fabric
from mrc.routing.srh import build_srh, parse_srh
from mrc.routing.table import Path, Table, compile_table
from mrc.routing.table import paths as table_paths

UDP_PORT = 47000


@dataclass
class RunningFabric:
    """A fabric that is up: its prefix, its Fabric, and shortcuts into its namespaces."""

    prefix: str
    fabric: Fabric
    file: str

    def ns(self, element: str) -> str:
        return netns.ns_name(self.prefix, element)

    def argv(self, element: str, cmd: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(element), *cmd]

    def run(
        self, element: str, cmd: Sequence[str], timeout: float = 30, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(element, cmd), capture_output=True, text=True, timeout=timeout, check=check
        )

    def popen(self, element: str, cmd: Sequence[str], **kw: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(self.argv(element, cmd), text=True, **kw)

    @property
    def failed(self) -> list[str]:
        return load_state(self.prefix).failed

    def table(self) -> Table:
        return compile_table(self.fabric, self.failed)

    def paths(self, src: str, dst: str, include_failed: bool = False) -> list[Path]:
        return table_paths(self.fabric, src, dst, self.failed, include_failed)

    def fail(self, element: str) -> None:
        netns.fail(self.prefix, element)

    def heal(self, element: str) -> None:
        netns.heal(self.prefix, element)

    def loss(self, link: str, percent: float) -> None:
        netns.set_loss(self.prefix, link, percent)

    def loss_drops(self, link: str, towards: str | None = None) -> int:
        return netns.loss_drops(self.prefix, link, towards)

    def counters(self, element: str) -> dict[str, dict[str, int]]:
        return netns.link_counters(self.prefix, element)

    def xfer(
        self,
        src: str,
        dst: str,
        args: Sequence[str] = (),
        client_args: Sequence[str] = (),
        server_args: Sequence[str] = (),
    ) -> Xfer:
        """Starts a verified transfer src -> dst (`python -m mrc.fabric.xfer`: a server
        in dst's namespace, then a client in src's once the server listens). `args` go
        to both (size, mode, chunk, ...); read the JSON lines of `client.stdout`."""
        run = [sys.executable, "-m", "mrc.fabric.xfer"]
        common = ["--fabric", self.file, *args]
        server = self.popen(
            dst,
            [*run, "server", "--host", dst, *common, *server_args],
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE,  # closed by server_result and kill (ends --linger)
        )
        assert server.stdout is not None
        line = server.stdout.readline()
        if not line:
            server.wait()
            raise RuntimeError(f"xfer server on {dst} exited ({server.returncode}), not listening")
        port = json.loads(line)["port"]
        client = self.popen(
            src,
            [*run, "client", "--host", src, "--peer", dst, "--port", str(port)]
            + [*common, *client_args],
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE,  # closed by Xfer.kill (ends a client run with --linger)
        )
        return Xfer(server, client, port)


@dataclass
class Xfer:
    """A running `mrc.fabric.xfer` pair (see RunningFabric.xfer)."""

    server: subprocess.Popen[str]
    client: subprocess.Popen[str]
    port: int

    def server_result(self) -> dict[str, Any]:
        """The server's closing JSON line (its hash and stats); waits for it to exit."""
        assert self.server.stdout is not None
        line = self.server.stdout.readline()
        self._close_stdin(self.server)
        self.server.wait(timeout=60)
        return json.loads(line) if line else {}

    @staticmethod
    def _close_stdin(p: subprocess.Popen[str]) -> None:
        if p.stdin and not p.stdin.closed:
            p.stdin.close()

    def kill(self) -> None:
        for p in (self.client, self.server):
            self._close_stdin(p)
        for p in (self.client, self.server):
            if p.poll() is None:
                p.kill()
                p.wait()


def unique_prefix(stem: str = "t") -> str:
    """A fresh fabric name, so parallel or leftover test fabrics never collide."""
    return f"{stem}{secrets.token_hex(3)}"


@contextmanager
def fabric_up(path: str | FsPath, prefix: str | None = None) -> Iterator[RunningFabric]:
    """Bring up the fabric file `path` as namespaces "<prefix>-*" and always tear it down,
    also when the body raises. A leftover fabric of the same prefix is removed first."""
    prefix = prefix or unique_prefix()
    netns.down(prefix)
    netns.up(path, prefix)
    try:
        yield RunningFabric(prefix, load_fabric(path), str(path))
    finally:
        netns.down(prefix)


class Faults:
    """Loss on every link of a running fabric, and a thread that fails or heals a random
    link (host cable or leaf-spine) every 0.2-1.0 x `flap_s` seconds, never one whose
    failure would leave a pair of hosts without a path (the transport cannot carry data
    with none, and its timeout then rightly fails the connection). `events` holds
    (time.time(), "fail" or "heal", link). end() heals everything and removes the loss.

        with fabric_up(f) as fab, Faults(fab, loss=2.0, flap_s=0.3, seed=1) as faults:
            ...  # traffic that must survive them
    """

    def __init__(self, fab: RunningFabric, loss: float, flap_s: float, seed: int = 0) -> None:
        self.fab, self.flap_s, self.rnd = fab, flap_s, random.Random(seed)
        self.links = [link.name for link in fab.fabric.links]
        hosts = [h.name for h in fab.fabric.hosts]
        self.pairs = [(a, b) for i, a in enumerate(hosts) for b in hosts[i + 1 :]]
        self.down: set[str] = set()
        self.events: list[tuple[float, str, str]] = []
        self.skipped = 0  # failures not made: they would have cut a pair off
        self.error: BaseException | None = None  # what stopped the thread; end() raises it
        self._stop = threading.Event()
        for link in self.links:
            fab.loss(link, loss)
        self._thread = threading.Thread(target=self._run, name="faults")
        self._thread.start()

    def _cuts_a_pair(self, link: str) -> bool:
        failed = [*self.down, link]
        return any(not table_paths(self.fab.fabric, a, b, failed) for a, b in self.pairs)

    def _run(self) -> None:
        try:
            self._flap()
        except BaseException as e:  # raised by end(), in the caller's thread
            self.error = e

    def _flap(self) -> None:
        while not self._stop.wait(self.rnd.uniform(0.2, 1.0) * self.flap_s):
            if self.down and self.rnd.random() < 0.5:
                link = self.rnd.choice(sorted(self.down))
                self.fab.heal(link)
                self.down.discard(link)
                self.events.append((time.time(), "heal", link))
                continue
            link = self.rnd.choice(self.links)
            if link in self.down:
                continue
            if self._cuts_a_pair(link):
                self.skipped += 1
                continue
            self.fab.fail(link)
            self.down.add(link)
            self.events.append((time.time(), "fail", link))

    @property
    def failures(self) -> int:
        return sum(1 for _, what, _ in self.events if what == "fail")

    def end(self) -> None:
        self._stop.set()
        self._thread.join()
        for link in sorted(self.down):
            self.fab.heal(link)
        self.down.clear()
        for link in self.links:
            self.fab.loss(link, 0)
        if self.error is not None:
            raise RuntimeError(f"the fault thread stopped: {self.error}") from self.error

    def __enter__(self) -> Faults:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()


# SRv6 UDP traffic inside the namespaces ----------------------------------------------------

_RECEIVER = r"""
import json, select, socket, sys, time
addrs, port, expect, timeout = json.loads(sys.argv[1])
socks = []
for a in addrs:
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.bind((a, port))
    s.setsockopt(41, 56, 1)  # IPV6_RECVRTHDR: hand us the routing header
    try:  # bursts of small datagrams overflow the default buffer (~256 of them)
        s.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE (root)
    except OSError:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
    socks.append(s)
print("ready", flush=True)
counts, srh = {}, {}
deadline = time.monotonic() + timeout
def done():
    return all(counts.get(t, 0) >= n for t, n in expect.items())
while not done() and time.monotonic() < deadline:
    r, _, _ = select.select(socks, [], [], max(0.0, deadline - time.monotonic()))
    for s in r:
        data, anc, _f, _src = s.recvmsg(65535, 1024)
        tag = data.decode(errors="replace").split(":")[0]
        counts[tag] = counts.get(tag, 0) + 1
        for level, kind, value in anc:
            if level == 41 and kind == 57:
                srh.setdefault(tag, value.hex())
print(json.dumps({"counts": counts, "srh": srh}), flush=True)
"""

_SENDER = r"""
import json, socket, sys
errors = {}
for src, srh, dst, port, tag, count in json.loads(sys.argv[1]):
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.bind((src, 0))
    if srh:
        s.setsockopt(41, 57, bytes.fromhex(srh))  # IPV6_RTHDR, sticky
    for i in range(count):
        try:
            s.sendto(f"{tag}:{i}".encode(), (dst, port))
        except OSError as e:  # e.g. ENETUNREACH: no route to the first segment
            errors.setdefault(tag, {}).setdefault(e.strerror, 0)
            errors[tag][e.strerror] += 1
    s.close()
print(json.dumps(errors))
"""


@dataclass
class ReceiverResult:
    counts: dict[str, int] = field(default_factory=dict)
    srh: dict[str, list[str]] = field(default_factory=dict)  # tag -> segments seen


class UdpReceiver:
    """A UDP receiver in `host`'s namespace on `addrs`; it stops once it has every
    expected count ({tag: datagrams}) or after `timeout` seconds. Use as a context manager:
    on exit it waits for the receiver and fills `result`."""

    def __init__(
        self,
        fab: RunningFabric,
        host: str,
        addrs: Sequence[str],
        expect: dict[str, int],
        timeout: float = 5.0,
        port: int = UDP_PORT,
    ) -> None:
        self.fab, self.host, self.timeout = fab, host, timeout
        arg = json.dumps([list(addrs), port, expect, timeout])
        self.proc = fab.popen(host, [sys.executable, "-c", _RECEIVER, arg], stdout=subprocess.PIPE)
        self.result = ReceiverResult()
        self._wait_ready()

    def _wait_ready(self) -> None:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.proc.stdout], [], [], deadline - time.monotonic())
            if r:
                line = self.proc.stdout.readline()
                if line.strip() == "ready":
                    return
                if not line:
                    break
        self.proc.kill()
        raise RuntimeError(f"UDP receiver in {self.host} did not start")

    def __enter__(self) -> UdpReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            out, _ = self.proc.communicate(timeout=self.timeout + 10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        if exc[0] is not None:
            return
        lines = out.strip().splitlines()
        data = json.loads(lines[-1]) if lines else {"counts": {}, "srh": {}}
        self.result.counts = data["counts"]

        self.result.srh = {t: parse_srh(bytes.fromhex(h)) for t, h in data["srh"].items()}


def send_on_paths(
    fab: RunningFabric,
    host: str,
    sends: Sequence[tuple[Path, str, int]],
    port: int = UDP_PORT,
) -> dict[str, dict[str, int]]:
    """From `host`'s namespace, send (path, tag, count) datagrams "tag:i", each path on its
    own socket bound to the path's plane address with the path's SRH set sticky.
    Returns the send errors: {tag: {strerror: count}} (empty when every sendto worked)."""
    spec = [
        [p.src_addr, build_srh(p.segments).hex() if p.segments else "", p.dst_addr, port, tag, n]
        for p, tag, n in sends
    ]
    out = fab.run(host, [sys.executable, "-c", _SENDER, json.dumps(spec)]).stdout
    errors: dict[str, dict[str, int]] = json.loads(out.strip().splitlines()[-1])
    return errors


def wait_tcp_listening(fab: RunningFabric, host: str, port: int, timeout: float = 10) -> None:
    """Poll (bounded) until something listens on TCP `port` in `host`'s namespace."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = fab.run(host, ["ss", "-Hltn", f"sport = :{port}"]).stdout
        if out.strip():
            return
        time.sleep(0.02)
    raise TimeoutError(f"nothing listens on TCP port {port} in {host} after {timeout} s")


def namespaces_left(prefix: str) -> list[str]:
    return netns.list_namespaces(prefix)


def root_links() -> set[str]:
    """Interface names in the root namespace (to check nothing leaked there)."""
    out = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True, check=True)
    return {d["ifname"] for d in json.loads(out.stdout)}
