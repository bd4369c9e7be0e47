"""Endpoints placed on a fabric: connections whose paths come from the route table.

    fe = fabric_endpoint("routing/4host-4plane.toml", "h0")
    conn = fe.connect("h1", port)          # sprays over every (plane, spine) path to h1

The endpoint's planes are the host's NIC addresses (index = plane); each connection
gets the table's paths to its peer, each an SRv6 segment list set on its own socket.
Path ids are mirrored in the table, so both directions of path k share plane and spine.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable
from pathlib import Path as FsPath
from typing import Any

from mrc import Connection, Endpoint, MrcError, UsageError
from mrc.routing import Fabric, Path, host_planes, load_fabric, paths


class FabricEndpoint:
    """An mrc.Endpoint on one host of a fabric."""

    def __init__(self, fabric: Fabric, host: str, failed: Iterable[str] = (), **ep: Any):
        self.fabric = fabric
        self.host = fabric.host(host).name  # raises FabricError for an unknown host
        self.failed = frozenset(failed)
        planes = host_planes(fabric, host)
        try:
            self.endpoint = Endpoint(planes, **ep)
        except MrcError as e:
            if getattr(e, "code", None) != -errno.EADDRNOTAVAIL:
                raise
            raise UsageError(
                f"host {self.host}'s addresses ({', '.join(planes)}) are not on this machine's "
                f"interfaces: run this inside the host's namespace, e.g. `mrc-fabric exec "
                f"{self.host} --name NAME -- COMMAND` ({e})"
            ) from e

    def paths_to(self, peer: str) -> list[Path]:
        """The route table's usable paths from this host to `peer`."""
        return paths(self.fabric, self.host, peer, self.failed)

    def listen(self, port: int = 0) -> int:
        """Listen for connection hellos on every plane address of this host."""
        return self.endpoint.listen(port)

    def connect(self, peer: str, port: int, timeout: float | None = 5.0) -> Connection:
        """Connect to `peer` (a host name of the fabric) listening on `port`: the set-up
        races over every plane of the peer, so it works while any plane is up."""
        return self.endpoint.connect(
            host_planes(self.fabric, peer),
            port,
            timeout=timeout,
            paths=self.paths_to(peer),
            name=self.host,
        )

    def accept(self, timeout: float | None = None) -> Connection:
        """Accept one connection; its paths come from the table, by the peer's name (this
        host's name goes back to the peer)."""
        return self.endpoint.accept(timeout=timeout, paths=self.paths_to, name=self.host)

    def close(self) -> None:
        self.endpoint.close()

    def __enter__(self) -> FabricEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fabric_endpoint(
    fabric: str | FsPath | Fabric, host: str, failed: Iterable[str] = (), **ep: Any
) -> FabricEndpoint:
    """An endpoint for `host` of the fabric file (or Fabric) `fabric`."""
    fab = fabric if isinstance(fabric, Fabric) else load_fabric(fabric)
    return FabricEndpoint(fab, host, failed, **ep)
