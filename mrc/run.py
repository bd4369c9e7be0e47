"""mrc-run: start N ranks of a command, as torchrun/mpirun do, on loopback or a fabric.

    mrc-run -n 4 -- python train.py
    mrc-run -n 4 --fabric routing/4host-4plane.toml --name mrc -- mrc-perf all_reduce -b 8 -e 1M

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
(torchrun's names) and MRC_PORT, MRC_RUN_ID, MRC_TIMEOUT, and on a fabric MRC_FABRIC,
MRC_FABRIC_NAME, MRC_HOST, MRC_MASTER_ADDRS, so mrc.Communicator.from_env() needs nothing
else. On a fabric (which must be up: `mrc-fabric up FILE --name NAME`) rank r runs in host
r's namespace (--hosts to choose), MASTER_ADDR is rank 0's host's plane-0 address and
MRC_MASTER_ADDRS all its planes' (a rank whose plane 0 is down joins over another).

Every output line is prefixed "[r] ". When a rank fails, the others get --settle seconds
(2) to end by themselves (their communicators raise at once, naming it), then are stopped
(SIGTERM, then SIGKILL), its last lines and exit code are shown, and mrc-run exits with the first
failure's code (128 + signal for a rank killed by a signal). Ctrl-C (SIGINT) or SIGTERM to
mrc-run stops every rank; it exits 130 or 143.

--bind-to core (Open MPI's name) pins rank r, and every thread it starts, to the r-th
equal block of this machine's cores (wrapping when there are more ranks than cores): its
caller and progress threads then hand work over on one core instead of waking each other
across cores.
"""

from __future__ import annotations

import collections
import errno
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path as FsPath
from typing import IO

import click

from mrc.errors import MrcError, UsageError

TAIL_LINES = 20
STOP_GRACE_S = 3.0
SETTLE_S = 2.0  # after a failure, how long the others may take to end by themselves
# Ranks get SIGTERM when mrc-run dies, even by SIGKILL (a scheduler's, the OOM killer's),
# instead of running on without a launcher: setpriv (util-linux) sets the parent-death
# signal and execs the rank, which keeps it (so does `ip netns exec`, which execs too).
# Python's preexec_fn could do it without setpriv, but is not safe beside the reader
# threads. Without setpriv, ranks outlive a killed mrc-run as before.
_SETPRIV = shutil.which("setpriv")


@dataclass
class Rank:
    rank: int
    argv: list[str]
    env: dict[str, str]
    host: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=TAIL_LINES)
    )
    reader: threading.Thread | None = None
    cpus: set[int] | None = None  # --bind-to core: the cores it runs on


BIND_MODES = ("none", "core")  # --bind-to, as Open MPI names them


def core_blocks(n: int, cpus: Sequence[int] | None = None) -> list[set[int]]:
    """Rank r's cores for --bind-to core: the r-th of n equal blocks of the cores this
    process may use, one core each (wrapping) when there are more ranks than cores."""
    avail = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if n >= len(avail):
        return [{avail[r % len(avail)]} for r in range(n)]
    k = len(avail) // n
    return [set(avail[r * k : (r + 1) * k]) for r in range(n)]


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports of this namespace (held together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


# Run in rank 0's namespace: n ports free on every address there, held together.
_FREE_PORTS_CODE = (
    "import socket,sys\n"
    "s=[socket.socket(socket.AF_INET6) for _ in range(int(sys.argv[1]))]\n"
    "[x.bind(('::',0)) for x in s]\n"
    "print(*[x.getsockname()[1] for x in s])"
)


def free_ports_in(prefix: str, host: str, n: int) -> list[int]:
    """n distinct TCP ports free in the namespace of a fabric host, where rank 0 will
    listen (ports free in the launcher's own namespace say nothing about it)."""
    from mrc.fabric import netns

    argv = netns.exec_argv(prefix, host, [sys.executable, "-S", "-c", _FREE_PORTS_CODE, str(n)])
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True)
        ports = [int(p) for p in out.stdout.split()]
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        raise click.ClickException(
            f"cannot find free ports on fabric host {host}: {detail}"
        ) from None
    if len(ports) != n:
        raise click.ClickException(f"cannot find free ports on fabric host {host}: {out.stdout!r}")
    return ports


def ports(master_port: int, mrc_port: int) -> dict[str, str]:
    return {
        "MASTER_PORT": str(master_port),  # for the program's own torch store, if any
        "MRC_PORT": str(mrc_port),  # the communicator's rendezvous
    }


def exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exited with code {rc}"


def plan(
    n: int,
    cmd: Sequence[str],
    fabric: str | None = None,
    name: str = "mrc",
    hosts: Sequence[str] | None = None,
    timeout: float | None = None,
    planes: str | None = None,
    base_env: dict[str, str] | None = None,
) -> list[Rank]:
    """Each rank's argv and environment (no process started yet)."""
    if n < 1:
        raise click.UsageError(f"-n must be >= 1, got {n}")
    if not cmd:
        raise click.UsageError("no command: mrc-run -n N -- CMD [ARGS...]")
    from mrc.fabric.netns import tools_path

    env0 = dict(os.environ if base_env is None else base_env)
    common = {
        # As mrc-fabric exec: `sudo mrc-run ... -- python x.py` runs this venv's python.
        "PATH": tools_path(env0.get("PATH")),
        "WORLD_SIZE": str(n),
        "LOCAL_WORLD_SIZE": str(n),
        "MRC_RUN_ID": secrets.token_hex(8),
        "PYTHONUNBUFFERED": "1",  # lines come out as they are printed, not at exit
    }
    if timeout is not None:
        common["MRC_TIMEOUT"] = str(timeout)
    if planes is not None:
        common["MRC_PLANES"] = planes
    if fabric is None:
        if hosts:
            raise click.UsageError("--hosts needs --fabric")
        common["MASTER_ADDR"] = "127.0.0.1"
        common.update(ports(*free_ports(2)))
        return [
            Rank(r, list(cmd), {**env0, **common, "RANK": str(r), "LOCAL_RANK": str(r)})
            for r in range(n)
        ]
    return _plan_fabric(n, cmd, fabric, name, hosts, env0, common)


def _plan_fabric(
    n: int,
    cmd: Sequence[str],
    fabric: str,
    name: str,
    hosts: Sequence[str] | None,
    env0: dict[str, str],
    common: dict[str, str],
) -> list[Rank]:
    from mrc.fabric import netns
    from mrc.fabric.state import load_state
    from mrc.routing import load_fabric

    fab = load_fabric(fabric)
    state = load_state(name)  # raises "not up; run mrc-fabric up ..." naming the prefix
    if FsPath(state.fabric).resolve() != FsPath(fabric).resolve():
        raise click.UsageError(
            f"fabric {name!r} is up from {state.fabric}, not {fabric}: pass its file, or "
            f"--name of the fabric built from {fabric}"
        )
    names = [h.name for h in fab.hosts]
    if hosts is None:
        if n > len(names):
            raise click.UsageError(
                f"-n {n} ranks but fabric {fab.name} has {len(names)} hosts: pass --hosts"
            )
        hosts = names[:n]
    if len(hosts) != n:
        raise click.UsageError(f"--hosts lists {len(hosts)} hosts for -n {n} ranks")
    for h in hosts:
        if h not in names:
            raise click.UsageError(
                f"no host {h!r} in fabric {fab.name} (hosts: {', '.join(names)})"
            )
    # The rendezvous (and a program's own store) listen in rank 0's host namespace:
    # ports free there, not in the launcher's.
    common = {
        **common,
        **ports(*free_ports_in(name, hosts[0], 2)),
        "MASTER_ADDR": fab.host(hosts[0]).addrs[0],
        # its other planes: a rank whose plane-0 cable is down joins over another
        "MRC_MASTER_ADDRS": ",".join(fab.host(hosts[0]).addrs),
        "MRC_FABRIC": str(FsPath(fabric).resolve()),
        "MRC_FABRIC_NAME": name,
    }
    ranks = []
    seen: dict[str, int] = {}
    for r, h in enumerate(hosts):
        local = seen.get(h, 0)
        seen[h] = local + 1
        env = {**env0, **common, "RANK": str(r), "LOCAL_RANK": str(local), "MRC_HOST": h}
        ranks.append(Rank(r, netns.exec_argv(name, h, list(cmd)), env, host=h))
    for rk in ranks:
        rk.env["LOCAL_WORLD_SIZE"] = str(seen[rk.host or ""])
    return ranks


class _Stopped(Exception):
    """mrc-run got SIGINT or SIGTERM: stop every rank, exit 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class Launcher:
    """Runs the planned ranks; run() returns the exit code mrc-run exits with."""

    def __init__(
        self,
        ranks: list[Rank],
        out: IO[str] | None = None,
        time_limit: float = 0,
        settle: float = SETTLE_S,
    ) -> None:
        self.ranks = ranks
        self.settle = settle
        self.out = out or sys.stdout
        self.time_limit = time_limit
        self._lock = threading.Lock()
        self._exits: queue.Queue[tuple[int, int]] = queue.Queue()
        self._signal: int | None = None  # SIGINT/SIGTERM received (run)
        self._defer_signals = True  # starting or stopping ranks: a signal is only noted

    def say(self, text: str) -> None:
        with self._lock:
            self.out.write(text if text.endswith("\n") else text + "\n")
            self.out.flush()

    def _start(self, rk: Rank) -> None:
        # Its own session: a rank's children are stopped with it, and the terminal's Ctrl-C
        # reaches mrc-run only, which stops every rank the same way. A bound rank inherits
        # the mask of the thread that forks it (Linux affinity is per thread, kept across
        # exec), so this thread takes the rank's mask for the fork and then its own back:
        # exact, where setting the child's after the start would race its first threads.
        own = os.sched_getaffinity(0) if rk.cpus else None
        argv = rk.argv
        # A command that cannot run (missing, not executable) goes to Popen as it is, whose
        # error mrc-run reports, rather than to setpriv, which would print its own.
        if _SETPRIV and shutil.which(argv[0], path=rk.env.get("PATH")):
            argv = [_SETPRIV, "--pdeathsig", "TERM", "--", *argv]
        if rk.cpus:
            os.sched_setaffinity(0, rk.cpus)
        try:
            rk.proc = subprocess.Popen(
                argv,
                env=rk.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            if own is not None:
                os.sched_setaffinity(0, own)
        rk.reader = threading.Thread(target=self._pump, args=(rk,), daemon=True)
        rk.reader.start()

    def _pump(self, rk: Rank) -> None:
        assert rk.proc is not None and rk.proc.stdout is not None
        for raw in rk.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            rk.tail.append(line)
            self.say(f"[{rk.rank}] {line}")
        rk.proc.wait()
        self._exits.put((rk.rank, rk.proc.returncode))

    def _stop(self, ranks: list[Rank], settle: float = 0.0) -> list[int]:
        """Give the ranks `settle` seconds to end by themselves (after a failure, the
        others' communicators raise at once, naming the failed rank: their words are
        worth showing), then SIGTERM every running rank's process group and SIGKILL
        what is left after the grace period; returns the ranks that had to be stopped."""
        deadline = time.monotonic() + settle
        for rk in ranks:
            if rk.proc is None:
                continue  # never started
            try:
                rk.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        stopped = [rk for rk in ranks if rk.proc is not None and rk.proc.poll() is None]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for rk in stopped:
                assert rk.proc is not None
                if rk.proc.poll() is None:
                    try:
                        os.killpg(rk.proc.pid, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + STOP_GRACE_S
            for rk in stopped:
                assert rk.proc is not None
                try:
                    rk.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        return [rk.rank for rk in stopped]

    def _on_signal(self, signum: int, _frame: object) -> None:
        """SIGINT (Ctrl-C) or SIGTERM (kill, a batch system cancelling the job): while
        ranks are being started only noted (an exception raised inside Popen or
        Thread.start would leave a rank forked but unrecorded, in a session of its own
        that nothing would stop), afterwards raised where the main thread waits."""
        if self._signal is None:
            self._signal = signum
        if not self._defer_signals:
            raise _Stopped(signum)

    def _handle_signals(self) -> dict[int, object]:
        """Installs _on_signal (main thread only); a signal ignored stays ignored (SIGINT
        in a shell's background job, as POSIX asks). Returns what to restore."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        old: dict[int, object] = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) is not signal.SIG_IGN:
                old[sig] = signal.signal(sig, self._on_signal)
        return old

    def run(self) -> int:
        first: tuple[int, int] | None = None
        left = len(self.ranks)
        old = self._handle_signals()
        try:
            try:
                for rk in self.ranks:
                    self._start(rk)
                    if self._signal is not None:
                        break
            except OSError as e:
                self._stop(self.ranks)
                self.say(f"mrc-run: cannot start {self.ranks[0].argv[0]!r}: {e.strerror}")
                return 126 if e.errno == errno.EACCES else 127  # as a shell says it
            self._defer_signals = False
            if self._signal is not None:
                raise _Stopped(self._signal)
            deadline = time.monotonic() + self.time_limit if self.time_limit > 0 else None
            while left:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    rank, rc = self._exits.get(timeout=wait)
                except queue.Empty:
                    stopped = self._stop(self.ranks)
                    self.say(
                        f"mrc-run: time limit of {self.time_limit:g} s reached; "
                        f"stopped ranks {', '.join(map(str, stopped))}"
                    )
                    self._drain()
                    return 124
                left -= 1
                if rc != 0 and first is None:
                    first = (rank, rc)
                    others = [r for r in self.ranks if r.rank != rank]
                    stopped = self._stop(others, settle=self.settle)
                    self._report(rank, rc, stopped)
        except (_Stopped, KeyboardInterrupt) as e:
            signum = e.signum if isinstance(e, _Stopped) else signal.SIGINT
            self._defer_signals = True  # a second signal while stopping: noted, not raised
            stopped = self._stop(self.ranks)
            what = "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)"
            self.say(f"mrc-run: {what}; stopped ranks {', '.join(map(str, stopped))}")
            self._drain()
            return 128 + signum
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
        self._drain()
        return 0 if first is None else exit_code(first[1])

    def _drain(self) -> None:
        for rk in self.ranks:
            if rk.reader is not None:
                rk.reader.join(timeout=5)

    def _report(self, rank: int, rc: int, stopped: list[int]) -> None:
        rk = self.ranks[rank]
        if rk.reader is not None:
            rk.reader.join(timeout=5)  # its last lines are in the tail
        where = f" on {rk.host}" if rk.host else ""
        lines = [f"mrc-run: rank {rank}{where} {describe(rc)} (first failure)"]
        if stopped:
            lines.append(f"mrc-run: stopped ranks {', '.join(map(str, stopped))}")
        lines.append(f"mrc-run: last {len(rk.tail)} lines of rank {rank}:")
        lines += [f"  {line}" for line in rk.tail]
        self.say("\n".join(lines))


# CMD's own options are CMD's: the first word that is not one of mrc-run's starts it
# (`mrc-run -n 4 python x.py -n 8`), with or without `--` before it, as with mpirun
@click.command(
    context_settings={"help_option_names": ["-h", "--help"], "allow_interspersed_args": False}
)
@click.version_option(package_name="mrc", prog_name="mrc-run")
@click.option("-n", "--nranks", "n", type=int, required=True, help="Number of ranks.")
@click.option("--fabric", type=click.Path(exists=True, dir_okay=False), help="Fabric file.")
@click.option("--name", default="mrc", show_default=True, help="Name of the running fabric.")
@click.option("--hosts", help="Fabric host of each rank, comma-separated (default h0..).")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True, max=1e9),
    help="Communicator timeout, seconds (MRC_TIMEOUT).",
)
@click.option("--planes", help="MRC_PLANES for every rank (a loopback plane count).")
@click.option(
    "--time-limit",
    type=click.FloatRange(min=0, max=1e9),
    default=0,
    help="Stop every rank after S seconds (0: no limit).",
)
@click.option(
    "--settle",
    type=click.FloatRange(min=0, max=1e9),
    default=SETTLE_S,
    show_default=True,
    help="After a failure, seconds the others get to end by themselves before SIGTERM.",
)
@click.option(
    "--bind-to",
    type=click.Choice(BIND_MODES),
    default="none",
    show_default=True,
    help="core: rank r runs on the r-th equal block of this machine's cores.",
)
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def main(
    n: int,
    fabric: str | None,
    name: str,
    hosts: str | None,
    timeout: float | None,
    planes: str | None,
    time_limit: float,
    settle: float,
    bind_to: str,
    cmd: tuple[str, ...],
) -> None:
    """Start N ranks of CMD with the environment mrc.Communicator.from_env() reads.

    CMD's own options follow it and stay CMD's (mrc-run -n 4 python train.py -n 8); a
    `--` before CMD is optional."""
    host_list = [h.strip() for h in hosts.split(",") if h.strip()] if hosts else None
    try:
        ranks = plan(n, cmd, fabric, name, host_list, timeout, planes)
    except MrcError as e:
        err = click.ClickException(str(e))
        err.exit_code = 2 if isinstance(e, UsageError) else 1  # bad input: 2, as mrc-route
        raise err from None
    if bind_to == "core":
        for rk, cpus in zip(ranks, core_blocks(n), strict=True):
            rk.cpus = cpus
        click.echo(
            "mrc-run: bound to cores: "
            + " ".join(f"{rk.rank}:{','.join(map(str, sorted(rk.cpus or ())))}" for rk in ranks)
        )
    sys.exit(Launcher(ranks, time_limit=time_limit, settle=settle).run())


if __name__ == "__main__":
    main()
