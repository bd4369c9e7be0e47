"""mrc-fabric: build a fabric file as network namespaces, fail and heal it, tear it down.

    mrc-fabric up FABRIC [--name PREFIX]      namespaces <PREFIX>-<element> (default "mrc")
    mrc-fabric fail|heal ELEMENT [--name P]   a link, switch, host or planeN
    mrc-fabric loss LINK PERCENT [--name P]   drop PERCENT % on a link (0 removes it)
    mrc-fabric status [--name P] [--json]
    mrc-fabric exec ELEMENT [--name P] -- CMD...  finds this venv's tools (mrc-perf, python)
    mrc-fabric down [--name P]                also cleans up after a crash

Exit codes: 0 fine, 1 a command failed, 2 bad input (fabric file, element name).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click
from rich.console import Console
from rich.table import Table as RichTable

from mrc.errors import UsageError
from mrc.fabric import netns
from mrc.fabric.state import DEFAULT_PREFIX, FabricNetError
from mrc.routing.fabric import FabricError

F = TypeVar("F", bound=Callable[..., Any])


def _name(f: F) -> F:
    return click.option(
        "--name",
        "-n",
        "prefix",
        default=DEFAULT_PREFIX,
        show_default=True,
        help="Fabric name: the prefix of its namespaces.",
    )(f)


def _fail(err: Exception) -> NoReturn:
    click.echo(f"mrc-fabric: error: {err}", err=True)
    sys.exit(2 if isinstance(err, UsageError) else 1)  # a fabric file, an element, a name


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mrc", prog_name="mrc-fabric")
def cli() -> None:
    """Build a fabric file (routing/*.toml) as real network namespaces (needs root).

    Loss is given in percent, as everywhere on mrc's command lines (mrc-perf --loss,
    MRC_LOSS); the Python API (Endpoint.inject) takes a probability 0..1.
    """


@cli.command(short_help="Build FABRIC as namespaces, veth links, SIDs, rate limits.")
@click.argument("fabric")
@_name
def up(fabric: str, prefix: str) -> None:
    """Build FABRIC: a namespace per host and switch, veth links, SRv6 SIDs, rate limits."""
    try:
        netns.up(fabric, prefix)
        st = netns.status(prefix)
    except (FabricError, FabricNetError) as e:
        _fail(e)
    click.echo(f"up: {st['fabric']} as {st['namespaces']} namespaces {prefix}-*")
    if not netns.kernel_has_seg6local():
        click.echo(
            "note: this kernel has no SRv6 lightweight tunnels (CONFIG_IPV6_SEG6_LWTUNNEL): "
            "the switches' End SIDs are addresses on lo, and endpoints put the routing "
            "header on with the socket (GSO batches cut at the sender: more CPU per byte)",
            err=True,
        )


@cli.command(short_help="Remove the fabric (also the leftovers of a crash).")
@_name
def down(prefix: str) -> None:
    """Remove every namespace of the fabric (also leftovers of a crash) and its state."""
    try:
        gone = netns.down(prefix)
    except FabricNetError as e:
        _fail(e)
    click.echo(f"down: removed {len(gone)} namespaces {prefix}-*")


@cli.command(short_help="Fail a link, switch, host or planeN.")
@click.argument("element")
@_name
def fail(element: str, prefix: str) -> None:
    """Fail ELEMENT: a link, a switch or host (all its links) or planeN (all its links)."""
    try:
        st = netns.fail(prefix, element)
    except (FabricError, FabricNetError) as e:
        _fail(e)
    click.echo(f"failed: {', '.join(st.failed)}")


@cli.command()
@click.argument("element")
@_name
def heal(element: str, prefix: str) -> None:
    """Heal a failed ELEMENT."""
    try:
        st = netns.heal(prefix, element)
    except (FabricError, FabricNetError) as e:
        _fail(e)
    click.echo(f"failed: {', '.join(st.failed) or 'none'}")


@cli.command(short_help="Drop PERCENT % of LINK's packets (0 removes it).")
@click.argument("link")
@click.argument("percent", type=click.FloatRange(0, 100))
@_name
def loss(link: str, percent: float, prefix: str) -> None:
    """Drop PERCENT % (e.g. 2 or 0.5: percent, not a fraction) of the packets on LINK, both
    directions; 0 removes it."""
    try:
        st = netns.set_loss(prefix, link, percent)
    except (FabricError, FabricNetError) as e:
        _fail(e)
    click.echo("loss: " + (", ".join(f"{k} {v}%" for k, v in st.loss.items()) or "none"))


@cli.command(short_help="What is up, failed, down and lossy.")
@_name
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(prefix: str, as_json: bool) -> None:
    """What is up: fabric file, namespaces, failed elements, down links, loss."""
    try:
        st = netns.status(prefix)
    except (FabricError, FabricNetError) as e:
        _fail(e)
    if as_json:
        click.echo(json.dumps(st, indent=1))
        return
    t = RichTable(title=f"fabric {prefix}", show_header=False, title_justify="left")
    t.add_column("key")
    t.add_column("value")
    t.add_row("fabric", f"{st['fabric']} ({st['file']})")
    t.add_row("namespaces", f"{st['namespaces']} ({len(st['missing'])} missing)")
    t.add_row("failed", ", ".join(st["failed"]) or "none")
    t.add_row("down links", ", ".join(st["down_links"]) or "none")
    t.add_row("loss", ", ".join(f"{k} {v}%" for k, v in st["loss"].items()) or "none")
    Console().print(t)
    if st["missing"]:
        sys.exit(1)


class _CommandLast(click.Command):
    """ELEMENT, this command's own options, then CMD: the first word after ELEMENT that
    is not one of its options starts CMD, and everything from there on is CMD's (its
    -n is not --name), with or without the `--` before it."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        own: dict[str, bool] = {}  # option -> takes a value
        for p in self.get_params(ctx):
            if isinstance(p, click.Option):
                for o in p.opts + p.secondary_opts:
                    own[o] = not p.is_flag
        out: list[str] = []
        seen_element = False
        i = 0
        while i < len(args):
            a = args[i]
            if a == "--":
                out += args[i:]
                break
            name = a.split("=", 1)[0]
            if name in own:
                step = 2 if own[name] and "=" not in a else 1
                out += args[i : i + step]
                i += step
                continue
            if seen_element:
                out += ["--", *args[i:]]
                break
            seen_element = True
            out.append(a)
            i += 1
        return super().parse_args(ctx, out)


@cli.command("exec", cls=_CommandLast)
@click.argument("element")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@_name
def exec_(element: str, cmd: tuple[str, ...], prefix: str) -> None:
    """Run CMD in ELEMENT's namespace: mrc-fabric exec h0 -- iperf3 -s.

    The directory of this mrc-fabric's Python (the venv's bin: mrc-perf, mrc-route,
    python) goes first on CMD's PATH, so the project's tools are found even when sudo
    reset PATH."""
    try:
        argv = netns.exec_argv(prefix, element, cmd)
    except (FabricError, FabricNetError) as e:
        _fail(e)
    env = {**os.environ, "PATH": netns.tools_path(os.environ.get("PATH"))}
    os.execvpe(argv[0], argv, env)


def main() -> None:
    cli(prog_name="mrc-fabric")


if __name__ == "__main__":
    main()
