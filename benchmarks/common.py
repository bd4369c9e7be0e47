"""Shared helpers for benchmarks: tools, JSON results, plots."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

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


def machine() -> dict[str, Any]:
    return {
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def save(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps({"machine": machine(), **data}, indent=2) + "\n")
    return out
