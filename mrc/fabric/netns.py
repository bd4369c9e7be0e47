"""Build a fabric file as real network namespaces (root only).

One namespace per host and per switch, named "<prefix>-<element>"; one veth pair per link
(MTU 9000), interfaces named for the peer element on switches and "nic<plane>" on hosts;
IPv6 addresses with nodad and keep_addr_on_down=1 (so fail/heal keeps them); an End SID
on every switch (a seg6local route, or on a kernel without SRv6 lightweight tunnels an
address on lo, whose packets the kernel's own SRH handling forwards); static routes
(proto 150) so every host plane address and every locator of a plane is reachable inside
the plane; tbf on both ends of every link (tbf shapes egress only). Failed links are set
down at both ends; routes are recomputed so that no node keeps a static route into a dead
end (as a routing protocol would converge to; never a detour: only shortest-path next hops
of the healthy fabric).

Commands go through `ip -batch`, `tc -batch` and `nft -f`, one process per namespace and
tool, run in parallel: bringing up the 4-host 4-plane fabric takes about a second.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path as FsPath
from typing import Any

from mrc.fabric.state import (
    FabricNetError,
    State,
    check_prefix,
    load_state,
    remove_state,
    state_path,
)
from mrc.routing.fabric import Fabric, FabricError, Host, Link, Switch, load_fabric

NETNS_DIR = "/run/netns"
ROUTE_PROTO = "150"  # marks every route mrc-fabric adds, so it can flush exactly those
MTU = 9000
NFT_TABLE = "mrc_loss"
_WORKERS = 8


# Running commands ---------------------------------------------------------------------------


def _run(cmd: Sequence[str], input: str | None = None, check: bool = True) -> str:
    proc = subprocess.run(list(cmd), input=input, capture_output=True, text=True)
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()
        raise FabricNetError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {detail}")
    return proc.stdout


def _parallel(jobs: Iterable[tuple[Sequence[str], str | None]], check: bool = True) -> None:
    """Run (command, stdin) jobs in parallel; raise the first failure after all finished."""
    jobs = list(jobs)
    with ThreadPoolExecutor(max_workers=_WORKERS) as pool:
        futures = [pool.submit(_run, cmd, inp, check) for cmd, inp in jobs]
        errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]  # type: ignore[misc]


def ns_name(prefix: str, element: str) -> str:
    return f"{prefix}-{element}"


def list_namespaces(prefix: str) -> list[str]:
    """Every namespace of fabric `prefix` (also the leftovers of a crashed run)."""
    check_prefix(prefix)
    try:
        names = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(prefix + "-"))


# What to configure ----------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    prefix: str
    nexthops: tuple[tuple[str, str], ...]  # (gateway, interface)

    def command(self) -> str:
        if len(self.nexthops) == 1:
            gw, dev = self.nexthops[0]
            return f"route replace {self.prefix} proto {ROUTE_PROTO} via {gw} dev {dev} onlink"
        hops = " ".join(f"nexthop via {gw} dev {dev} onlink" for gw, dev in self.nexthops)
        return f"route replace {self.prefix} proto {ROUTE_PROTO} {hops}"


def compute_routes(fabric: Fabric, down: frozenset[str]) -> dict[str, list[Route]]:
    """Static routes of every node, given the set of down links.

    Next hops are those on shortest paths of the healthy plane (so never a detour through a
    valley), minus the ones over a down link or towards a node that lost its own route.
    """
    routes: dict[str, list[Route]] = {n: [] for n in fabric.nodes()}
    for plane in range(fabric.planes):
        links = [link for link in fabric.links if link.plane == plane]
        adj: dict[str, list[tuple[str, Link]]] = {}
        for link in links:
            adj.setdefault(link.a, []).append((link.b, link))
            adj.setdefault(link.b, []).append((link.a, link))
        hosts = {h.name for h in fabric.hosts}
        dests: list[tuple[str, str, Link | None]] = []  # (prefix, owner, connected link)
        for h in fabric.hosts:
            hl = fabric.host_link(h.name, plane)
            dests.append((hl.prefix, h.name, hl))
        for s in fabric.switches:
            if s.plane == plane:
                dests.append((s.locator, s.name, None))
        for prefix, owner, connected in dests:
            dist = {owner: 0}
            order = [owner]
            for node in order:  # BFS; hosts do not forward
                if node in hosts and node != owner:
                    continue
                for peer, _link in adj.get(node, []):
                    if peer not in dist:
                        dist[peer] = dist[node] + 1
                        order.append(peer)
            reach = {owner}
            for node in order[1:]:
                hops = []
                for peer, link in adj.get(node, []):
                    if dist.get(peer) == dist[node] - 1 and peer in reach and link.name not in down:
                        if connected is not None and link is connected:
                            hops = []  # the kernel's connected route covers it
                            reach.add(node)
                            break
                        hops.append((link.end(peer)[1], link.end(node)[0]))
                if hops:
                    reach.add(node)
                    routes[node].append(Route(prefix, tuple(sorted(hops, key=lambda x: x[1]))))
    return routes


@functools.cache
def kernel_has_seg6local() -> bool:
    """Whether this kernel has SRv6 lightweight tunnels (CONFIG_IPV6_SEG6_LWTUNNEL: seg6
    and seg6local routes). Some builds lack them ("lwt encapsulation type not
    supported"); probed once, in a scratch namespace."""
    ns = f"mrc-probe-{os.getpid()}"
    _run(["ip", "netns", "del", ns], check=False)  # a killed probe's, under a reused pid
    _run(["ip", "netns", "add", ns])
    try:
        _run(["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        _run(["ip", "-n", ns, "link", "set", "p0", "up"])
        add = ["ip", "-6", "-n", ns, "route", "add", "fd00:ffff::1/128", "encap", "seg6local"]
        proc = subprocess.run([*add, "action", "End", "dev", "p0"], capture_output=True)
        return proc.returncode == 0
    finally:
        _run(["ip", "netns", "del", ns], check=False)


def _end_sid_command(fabric: Fabric, sw: Switch, down: frozenset[str]) -> str | None:
    # Without seg6local the SID is an address on lo and the kernel's own SRH handling
    # (ipv6_srh_rcv, seg6_enabled) does End: the same packets on the wire.
    if not kernel_has_seg6local():
        return f"addr replace {sw.sid}/128 dev lo"
    # seg6local needs a real device (there is no dummy driver here, and "dev lo" does not
    # forward): use the switch's first link that is up.
    for link in fabric.links_of(sw.name):
        if link.name not in down:
            dev = link.end(sw.name)[0]
            return (
                f"route replace {sw.sid}/128 proto {ROUTE_PROTO} encap seg6local action End "
                f"dev {dev}"
            )
    return None


def _node_commands(
    fabric: Fabric,
    node: Host | Switch,
    down: frozenset[str],
    routes: list[Route],
    flush: bool = True,
) -> list[str]:
    """The node's routes. flush=False (a fail or heal) replaces routes in place instead of
    flushing first: a flush left every plane without routes for a moment, so a TCP
    connect over a healthy plane failed with "Network is unreachable" while another
    plane flapped."""
    cmds = [f"route flush proto {ROUTE_PROTO}"] if flush else []
    if isinstance(node, Switch) and (end := _end_sid_command(fabric, node, down)):
        cmds.append(end)
    cmds += [r.command() for r in routes]
    return cmds


def _stale_routes(node: Host | Switch, old: list[Route], new: list[Route], end: bool) -> str:
    """`route del` commands for the prefixes that `new` no longer has."""
    keep = {r.prefix for r in new}
    gone = [r.prefix for r in old if r.prefix not in keep]
    if isinstance(node, Switch) and not end:
        gone.append(f"{node.sid}/128")
    return "".join(f"route del {p} proto {ROUTE_PROTO}\n" for p in gone)


def _sysctls(node: Host | Switch) -> str:
    fwd = "1" if isinstance(node, Switch) else "0"
    values = {
        "accept_dad": "0",
        "dad_transmits": "0",
        "keep_addr_on_down": "1",
        "seg6_enabled": "1",
        "accept_ra": "0",
        "router_solicitations": "0",
        "forwarding": fwd,
    }
    pairs = [
        f"net.ipv6.conf.{scope}.{k}={v}" for scope in ("all", "default") for k, v in values.items()
    ]
    return " ".join(pairs)


def _burst(rate_bps: int) -> int:
    # At least two jumbo frames, and 1 ms at the rate: tbf needs burst >= rate / HZ.
    return max(2 * MTU + 2000, rate_bps // 8 // 1000)


# The operations -------------------------------------------------------------------------------


def up(fabric_file: str | FsPath, prefix: str) -> State:
    """Build `fabric_file` as namespaces "<prefix>-<element>". On any failure everything
    made so far is removed again. Raises FabricError (bad file) or FabricNetError."""
    check_prefix(prefix)
    fabric = load_fabric(fabric_file)
    if os.geteuid() != 0:
        raise FabricNetError("mrc-fabric up needs root (network namespaces)")
    if list_namespaces(prefix) or state_path(prefix).exists():
        raise FabricNetError(
            f"fabric {prefix!r} is already up (or left over); run `mrc-fabric down --name {prefix}`"
        )
    state = State(prefix, str(FsPath(fabric_file).resolve()))
    try:
        _build(fabric, prefix)
        state.save()
    except BaseException:
        down(prefix)
        raise
    return state


def _build(fabric: Fabric, prefix: str) -> None:
    nodes: list[Host | Switch] = [*fabric.hosts, *fabric.switches]
    ns = {n.name: ns_name(prefix, n.name) for n in nodes}
    kernel_has_seg6local()  # probed here, once, not by the threads below
    _run(["ip", "-batch", "-"], "".join(f"netns add {ns[n.name]}\n" for n in nodes))
    # Defaults first, so every interface created afterwards inherits them.
    _parallel(
        (["ip", "netns", "exec", ns[n.name], "sysctl", "-q", "-w", *_sysctls(n).split()], None)
        for n in nodes
    )
    veths = "".join(
        f"link add {link.a_if} netns {ns[link.a]} mtu {MTU} type veth "
        f"peer name {link.b_if} netns {ns[link.b]} mtu {MTU}\n"
        for link in fabric.links
    )
    _run(["ip", "-batch", "-"], veths)
    routes = compute_routes(fabric, frozenset())
    # Every link end's MAC, so each end starts out knowing its neighbour: without it
    # the first packets of a job wait for neighbour discovery, and what does not fit in
    # its queue (unres_qlen) is dropped, which can fail every path of a plane at once.
    macs: dict[tuple[str, str], str] = {}
    for n in nodes:
        for d in json.loads(_run(["ip", "-j", "-n", ns[n.name], "link", "show"])):
            macs[(n.name, d["ifname"])] = d.get("address", "")

    def configure(node: Host | Switch) -> None:
        cmds = ["link set lo up"]
        tc = []
        for link in fabric.links_of(node.name):
            dev, addr, peer = link.end(node.name)
            peer_dev, peer_addr, _ = link.end(peer)
            cmds += [f"addr add {addr}/64 dev {dev} nodad", f"link set {dev} up"]
            if macs.get((peer, peer_dev)):  # stale: used at once, then confirmed as usual
                cmds.append(
                    f"neigh replace {peer_addr} lladdr {macs[(peer, peer_dev)]} dev {dev} nud stale"
                )
            tc.append(
                f"qdisc replace dev {dev} root tbf rate {link.rate_bps}bit "
                f"burst {_burst(link.rate_bps)} latency 20ms"
            )
        cmds += _node_commands(fabric, node, frozenset(), routes[node.name])
        _run(["ip", "-6", "-n", ns[node.name], "-batch", "-"], "\n".join(cmds) + "\n")
        _run(["tc", "-n", ns[node.name], "-batch", "-"], "\n".join(tc) + "\n")

    with ThreadPoolExecutor(max_workers=_WORKERS) as pool:
        for f in [pool.submit(configure, n) for n in nodes]:
            f.result()


def down(prefix: str) -> list[str]:
    """Remove every namespace of fabric `prefix` (killing what runs in them; the veths and
    nft tables go with them) and its state file. Safe to call when nothing is up.
    Returns the namespaces removed."""
    names = list_namespaces(prefix)
    for name in names:
        for pid in _run(["ip", "netns", "pids", name], check=False).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    if names:
        _run(
            ["ip", "-force", "-batch", "-"], "".join(f"netns del {n}\n" for n in names), check=False
        )
    left = list_namespaces(prefix)
    remove_state(prefix)
    if left:
        raise FabricNetError(f"could not remove namespaces: {', '.join(left)}")
    return names


def _load(prefix: str) -> tuple[State, Fabric]:
    state = load_state(prefix)
    return state, load_fabric(state.fabric)


def _check_element(fabric: Fabric, element: str) -> None:
    fabric.check_failed([element])


def _mac(prefix: str, node: str, dev: str) -> str:
    out = _run(["ip", "-j", "-n", ns_name(prefix, node), "link", "show", "dev", dev])
    return str(json.loads(out)[0].get("address", ""))


def _apply_failed(
    fabric: Fabric, prefix: str, before: frozenset[str], after: frozenset[str]
) -> None:
    was, now = fabric.failed_links(before), fabric.failed_links(after)
    batches: dict[str, list[str]] = {}
    for name in sorted(was ^ now):
        link = fabric.link(name)
        verb = "down" if name in now else "up"
        for node in (link.a, link.b):
            batches.setdefault(node, []).append(f"link set {link.end(node)[0]} {verb}")
        if verb == "up":
            # The link's down dropped each end's neighbour entry. Seeded again, as at
            # build: else the first packets ask for it while the other end is still
            # down, and the kernel asks again only a second later (retrans_time):
            # healed paths came back after 1.0 s in 4 of 24 heals, else in 39-125 ms.
            for node in (link.a, link.b):
                dev, _addr, peer = link.end(node)
                peer_dev, peer_addr, _ = link.end(peer)
                mac = _mac(prefix, peer, peer_dev)
                if mac:
                    batches[node].append(
                        f"neigh replace {peer_addr} lladdr {mac} dev {dev} nud stale"
                    )
    old_routes, new_routes = compute_routes(fabric, was), compute_routes(fabric, now)
    stale: dict[str, str] = {}
    for node in fabric.nodes():
        el = fabric.element(node)
        assert isinstance(el, Host | Switch)
        touched = node in batches
        if touched or old_routes[node] != new_routes[node]:
            batches.setdefault(node, []).extend(
                _node_commands(fabric, el, now, new_routes[node], flush=False)
            )
            has_end = isinstance(el, Switch) and _end_sid_command(fabric, el, now) is not None
            stale[node] = _stale_routes(el, old_routes[node], new_routes[node], has_end)
    _parallel(
        (["ip", "-6", "-n", ns_name(prefix, node), "-batch", "-"], "\n".join(cmds) + "\n")
        for node, cmds in batches.items()
    )
    # The kernel may have dropped some with their link already: errors are expected.
    _parallel(
        (
            (["ip", "-6", "-force", "-n", ns_name(prefix, node), "-batch", "-"], dels)
            for node, dels in stale.items()
            if dels
        ),
        check=False,
    )


def fail(prefix: str, element: str) -> State:
    """Fail a link, switch, host or plane (all its links go down at both ends)."""
    state, fabric = _load(prefix)
    _check_element(fabric, element)
    before = frozenset(state.failed)
    state.failed = sorted(before | {element})
    _apply_failed(fabric, prefix, before, frozenset(state.failed))
    state.save()
    return state


def heal(prefix: str, element: str) -> State:
    """Undo `fail` of an element (a link stays down while another failed element covers it)."""
    state, fabric = _load(prefix)
    _check_element(fabric, element)
    if element not in state.failed:
        raise FabricNetError(
            f"{element} is not failed (failed: {', '.join(state.failed) or 'none'})"
        )
    before = frozenset(state.failed)
    state.failed = sorted(before - {element})
    _apply_failed(fabric, prefix, before, frozenset(state.failed))
    state.save()
    return state


def loss_switch(fabric: Fabric, link: Link) -> tuple[str, str]:
    """(switch, interface) where loss on `link` is injected: a switch's forward hook sees
    both directions of the link (a sender's own output hook would return EPERM instead)."""
    for node in (link.a, link.b):
        if isinstance(fabric.element(node), Switch):
            return node, link.end(node)[0]
    raise FabricError(f"link {link.name} has no switch end", fabric.source)


def set_loss(prefix: str, link_name: str, percent: float) -> State:
    """Drop `percent` % of the packets crossing `link_name`, each direction (0 removes it).
    Resolution: 0.01 % (nftables draws a random number modulo 10000)."""
    state, fabric = _load(prefix)
    if not 0 <= percent <= 100:
        raise FabricNetError(f"loss must be 0..100 percent, got {percent}")
    try:
        link = fabric.link(link_name)
    except KeyError as e:
        raise FabricError(str(e).strip("'\""), fabric.source, key="link") from None
    if percent:
        state.loss[link.name] = percent
    else:
        state.loss.pop(link.name, None)
    switch, _dev = loss_switch(fabric, link)
    rules = []
    for name, pct in sorted(state.loss.items()):
        sw, dev = loss_switch(fabric, fabric.link(name))
        if sw == switch:
            # 100 %: every packet (nft's numgen draws 0..9999, so "< 10000" is refused):
            # a black hole with the link up, as a gray failure looks.
            draw = (
                ""
                if round(pct * 100) >= 10000
                else f"numgen random mod 10000 < {round(pct * 100)} "
            )
            rules += [
                f'    iifname "{dev}" {draw}counter drop',
                f'    oifname "{dev}" {draw}counter drop',
            ]
    script = f"table inet {NFT_TABLE}\ndelete table inet {NFT_TABLE}\n"
    if rules:
        script += (
            f"table inet {NFT_TABLE} {{\n  chain forward {{\n"
            "    type filter hook forward priority 0; policy accept;\n"
            + "\n".join(rules)
            + "\n  }\n}\n"
        )
    _run(["ip", "netns", "exec", ns_name(prefix, switch), "nft", "-f", "-"], script)
    state.save()
    return state


def loss_drops(prefix: str, link_name: str, towards: str | None = None) -> int:
    """Packets dropped so far by the loss rules of `link_name`: both directions, or only
    those travelling towards the link's end `towards` (a node name)."""
    _state, fabric = _load(prefix)
    link = fabric.link(link_name)
    switch, dev = loss_switch(fabric, link)
    if towards is not None and towards not in (link.a, link.b):
        raise FabricNetError(f"{towards} is not an end of link {link.name} ({link.a}, {link.b})")
    # At the switch, packets towards the link's other end leave through dev (oifname);
    # packets towards the switch come in through it (iifname).
    meta = None if towards is None else ("iifname" if towards == switch else "oifname")
    cmd = ["ip", "netns", "exec", ns_name(prefix, switch), "nft", "-j", "list", "ruleset"]
    total = 0
    for item in json.loads(_run(cmd))["nftables"]:
        rule = item.get("rule")
        if not rule or rule.get("table") != NFT_TABLE:
            continue
        exprs = rule["expr"]
        matches = [e["match"] for e in exprs if "match" in e]
        if any(
            m.get("right") == dev
            and (meta is None or m.get("left", {}).get("meta", {}).get("key") == meta)
            for m in matches
        ):
            total += sum(e["counter"]["packets"] for e in exprs if "counter" in e)
    return total


def status(prefix: str) -> dict[str, Any]:
    """What is up: the state file plus which namespaces exist and which links are down."""
    state, fabric = _load(prefix)
    present = set(list_namespaces(prefix))
    expected = [ns_name(prefix, n) for n in fabric.nodes()]
    return {
        "prefix": prefix,
        "fabric": fabric.name,
        "file": state.fabric,
        "namespaces": len(expected),
        "missing": sorted(set(expected) - present),
        "failed": state.failed,
        "down_links": sorted(fabric.failed_links(state.failed)),
        "loss": state.loss,
    }


def exec_argv(prefix: str, host: str, cmd: Sequence[str]) -> list[str]:
    """The argv that runs `cmd` in the namespace of `host` (or of any element)."""
    _state, fabric = _load(prefix)
    try:
        fabric.element(host)
    except KeyError:
        raise FabricError(f"unknown element {host!r}", fabric.source) from None
    return ["ip", "netns", "exec", ns_name(prefix, host), *cmd]


def link_counters(prefix: str, element: str) -> dict[str, dict[str, int]]:
    """Per-interface rx/tx packet and byte counters in an element's namespace."""
    out = _run(["ip", "-n", ns_name(prefix, element), "-s", "-j", "link", "show"])
    stats: dict[str, dict[str, int]] = {}
    for dev in json.loads(out):
        s = dev.get("stats64", dev.get("stats", {}))
        stats[dev["ifname"]] = {
            "rx_packets": int(s["rx"]["packets"]),
            "tx_packets": int(s["tx"]["packets"]),
            "rx_bytes": int(s["rx"]["bytes"]),
            "tx_bytes": int(s["tx"]["bytes"]),
        }
    return stats


def tools_path(path: str | None) -> str:
    """PATH with the directory of this Python first (a venv's bin: python, mrc-perf,
    mrc-route), so a command run for the user finds the project's tools and interpreter
    even where sudo reset PATH. Not resolved: a venv's bin/python is a link to the base
    interpreter, and the venv's scripts live next to the link."""
    tools = os.path.dirname(os.path.abspath(sys.executable))
    return os.pathsep.join([tools, path if path is not None else os.defpath])
