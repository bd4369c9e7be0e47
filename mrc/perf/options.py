"""The options of one mrc-perf run, and the check that client and server agree on them.

perftest refuses to run when the two sides were started with different message sizes,
iteration counts or test types; mrc-perf does the same: the client sends its options in
its first control message and the server answers with a verdict naming every option that
differs, so both sides can say which one and exit instead of hanging.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_PORT = 18515  # perftest's default TCP port
MIN_SIZE = 2
MAX_SIZE = 8 << 20  # -a goes from 2 B to 8 MiB, like perftest
DEFAULT_BW_ITERS = 5000  # perftest's defaults
DEFAULT_LAT_ITERS = 1000
DEFAULT_BW_SIZE = 65536
DEFAULT_LAT_SIZE = 2

TESTS: dict[str, str] = {
    "write_bw": "MRC_Write BW Test",
    "send_bw": "MRC_Send BW Test",
    "write_lat": "MRC_Write Latency Test",
    "send_lat": "MRC_Send Latency Test",
}

# Options both sides must agree on: (field, how a user spells it).
MUST_MATCH: tuple[tuple[str, str], ...] = (
    ("test", "test"),
    ("size", "-s/--size"),
    ("all_sizes", "-a/--all"),
    ("iters", "-n/--iters"),
    ("duration", "-D/--duration"),
    ("qps", "-q/--qps"),
    ("tx_depth", "-t/--tx-depth"),
    ("verify", "--verify"),
)


@dataclass
class PerfOptions:
    test: str
    size: int
    all_sizes: bool
    iters: int
    duration: float | None
    qps: int
    tx_depth: int
    port: int
    mss: int
    timeout: float
    planes: list[str]
    server: str | None = None  # the client's target; None on the server
    report_gbits: bool = False
    verify: bool = False
    show_paths: bool = False
    fail_plane: list[tuple[int, float]] = field(default_factory=list)
    loss: list[tuple[int, float]] = field(default_factory=list)
    out_json: bool = False
    out_json_file: str | None = None
    quiet: bool = False
    cpu_util: bool = False  # perftest's --cpu_util: the machine's CPU use in the table
    planes_given: bool = False  # --planes on the command line (else the defaults)

    @property
    def is_bw(self) -> bool:
        return self.test.endswith("_bw")

    @property
    def is_write(self) -> bool:
        return self.test.startswith("write")

    def sizes(self) -> list[int]:
        """The message sizes to run: one, or every power of two from 2 B to 8 MiB (-a)."""
        if not self.all_sizes:
            return [self.size]
        out, s = [], MIN_SIZE
        while s <= MAX_SIZE:
            out.append(s)
            s <<= 1
        return out

    def wire(self) -> dict[str, Any]:
        """The options the peer checks, as sent in the hello."""
        d = asdict(self)
        return {name: d[name] for name, _ in MUST_MATCH}


def mismatches(mine: dict[str, Any], theirs: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """[(option as spelled on the command line, my value, their value)] for each difference."""
    return [
        (spelled, mine.get(name), theirs.get(name))
        for name, spelled in MUST_MATCH
        if mine.get(name) != theirs.get(name)
    ]
