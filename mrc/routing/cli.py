"""mrc-route: show, check and diff static source-route tables.

    mrc-route show FABRIC [--from H] [--to H] [--failed X ...] [--state PREFIX] [--all] [--json]
    mrc-route check FABRIC [--failed X ...] [--state PREFIX] [--json]
    mrc-route diff A B [--json]
    mrc-route live SOCKET [--interval S] [--count N] [--json]
    mrc-route kernel [--flush] [--json]

FABRIC is a fabric file (routing/*.toml) or a table saved with `show --json`. Exit codes:
0 fine, 1 problems found (check) or tables differ (diff), 2 bad input.
`live` reads a running endpoint's stats socket (Endpoint.serve_stats) and shows its
paths as the transport sees them: state, RTT, send rate, losses, refreshed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path as FsPath
from typing import Any, NoReturn, TypeVar

import click
from rich import box
from rich.console import Console
from rich.table import Table as RichTable

from mrc.routing.fabric import FabricError, load_fabric
from mrc.routing.table import (
    FAILED,
    Path,
    Table,
    check_table,
    compile_table,
    diff_tables,
    text_row,
)

F = TypeVar("F", bound=Callable[..., Any])
EXIT_PROBLEMS = 1
EXIT_BAD_INPUT = 2


def _fail(err: Exception, as_json: bool) -> NoReturn:
    if as_json:
        body = err.to_dict() if isinstance(err, FabricError) else {"error": str(err)}
        click.echo(json.dumps(body))
    click.echo(f"mrc-route: error: {err}", err=True)
    sys.exit(EXIT_BAD_INPUT)


def _state_failed(prefix: str) -> tuple[str, list[str]]:
    from mrc.fabric.state import load_state  # pure Python; no root needed

    st = load_state(prefix)
    return st.fabric, st.failed


def load_table(source: str | None, failed: Iterable[str] = (), state: str | None = None) -> Table:
    """A table from a fabric file (compiled with `failed` and the state's failed set) or
    from a JSON table file. Raises FabricError (bad file) or MrcError (bad state)."""
    failed = list(failed)
    if state is not None:
        fabric_file, state_failed = _state_failed(state)
        source = source or fabric_file
        failed += state_failed
    if source is None:
        raise FabricError("give a fabric file (or --state PREFIX)", "-")
    if source.endswith(".json"):
        try:
            data = json.loads(FsPath(source).read_text())
        except OSError as e:
            raise FabricError(f"cannot read: {e.strerror}", source) from None
        except ValueError as e:
            raise FabricError(f"bad JSON: {e}", source) from None
        table = Table.from_dict(data, source)
        if failed:
            raise FabricError("--failed/--state need a fabric file, not a table", source)
        return table
    return compile_table(load_fabric(source), failed)


def _common(f: F) -> F:
    f = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")(f)
    f = click.option(
        "--state",
        metavar="PREFIX",
        help="Also apply the failed set of the running fabric PREFIX (mrc-fabric).",
    )(f)
    f = click.option(
        "--failed",
        "-f",
        multiple=True,
        metavar="ELEMENT",
        help="A failed link, switch, host or planeN (repeatable).",
    )(f)
    return f


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mrc", prog_name="mrc-route")
def cli() -> None:
    """Show, check and diff static SRv6 source-route tables compiled from fabric files;
    watch a running endpoint's paths (live)."""


@cli.command()
@click.argument("fabric", required=False)
@click.option("--from", "src", metavar="HOST", help="Only paths from HOST.")
@click.option("--to", "dst", metavar="HOST", help="Only paths to HOST.")
@click.option("--all", "include_failed", is_flag=True, help="Also list failed paths.")
@click.option("--text", "as_text", is_flag=True, help="The stable plain-text table form.")
@_common
def show(
    fabric: str | None,
    src: str | None,
    dst: str | None,
    include_failed: bool,
    as_text: bool,
    failed: tuple[str, ...],
    state: str | None,
    as_json: bool,
) -> None:
    """Show the route table of FABRIC (one line per path)."""
    try:
        table = load_table(fabric, failed, state)
        for host in (src, dst):
            if host is not None and host not in table.hosts:
                raise FabricError(f"no host {host!r}", table.source, key="--from/--to")
    except Exception as e:  # noqa: BLE001 - every load problem is bad input
        _fail(e, as_json)
    rows = [
        p
        for p in table.rows(include_failed)
        if (src is None or p.src == src) and (dst is None or p.dst == dst)
    ]
    if as_json:
        d = table.to_dict(include_failed)
        d["paths"] = [p.to_dict() for p in rows]
        click.echo(json.dumps(d, indent=1))
        return
    if as_text:
        header = table.to_text(include_failed).splitlines()[:2]
        click.echo("\n".join([*header, *(text_row(p) for p in rows)]))
        return
    _print_paths(table, rows)


def _print_paths(table: Table, rows: list[Path], title: str | None = None) -> None:
    failed = ", ".join(sorted(table.failed)) or "none"
    rt = RichTable(title=title or f"{table.fabric_name}  (failed: {failed})", title_justify="left")
    for col in ("src", "dst", "id", "plane", "spine", "segments", "state"):
        rt.add_column(col, justify="right" if col in ("id", "plane") else "left")
    for p in rows:
        state = f"[red]{p.state}[/red]" if p.state == FAILED else p.state
        rt.add_row(p.src, p.dst, str(p.id), str(p.plane), p.spine, " ".join(p.segments), state)
    Console().print(rt)


@cli.command()
@click.argument("fabric", required=False)
@_common
def check(fabric: str | None, failed: tuple[str, ...], state: str | None, as_json: bool) -> None:
    """Check FABRIC's table: every host pair has a path, planes are balanced, no duplicate
    address or SID, no usable path through a failed element. Exit 1 on any problem."""
    try:
        table = load_table(fabric, failed, state)
    except Exception as e:  # noqa: BLE001
        _fail(e, as_json)
    problems = check_table(table)
    if as_json:
        click.echo(json.dumps({"ok": not problems, "problems": [p.to_dict() for p in problems]}))
    elif problems:
        for p in problems:
            click.echo(f"{p.kind}: {p.message}")
    else:
        n = len(table.rows())
        click.echo(f"ok: {table.fabric_name}: {n} paths, {len(table.hosts)} hosts")
    sys.exit(EXIT_PROBLEMS if problems else 0)


@cli.command()
@click.argument("a")
@click.argument("b")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def diff(a: str, b: str, as_json: bool) -> None:
    """Paths that differ between tables A and B (fabric files or JSON tables).
    Exit 1 when they differ."""
    try:
        ta, tb = load_table(a), load_table(b)
    except Exception as e:  # noqa: BLE001
        _fail(e, as_json)
    changes = diff_tables(ta, tb)
    if as_json:
        click.echo(json.dumps([{"change": c, **p.to_dict()} for c, p in changes], indent=1))
    else:
        for c, p in changes:
            click.echo(
                f"{c} {p.src} {p.dst} {p.id} plane{p.plane} {p.spine} {','.join(p.segments)}"
            )
    sys.exit(EXIT_PROBLEMS if changes else 0)


_STATE_STYLE = {"good": "green", "suspect": "yellow", "probing": "cyan", "failed": "red"}


def _live_table(doc: dict[str, Any], prev: dict[str, Any] | None, wide: bool) -> RichTable:
    """The paths of one stats snapshot; rates from the difference with `prev`. Narrow
    (under 120 columns) keeps what fits in 80: path, plane, destination, state, RTT,
    rate, packets, retransmits, losses. A path is named peer.path: the peer's connection
    name (a communicator's: the rank; a fabric endpoint's: the host), else #connection."""
    from rich.markup import escape

    stats = doc["stats"]
    dt = doc["time"] - prev["time"] if prev else 0.0
    before = {(p["conn_id"], p["path"]): p for p in prev["stats"]["paths"]} if prev else {}
    planes = ", ".join(f"{p['addr']}" for p in doc["planes"])
    ended = len({p["conn_id"] for p in stats["paths"] if p.get("conn_error")})
    t = RichTable(
        title=f"pid {doc['pid']}: planes {planes}; {stats['conns']} connection(s)"
        + (f", {ended} ended" if ended else ""),
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    cols = ["peer.path", "pl", "dst", "state", "rtt us", "Mb/s", "pkts", "retx", "lost"]
    if wide:
        cols[3:3] = ["segs"]
        cols[5:5] = ["base us"]
        cols.append("cwnd KB")
    for col in cols:
        t.add_column(col, justify="left" if col in ("dst", "state", "peer.path") else "right")
    for p in stats["paths"]:
        old = before.get((p["conn_id"], p["path"]))
        rate = (p["tx_bytes"] - old["tx_bytes"]) * 8 / dt / 1e6 if old and dt > 0 else 0.0
        style = _STATE_STYLE.get(p["state"], "")
        state = f"[{style}]{p['state']}[/]"
        if p.get("conn_error"):  # its states froze when the connection ended
            how = "closed" if p["conn_error"] == "connection closed" else "conn failed"
            state = f"[dim]{how}[/]"
        row = {
            # The name comes from the peer's hello: shown as text, never as markup.
            "peer.path": f"{escape(p.get('peer') or '#' + str(p['conn']))}.{p['path']}",
            "pl": str(p["plane"]),
            "dst": p["dst"],
            "segs": str(p["segments"]),
            "state": state,
            "rtt us": f"{p['srtt_us']:.0f}",
            "base us": f"{p['base_rtt_us']:.0f}",
            "Mb/s": f"{rate:.1f}",
            "pkts": str(p["tx_pkts"]),
            "retx": str(p["retx"]),
            "lost": str(p["lost"]),
            "cwnd KB": f"{p['cwnd'] / 1024:.0f}",
        }
        t.add_row(*(row[c] for c in cols))
    drops = {k: v for k, v in stats["drops"].items() if v}
    t.caption = "drops: " + (", ".join(f"{k} {v}" for k, v in drops.items()) or "none")
    t.caption_justify = "left"
    return t


def _fetch_error(path: str, e: Exception) -> OSError:
    import os
    import stat

    try:
        mode: int | None = os.stat(path).st_mode
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISSOCK(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a socket"
        return OSError(f"{path} is {kind}: give the Unix socket the endpoint serves stats on")
    if isinstance(e, ConnectionRefusedError):
        if mode is not None:
            return OSError(
                f"{path} is a stale stats socket: no endpoint serves it any more (its process "
                f"ended without closing it); remove it with `rm {path}`"
            )
    if isinstance(e, FileNotFoundError):
        return OSError(f"no mrc stats at {path}: no such socket (did the endpoint serve_stats?)")
    return OSError(f"no mrc stats at {path}: {e}")


@cli.command()
@click.argument("socket_path", metavar="SOCKET")
@click.option(
    "--interval",
    default=0.5,
    show_default=True,
    type=click.FloatRange(0.05),
    help="Seconds between refreshes.",
)
@click.option(
    "--count",
    default=0,
    type=click.IntRange(0),
    help="Stop after N snapshots (0: until interrupted).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON snapshot per line.")
def live(socket_path: str, interval: float, count: int, as_json: bool) -> None:
    """Live path state of a running endpoint (one that called serve_stats(SOCKET)).
    Ctrl-C ends it (exit 0)."""
    from mrc.telemetry import fetch

    def snap() -> dict[str, Any]:
        try:
            return fetch(socket_path)
        except (OSError, ValueError) as e:
            _fail(_fetch_error(socket_path, e), as_json)

    try:
        _live_loop(snap, interval, count, as_json)
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a live view ends


def _live_loop(
    snap: Callable[[], dict[str, Any]], interval: float, count: int, as_json: bool
) -> None:
    import time

    from rich.live import Live

    prev: dict[str, Any] | None = None
    n = 0
    if as_json:
        while True:
            click.echo(json.dumps(snap()))
            n += 1
            if count and n >= count:
                return
            time.sleep(interval)  # the refresh period
    console = Console()
    with Live(console=console, auto_refresh=False) as view:
        while True:
            doc = snap()
            view.update(_live_table(doc, prev, console.width >= 120), refresh=True)
            prev, n = doc, n + 1
            if count and n >= count:
                return
            time.sleep(interval)  # the refresh period


# src_c/seg6route.c: endpoints put each SRv6 route socket's SRH in a kernel seg6
# route, in table M chosen by rule `pref 9000 fwmark M lookup M`, M in this range.
SEG6ROUTE_PREF = 9000
SEG6ROUTE_BASE, SEG6ROUTE_MASK = 0x6D720000, 0xFFFF0000


def _ip_json(*args: str) -> list[dict[str, Any]]:
    import subprocess

    try:
        out = subprocess.run(["ip", "-6", "-j", *args], capture_output=True, text=True, check=True)
    except FileNotFoundError:
        _fail(OSError("`ip` (iproute2) not found"), False)
    except subprocess.CalledProcessError as e:
        _fail(OSError(f"ip -6 {' '.join(args)}: {e.stderr.strip()}"), False)
    return json.loads(out.stdout or "[]")


def seg6_tables() -> list[dict[str, Any]]:
    """This network namespace's mrc seg6 route tables: mark, device, segments."""
    found = []
    for rule in _ip_json("rule", "show", "pref", str(SEG6ROUTE_PREF)):
        mark = int(str(rule.get("fwmark", "0")), 0)
        if mark & SEG6ROUTE_MASK != SEG6ROUTE_BASE:
            continue
        routes = _ip_json("route", "show", "table", str(mark))
        encap = next((r for r in routes if r.get("dst") == "default"), {})
        sid = next((r["dst"] for r in routes if r.get("type") == "throw"), None)
        found.append(
            {
                "mark": f"{mark:#x}",
                "dev": encap.get("dev"),
                "segs": encap.get("segs", []) if encap.get("encap") == "seg6" else [],
                "first_sid": sid,
            }
        )
    return found


@cli.command()
@click.option("--flush", is_flag=True, help="Remove them (only when no endpoint runs here).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def kernel(flush: bool, as_json: bool) -> None:
    """The kernel seg6 routes mrc endpoints installed in this network namespace.

    An endpoint with CAP_NET_ADMIN gives each SRv6 route socket a firewall mark and a
    table holding `encap seg6 mode inline` for its segments, so UDP GSO batches keep
    their routing header; the entries are shared by the host's endpoints and stay
    after they close. --flush deletes them: an endpoint still using one would then
    send without the SRH."""
    tables = seg6_tables()
    if flush:
        import subprocess

        for t in tables:
            for cmd in (
                ["ip", "-6", "rule", "del", "pref", str(SEG6ROUTE_PREF), "fwmark", t["mark"]],
                ["ip", "-6", "route", "flush", "table", str(int(t["mark"], 16))],
            ):
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode:
                    _fail(OSError(f"{' '.join(cmd)}: {r.stderr.strip()}"), as_json)
    if as_json:
        click.echo(json.dumps({"tables": tables, "flushed": flush}, indent=1))
        return
    rt = RichTable(
        title="mrc kernel seg6 routes" + (" (flushed)" if flush else ""),
        title_justify="left",
        box=box.SIMPLE,
    )
    for col in ("mark / table", "dev", "segments (before the destination)"):
        rt.add_column(col)
    for t in tables:
        rt.add_row(t["mark"], str(t["dev"]), ", ".join(t["segs"][:-1]) or "-")
    Console().print(rt if tables else "no mrc seg6 routes in this network namespace")


def main() -> None:
    cli(prog_name="mrc-route")


if __name__ == "__main__":
    main()
