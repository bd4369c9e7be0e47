"""Collectives over the mrc transport (issue 12): docs/architecture.md, "Collectives".

schedule: the planner (algorithms as data); ops: the Collectives mixin of
mrc.Communicator and Work (async_op=True); simulate: the numpy oracle."""

from mrc.collectives.ops import Collectives, Work

__all__ = ["Collectives", "Work"]
