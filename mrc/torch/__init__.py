"""torch.distributed backend "mrc": `import mrc.torch`, then `dist.init_process_group("mrc")`.

    import torch.distributed as dist
    import mrc.torch  # registers the backend

    dist.init_process_group("mrc")          # env:// (torchrun), file://, tcp:// or store=
    dist.all_reduce(tensor)

The unique id of each group's mrc Communicator goes through torch's own store: the group's
rank 0 makes it and sets it, the others get it. The communicator's planes come from
MRC_FABRIC / MRC_HOST (set by mrc-run inside a fabric) or MRC_PLANES (comma-separated local
addresses, or a count of loopback planes), else 4 loopback planes 127.<1+RANK>.0.1..4.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

try:
    import torch
    import torch.distributed as dist
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "mrc.torch needs PyTorch: pip install 'mrc[torch]' (pins torch==2.13.0)"
    ) from e

from mrc.torch._tensors import TensorError
from mrc.torch.process_group import BACKEND_NAME, MrcBackendError, ProcessGroupMRC, Work

# Devices the backend registers for. CUDA tensors go through mrc.gpu's pinned-host
# staging (a collective waits for the work queued on the caller's current stream).
DEVICES = ["cpu", "cuda"]

_UID_KEY = "mrc_unique_id"
# Groups this process built, by membership: the n-th group of the same ranks takes key
# "mrc_unique_id/n". A store outlives its groups (torchrun's agent store): a group made
# again after destroy_process_group has the same prefix, and read the dead one's id.
_made: dict[tuple[int, ...], int] = {}

__all__ = [
    "BACKEND_NAME",
    "DEVICES",
    "MrcBackendError",
    "ProcessGroupMRC",
    "TensorError",
    "Work",
    "communicator",
    "create_process_group",
]


def _communicator_kwargs(global_rank: int) -> dict[str, Any]:
    """Planes, fabric and host for this process's communicator of any group.

    The communicator's defaults go by its rank in the group; a subgroup's rank 0 is not
    global rank 0, so the loopback planes and the fabric host are picked by the global rank
    (the launcher's RANK) here: every group of a process then uses that process's planes.
    """
    from mrc.collectives.communicator import loopback_planes

    kw: dict[str, Any] = {}
    fabric = os.environ.get("MRC_FABRIC")
    if fabric:
        from mrc.routing import load_fabric

        kw["fabric"] = fabric
        host = os.environ.get("MRC_HOST")
        if not host:
            hosts = load_fabric(fabric).hosts
            if global_rank >= len(hosts):
                raise ValueError(
                    f"mrc backend: rank {global_rank} has no host in {fabric} "
                    f"({len(hosts)} hosts); set MRC_HOST"
                )
            host = hosts[global_rank].name
        kw["host"] = host
        return kw
    planes = os.environ.get("MRC_PLANES", "").strip()
    if planes and not planes.isdigit():
        kw["planes"] = planes  # this process's addresses, whatever the group
    else:
        kw["planes"] = loopback_planes(global_rank, int(planes) if planes else 4)
    return kw


def _rendezvous_addr(kw: dict[str, Any], global_rank: int) -> str | None:
    """Where a group's rank 0 serves its rendezvous. Global rank 0: MASTER_ADDR (None:
    get_unique_id's default). A subgroup's rank 0 is another process, often on another
    host (a fabric host's namespace), where MASTER_ADDR is not an address of its own: it
    serves on its own first plane (on loopback planes 127.0.0.1 is everyone's)."""
    if global_rank == 0:
        return None
    if "fabric" in kw:
        from mrc.routing import load_fabric

        return load_fabric(kw["fabric"]).host(kw["host"]).addrs[0]
    planes = kw.get("planes")
    if isinstance(planes, str):  # MRC_PLANES: this process's addresses
        return planes.split(",")[0].strip()
    return None


# MRC_STATS_SOCKET: one group of the process serves it, the first (the world's) while
# it lives; after destroy_process_group the next world group serves it again
_stats_owner: ProcessGroupMRC | None = None


def create_process_group(
    store: dist.Store,
    rank: int,
    size: int,
    timeout: timedelta,
    global_ranks: list[int] | None = None,
) -> ProcessGroupMRC:
    """A ProcessGroupMRC for one group: rendezvous through store, then the mrc mesh.

    store is the group's own (prefixed) store, so every group rendezvouses apart.
    """
    import mrc

    global_rank = global_ranks[rank] if global_ranks else rank
    kw = _communicator_kwargs(global_rank)
    members = tuple(global_ranks) if global_ranks else tuple(range(size))
    _made[members] = _made.get(members, 0) + 1  # the same count on every member
    key = f"{_UID_KEY}/{_made[members]}"
    if rank == 0:
        uid = mrc.get_unique_id(_rendezvous_addr(kw, global_rank))
        store.set(key, uid)
    else:
        # a store get blocks until rank 0 has set it, for at most the store's timeout
        uid = bytes(store.get(key))
    # MRC_TIMEOUT (mrc-run --timeout) overrides the group's timeout for the communicator:
    # torch's default of 30 minutes is long for noticing a hung peer
    secs = float(os.environ.get("MRC_TIMEOUT") or timeout.total_seconds())
    global _stats_owner
    stats = os.environ.get("MRC_STATS_SOCKET")
    serve = bool(stats) and (_stats_owner is None or _stats_owner.closed)
    if serve:
        kw["stats_socket"] = stats  # the communicator puts its rank, the global one, in
    if os.environ.get("MRC_ENDPOINT_TIMEOUT"):  # the transport's give-up (README)
        from mrc.collectives.communicator import seconds_var

        kw["endpoint"] = {"timeout": seconds_var(os.environ, "MRC_ENDPOINT_TIMEOUT")}
    comm = mrc.Communicator(rank, size, uid, timeout=secs, **kw)
    pg = ProcessGroupMRC(comm, rank, size, timeout)
    if serve:
        _stats_owner = pg
    return pg


def _create(opts: Any, pg_options: Any = None) -> ProcessGroupMRC:
    # extended_api: one DistributedBackendOptions with the group's store, rank, size, timeout
    return create_process_group(
        opts.store,
        opts.group_rank,
        opts.group_size,
        opts.timeout,
        list(opts.global_ranks_in_group),
    )


def communicator(group: Any = None) -> Any:
    """The mrc Communicator of a process group (default: WORLD), e.g. for .endpoint.inject."""
    pg = dist.distributed_c10d._get_default_group() if group is None else group
    if not isinstance(pg, ProcessGroupMRC):
        raise TypeError(f"{pg!r} is not an mrc process group (backend {dist.get_backend(pg)})")
    return pg.communicator


def _register() -> None:
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=DEVICES)


def _autoload() -> None:
    """The "torch.backends" entry point: importing this module already registered "mrc"."""


_register()
del torch  # only imported to fail early with the install hint
