"""Shared helpers for benchmarks: tools, JSON results, plots."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from mrc.fabric.netns import kernel_has_seg6local
from mrc.perf.stats import machine_jiffies

# OpenBLAS worker threads spin and steal the two cores the datapath needs.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

RESULTS = Path(__file__).resolve().parent / "results"


def ensure_tool(cmd: str, package: str) -> str:
    """The path of `cmd`, installing Debian's `package` with apt-get when missing."""
    path = shutil.which(cmd)
    if path:
        return path
    if os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", package],
            check=True,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
        path = shutil.which(cmd)
    if not path:
        raise SystemExit(f"benchmark needs '{cmd}' (Debian package {package})")
    return path


_BUSY_BEFORE: float | None = None
_STAT_AT_START: tuple[int, int, int] | None = None
IDLE_BELOW = 0.1  # busy cores in the second before a run: under this, an idle machine


def busy_cores(seconds: float = 1.0) -> float:
    """Cores busy on the whole machine over `seconds` (/proc/stat, a measurement
    interval): taken before a run, it says whether its numbers come from an otherwise
    idle machine, as committed numbers must."""
    t0, b0, _ = machine_jiffies()
    time.sleep(seconds)
    t1, b1, _ = machine_jiffies()
    jiffies = t1 - t0
    return round((b1 - b0) / jiffies * (os.cpu_count() or 1), 3) if jiffies else 0.0


def steal_since_start() -> float | None:
    """The share of the machine's CPU time the hypervisor gave to someone else since
    record_load() (/proc/stat steal): on a shared VM the reason one run of a
    CPU-bound benchmark is 20-30% slower than the next."""
    if _STAT_AT_START is None:
        return None
    total, _, steal = machine_jiffies()
    jiffies = total - _STAT_AT_START[0]
    return round((steal - _STAT_AT_START[2]) / jiffies, 3) if jiffies else 0.0


def record_load() -> float:
    """Call first in a benchmark's main: the machine's load before the run goes into
    every result it saves (machine.busy_cores_before_run, machine.idle)."""
    global _BUSY_BEFORE, _STAT_AT_START
    _BUSY_BEFORE = busy_cores()
    _STAT_AT_START = machine_jiffies()
    if _BUSY_BEFORE >= IDLE_BELOW:
        print(f"note: {_BUSY_BEFORE:.2f} cores busy before the run: the machine is not idle")
    return _BUSY_BEFORE


def load_note() -> str:
    """The results' note on the machine's load, from record_load()'s measurement."""
    if _BUSY_BEFORE is None:
        return "machine load before the run not measured"
    if _BUSY_BEFORE < IDLE_BELOW:
        return f"idle machine ({_BUSY_BEFORE:.2f} cores busy in the second before the run)"
    return f"machine shared with other work ({_BUSY_BEFORE:.2f} cores busy before the run)"


def machine() -> dict[str, Any]:
    return {
        "host": platform.node(),
        "kernel": platform.release(),
        # False: SRv6 paths use the sticky header (GSO batches cut at the sender), so
        # fabric numbers are not comparable with a kernel's that has seg6 lwtunnels.
        "seg6_lwtunnel": kernel_has_seg6local() if os.geteuid() == 0 else None,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "busy_cores_before_run": _BUSY_BEFORE,
        "idle": None if _BUSY_BEFORE is None else _BUSY_BEFORE < IDLE_BELOW,
        "steal_during_run": steal_since_start(),
    }


def save(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps({"machine": machine(), **data}, indent=2) + "\n")
    return out


class CpuMeter:
    """CPU spent while the block runs, two ways: by the processes it started and
    waited for (getrusage of the children: user + system), and by the whole machine
    (/proc/stat: every jiffy neither idle nor stolen by the hypervisor, which also
    holds the kernel's softirq work of forwarding through the fabric's namespaces,
    and anything else running). On a machine shared with other work the second is an
    upper bound. machine_steal: the share of the machine's time stolen meanwhile.

        with CpuMeter() as cpu:
            ...run and wait for the processes...
        cpu.result(gigabytes)  # {"proc_cpu_s", "machine_busy_cpu_s", "*_per_gb", ...}
    """

    def __enter__(self) -> CpuMeter:
        import resource

        self._ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        self._stat0 = machine_jiffies()
        self._t0 = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        import resource

        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        total, busy, steal = machine_jiffies()
        self.elapsed = time.monotonic() - self._t0
        self.proc_cpu_s = (ru.ru_utime - self._ru.ru_utime) + (ru.ru_stime - self._ru.ru_stime)
        jiffies = total - self._stat0[0]
        busy -= self._stat0[1]
        stolen = steal - self._stat0[2]
        hz = os.sysconf("SC_CLK_TCK")
        self.machine_busy_cpu_s = busy / hz
        self.machine_idle = (jiffies - busy - stolen) / jiffies if jiffies else 0.0
        self.machine_steal = stolen / jiffies if jiffies else 0.0

    def result(self, gigabytes: float) -> dict[str, Any]:
        gb = gigabytes or float("nan")
        return {
            "elapsed_s": round(self.elapsed, 3),
            "proc_cpu_s": round(self.proc_cpu_s, 3),
            "proc_cpu_s_per_gb": round(self.proc_cpu_s / gb, 3),
            "machine_busy_cpu_s": round(self.machine_busy_cpu_s, 3),
            "machine_busy_cpu_s_per_gb": round(self.machine_busy_cpu_s / gb, 3),
            "machine_idle": round(self.machine_idle, 3),
            "machine_steal": round(self.machine_steal, 3),
        }


class CpuTrace:
    """The machine's CPU time (/proc/stat, as CpuMeter) sampled every `interval` seconds
    while the block runs, so that CPU per byte can be taken over the window in which
    every flow of a run is moving, without the processes' start and exit (eight Python
    processes importing, filling and hashing their buffers: 6-7 CPU-s, 0.8 CPU-s/GB of a
    5 s mrc ring, measured by running it for 2 and 8 s).

        with CpuTrace() as trace:
            ...run...
        trace.window(t0, t1)  # {"cpu_s", "steal", "seconds"} between Unix times t0, t1
    """

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.samples: list[tuple[float, int, int, int]] = []  # (time, all, busy, steal)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        self.samples.append((time.time(), *machine_jiffies()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> CpuTrace:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def window(self, t0: float, t1: float) -> dict[str, float] | None:
        """Busy CPU-seconds and the stolen share between the first sample at or after t0
        and the last at or before t1 (None when fewer than two samples fall inside)."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return None
        (ta, alla, busya, steala), (tb, allb, busyb, stealb) = inside[0], inside[-1]
        hz = os.sysconf("SC_CLK_TCK")
        return {
            "seconds": tb - ta,
            "cpu_s": (busyb - busya) / hz,
            "steal": (stealb - steala) / (allb - alla) if allb > alla else 0.0,
        }


def iperf3_tcp_streams(
    fab: Any, streams: list[tuple[str, str, int]], seconds: float
) -> list[dict[str, Any]]:
    """iperf3 TCP streams all at once on a running fabric: for each (src host, dst host,
    plane) a server in dst bound to that plane's address, then a client in src bound to
    its own plane address, for `seconds`. Returns per stream Gb/s, bytes received and
    t_start (Unix time its client was started)."""
    from mrc.fabric.testing import wait_tcp_listening
    from mrc.routing import host_planes

    iperf = ensure_tool("iperf3", "iperf3")
    srvs, clis = [], []
    for i, (_, dst, plane) in enumerate(streams):
        port = 5201 + i
        d = host_planes(fab.fabric, dst)[plane]
        srvs.append(
            fab.popen(dst, [iperf, "-s", "-1", "-B", d, "-p", str(port)], stdout=subprocess.DEVNULL)
        )
        wait_tcp_listening(fab, dst, port)
    for i, (src, dst, plane) in enumerate(streams):
        s, d = host_planes(fab.fabric, src)[plane], host_planes(fab.fabric, dst)[plane]
        cmd = [iperf, "-c", d, "-B", s, "-p", str(5201 + i), "-t", str(seconds), "-J"]
        clis.append((time.time(), fab.popen(src, cmd, stdout=subprocess.PIPE)))
    out = []
    for (src, dst, plane), (t_start, c) in zip(streams, clis, strict=True):
        text, _ = c.communicate(timeout=seconds + 30)
        end = json.loads(text)["end"]["sum_received"]
        out.append(
            {
                "src": src,
                "dst": dst,
                "plane": plane,
                "gbps": end["bits_per_second"] / 1e9,
                "bytes": end["bytes"],
                "t_start": t_start,
            }
        )
    for s in srvs:
        s.wait(timeout=10)
    return out
