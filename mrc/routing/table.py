"""Compile a fabric into the static source-route table.

For each ordered pair of hosts (A, B) the candidate paths are every (plane, T1 spine) that
joins A's leaf and B's leaf in that plane; the segment list is [spine SID, B's plane
address]. Paths are numbered 0..n-1 in (plane, spine index) order over the FULL healthy
fabric, so:
  - ids are mirrored: path k from A to B and path k from B to A use the same plane and
    spine (the candidate set is symmetric and sorted the same way);
  - ids are stable: a failed element removes the paths that cross it, the others keep
    their ids.
A plane without T1 switches gives one path per plane through the shared leaf (if A and B
share one): segments [leaf SID, B's address].
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from mrc.routing.fabric import Fabric, FabricError, Link

TABLE_FORMAT = "mrc-route-table/1"
UP = "up"
FAILED = "failed"


@dataclass(frozen=True)
class Path:
    """One source route from `src` to `dst`.

    segments: the SRv6 segment list in travel order ([spine SID, dst_addr]); set it as a
    sticky IPV6_RTHDR (mrc.routing.srh.build_srh) on a UDP socket bound to src_addr and
    sendto() dst_addr. crosses: every element (hosts, plane, links, switches) the path uses.
    """

    id: int
    plane: int
    spine: str
    src_addr: str
    segments: list[str]
    dst_addr: str
    state: str = UP
    src: str = ""
    dst: str = ""
    crosses: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["crosses"] = list(self.crosses)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Path:
        return cls(
            id=int(d["id"]),
            plane=int(d["plane"]),
            spine=str(d["spine"]),
            src_addr=str(d["src_addr"]),
            segments=[str(s) for s in d["segments"]],
            dst_addr=str(d["dst_addr"]),
            state=str(d.get("state", UP)),
            src=str(d.get("src", "")),
            dst=str(d.get("dst", "")),
            crosses=tuple(str(x) for x in d.get("crosses", ())),
        )


def text_row(p: Path) -> str:
    """One path in the stable text form: src dst id plane spine src_addr segs dst_addr state."""
    segs = ",".join(p.segments)
    return f"{p.src} {p.dst} {p.id} {p.plane} {p.spine} {p.src_addr} {segs} {p.dst_addr} {p.state}"


def host_planes(fabric: Fabric, host: str) -> list[str]:
    """The host's plane addresses; index = plane."""
    return list(fabric.host(host).addrs)


def candidate_paths(fabric: Fabric, src: str, dst: str) -> list[Path]:
    """Every path from src to dst over the healthy fabric, numbered, all "up"."""
    a, b = fabric.host(src), fabric.host(dst)
    if a.name == b.name:
        return []
    out: list[Path] = []
    for plane in range(fabric.planes):
        la, lb = fabric.leaf_of(src, plane), fabric.leaf_of(dst, plane)
        ha, hb = fabric.host_link(src, plane), fabric.host_link(dst, plane)
        pivots = fabric.spines(plane)
        for spine in pivots:
            up, down = (
                fabric.link_between(la.name, spine.name),
                fabric.link_between(spine.name, lb.name),
            )
            if up is None or down is None:
                continue
            out.append(
                _path(
                    fabric,
                    len(out),
                    plane,
                    spine.name,
                    spine.sid,
                    (ha, la.name, up),
                    (down, lb.name, hb),
                    src,
                    dst,
                )
            )
        if not pivots and la.name == lb.name:
            out.append(_path(fabric, len(out), plane, la.name, la.sid, (ha,), (hb,), src, dst))
    return out


def _path(
    fabric: Fabric,
    pid: int,
    plane: int,
    pivot: str,
    sid: str,
    up: tuple[Link | str, ...],
    down: tuple[Link | str, ...],
    src: str,
    dst: str,
) -> Path:
    names = [x.name if isinstance(x, Link) else x for x in (*up, *down)]
    crosses = (src, fabric.plane_name(plane), *names[: len(up)], pivot, *names[len(up) :], dst)
    a_addr, b_addr = fabric.host(src).addrs[plane], fabric.host(dst).addrs[plane]
    return Path(pid, plane, pivot, a_addr, [sid, b_addr], b_addr, UP, src, dst, crosses)


@dataclass
class Table:
    """The compiled route table: every candidate path of every host pair, with its state."""

    fabric_name: str
    source: str
    planes: int
    hosts: dict[str, list[str]]  # host -> plane addresses
    sids: dict[str, str]  # switch -> End SID
    failed: frozenset[str] = frozenset()
    all_paths: dict[tuple[str, str], list[Path]] = field(default_factory=dict)

    def pairs(self) -> Iterator[tuple[str, str]]:
        yield from self.all_paths

    def paths(self, src: str, dst: str, include_failed: bool = False) -> list[Path]:
        if src not in self.hosts or dst not in self.hosts:
            unknown = src if src not in self.hosts else dst
            raise KeyError(f"no host {unknown!r} in fabric {self.fabric_name}")
        got = self.all_paths.get((src, dst), [])
        return [p for p in got if include_failed or p.state == UP]

    def rows(self, include_failed: bool = False) -> list[Path]:
        return [p for ps in self.all_paths.values() for p in ps if include_failed or p.state == UP]

    # Stable forms -----------------------------------------------------------------------
    def to_dict(self, include_failed: bool = False) -> dict[str, Any]:
        return {
            "format": TABLE_FORMAT,
            "fabric": self.fabric_name,
            "source": self.source,
            "planes": self.planes,
            "failed": sorted(self.failed),
            "hosts": self.hosts,
            "sids": self.sids,
            "paths": [p.to_dict() for p in self.rows(include_failed)],
        }

    def to_json(self, include_failed: bool = False) -> str:
        return json.dumps(self.to_dict(include_failed), indent=1) + "\n"

    def to_text(self, include_failed: bool = False) -> str:
        failed = ",".join(sorted(self.failed)) or "-"
        lines = [
            f"# {TABLE_FORMAT} fabric={self.fabric_name} failed={failed}",
            "# src dst id plane spine src_addr segments dst_addr state",
        ]
        lines += [text_row(p) for p in self.rows(include_failed)]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any], file: str = "<json>") -> Table:
        """A table written by to_dict(). Raises FabricError naming the file and the field."""
        if not isinstance(d, dict) or d.get("format") != TABLE_FORMAT:
            raise FabricError(f"not a route table (format is not {TABLE_FORMAT})", file, "format")
        with _field(file, None):
            t = cls(
                fabric_name=str(d["fabric"]),
                source=str(d.get("source", file)),
                planes=int(d["planes"]),
                hosts={str(k): [str(a) for a in v] for k, v in d["hosts"].items()},
                sids={str(k): str(v) for k, v in d.get("sids", {}).items()},
                failed=frozenset(str(x) for x in d.get("failed", ())),
            )
            rows = list(d["paths"])
        for i, row in enumerate(rows):
            with _field(file, f"paths[{i}]"):
                p = Path.from_dict(row)
            t.all_paths.setdefault((p.src, p.dst), []).append(p)
        return t


@contextlib.contextmanager
def _field(file: str, where: str | None) -> Iterator[None]:
    """A missing key or a value of the wrong type in a JSON table, as a FabricError."""
    try:
        yield
    except KeyError as e:
        key = str(e.args[0])
        raise FabricError(
            f"missing key {key!r}", file, f"{where}.{key}" if where else key
        ) from None
    except (TypeError, ValueError, AttributeError) as e:
        raise FabricError(f"bad value ({e})", file, where) from None


def compile_table(fabric: Fabric, failed: Iterable[str] = ()) -> Table:
    """The route table of `fabric` with the paths crossing any `failed` element marked failed.

    `failed` holds element names: links, switches, hosts, or planes ("plane2").
    Raises FabricError for an unknown name.
    """
    bad = fabric.check_failed(failed)
    down = bad | fabric.failed_links(bad)
    table = Table(
        fabric_name=fabric.name,
        source=fabric.source,
        planes=fabric.planes,
        hosts={h.name: list(h.addrs) for h in fabric.hosts},
        sids={s.name: s.sid for s in fabric.switches},
        failed=bad,
    )
    for a in fabric.hosts:
        for b in fabric.hosts:
            if a.name == b.name:
                continue
            got = []
            for p in candidate_paths(fabric, a.name, b.name):
                if down.intersection(p.crosses):
                    p = replace(p, state=FAILED)
                got.append(p)
            table.all_paths[(a.name, b.name)] = got
    return table


def paths(
    table_or_fabric: Table | Fabric,
    src_host: str,
    dst_host: str,
    failed: Iterable[str] = (),
    include_failed: bool = False,
) -> list[Path]:
    """The usable paths from src_host to dst_host, in id order.

    With a Fabric, `failed` names the failed elements; with a Table, its own failed set
    applies (plus `failed`, if given). include_failed=True also returns the failed paths
    (state "failed"), ids unchanged.
    """
    failed = frozenset(failed)
    if isinstance(table_or_fabric, Table) and not failed:
        return table_or_fabric.paths(src_host, dst_host, include_failed)
    if isinstance(table_or_fabric, Table):
        raise TypeError("pass a Fabric to apply another failed set")
    fabric = table_or_fabric
    bad = fabric.check_failed(failed)
    down = bad | fabric.failed_links(bad)
    out = []
    for p in candidate_paths(fabric, src_host, dst_host):
        if down.intersection(p.crosses):
            if not include_failed:
                continue
            p = replace(p, state=FAILED)
        out.append(p)
    return out


# Checks -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    kind: str  # "no-path", "unbalanced", "duplicate", "failed-path"
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "message": self.message}


def check_table(table: Table) -> list[Problem]:
    """What is wrong with a table: a host pair with no usable path, planes with unequal
    numbers of candidate paths, duplicate addresses or SIDs, a usable path through a
    failed element. An empty list means clean."""
    problems: list[Problem] = []
    owner: dict[str, str] = {}
    for host, addrs in sorted(table.hosts.items()):
        if len(addrs) != table.planes:
            problems.append(
                Problem("unbalanced", f"host {host} has {len(addrs)} of {table.planes} planes")
            )
        for plane, addr in enumerate(addrs):
            _claim(problems, owner, addr, f"{host} plane {plane}")
    for sw, sid in sorted(table.sids.items()):
        _claim(problems, owner, sid, f"SID of {sw}")
    hosts = sorted(table.hosts)
    for a in hosts:
        for b in hosts:
            if a == b:
                continue
            every = table.all_paths.get((a, b), [])
            if not any(p.state == UP for p in every):
                why = " (every path crosses a failed element)" if every else ""
                problems.append(Problem("no-path", f"no path from {a} to {b}{why}"))
            per_plane = Counter(p.plane for p in every)
            counts = [per_plane.get(plane, 0) for plane in range(table.planes)]
            if len(set(counts)) > 1:
                problems.append(
                    Problem(
                        "unbalanced",
                        f"{a} -> {b}: paths per plane differ: "
                        + ", ".join(f"plane{i}={n}" for i, n in enumerate(counts)),
                    )
                )
            ids = [p.id for p in every]
            if ids != list(range(len(ids))):
                problems.append(Problem("duplicate", f"{a} -> {b}: path ids are not 0..n-1"))
            for p in every:
                hit = sorted(table.failed.intersection(p.crosses))
                if p.state == UP and hit:
                    problems.append(
                        Problem(
                            "failed-path",
                            f"{a} -> {b} path {p.id} is up but crosses failed {', '.join(hit)}",
                        )
                    )
                if (mirror := _mirror(table, p)) is not None:
                    problems.append(Problem("unbalanced", mirror))
    return problems


def _claim(problems: list[Problem], owner: dict[str, str], addr: str, who: str) -> None:
    if addr in owner:
        problems.append(Problem("duplicate", f"address {addr} used by {owner[addr]} and {who}"))
    else:
        owner[addr] = who


def _mirror(table: Table, p: Path) -> str | None:
    back = table.all_paths.get((p.dst, p.src), [])
    twin = next((q for q in back if q.id == p.id), None)
    if twin is None or (twin.plane, twin.spine) != (p.plane, p.spine):
        return f"{p.src} -> {p.dst} path {p.id} has no mirror path {p.id} back"
    return None


def diff_tables(a: Table, b: Table) -> list[tuple[str, Path]]:
    """Differences between two tables, as ("-", path) / ("+", path) in a stable order."""

    def index(t: Table) -> dict[tuple[str, str, int], Path]:
        return {(p.src, p.dst, p.id): p for p in t.rows(include_failed=False)}

    ia, ib = index(a), index(b)
    out: list[tuple[str, Path]] = []
    for key in sorted(set(ia) | set(ib)):
        pa, pb = ia.get(key), ib.get(key)
        if pa == pb:
            continue
        if pa is not None:
            out.append(("-", pa))
        if pb is not None:
            out.append(("+", pb))
    return out
