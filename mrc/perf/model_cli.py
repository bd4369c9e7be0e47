"""`mrc-perf model`: the AllReduce cost model of mrc.collectives.model, from the shell.

    mrc-perf model --ranks 4 --lost-fraction 1/4 --json
    mrc-perf model --ranks 4,16,64,1024 --lost-fraction 1/4,1/2,3/4 --plot overhead.png

Times are in units of D/B (D: bytes per rank, B: a healthy rank's bandwidth) with no
latency term, for one rank that lost a fraction X of its bandwidth.
"""

from __future__ import annotations

import json
import os
from fractions import Fraction

import click

from mrc.collectives import model as m
from mrc.perf import report

PLOT_RANKS = (4, 16, 64)
PLOT_MARKS = (0.25, 0.5, 0.75)  # 1, 2, 3 planes of 4 lost

# (key, column header) of the table, after n and X.
COLUMNS = (
    ("healthy", "healthy"),
    ("ring", "ring"),
    ("split_x", "R2CC\nY=X"),
    ("split_opt", "R2CC\nY*"),
    ("mrc", "mrc"),
    ("lower_bound", "bound"),
)


def _list(value: str, what: str, parse: type) -> list:
    out = []
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            out.append(parse(item))
        except (ValueError, ZeroDivisionError):
            raise click.BadParameter(f"{item!r} is not {what}") from None
    if not out:
        raise click.BadParameter(f"no value given (want {what}, comma-separated)")
    return out


def _ranks(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    ranks = _list(value, "a rank count", int)
    for n in ranks:
        if n < 1:
            raise click.BadParameter(f"{n} ranks: must be >= 1")
    return ranks


def _fractions(ctx: click.Context, param: click.Parameter, value: str) -> list[float]:
    xs = [float(x) for x in _list(value, "a fraction such as 0.25 or 1/4", Fraction)]
    for x in xs:
        if not 0.0 <= x < 1.0:
            raise click.BadParameter(
                f"X = {x:g}: must be in [0, 1) (at 1 the rank is cut off and nothing finishes)"
            )
    return xs


def _host_rate(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        h = float(Fraction(value.strip()))
    except (ValueError, ZeroDivisionError):
        raise click.BadParameter(f"{value!r} is not a number such as 5 or 5/2") from None
    if not h > 0.0:
        raise click.BadParameter(
            f"{h:g}: must be > 0 (in units of B: 5 = five times a rank's rate)"
        )
    return h


def _plot_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Checked before anything is computed or printed: a .png, .svg or .pdf that can be
    written."""
    if value is not None and os.path.splitext(value)[1].lower() not in (".png", ".svg", ".pdf"):
        raise click.BadParameter(f"{value}: give a .png, .svg or .pdf file")
    return report.out_file(ctx, param, value)


def print_table(ranks: list[int], xs: list[float], host: float | None = None) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    with_host = None if host is None else f"hosts at {host:g}B (--host-rate)"
    table = Table(
        title="AllReduce, one rank at (1-X)B: time in D/B (no latency), overhead",
        caption=with_host,
        caption_justify="left",
        title_justify="left",
        box=box.SIMPLE_HEAD,  # each row two lines, time over overhead: fits 80 columns
        show_edge=False,
        pad_edge=False,
    )
    table.add_column("n", justify="right")
    table.add_column("X", justify="right")
    for _, header in COLUMNS:
        table.add_column(header, justify="right")
    table.add_column("Y*", justify="right")
    for n in ranks:
        for x in xs:
            row = m.summary(n, x, host)
            cells = [str(n), f"{x:.3g}"]
            for key, _ in COLUMNS:
                over = 100.0 * (row[key] / row["healthy"] - 1.0) if row["healthy"] else 0.0
                pct = f"{over:+.1f}%" if abs(over) < 99.95 else f"{over:+.0f}%"
                cells.append(f"{row[key]:.4f}\n{pct}")
            cells.append(f"{row['y_opt']:.4f}")
            table.add_row(*cells)
    Console().print(table)


def plot(path: str, host: float | None = None) -> None:
    """Overhead over the healthy ring vs X for n in PLOT_RANKS, one panel each."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.UsageError(
            "--plot needs matplotlib (pip install matplotlib, or mrc[test])"
        ) from None
    xs = [i / 200 for i in range(0, 161)]  # 0 .. 0.8
    curves = (
        ("ring", "ring (through the degraded rank)", "tab:red"),
        ("split_x", "R2CC split, Y = X", "tab:orange"),
        ("split_opt", "R2CC split, Y = Y*", "tab:olive"),
        ("mrc", "mrc resilient shares = lower bound", "tab:blue"),
    )
    fig, axes = plt.subplots(1, len(PLOT_RANKS), figsize=(13, 4.2), sharey=True)
    for ax, n in zip(axes, PLOT_RANKS, strict=True):
        rows = [m.summary(n, x, host) for x in xs]
        for key, label, color in curves:
            ys = [100.0 * (r[key] / r["healthy"] - 1.0) for r in rows]
            ax.plot(xs, ys, label=label, color=color)
        for x in PLOT_MARKS:
            r = m.summary(n, x, host)
            ax.plot([x], [100.0 * (r["mrc"] / r["healthy"] - 1.0)], "o", color="tab:blue")
        ax.axvline(m.crossover(n), color="grey", lw=0.8, ls=":")
        ax.set_title(f"n = {n} (dotted: X_c = {m.crossover(n):.3f})")
        ax.set_xlabel("X, fraction of one rank's bandwidth lost")
        ax.set_ylim(0, 300)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("overhead over the healthy ring (%)")
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(
        "AllReduce with one degraded rank: modelled overhead (no latency term"
        + ("" if host is None else f"; hosts at {host:g}B")
        + ")"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@click.command(name="model")
@click.option(
    "-n",
    "--ranks",
    required=True,
    callback=_ranks,
    help="Rank count N, or several comma-separated (e.g. 16,64,1024).",
)
@click.option(
    "-x",
    "--lost-fraction",
    "lost",
    required=True,
    callback=_fractions,
    help="Fraction X of one rank's bandwidth lost (0.25 or 1/4), or several comma-separated.",
)
@click.option(
    "--host-rate",
    "host",
    callback=_host_rate,
    help="Also count the hosts' own cost: each handles this many B of traffic, sent plus "
    "received (e.g. 5; docs/collectives-model.md section 7). Default: the wire alone.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object (one N and one X only)."
)
@click.option(
    "--plot",
    "plot_file",
    type=click.Path(dir_okay=False),
    callback=_plot_file,
    help=f"Draw overhead vs X for n in {{{', '.join(map(str, PLOT_RANKS))}}} (.png, .svg, .pdf).",
)
def model(
    ranks: list[int], lost: list[float], host: float | None, as_json: bool, plot_file: str | None
) -> None:
    """The AllReduce cost model: one rank lost a fraction X of its bandwidth.

    Times in units of D/B, no latency term: ring (through the degraded rank), R2CC's split
    at Y* and at Y = X, the lower bound for any AllReduce, the schedule mrc's planner picks,
    and the healthy ring. docs/collectives-model.md derives them.
    """
    if as_json:
        if len(ranks) != 1 or len(lost) != 1:
            raise click.UsageError(
                f"--json prints one object: give one --ranks and one --lost-fraction "
                f"(got {len(ranks)} and {len(lost)})"
            )
        row = m.summary(ranks[0], lost[0], host)
        # 15 significant digits: the model's own rounding (1.6000000000000003) is noise.
        click.echo(json.dumps({k: float(f"{row[k]:.15g}") for k in m.KEYS}))
    else:
        print_table(ranks, lost, host)
    if plot_file:
        plot(plot_file, host)
        if not as_json:
            click.echo(f"wrote {plot_file}")
