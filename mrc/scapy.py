"""Scapy dissector for the mrc wire format (docs/wire.md, src_c/wire.h).

Layers: ``MRC`` (the 24-byte common header) followed by ``MRCData`` (types WRITE
and SEND, then ``len`` payload bytes as ``Raw``), ``MRCAck`` or ``MRCNak``, chosen
by ``type``; an ACK's further echoes (``len`` / 24 of them, one per other path
that delivered) are ``MRCAck.echoes``, a list of ``MRCAckEcho``; PROBE, PROBE_ACK
and CLOSE have no extension. All fields are little-endian.

mrc has no fixed UDP port (one ephemeral port per plane by default), so there are
two ways to get packets decoded:

* ``bind_port(port)`` binds the layer to one UDP port (both directions);
  ``DEFAULT_PORT`` (4793) is the one tools bind when told nothing else.
* ``install_heuristic()`` makes every UDP payload that starts with the mrc magic
  and version decode as ``MRC``, whatever the ports; ``decode(pkt)`` does the
  same for one packet read before the hook was installed.

Scapy is imported here only (it is a test/tool dependency, not a runtime one):
importing ``mrc`` never imports scapy.
"""

from __future__ import annotations

import struct
from typing import Any

from scapy.fields import (
    ByteEnumField,
    ByteField,
    FieldListField,
    FlagsField,
    LEIntField,
    LELongField,
    LEShortField,
    PacketListField,
    StrFixedLenField,
    XLELongField,
    XLEShortField,
)
from scapy.layers.inet import UDP
from scapy.packet import Packet, Raw, bind_layers

__all__ = [
    "DEFAULT_PORT",
    "ECHO_LEN",
    "F_ACKS",
    "MAGIC",
    "VERSION",
    "MRC",
    "MRCAck",
    "MRCAckEcho",
    "MRCData",
    "MRCNak",
    "PKT_TYPES",
    "bind_port",
    "decode",
    "install_heuristic",
    "is_mrc",
    "sack_psns",
]

DEFAULT_PORT = 4793
MAGIC = 0x4D52
VERSION = 4
HDR_LEN = 24
ECHO_LEN = 24  # one further echo of an ACK
EXT_LEN = {1: 32, 2: 32, 3: 80, 4: 8}  # extension bytes after the header, by type
LEN_TYPES = (1, 2, 3)  # types whose ``len`` counts bytes after the extension
DATA_TYPES = (1, 2)  # WRITE, SEND
F_ACKS = 0x20  # DATA: an ACK packet follows the extension, then the payload
PKT_TYPES = {
    1: "WRITE",
    2: "SEND",
    3: "ACK",
    4: "NAK",
    5: "PROBE",
    6: "PROBE_ACK",
    7: "CLOSE",
}
NAK_CODES = {1: "bad_key", 2: "bad_bounds", 3: "rnr", 4: "ready"}


class MRC(Packet):  # type: ignore[misc]
    """Common header, 24 bytes."""

    name = "MRC"
    fields_desc = [
        XLEShortField("magic", MAGIC),
        ByteField("version", VERSION),
        ByteEnumField("type", 1, PKT_TYPES),
        FlagsField("flags", 0, 8, ["FIRST", "LAST", "IMM", "CUM", "LAZY", "ACKS"]),
        ByteField("path", 0),
        LEShortField("len", None),
        LEIntField("conn", 0),
        LEIntField("psn", 0),
        LELongField("ts", 0),
    ]

    def post_build(self, pkt: bytes, pay: bytes) -> bytes:
        if self.len is None:
            # bytes after the extension: DATA's payload, an ACK's further echoes
            ext = EXT_LEN.get(self.type, 0)
            if self.type in DATA_TYPES and int(self.flags) & F_ACKS:
                ext += _carried_len(pay[ext:])
            n = max(len(pay) - ext, 0) if self.type in LEN_TYPES else 0
            if self.type == 3 and isinstance(self.payload, MRCAck):
                n = len(self.payload.echoes) * ECHO_LEN  # not the data after a carried ACK
            pkt = pkt[:6] + struct.pack("<H", n) + pkt[8:]
        return pkt + pay

    def guess_payload_class(self, payload: bytes) -> Any:
        return {1: MRCData, 2: MRCData, 3: MRCAck, 4: MRCNak}.get(self.type, Raw)

    def mysummary(self) -> str:
        return self.sprintf("MRC %MRC.type% conn=%MRC.conn% path=%MRC.path% psn=%MRC.psn%")


def _carried_len(data: bytes) -> int:
    """Bytes of the ACK packet at the start of ``data`` (what DATA with ACKS carries)."""
    if len(data) < HDR_LEN + EXT_LEN[3]:
        return len(data)
    return HDR_LEN + EXT_LEN[3] + int(struct.unpack_from("<H", data, 6)[0])


class MRCData(Packet):  # type: ignore[misc]
    """DATA extension (WRITE, SEND), 32 bytes; with flag ACKS the ACK it carries
    follows as an MRC layer (its payload is then the data), else the payload as Raw."""

    name = "MRCData"
    fields_desc = [
        LEIntField("msn", 0),
        LEIntField("imm", 0),
        XLELongField("key", 0),
        LELongField("offset", 0),
        LELongField("msg_len", 0),
    ]

    def guess_payload_class(self, payload: bytes) -> Any:
        under = self.underlayer
        if under is not None and int(under.flags) & F_ACKS:
            return MRC
        return Raw


class MRCAckEcho(Packet):  # type: ignore[misc]
    """One further echo of an ACK, 24 bytes: a path that delivered, its latest PSN,
    that packet's send timestamp and when the receiver got it (the receiver's clock)."""

    name = "MRCAckEcho"
    fields_desc = [
        ByteField("path", 0),
        StrFixedLenField("pad", b"\0\0\0", 3),
        LEIntField("psn", 0),
        LELongField("ts", 0),
        LELongField("rx_ts", 0),
    ]

    def extract_padding(self, s: bytes) -> tuple[bytes, bytes]:
        return b"", s


def _echo_count(ack: Any) -> int:
    under = ack.underlayer
    return (under.len or 0) // ECHO_LEN if under is not None else 0


class MRCAck(Packet):  # type: ignore[misc]
    """ACK extension, 80 bytes: SACK base, echoed PSN, when the receiver got that
    packet (``echo_rx_ts``), 8 little-endian u64 words; then the header's ``len`` / 24
    further echoes (``echoes``)."""

    name = "MRCAck"
    fields_desc = [
        LEIntField("sack_base", 0),
        LEIntField("echo_psn", 0),
        LELongField("echo_rx_ts", 0),
        FieldListField("sack", [0] * 8, XLELongField("", 0), count_from=lambda _p: 8),
        PacketListField("echoes", [], MRCAckEcho, count_from=_echo_count),
    ]

    def guess_payload_class(self, payload: bytes) -> Any:
        return Raw


class MRCNak(Packet):  # type: ignore[misc]
    """NAK extension, 8 bytes."""

    name = "MRCNak"
    fields_desc = [LEIntField("msn", 0), LEIntField("code", 1)]

    def guess_payload_class(self, payload: bytes) -> Any:
        return Raw


bind_layers(MRC, MRCData, type=1)
bind_layers(MRC, MRCData, type=2)
bind_layers(MRC, MRCAck, type=3)
bind_layers(MRC, MRCNak, type=4)

_bound_ports: set[int] = set()
_heuristic_installed = False
_orig_udp_guess: Any = None


def bind_port(port: int = DEFAULT_PORT) -> None:
    """Decodes UDP traffic to or from ``port`` as MRC. Calling it again is a no-op."""
    if port in _bound_ports:
        return
    bind_layers(UDP, MRC, dport=port)
    bind_layers(UDP, MRC, sport=port)
    _bound_ports.add(port)


def is_mrc(data: bytes) -> bool:
    """True if ``data`` starts like an mrc packet (length, magic and version)."""
    return len(data) >= HDR_LEN and data[0:2] == b"\x52\x4d" and data[2] == VERSION


def install_heuristic() -> None:
    """Decodes any UDP payload that starts with mrc's magic and version as MRC.

    Wraps ``UDP.guess_payload_class``: port bindings made elsewhere still win when
    the payload does not look like mrc. Idempotent.
    """
    global _heuristic_installed, _orig_udp_guess
    if _heuristic_installed:
        return
    _orig_udp_guess = UDP.guess_payload_class

    def guess(self: Any, payload: bytes) -> Any:
        if is_mrc(bytes(payload[:HDR_LEN])):
            return MRC
        return _orig_udp_guess(self, payload)

    UDP.guess_payload_class = guess
    _heuristic_installed = True


def decode(pkt: Any) -> Any:
    """The MRC layer of a scapy packet (decoding its UDP payload if needed), or None."""
    if pkt.haslayer(MRC):
        return pkt[MRC]
    if not pkt.haslayer(UDP):
        return None
    data = bytes(pkt[UDP].payload)
    return MRC(data) if is_mrc(data) else None


def split(data: bytes) -> list[bytes]:
    """The mrc packets in one UDP payload. The sender hands the kernel runs of packets
    as one UDP GSO datagram; a capture taken before the stack cuts it (on lo or a
    veth) shows them back to back, and each header's ``len`` says where the next one
    starts. Trailing bytes that do not form a whole packet are left out."""
    out = []
    while is_mrc(data[:HDR_LEN]):
        typ = data[3]
        n = HDR_LEN + EXT_LEN.get(typ, 0)
        if typ in DATA_TYPES and data[4] & F_ACKS:
            n += _carried_len(data[n:])  # the ACK it carries, before the payload
        if typ in LEN_TYPES:
            n += struct.unpack_from("<H", data, 6)[0]
        if n > len(data):
            break
        out.append(data[:n])
        data = data[n:]
    return out


def decode_all(pkt: Any) -> list[Any]:
    """Every MRC packet a scapy packet carries (several when it is a GSO datagram)."""
    if not pkt.haslayer(UDP):
        return []
    return [MRC(p) for p in split(bytes(pkt[UDP].payload))]


def sack_psns(ack: Any) -> list[int]:
    """PSNs an ``MRCAck`` reports as received in its SACK bitmap."""
    out = []
    for w, word in enumerate(ack.sack):
        while word:
            b = (word & -word).bit_length() - 1
            out.append((ack.sack_base + w * 64 + b) & 0xFFFFFFFF)
            word &= word - 1
    return out
