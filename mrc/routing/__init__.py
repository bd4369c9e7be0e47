"""Source routing: fabric files (routing/*.toml) compiled into the static SRv6 route table."""

from __future__ import annotations

from mrc.routing.fabric import Fabric, FabricError, Host, Link, Switch, load_fabric, parse_fabric
from mrc.routing.srh import build_srh, parse_srh, set_srh
from mrc.routing.table import (
    FAILED,
    UP,
    Path,
    Problem,
    Table,
    candidate_paths,
    check_table,
    compile_table,
    diff_tables,
    host_planes,
    paths,
)

__all__ = [
    "FAILED",
    "UP",
    "Fabric",
    "FabricError",
    "Host",
    "Link",
    "Path",
    "Problem",
    "Switch",
    "Table",
    "build_srh",
    "candidate_paths",
    "check_table",
    "compile_table",
    "diff_tables",
    "host_planes",
    "load_fabric",
    "parse_fabric",
    "parse_srh",
    "paths",
    "set_srh",
]
