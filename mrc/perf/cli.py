"""mrc-perf: perftest (ib_write_bw, ib_send_bw, ib_write_lat, ib_send_lat) for mrc.

    server$ mrc-perf write_bw -s 65536
    client$ mrc-perf write_bw -s 65536 SERVER_ADDR

Same options on both sides; the client checks them against the server's before running.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy is imported anywhere

import click  # noqa: E402

from mrc.perf import coll as coll_commands  # noqa: E402
from mrc.perf import model_cli, report  # noqa: E402
from mrc.perf.options import (  # noqa: E402
    DEFAULT_BW_ITERS,
    DEFAULT_BW_SIZE,
    DEFAULT_LAT_ITERS,
    DEFAULT_LAT_SIZE,
    DEFAULT_PORT,
    MAX_SIZE,
    MIN_SIZE,
    TESTS,
    PerfOptions,
)

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_SERVER_PLANES = "127.0.0.1"
DEFAULT_CLIENT_PLANES = "127.0.0.2"


def _plane_at(value: str) -> tuple[int, float]:
    plane, sep, secs = value.partition("@")
    try:
        if not sep:
            raise ValueError
        p, s = int(plane), float(secs)
    except ValueError:
        raise click.BadParameter(
            f"{value!r}: expected PLANE@SECONDS, e.g. 1@2.5", param_hint="--fail-plane"
        ) from None
    if p < 0 or not 0 <= s < 1e6:  # also refuses nan and inf
        raise click.BadParameter(
            f"{value!r}: plane >= 0 and seconds 0..1e6", param_hint="--fail-plane"
        )
    return p, s


def _plane_loss(value: str) -> tuple[int, float]:
    plane, sep, pct = value.partition(":")
    try:
        if not sep:
            raise ValueError
        p, x = int(plane), float(pct.rstrip("%"))
    except ValueError:
        raise click.BadParameter(
            f"{value!r}: expected PLANE:PERCENT, e.g. 0:1.5", param_hint="--loss"
        ) from None
    if p < 0 or not 0 <= x <= 100:
        raise click.BadParameter(
            f"{value!r}: plane >= 0 and percent in 0..100", param_hint="--loss"
        )
    return p, x


def _size(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    if value is not None and not MIN_SIZE <= value <= MAX_SIZE:
        raise click.BadParameter(f"{value} bytes: must be {MIN_SIZE}..{MAX_SIZE} (8 MiB)")
    return value


def _source_for(server: str) -> str | None:
    """The local address the routing table picks to reach `server` (perftest's habit:
    the client names only the server), or None for loopback or an unroutable one."""
    import ipaddress
    import socket

    try:
        ip = ipaddress.ip_address(server)
    except ValueError:
        return None  # a host name: resolved by connect, planes stay the default
    if ip.is_loopback:
        return None
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((server, 9))  # UDP: no packet leaves, the kernel only picks a route
        except OSError:
            return None
        return str(s.getsockname()[0])


def common_options(f: F) -> F:
    """perftest's options, plus mrc's multipath ones; the same on every test."""
    opts = [
        click.argument("server", required=False),
        click.option("-s", "--size", type=int, callback=_size, help="Message size in bytes."),
        click.option(
            "-a",
            "--all",
            "all_sizes",
            is_flag=True,
            help="Run every size from 2 B to 8 MiB (powers of two).",
        ),
        click.option(
            "-n",
            "--iters",
            type=click.IntRange(min=1),
            help="Iterations per size (default 5000 for bw, 1000 for lat).",
        ),
        click.option(
            "-D",
            "--duration",
            type=click.FloatRange(min=0, min_open=True),
            help="Run each size for this many seconds (overrides --iters).",
        ),
        click.option(
            "-q",
            "--qps",
            type=click.IntRange(1, 64),
            default=1,
            show_default=True,
            help="Connections, each its own mrc Connection; ops spread over them.",
        ),
        click.option(
            "-t",
            "--tx-depth",
            type=click.IntRange(1, 4096),
            default=128,
            show_default=True,
            help="Operations in flight per connection (bw).",
        ),
        click.option(
            "-p",
            "--port",
            type=click.IntRange(0, 65535),
            default=DEFAULT_PORT,
            show_default=True,
            help="TCP port of the server's listener (0: any).",
        ),
        click.option(
            "--mss",
            type=click.IntRange(64, 65000),
            default=None,
            help="mrc payload bytes per packet [default: 32768 on loopback, 8192 with "
            "--fabric or --planes, to fit a 9000-byte MTU with an SRv6 header].",
        ),
        click.option(
            "--timeout",
            type=click.FloatRange(min=0.1),
            default=5.0,
            show_default=True,
            help="Endpoint timeout: a peer silent on every path this long is gone.",
        ),
        click.option(
            "--cpu_util",
            "--cpu-util",
            "cpu_util",
            is_flag=True,
            help="Show the machine's CPU use (busy %, from /proc/stat) over each measured"
            " run, as perftest does; bw tests with -D.",
        ),
        click.option(
            "--report_gbits",
            "--report-gbits",
            "report_gbits",
            is_flag=True,
            help="Report bandwidth in Gb/sec instead of MB/sec.",
        ),
        click.option(
            "--out_json",
            "--out-json",
            "out_json",
            is_flag=True,
            help="Print the results as JSON after the table.",
        ),
        click.option(
            "--out_json_file",
            "--out-json-file",
            "out_json_file",
            type=click.Path(dir_okay=False, writable=True),
            callback=report.out_file,
            help="Write the JSON results here (checked before the run).",
        ),
        click.option(
            "--planes",
            help="Local plane addresses, comma-separated. Default: the server "
            f"{DEFAULT_SERVER_PLANES} (loopback only: give --planes to be reachable from "
            "other hosts); the client the address it routes to SERVER from "
            f"({DEFAULT_CLIENT_PLANES} for a loopback SERVER).",
        ),
        click.option(
            "--fabric",
            type=click.Path(exists=True, dir_okay=False),
            help="Fabric file: take planes and routes for --host from it.",
        ),
        click.option(
            "--host",
            help="This host's name in --fabric (the client then names the server by host name).",
        ),
        click.option(
            "--paths",
            "show_paths",
            is_flag=True,
            help="After the run, print per-path counters and a per-plane timeline.",
        ),
        click.option(
            "--verify", is_flag=True, help="Send a seeded pattern and compare sha256 at both ends."
        ),
        click.option(
            "--fail-plane",
            "fail_plane",
            multiple=True,
            type=str,
            metavar="P@SEC",
            help="Take local plane P down SEC seconds into the run (repeatable).",
        ),
        click.option(
            "--loss",
            multiple=True,
            type=str,
            metavar="P:PCT",
            help="Drop PCT percent (0..100, not a fraction) of the packets sent on local "
            "plane P (repeatable); MRC_LOSS takes the same form.",
        ),
        click.option(
            "--local", is_flag=True, help="Run server and client here, over loopback planes."
        ),
        click.option(
            "--nplanes",
            type=click.IntRange(1, 16),
            default=4,
            show_default=True,
            help="Planes per side with --local.",
        ),
        click.option("--quiet", is_flag=True, help="No live progress line."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _run(test: str, **kw: Any) -> None:
    from mrc.perf.runner import PerfError, run_client, run_local, run_server

    is_bw = test.endswith("_bw")
    fail_plane = [_plane_at(v) for v in kw["fail_plane"]]
    loss = [_plane_loss(v) for v in kw["loss"]]
    if not is_bw and kw["qps"] != 1:
        raise click.UsageError("latency tests use one connection (-q 1), like perftest")
    if kw["cpu_util"] and not (is_bw and kw["duration"]):
        raise click.UsageError("--cpu_util needs a bw test and -D/--duration (as in perftest)")
    if kw["all_sizes"] and kw["size"] is not None:
        raise click.UsageError("-a/--all and -s/--size exclude each other")
    if bool(kw["fabric"]) != bool(kw["host"]):
        raise click.UsageError("--fabric and --host go together")
    if kw["local"] and (kw["server"] or kw["fabric"] or kw["planes"]):
        raise click.UsageError("--local runs both sides itself: no SERVER, --planes or --fabric")
    server = kw["server"]
    default_planes = DEFAULT_CLIENT_PLANES if server else DEFAULT_SERVER_PLANES
    if server and not kw["planes"] and not kw["fabric"]:
        default_planes = _source_for(server) or default_planes
    planes = [p.strip() for p in (kw["planes"] or default_planes).split(",") if p.strip()]
    if not planes:
        raise click.BadParameter(f"{kw['planes']!r}: no address", param_hint="--planes")
    nplanes = kw["nplanes"] if kw["local"] else len(planes)
    for p, _ in fail_plane + loss:
        if p >= nplanes and not kw["fabric"]:
            raise click.BadParameter(
                f"plane {p} does not exist (0..{nplanes - 1})", param_hint="--fail-plane/--loss"
            )
    opts = PerfOptions(
        test=test,
        size=kw["size"] or (DEFAULT_BW_SIZE if is_bw else DEFAULT_LAT_SIZE),
        all_sizes=kw["all_sizes"],
        iters=kw["iters"] or (DEFAULT_BW_ITERS if is_bw else DEFAULT_LAT_ITERS),
        duration=kw["duration"],
        qps=kw["qps"],
        tx_depth=kw["tx_depth"],
        port=kw["port"],
        mss=kw["mss"] or (8192 if kw["fabric"] or kw["planes"] else 32768),
        timeout=kw["timeout"],
        planes=planes,
        server=server,
        report_gbits=kw["report_gbits"],
        verify=kw["verify"],
        show_paths=kw["show_paths"],
        fail_plane=fail_plane,
        loss=loss,
        out_json=kw["out_json"],
        out_json_file=kw["out_json_file"],
        quiet=kw["quiet"],
        cpu_util=kw["cpu_util"],
        planes_given=bool(kw["planes"] or kw["fabric"]),
    )
    fabric = (kw["fabric"], kw["host"]) if kw["fabric"] else None
    try:
        if kw["local"]:
            rc = run_local(opts, kw["nplanes"], sys.stdout)
        elif server:
            rc = run_client(opts, sys.stdout, fabric)
        else:
            rc = run_server(opts, sys.stdout, fabric)
    except PerfError as e:
        click.echo(f"mrc-perf: error: {e}", err=True)
        sys.exit(e.code)
    except KeyboardInterrupt:
        sys.exit(130)
    if rc:
        click.echo("mrc-perf: error: --verify found different data at the two ends", err=True)
    sys.exit(rc)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mrc", prog_name="mrc-perf")
def main() -> None:
    """perftest-style bandwidth and latency tests over mrc.

    Start the server with no address, then the client with the server's address and the
    same options. --local runs both here.
    """


def _make(test: str) -> None:
    def cmd(**kw: Any) -> None:
        _run(test, **kw)

    cmd.__doc__ = f"{TESTS[test]} (like ib_{test})."
    main.command(name=test)(common_options(cmd))


for _test in TESTS:
    _make(_test)

# The collective tests (nccl-tests' all_reduce_perf ...), run on every rank under mrc-run.
coll_commands.register(main)
# `mrc-perf model`: the AllReduce cost model (mrc/perf/model_cli.py); runs nothing.
main.add_command(model_cli.model)


if __name__ == "__main__":
    main()
