"""mrc-perf all_reduce|all_gather|reduce_scatter|broadcast|reduce|alltoall|sendrecv:
nccl-tests for mrc. Every rank runs the same command under a launcher:

    mrc-run -n 4 -- mrc-perf all_reduce -b 8 -e 64M -f 2 -c 1

Flags as nccl-tests': -b/-e/-f (or -i) sizes, -n iterations, -w warmup, -c check, -o op,
-d dtype, -r root; --out_json FILE. Only rank 0 prints the table: size, count, type, redop,
root, time, algbw, busbw and #wrong, out-of-place then in-place, and "# Avg bus bandwidth".

Sizes are bytes of the whole buffer as in nccl-tests (for all_gather the gathered output,
for reduce_scatter and alltoall the input), so algbw = size / time, and busbw = algbw times
the collective's factor from nccl-tests' PERFORMANCE.md (all_reduce 2(n-1)/n; all_gather,
reduce_scatter, alltoall (n-1)/n; broadcast, reduce, sendrecv 1). Time is the mean per
iteration, averaged over the ranks (nccl-tests' default -a 1).

Check (-c 1): every rank's input is a deterministic function of (rank, size), so each rank
computes the expected output itself, with numpy, reducing in rank order (the order mrc's
collectives guarantee), and counts the elements whose bits differ; #wrong is the sum over
the ranks.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click
import numpy as np

from mrc.collectives import model, schedule
from mrc.perf import report

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "alltoall",
    "sendrecv",
)
OPS = ("sum", "prod", "min", "max", "avg")


def busbw_factor(coll: str, n: int) -> float:
    """nccl-tests' PERFORMANCE.md: the bytes each rank's link carries per byte of size."""
    if coll == "all_reduce":
        return 2 * (n - 1) / n
    if coll in ("all_gather", "reduce_scatter", "alltoall"):
        return (n - 1) / n
    return 1.0


# name -> (canonical name, numpy storage dtype). bfloat16 is stored as uint16 and passed
# with dtype="bfloat16" (numpy has no bfloat16).
DTYPES: dict[str, tuple[str, np.dtype[Any]]] = {}
for _names, _np in (
    (("int8", "char"), np.int8),
    (("uint8",), np.uint8),
    (("int32", "int"), np.int32),
    (("int64",), np.int64),
    (("float16", "half"), np.float16),
    (("bfloat16",), np.uint16),
    (("float32", "float"), np.float32),
    (("float64", "double"), np.float64),
):
    for _n in _names:
        DTYPES[_n] = (_names[0], np.dtype(_np))


# The type column shows nccl-tests' names, so tables compare line by line.
NCCL_NAMES = {"float16": "half", "float32": "float", "float64": "double"}


MAX_BYTES = 1 << 40  # a size beyond this is a typo, not a buffer this machine allocates


def parse_size(text: str, hint: str | None = None) -> int:
    """nccl-tests' sizes: 8, 64K, 1M, 2G (powers of 1024). hint: the option, for errors."""
    t = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    digits = t[:-1] if t[-1:] in "KMG" else t
    try:
        x = float(digits) * scale
        if not math.isfinite(x):
            raise ValueError
    except ValueError:
        raise click.BadParameter(
            f"{text!r}: want bytes, e.g. 8, 64K, 1M, 2G", param_hint=hint
        ) from None
    if not 0 <= x <= MAX_BYTES:
        raise click.BadParameter(f"{text!r}: size must be 0..1T", param_hint=hint)
    return int(x)


def _size_option(ctx: click.Context, param: click.Parameter, value: str) -> int:
    return parse_size(value, param.opts[0] if param.opts else None)


def sizes(minb: int, maxb: int, factor: float, step: int) -> list[int]:
    if maxb < minb:
        raise click.BadParameter(f"-e {maxb} is below -b {minb}", param_hint="-e")
    out, s = [], minb
    while s <= maxb:
        out.append(s)
        nxt = s + step if step else int(s * factor)
        s = nxt if nxt > s else s + 1
    return out


# --- bfloat16 in numpy: float32 with the low half rounded off, to nearest even ------------


def bf16_to_f32(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(a: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    nan = np.isnan(a)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)


# --- inputs and the reference -------------------------------------------------------------


def rank_data(rank: int, count: int, dtype: str, op: str) -> np.ndarray:
    """Rank `rank`'s input: the same on every rank that computes it. Floats are random
    (so a reduction in another order gives other bits), except for prod, whose inputs are
    small integers so that n of them neither overflow nor underflow."""
    rng = np.random.default_rng([rank, count, len(dtype)])
    name, store = DTYPES[dtype]
    if name in ("int8", "uint8", "int32", "int64") or op == "prod":
        lo, hi = (0, 4) if name == "uint8" else (-3, 4)
        if op == "prod":
            lo, hi = (1, 3) if name == "uint8" else (-2, 3)
        vals = rng.integers(lo, hi, count).astype(np.float64)
    else:
        vals = rng.standard_normal(count)
    if name == "bfloat16":
        return f32_to_bf16(vals.astype(np.float32))
    return vals.astype(store)


def combine(acc: np.ndarray, x: np.ndarray, op: str, dtype: str) -> np.ndarray:
    """acc op x in the buffer's dtype, rounded every step (float16/bfloat16 through
    float32, as mrc's C reductions do); integers wrap."""
    name = DTYPES[dtype][0]
    if name == "bfloat16":
        return f32_to_bf16(combine(bf16_to_f32(acc), bf16_to_f32(x), op, "float32"))
    if name == "float16":
        return combine(acc.astype(np.float32), x.astype(np.float32), op, "float32").astype(
            np.float16
        )
    with np.errstate(over="ignore"):
        if op in ("sum", "avg"):
            return acc + x
        if op == "prod":
            return acc * x
        return np.minimum(acc, x) if op == "min" else np.maximum(acc, x)


def finish(acc: np.ndarray, op: str, dtype: str, n: int) -> np.ndarray:
    """avg: the rank-order sum divided by n once (integers truncate toward zero)."""
    if op != "avg" or n == 1:
        return acc
    name = DTYPES[dtype][0]
    if name == "bfloat16":
        return f32_to_bf16(bf16_to_f32(acc) / np.float32(n))
    if name == "float16":
        return (acc.astype(np.float32) / np.float32(n)).astype(np.float16)
    if acc.dtype.kind == "f":
        return acc / acc.dtype.type(n)
    wide = acc.astype(np.int64)
    return (np.sign(wide) * (np.abs(wide) // n)).astype(acc.dtype)


def reduced(count: int, dtype: str, op: str, n: int) -> np.ndarray:
    acc = rank_data(0, count, dtype, op).copy()
    for r in range(1, n):
        acc = combine(acc, rank_data(r, count, dtype, op), op, dtype)
    return finish(acc, op, dtype, n)


def wrong(got: np.ndarray, want: np.ndarray) -> int:
    """Elements whose bits differ (bit-exact, also for floats and NaN)."""
    if got.size != want.size:
        return max(got.size, want.size)
    if got.size == 0:
        return 0
    g = np.ascontiguousarray(got).view(np.uint8).reshape(got.size, -1)
    w = np.ascontiguousarray(want).view(np.uint8).reshape(want.size, -1)
    return int(np.count_nonzero((g != w).any(axis=1)))


# --- one collective at one size -------------------------------------------------------------


@dataclass
class Case:
    """Buffers, the call and the expected output of one collective at one size."""

    count: int  # elements in the table's "count" column
    run: Callable[[], object]
    out: np.ndarray  # what the check compares
    want: np.ndarray | None  # None: this rank's output is not defined (e.g. reduce, non-root)
    reset: Callable[[], None]  # re-initialise inputs (in-place ops overwrite them)


def make_case(
    comm: Any, coll: str, nbytes: int, dtype: str, op: str, root: int, inplace: bool
) -> Case | None:
    n, rank = comm.size, comm.rank
    store = DTYPES[dtype][1]
    kw: dict[str, Any] = {"dtype": "bfloat16"} if DTYPES[dtype][0] == "bfloat16" else {}
    count = nbytes // store.itemsize
    if coll in ("all_gather", "reduce_scatter", "alltoall"):
        count -= count % n
    part = count // n if n else 0
    mine = rank_data(rank, count, dtype, op)

    if coll == "all_reduce":
        send = mine.copy()
        recv = send if inplace else np.zeros_like(send)

        def reset() -> None:
            send[:] = mine

        def run() -> object:
            return comm.all_reduce(send, None if inplace else recv, op=op, **kw)

        return Case(count, run, recv, reduced(count, dtype, op, n), reset)
    if coll == "reduce":
        send = mine.copy()
        recv = send if inplace else np.zeros_like(send)

        def reset() -> None:
            send[:] = mine

        def run() -> object:
            return comm.reduce(send, None if inplace else recv, op=op, root=root, **kw)

        want = reduced(count, dtype, op, n) if rank == root else None
        return Case(count, run, recv, want, reset)
    if coll == "broadcast":
        if not inplace:
            return None  # mrc's broadcast(buf, root) is in place only
        buf = np.zeros_like(mine)
        src = rank_data(root, count, dtype, op)

        def reset() -> None:
            buf[:] = src if rank == root else 0

        return Case(count, lambda: comm.broadcast(buf, root=root, **kw), buf, src, reset)
    if coll == "all_gather":
        # In place: this rank's input is its own slot of the output, as in NCCL.
        pieces = [rank_data(r, part, dtype, op) for r in range(n)]
        recv = np.zeros(count, dtype=store)
        send = recv[rank * part : (rank + 1) * part] if inplace else pieces[rank].copy()

        def reset() -> None:
            recv[:] = 0
            send[:] = pieces[rank]

        want = np.concatenate(pieces) if pieces else recv.copy()
        return Case(count, lambda: comm.all_gather(send, recv, **kw), recv, want, reset)
    if coll == "reduce_scatter":
        send = mine.copy()
        recv = send[rank * part : (rank + 1) * part] if inplace else np.zeros(part, dtype=store)

        def reset() -> None:
            send[:] = mine

        full = reduced(count, dtype, op, n)
        want = full[rank * part : (rank + 1) * part]
        return Case(count, lambda: comm.reduce_scatter(send, recv, op=op, **kw), recv, want, reset)
    if coll == "alltoall":
        if inplace:
            return None  # NCCL has no in-place all-to-all either
        send = mine.copy()
        recv = np.zeros_like(send)
        # Block j of rank r's input goes to rank j's block r.
        want = (
            np.concatenate(
                [rank_data(r, count, dtype, op)[rank * part : (rank + 1) * part] for r in range(n)]
            )
            if n
            else recv.copy()
        )
        return Case(count, lambda: comm.all_to_all(send, recv, **kw), recv, want, lambda: None)
    if coll == "sendrecv":
        if inplace:
            return None
        # A ring: each rank sends to rank + 1 and receives from rank - 1 (nccl-tests).
        send, recv = mine.copy(), np.zeros_like(mine)
        nxt, prv = (rank + 1) % n, (rank - 1) % n
        # send/recv move bytes (no dtype argument): bfloat16's uint16 storage as bytes.
        sbytes, rbytes = send.view(np.uint8), recv.view(np.uint8)

        def run() -> object:
            if n == 1:
                recv[:] = send
                return recv
            # Even ranks send first, odd ranks receive first: no cycle of ranks that all
            # wait to send, however large the message (and an odd ring still closes: the
            # last even rank's send waits only for rank 0's receive, which follows).
            if rank % 2 == 0:
                comm.send(sbytes, nxt)
                comm.recv(rbytes, prv)
            else:
                comm.recv(rbytes, prv)
                comm.send(sbytes, nxt)
            return recv

        want = rank_data(prv, count, dtype, op)
        return Case(count, run, recv, want, lambda: None)
    raise click.UsageError(f"unknown collective {coll!r}")


def measure(comm: Any, case: Case, iters: int, warmup: int, check: bool) -> tuple[float, int]:
    """(mean seconds per iteration, averaged over ranks; #wrong summed over ranks)."""
    nwrong = 0
    if check:
        case.reset()
        case.run()
        if case.want is not None:
            nwrong = wrong(case.out, case.want)
    for _ in range(warmup):
        case.run()
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        case.run()
    secs = (time.perf_counter() - t0) / max(1, iters)
    stats = np.array([secs, float(nwrong)], dtype=np.float64)
    comm.all_reduce(stats, op="sum")
    return float(stats[0]) / comm.size, int(stats[1])


# --- the table ------------------------------------------------------------------------------


def header(coll: str) -> str:
    return (
        "#\n"
        f"#{'':>53}{'out-of-place':>24}{'':>8}{'in-place':>24}\n"
        f"#{'size':>11} {'count':>12} {'type':>8} {'redop':>6} {'root':>6}"
        f" {'time':>8} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
        f" {'time':>8} {'algbw':>7} {'busbw':>7} {'#wrong':>6}\n"
        f"#{'(B)':>11} {'(elements)':>12} {'':>8} {'':>6} {'':>6}"
        f" {'(us)':>8} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}"
        f" {'(us)':>8} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}"
    )


def cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return f" {'N/A':>8} {'N/A':>7} {'N/A':>7} {'N/A':>6}"
    return f" {r['time_us']:8.2f} {r['algbw']:7.3f} {r['busbw']:7.3f} {r['wrong']:6d}"


def run_perf(
    coll: str,
    comm: Any,
    size_list: list[int],
    iters: int,
    warmup: int,
    check: bool,
    op: str,
    dtype: str,
    root: int,
    echo: Callable[[str], None],
) -> dict[str, Any]:
    n = comm.size
    if not 0 <= root < n:
        raise click.BadParameter(f"-r {root}: root must be a rank, 0..{n - 1}", param_hint="-r")
    factor = busbw_factor(coll, n)
    name = DTYPES[dtype][0]
    reduces = coll in ("all_reduce", "reduce", "reduce_scatter")
    rows: list[dict[str, Any]] = []
    echo(f"# mrc-perf {coll}: {n} ranks, iters {iters}, warmup {warmup}, check {int(check)}")
    algo = getattr(comm, "all_reduce_algo", None) if coll == "all_reduce" else None
    if algo is not None:
        echo(f"# all_reduce algorithm: {algo} (MRC_ALGO)")
        hosts = getattr(comm, "hosts", None)
        if algo == "auto" and hosts:
            # What auto runs by size here (healthy: a lost plane can move it, see README).
            how, why = model.layout_algo(hosts)
            small, top = schedule.small_max_bytes(n, comm.tree_min_ranks)
            echo(f"# auto: {small} up to {top} bytes, then {how} ({why})")
    echo(header(coll))
    for nbytes in size_list:
        row: dict[str, Any] = {}
        for place in ("out_of_place", "in_place"):
            case = make_case(comm, coll, nbytes, name, op, root, place == "in_place")
            if case is None:
                row[place] = None
                continue
            secs, nwrong = measure(comm, case, iters, warmup, check)
            size = case.count * DTYPES[name][1].itemsize
            algbw = size / secs / 1e9 if secs > 0 else 0.0
            row["count"], row["size"] = case.count, size
            row[place] = {
                "time_us": secs * 1e6,
                "algbw": algbw,
                "busbw": algbw * factor,
                "wrong": nwrong,
            }
        rows.append(row)
        echo(
            f" {row.get('size', nbytes):11d} {row.get('count', 0):12d}"
            f" {NCCL_NAMES.get(name, name):>8}"
            f" {op if reduces else 'none':>6} {root if coll in ('broadcast', 'reduce') else -1:6d}"
            f"{cell(row['out_of_place'])}{cell(row['in_place'])}"
        )
    bws = [row[p]["busbw"] for row in rows for p in ("out_of_place", "in_place") if row[p]]
    avg = sum(bws) / len(bws) if bws else 0.0
    nwrong = sum(row[p]["wrong"] for row in rows for p in ("out_of_place", "in_place") if row[p])
    echo(f"# Out of bounds values : {nwrong} {'OK' if nwrong == 0 else 'FAILED'}")
    echo(f"# Avg bus bandwidth    : {avg:.6g} ")
    echo("#")
    return {
        "collective": coll,
        "ranks": n,
        "dtype": name,
        "op": op if reduces else None,
        "root": root if coll in ("broadcast", "reduce") else -1,
        "iters": iters,
        "warmup": warmup,
        "check": check,
        "busbw_factor": factor,
        "algo": algo,
        "rows": rows,
        "wrong": nwrong,
        "avg_busbw": avg,
    }


def command(coll: str) -> click.Command:
    @click.command(
        name=coll,
        help=f"nccl-tests' {coll}_perf over mrc; every rank runs it (under mrc-run).",
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    @click.option(
        "-b",
        "--minbytes",
        default="32M",
        show_default=True,
        callback=_size_option,
        help="Smallest size (bytes; K, M, G: powers of 1024).",
    )
    @click.option(
        "-e",
        "--maxbytes",
        default="32M",
        show_default=True,
        callback=_size_option,
        help="Largest size.",
    )
    @click.option(
        "-f",
        "--stepfactor",
        type=float,
        default=2.0,
        show_default=True,
        help="Multiply the size by this each step.",
    )
    @click.option(
        "-i",
        "--stepbytes",
        default="0",
        callback=_size_option,
        help="Add this to the size each step instead of multiplying.",
    )
    @click.option(
        "-n",
        "--iters",
        type=click.IntRange(min=1),
        default=20,
        show_default=True,
        help="Timed operations per size.",
    )
    @click.option(
        "-w",
        "--warmup_iters",
        type=click.IntRange(min=0),
        default=1,
        show_default=True,
        help="Untimed operations per size first.",
    )
    @click.option(
        "-c",
        "--check",
        type=click.IntRange(0, 1),
        default=1,
        show_default=True,
        help="1: check every result against the rank-order reference (#wrong).",
    )
    @click.option(
        "-o",
        "--op",
        type=click.Choice(OPS),
        default="sum",
        show_default=True,
        help="Reduction.",
    )
    @click.option(
        "-d",
        "--datatype",
        type=click.Choice(sorted(DTYPES)),
        default="float",
        show_default=True,
        help="Element type.",
    )
    @click.option(
        "-r",
        "--root",
        type=int,
        default=0,
        show_default=True,
        help="Root rank of broadcast and reduce.",
    )
    @click.option(
        "--timeout",
        type=click.FloatRange(min=0, min_open=True),
        help="Communicator timeout, seconds (default MRC_TIMEOUT, else 60).",
    )
    @click.option(
        "--out_json",
        type=click.Path(dir_okay=False),
        callback=report.out_file,
        help="Rank 0 writes the results here (checked before the run).",
    )
    def cmd(
        minbytes: int,
        maxbytes: int,
        stepfactor: float,
        stepbytes: int,
        iters: int,
        warmup_iters: int,
        check: int,
        op: str,
        datatype: str,
        root: int,
        timeout: float | None,
        out_json: str | None,
    ) -> None:
        import mrc

        if not (math.isfinite(stepfactor) and (stepfactor > 1 or stepbytes)):
            raise click.BadParameter(f"{stepfactor}: the step factor must be > 1", param_hint="-f")
        size_list = sizes(minbytes, maxbytes, stepfactor, stepbytes)
        kw: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        try:
            with mrc.Communicator.from_env(**kw) as comm:

                def echo(line: str) -> None:
                    if comm.rank == 0:
                        click.echo(line)

                result = run_perf(
                    coll,
                    comm,
                    size_list,
                    iters,
                    warmup_iters,
                    bool(check),
                    op,
                    datatype,
                    root,
                    echo,
                )
                if out_json and comm.rank == 0:
                    with open(out_json, "w") as f:
                        json.dump(result, f, indent=1)
                        f.write("\n")
        except mrc.MrcError as e:  # a peer's failure, a mismatch, bad launcher variables
            # (the message names the rank)
            click.echo(f"mrc-perf: error: {e}", err=True)
            sys.exit(1)
        except MemoryError:
            click.echo(f"mrc-perf: error: out of memory for -e {maxbytes} bytes", err=True)
            sys.exit(1)
        except OSError as e:  # --out_json: checked before the run, may have gone since
            click.echo(f"mrc-perf: error: {e}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            sys.exit(130)
        if result["wrong"]:
            raise SystemExit(1)  # as nccl-tests: a wrong result fails the run

    return cmd


def register(group: click.Group) -> None:
    for coll in COLLECTIVES:
        group.add_command(command(coll))
