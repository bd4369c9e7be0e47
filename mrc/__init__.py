"""mrc: a multipath, RDMA-style reliable transport with SRv6 source routing."""

from __future__ import annotations

__version__ = "0.1.0"
