"""The SRv6 Segment Routing Header (RFC 8754) as a sticky IPV6_RTHDR socket option.

Linux accepts a type-4 routing header per socket (setsockopt IPV6_RTHDR), not per packet:
the transport opens one UDP socket per path, sets the path's SRH on it, and sendto()s the
final destination, which the kernel writes into segment 0.

     0                   1                   2                   3
    +---------------+---------------+---------------+---------------+
    |  Next Header  |  Hdr Ext Len  | Routing Type=4| Segments Left |
    +---------------+---------------+---------------+---------------+
    |  Last Entry   |     Flags     |              Tag              |
    +---------------+---------------+---------------+---------------+
    |            Segment List[0] (the final destination)            |
    |                              ...                              |
    |            Segment List[n-1] (the first segment visited)      |
    +---------------------------------------------------------------+

Hdr Ext Len counts 8-octet units after the first 8 octets: 2 per 16-octet segment.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Sequence

IPPROTO_IPV6 = socket.IPPROTO_IPV6  # 41
IPV6_RTHDR = 57
IPV6_RECVRTHDR = 56
SRH_TYPE = 4
_FIXED = struct.Struct("!BBBBBBH")  # next header, hdr ext len, type, left, last, flags, tag


def build_srh(segments: Sequence[str]) -> bytes:
    """The SRH for `segments` in travel order (e.g. [spine SID, destination]).

    The list is stored reversed, so segment 0 is the final destination and Segments Left
    points at the first segment to visit. Next Header is 0: the kernel fills it in.
    """
    if not segments:
        raise ValueError("an SRH needs at least one segment")
    if len(segments) > 127:
        raise ValueError(f"too many segments ({len(segments)}); at most 127")
    n = len(segments)
    packed = [ipaddress.IPv6Address(s).packed for s in reversed(segments)]
    return _FIXED.pack(0, 2 * n, SRH_TYPE, n - 1, n - 1, 0, 0) + b"".join(packed)


def parse_srh(data: bytes) -> list[str]:
    """Segments of an SRH (as received with IPV6_RECVRTHDR), in travel order."""
    if len(data) < _FIXED.size:
        raise ValueError(f"SRH too short ({len(data)} bytes)")
    _nh, hdrlen, rtype, _left, last, _flags, _tag = _FIXED.unpack_from(data)
    if rtype != SRH_TYPE:
        raise ValueError(f"routing header type {rtype}, not 4 (SRH)")
    if len(data) < 8 + 8 * hdrlen or hdrlen < 2 * (last + 1):
        raise ValueError("SRH length does not match its last entry")
    segs = [str(ipaddress.IPv6Address(data[8 + 16 * i : 24 + 16 * i])) for i in range(last + 1)]
    return list(reversed(segs))


def set_srh(sock: socket.socket, segments: Sequence[str]) -> None:
    """Make `segments` the sticky source route of a UDP/IPv6 socket."""
    sock.setsockopt(IPPROTO_IPV6, IPV6_RTHDR, build_srh(segments))
