"""Fabric files: parse and validate a TOML fabric description into frozen dataclasses.

A fabric is a set of hosts, each with one NIC per plane; every plane is a separate two-tier
Clos: T0 (leaf) switches that hosts attach to, T1 (spine) switches that join the leaves.
The file may describe the regular structure with a [clos] section, list every element
explicitly ([[host]], [[switch]], [[link]]), or both (explicit entries add elements, or
override the rate of a generated link). docs/routing.md has the schema and the addressing
plan. Every problem raises one FabricError naming the file and the key (or the line, for a
TOML syntax error).
"""

from __future__ import annotations

import ipaddress
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path as FsPath
from typing import Any

from mrc.errors import UsageError

DEFAULT_BASE = "fd00::/16"
# Third hextet of an address: what kind of /64 it is (see docs/routing.md, "Addressing").
KIND_HOST_LINK = 0x0
KIND_SWITCH_LINK = 0x1
KIND_LOCATOR = 0xFF

_NODE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,14}$")  # also an interface name: <= 15
_LINK_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}$")
_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(bit|bps)?\s*$", re.IGNORECASE)
_RATE_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_TOML_LINE = re.compile(r"\(at line (\d+), column (\d+)\)")


class FabricError(UsageError):
    """A fabric file (or a failed-element name) is invalid.

    file: the fabric file; key: the offending key (e.g. "link[3].b"), or None;
    line: the line of a TOML syntax error, or None.
    """

    def __init__(
        self, message: str, file: str, key: str | None = None, line: int | None = None
    ) -> None:
        self.message = message
        self.file = file
        self.key = key
        self.line = line
        super().__init__(str(self))

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
        if self.key is not None:
            where += f": {self.key}"
        return f"{where}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return {"error": self.message, "file": self.file, "key": self.key, "line": self.line}


@dataclass(frozen=True)
class Host:
    name: str
    index: int
    addrs: tuple[str, ...]  # the NIC address on each plane; index = plane


@dataclass(frozen=True)
class Switch:
    name: str
    plane: int
    tier: int  # 0: T0 (leaf), 1: T1 (spine)
    index: int  # order among the switches of its plane and tier
    locator: str  # SRv6 locator, a /64
    sid: str  # the End SID, inside the locator


@dataclass(frozen=True)
class Link:
    name: str
    a: str
    b: str
    plane: int
    rate_bps: int
    prefix: str  # the link's /64
    a_addr: str
    b_addr: str
    a_if: str  # interface name in a's namespace
    b_if: str

    def end(self, node: str) -> tuple[str, str, str]:
        """(interface, address, peer) of this link's end at `node`."""
        if node == self.a:
            return self.a_if, self.a_addr, self.b
        if node == self.b:
            return self.b_if, self.b_addr, self.a
        raise KeyError(f"{node} is not an end of link {self.name}")


@dataclass(frozen=True)
class Fabric:
    name: str
    source: str
    planes: int
    hosts: tuple[Host, ...]
    switches: tuple[Switch, ...]
    links: tuple[Link, ...]
    _by_name: dict[str, Host | Switch | Link] = field(
        init=False, repr=False, compare=False, hash=False
    )
    _node_links: dict[str, tuple[Link, ...]] = field(
        init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        by_name: dict[str, Host | Switch | Link] = {}
        for el in (*self.hosts, *self.switches, *self.links):
            by_name[el.name] = el
        node_links: dict[str, list[Link]] = {n.name: [] for n in (*self.hosts, *self.switches)}
        for link in self.links:
            node_links[link.a].append(link)
            node_links[link.b].append(link)
        object.__setattr__(self, "_by_name", by_name)
        object.__setattr__(self, "_node_links", {k: tuple(v) for k, v in node_links.items()})

    # Lookups -------------------------------------------------------------------------------
    def plane_name(self, plane: int) -> str:
        return f"plane{plane}"

    def element(self, name: str) -> Host | Switch | Link | int:
        """The element called `name`; a plane is returned as its index."""
        if name in self._by_name:
            return self._by_name[name]
        m = re.fullmatch(r"plane(\d+)", name)
        if m and int(m.group(1)) < self.planes:
            return int(m.group(1))
        raise KeyError(name)

    def host(self, name: str) -> Host:
        el = self._by_name.get(name)
        if not isinstance(el, Host):
            raise KeyError(f"no host {name!r} in fabric {self.name}")
        return el

    def switch(self, name: str) -> Switch:
        el = self._by_name.get(name)
        if not isinstance(el, Switch):
            raise KeyError(f"no switch {name!r} in fabric {self.name}")
        return el

    def link(self, name: str) -> Link:
        el = self._by_name.get(name)
        if not isinstance(el, Link):
            raise KeyError(f"no link {name!r} in fabric {self.name}")
        return el

    def links_of(self, node: str) -> tuple[Link, ...]:
        return self._node_links[node]

    def link_between(self, a: str, b: str) -> Link | None:
        for link in self._node_links.get(a, ()):
            if b in (link.a, link.b):
                return link
        return None

    def host_link(self, host: str, plane: int) -> Link:
        for link in self._node_links[host]:
            if link.plane == plane:
                return link
        raise KeyError(f"host {host} has no link in plane {plane}")

    def leaf_of(self, host: str, plane: int) -> Switch:
        return self.switch(self.host_link(host, plane).end(host)[2])

    def spines(self, plane: int) -> list[Switch]:
        return [s for s in self.switches if s.plane == plane and s.tier == 1]

    def nodes(self) -> list[str]:
        return [n.name for n in (*self.hosts, *self.switches)]

    def failed_links(self, failed: Iterable[str]) -> frozenset[str]:
        """The links a set of failed elements takes down (a node or plane: all its links)."""
        down: set[str] = set()
        for name in failed:
            el = self.element(name)
            if isinstance(el, Link):
                down.add(el.name)
            elif isinstance(el, int):
                down.update(link.name for link in self.links if link.plane == el)
            else:
                down.update(link.name for link in self._node_links[el.name])
        return frozenset(down)

    def check_failed(self, failed: Iterable[str], file: str | None = None) -> frozenset[str]:
        """Validate failed-element names; raises FabricError naming an unknown one."""
        out = frozenset(failed)
        for name in sorted(out):
            try:
                self.element(name)
            except KeyError:
                why = "not a host, switch, link or planeN"
                if re.fullmatch(r"plane\d+", name):
                    why = f"this fabric's planes are plane0..plane{self.planes - 1}"
                raise FabricError(
                    f"unknown element {name!r} ({why})", file or self.source, key="failed"
                ) from None
        return out


# Parsing ------------------------------------------------------------------------------------


def parse_rate(value: object) -> int:
    """'200mbit', '10gbit', '1.5g', 400000000 -> bits per second."""
    if isinstance(value, bool):
        raise ValueError(f"bad rate {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"rate must be positive, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f'bad rate {value!r} (want e.g. "200mbit" or bits per second)')
    m = _RATE.match(value)
    if not m:
        raise ValueError(f'bad rate {value!r} (want e.g. "200mbit", "10gbit")')
    bps = int(float(m.group(1)) * _RATE_SCALE[m.group(2).lower()])
    if bps <= 0:
        raise ValueError(f"rate must be positive, got {value!r}")
    return bps


def format_rate(bps: int) -> str:
    for suffix, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps % scale == 0:
            return f"{bps // scale}{suffix}"
    return f"{bps}bit"


def _addr(base: ipaddress.IPv6Network, plane: int, kind: int, index: int, host: int) -> str:
    value = int(base.network_address) | (plane << 96) | (kind << 80) | (index << 64) | host
    return str(ipaddress.IPv6Address(value))


class _Parser:
    """Turns the TOML document into a Fabric, keeping the key of every element for errors."""

    def __init__(self, doc: Mapping[str, Any], file: str, name: str) -> None:
        self.doc = doc
        self.file = file
        self.name = name
        # (name, key, addrs or None)
        self.hosts: list[tuple[str, str, list[str] | None]] = []
        # name -> (plane, tier, key, locator, sid)
        self.switches: dict[str, tuple[int, int, str, str | None, str | None]] = {}
        # frozenset(a, b) -> (name, a, b, rate, key)
        self.links: dict[frozenset[str], tuple[str, str, str, int, str]] = {}

    def err(self, message: str, key: str) -> FabricError:
        return FabricError(message, self.file, key=key)

    def table(self, key: str, allowed: set[str]) -> dict[str, Any]:
        value = self.doc.get(key, {})
        if not isinstance(value, dict):
            raise self.err("must be a table", key)
        for k in value:
            if k not in allowed:
                raise self.err(f"unknown key (allowed: {', '.join(sorted(allowed))})", f"{key}.{k}")
        return value

    def get_int(self, tbl: Mapping[str, Any], key: str, full: str, minimum: int) -> int:
        value = tbl.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self.err(f"must be an integer >= {minimum}, got {value!r}", full)
        return value

    def get_rate(self, tbl: Mapping[str, Any], key: str, full: str) -> int:
        if key not in tbl:
            raise self.err('missing (a link rate, e.g. "200mbit")', full)
        try:
            return parse_rate(tbl[key])
        except ValueError as e:
            raise self.err(str(e), full) from None

    def node_name(self, value: object, key: str) -> str:
        if not isinstance(value, str) or not _NODE_NAME.match(value):
            raise self.err(
                f"bad name {value!r} (a letter, then letters, digits or _; 15 at most)", key
            )
        if value in self.switches or any(h[0] == value for h in self.hosts):
            raise self.err(f"duplicate name {value!r}", key)
        if re.fullmatch(r"plane\d+", value):
            raise self.err(f"name {value!r} is reserved for planes", key)
        return value

    def add_link(self, a: str, b: str, rate: int, key: str, name: str | None = None) -> None:
        if a == b:
            raise self.err(f"link joins {a!r} to itself", key)
        pair = frozenset((a, b))
        old = self.links.get(pair)
        if old is not None:
            # An explicit [[link]] may override a generated one (its rate, its name).
            if not old[4].startswith("clos") or key.startswith("clos"):
                raise self.err(f"duplicate link between {a!r} and {b!r} (also {old[4]})", key)
            self.links[pair] = (name or old[0], old[1], old[2], rate, key)
            return
        self.links[pair] = (name or f"{a}-{b}", a, b, rate, key)

    def parse(self) -> Fabric:
        for k in self.doc:
            if k not in ("fabric", "clos", "addressing", "host", "switch", "link"):
                raise self.err(
                    "unknown section (allowed: fabric, clos, addressing, host, switch, link)", k
                )
        fab = self.table("fabric", {"name", "planes", "description"})
        name = fab.get("name", self.name)
        if not isinstance(name, str) or not name:
            raise self.err("must be a non-empty string", "fabric.name")
        addressing = self.table("addressing", {"base"})
        try:
            base = ipaddress.IPv6Network(addressing.get("base", DEFAULT_BASE))
        except (ValueError, TypeError) as e:
            raise self.err(f"bad IPv6 prefix: {e}", "addressing.base") from None
        if base.prefixlen > 16:
            raise self.err(
                "must be a /16 or shorter (planes use the 2nd hextet)", "addressing.base"
            )

        planes: int | None = None
        if "planes" in fab:
            planes = self.get_int(fab, "planes", "fabric.planes", 1)
        if "clos" in self.doc:
            clos_planes = self.parse_clos()
            if planes is not None and planes != clos_planes:
                raise self.err(
                    f"plane count mismatch: fabric.planes = {planes} but clos.planes = "
                    f"{clos_planes}",
                    "clos.planes",
                )
            planes = clos_planes
        if planes is None:
            raise self.err("missing: the number of planes (or a [clos] section)", "fabric.planes")
        self.parse_explicit(planes)
        return self.build(name, planes, base)

    def parse_clos(self) -> int:
        clos = self.table(
            "clos",
            {"hosts", "planes", "leaves", "spines", "hosts_per_leaf", "host_rate", "uplink_rate"},
        )
        for key in ("hosts", "planes", "leaves", "spines", "host_rate"):
            if key not in clos:
                raise self.err("missing", f"clos.{key}")
        hosts = self.get_int(clos, "hosts", "clos.hosts", 1)
        planes = self.get_int(clos, "planes", "clos.planes", 1)
        leaves = self.get_int(clos, "leaves", "clos.leaves", 1)
        spines = self.get_int(clos, "spines", "clos.spines", 0)
        per_leaf = -(-hosts // leaves)
        if "hosts_per_leaf" in clos:
            per_leaf = self.get_int(clos, "hosts_per_leaf", "clos.hosts_per_leaf", 1)
            if per_leaf * leaves < hosts:
                raise self.err(
                    f"{leaves} leaves x {per_leaf} hosts per leaf < {hosts} hosts",
                    "clos.hosts_per_leaf",
                )
        host_rate = self.get_rate(clos, "host_rate", "clos.host_rate")
        uplink_rate = self.get_rate(clos, "uplink_rate", "clos.uplink_rate") if spines else 0
        for h in range(hosts):
            self.hosts.append((f"h{h}", "clos.hosts", None))
        for p in range(planes):
            for i in range(leaves):
                self.switches[f"p{p}l{i}"] = (p, 0, "clos.leaves", None, None)
            for j in range(spines):
                self.switches[f"p{p}s{j}"] = (p, 1, "clos.spines", None, None)
            for h in range(hosts):
                self.add_link(f"h{h}", f"p{p}l{h // per_leaf}", host_rate, "clos.host_rate")
            for i in range(leaves):
                for j in range(spines):
                    self.add_link(f"p{p}l{i}", f"p{p}s{j}", uplink_rate, "clos.uplink_rate")
        return planes

    def entries(self, section: str) -> list[tuple[str, dict[str, Any]]]:
        value = self.doc.get(section, [])
        if not isinstance(value, list):
            raise self.err(f"must be an array of tables ([[{section}]])", section)
        out = []
        for i, entry in enumerate(value):
            if not isinstance(entry, dict):
                raise self.err("must be a table", f"{section}[{i}]")
            out.append((f"{section}[{i}]", entry))
        return out

    def parse_explicit(self, planes: int) -> None:
        for key, entry in self.entries("host"):
            self.check_keys(entry, key, {"name", "addrs"})
            name = self.node_name(entry.get("name"), f"{key}.name")
            addrs = entry.get("addrs")
            if addrs is not None:
                if not isinstance(addrs, list) or not all(isinstance(a, str) for a in addrs):
                    raise self.err("must be a list of IPv6 addresses", f"{key}.addrs")
                if len(addrs) != planes:
                    raise self.err(
                        f"plane count mismatch: {len(addrs)} addresses but the fabric has "
                        f"{planes} planes",
                        f"{key}.addrs",
                    )
            self.hosts.append((name, key, addrs))
        for key, entry in self.entries("switch"):
            self.check_keys(entry, key, {"name", "plane", "tier", "locator", "sid"})
            name = self.node_name(entry.get("name"), f"{key}.name")
            plane = self.get_int(entry, "plane", f"{key}.plane", 0)
            if plane >= planes:
                raise self.err(
                    f"plane count mismatch: plane {plane} but the fabric has {planes} planes "
                    f"(0..{planes - 1})",
                    f"{key}.plane",
                )
            tier = entry.get("tier")
            tier = {"leaf": 0, "t0": 0, "spine": 1, "t1": 1}.get(str(tier).lower(), tier)
            if tier not in (0, 1):
                raise self.err(f"must be 0 (leaf) or 1 (spine), got {tier!r}", f"{key}.tier")
            loc, sid = entry.get("locator"), entry.get("sid")
            for k, v in (("locator", loc), ("sid", sid)):
                if v is not None and not isinstance(v, str):
                    raise self.err("must be a string", f"{key}.{k}")
            self.switches[name] = (plane, int(tier), key, loc, sid)
        for key, entry in self.entries("link"):
            self.check_keys(entry, key, {"name", "a", "b", "rate"})
            ends = []
            for end in ("a", "b"):
                node = entry.get(end)
                if not isinstance(node, str):
                    raise self.err("missing (a host or switch name)", f"{key}.{end}")
                if node not in self.switches and not any(h[0] == node for h in self.hosts):
                    raise self.err(
                        f"unknown element {node!r} (not a host or switch)", f"{key}.{end}"
                    )
                ends.append(node)
            lname = entry.get("name")
            if lname is not None and (not isinstance(lname, str) or not _LINK_NAME.match(lname)):
                raise self.err(f"bad link name {lname!r}", f"{key}.name")
            self.add_link(ends[0], ends[1], self.get_rate(entry, "rate", f"{key}.rate"), key, lname)

    def check_keys(self, entry: Mapping[str, Any], key: str, allowed: set[str]) -> None:
        for k in entry:
            if k not in allowed:
                raise self.err(f"unknown key (allowed: {', '.join(sorted(allowed))})", f"{key}.{k}")

    def build(self, name: str, planes: int, base: ipaddress.IPv6Network) -> Fabric:
        host_index = {h[0]: i for i, h in enumerate(self.hosts)}
        host_key = {h[0]: h[1] for h in self.hosts}
        # Topology rules: host - T0, T0 - T1, within one plane; one host link per plane.
        host_links: dict[tuple[str, int], list[str]] = {}
        plane_of: dict[frozenset[str], int] = {}
        for pair, (lname, a, b, _rate, key) in self.links.items():
            sa, sb = self.switches.get(a), self.switches.get(b)
            if sa is None and sb is None:
                raise self.err(f"link joins two hosts ({a}, {b}); hosts attach to T0 switches", key)
            if sa is None or sb is None:
                host, sw = (a, sb) if sa is None else (b, sa)
                assert sw is not None
                if sw[1] != 0:
                    raise self.err(f"host {host} attaches to a T1 switch; use a T0 (leaf)", key)
                host_links.setdefault((host, sw[0]), []).append(lname)
                plane_of[pair] = sw[0]
            else:
                if sa[0] != sb[0]:
                    raise self.err(f"link joins plane {sa[0]} ({a}) and plane {sb[0]} ({b})", key)
                if sa[1] == sb[1]:
                    raise self.err(
                        f"link joins two T{sa[1]} switches ({a}, {b}); links are T0 - T1", key
                    )
                plane_of[pair] = sa[0]
        for host, _key, _addrs in self.hosts:
            for p in range(planes):
                got = host_links.get((host, p), [])
                if len(got) != 1:
                    what = "no link" if not got else f"{len(got)} links ({', '.join(got)})"
                    raise self.err(
                        f"plane count mismatch: host {host} has {what} into plane {p}; "
                        f"every host needs exactly one NIC link per plane",
                        host_key[host],
                    )
        # Addresses.
        seen: dict[str, str] = {}  # address or /64 -> key that owns it

        def claim(value: str, key: str, what: str) -> None:
            if value in seen:
                raise self.err(f"duplicate {what} {value} (also used by {seen[value]})", key)
            seen[value] = key

        def parse_addr(value: str, key: str) -> ipaddress.IPv6Address:
            try:
                return ipaddress.IPv6Address(value)
            except ValueError:
                raise self.err(f"bad IPv6 address {value!r}", key) from None

        hosts: list[Host] = []
        for name_, key, addrs in self.hosts:
            i = host_index[name_]
            if addrs is None:
                addrs = [_addr(base, p, KIND_HOST_LINK, i, 1) for p in range(planes)]
            norm = []
            for p, a in enumerate(addrs):
                k = f"{key}.addrs[{p}]" if key.startswith("host") else key
                ad = parse_addr(a, k)
                claim(str(ad), k, "address")
                claim(str(ipaddress.IPv6Network((int(ad) >> 64 << 64, 64))), k, "/64 of address")
                norm.append(str(ad))
            hosts.append(Host(name_, i, tuple(norm)))
        switches: list[Switch] = []
        counters: dict[tuple[int, int], int] = {}  # (plane, tier) -> switches so far
        in_plane: dict[int, int] = {}  # plane -> switches so far (the locator index)
        for sname, (plane, tier, key, loc, sid) in self.switches.items():
            idx = counters.get((plane, tier), 0)
            counters[(plane, tier)] = idx + 1
            pidx = in_plane.get(plane, 0)
            in_plane[plane] = pidx + 1
            if loc is None:
                loc = _addr(base, plane, KIND_LOCATOR, pidx, 0) + "/64"
            try:
                locator = ipaddress.IPv6Network(loc)
            except ValueError as e:
                raise self.err(f"bad locator: {e}", f"{key}.locator") from None
            sid_addr = (
                parse_addr(sid, f"{key}.sid") if sid is not None else locator.network_address + 1
            )
            if sid_addr not in locator:
                raise self.err(f"SID {sid_addr} is outside the locator {locator}", f"{key}.sid")
            lkey = f"{key}.locator" if key.startswith("switch") else f"{key} ({sname})"
            claim(str(locator), lkey, "locator")
            claim(str(sid_addr), f"{key}.sid" if key.startswith("switch") else lkey, "SID")
            switches.append(Switch(sname, plane, tier, idx, str(locator), str(sid_addr)))
        links: list[Link] = []
        names: set[str] = set(host_index) | set(self.switches)
        sw_link_index: dict[int, int] = {}
        host_addr = {h.name: h.addrs for h in hosts}
        for pair, (lname, a, b, rate, key) in self.links.items():
            if lname in names:
                raise self.err(f"duplicate name {lname!r}", f"{key}.name" if "[" in key else key)
            names.add(lname)
            plane = plane_of[pair]
            if a in host_addr or b in host_addr:
                if b in host_addr:  # the host is always end a
                    a, b = b, a
                ha = ipaddress.IPv6Address(host_addr[a][plane])
                net = ipaddress.IPv6Network((int(ha) >> 64 << 64, 64))
                leaf_addr = next(
                    str(net.network_address + n) for n in (2, 1, 3) if net.network_address + n != ha
                )
                links.append(
                    Link(lname, a, b, plane, rate, str(net), str(ha), leaf_addr, f"nic{plane}", a)
                )
            else:
                k = sw_link_index.get(plane, 0)
                sw_link_index[plane] = k + 1
                net_s = _addr(base, plane, KIND_SWITCH_LINK, k, 0) + "/64"
                claim(net_s, key, "link /64")
                links.append(
                    Link(
                        lname, a, b, plane, rate, net_s,
                        _addr(base, plane, KIND_SWITCH_LINK, k, 1),
                        _addr(base, plane, KIND_SWITCH_LINK, k, 2),
                        b, a,
                    )
                )  # fmt: skip
        return Fabric(name, self.file, planes, tuple(hosts), tuple(switches), tuple(links))


def parse_fabric(text: str, file: str = "<string>") -> Fabric:
    """Parse fabric TOML text; `file` names it in errors."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = _TOML_LINE.search(str(e))
        line = int(m.group(1)) if m else None
        msg = _TOML_LINE.sub("", str(e)).strip()
        raise FabricError(f"TOML syntax error: {msg}", file, line=line) from None
    stem = FsPath(file).stem if file != "<string>" else "fabric"
    return _Parser(doc, file, stem).parse()


def load_fabric(path: str | FsPath) -> Fabric:
    """Read and validate a fabric file. Raises FabricError."""
    file = str(path)
    try:
        text = FsPath(path).read_text()
    except OSError as e:
        raise FabricError(f"cannot read: {e.strerror}", file) from None
    except UnicodeDecodeError as e:
        raise FabricError(
            f"not a text (UTF-8) file: byte {e.start} is 0x{e.object[e.start]:02x}", file
        ) from None
    return parse_fabric(text, file)
