"""mrc-fabric: a fabric file built as real network namespaces (root), to fail and heal."""

from __future__ import annotations

from mrc.fabric.netns import down, fail, heal, link_counters, ns_name, set_loss, status, up
from mrc.fabric.state import FabricNetError, State, load_state

__all__ = [
    "FabricNetError",
    "State",
    "down",
    "fail",
    "heal",
    "link_counters",
    "load_state",
    "ns_name",
    "set_loss",
    "status",
    "up",
]
