/*
 * wire.h - the mrc packet format (one UDP datagram = one packet).
 *
 * Every packet starts with the common header; its type says which extension
 * follows. All fields are little-endian (the code requires a little-endian
 * host and refuses to build elsewhere). Byte-by-byte layout: docs/wire.md.
 *
 *  0                   1                   2                   3
 *  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
 * +-------------------------------+---------------+---------------+
 * |         magic 0x4d52          |  version = 4  |     type      |
 * +---------------+---------------+-------------------------------+
 * |     flags     |    path id    |        payload length         |
 * +---------------+---------------+-------------------------------+
 * |              connection id (the receiver's id)                |
 * +---------------------------------------------------------------+
 * |      psn (DATA: this packet; ACK: cumulative; NAK: refused)    |
 * +---------------------------------------------------------------+
 * |         timestamp, ns (DATA/PROBE: sender's; ACK: echoed)      |
 * |                                                               |
 * +---------------------------------------------------------------+
 *  DATA (WRITE, SEND) extension, 32 bytes:
 * |  msn  |  imm  |  key (WRITE: rkey; SEND: tag)  |  offset  |  msg_len  |
 *  then, with flag ACKS, a whole ACK packet (header, extension, echoes) for
 *  the same connection, then `payload length` bytes of payload.
 *  ACK extension, 80 bytes, then `payload length` / 24 further echoes:
 * |  sack_base  |  echo_psn  |  echo_rx_ts  |  sack bitmap, 512 bits        |
 * |  path | 0 0 0 |  psn  |  ts  |  rx_ts  |  (each further echo, 24 bytes) |
 *  NAK extension, 8 bytes:  |  msn  |  code  |
 */
#ifndef MRC_WIRE_H
#define MRC_WIRE_H

#include <assert.h>
#include <stddef.h>
#include <stdint.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "mrc's wire format is little-endian and this code assumes a little-endian host"
#endif

#define MRC_MAGIC 0x4d52u
/* 2: an ACK echoes every path that delivered; 3: each echo also says when the
 * receiver got that packet (its clock), for the path's one-way delay; 4: DATA
 * may carry an ACK (flag ACKS) and say that its own ACK may wait (flag LAZY) */
#define MRC_WIRE_VERSION 4u

enum mrc_pkt_type {
    MRC_PKT_WRITE = 1,     /* DATA: RDMA WRITE into (key, offset) */
    MRC_PKT_SEND = 2,      /* DATA: part of a two-sided tagged message */
    MRC_PKT_ACK = 3,       /* cumulative + selective ack, echoes path and ts */
    MRC_PKT_NAK = 4,       /* a DATA packet was refused (key/bounds) */
    MRC_PKT_PROBE = 5,     /* path liveness probe */
    MRC_PKT_PROBE_ACK = 6, /* answer to a probe, echoes path and ts */
    MRC_PKT_CLOSE = 7,     /* the sender closed the connection */
    MRC_PKT_TYPE_MAX = 8,
};

/* DATA flags */
#define MRC_F_FIRST 0x01u /* first packet of a message */
#define MRC_F_LAST 0x02u  /* last packet of a message */
#define MRC_F_IMM 0x04u   /* WRITE with immediate: deliver imm when complete */
/* Nobody waits for this packet's ACK (a send whose completion only frees a
 * buffer later): the receiver may hold the ACK, up to MRC_ACK_DELAY_NS, for
 * data of its own going back, which then carries it (MRC_F_ACKS). */
#define MRC_F_LAZY 0x10u
#define MRC_F_ACKS 0x20u  /* an ACK packet follows the data extension */
/* CLOSE flags */
#define MRC_F_CUM 0x08u   /* ts carries the closer's cumulative receive PSN */

struct mrc_hdr {
    uint16_t magic;
    uint8_t version;
    uint8_t type;
    uint8_t flags;
    uint8_t path;
    uint16_t len;  /* payload bytes after the extension */
    uint32_t conn; /* receiver's connection id */
    uint32_t psn;
    uint64_t ts;
};
static_assert(sizeof(struct mrc_hdr) == 24, "common header is 24 bytes");

struct mrc_data_ext {
    uint32_t msn;      /* message sequence number on the connection */
    uint32_t imm;
    uint64_t key;      /* WRITE: remote key; SEND: tag */
    uint64_t offset;   /* WRITE: offset in the region; SEND: offset in message */
    uint64_t msg_len;  /* total bytes of the message */
};
static_assert(sizeof(struct mrc_data_ext) == 32, "data extension is 32 bytes");

#define MRC_SACK_BITS 512
struct mrc_ack_ext {
    uint32_t sack_base;
    uint32_t echo_psn;
    uint64_t echo_rx_ts; /* when the receiver got echo_psn, ns of its own clock */
    uint64_t sack[MRC_SACK_BITS / 64];
};
static_assert(sizeof(struct mrc_ack_ext) == 80, "ack extension is 80 bytes");

/* One ACK answers every path of its connection that delivered since the last
 * one: the header's path and ts and the extension's echo_psn and echo_rx_ts
 * are the first echo, these follow the extension (the header's len counts
 * their bytes). */
struct mrc_ack_echo {
    uint8_t path;
    uint8_t pad[3]; /* zero, ignored */
    uint32_t psn;   /* the latest packet the receiver got on this path */
    uint64_t ts;    /* its send timestamp */
    uint64_t rx_ts; /* when the receiver got it, ns of the receiver's clock */
};
static_assert(sizeof(struct mrc_ack_echo) == 24, "ack echo is 24 bytes");
#define MRC_ACK_ECHO_MAX 7 /* further echoes per ACK: 8 paths; more take another ACK */

struct mrc_nak_ext {
    uint32_t msn;
    uint32_t code; /* MRC_NAK_* */
};
static_assert(sizeof(struct mrc_nak_ext) == 8, "nak extension is 8 bytes");

enum {
    MRC_NAK_KEY = 1,    /* unknown key or region not remotely writable: fatal */
    MRC_NAK_BOUNDS = 2, /* outside the region: fatal */
    MRC_NAK_RNR = 3,    /* receiver not ready: no RECV and no staging room; retry later */
    /* Not a refusal: the receiver that refused this connection (RNR) has
     * posted a RECV since, so the sender need not wait out its back-off. psn
     * and msn are 0. Best effort: if it is lost the back-off still ends. A
     * peer that predates it drops it as a bad ACK and waits out its timer. */
    MRC_NAK_READY = 4,
};

#define MRC_DATA_HDR_LEN (sizeof(struct mrc_hdr) + sizeof(struct mrc_data_ext))
#define MRC_ACK_LEN (sizeof(struct mrc_hdr) + sizeof(struct mrc_ack_ext))
#define MRC_ACK_MAX_LEN (MRC_ACK_LEN + MRC_ACK_ECHO_MAX * sizeof(struct mrc_ack_echo))
#define MRC_NAK_LEN (sizeof(struct mrc_hdr) + sizeof(struct mrc_nak_ext))
#define MRC_CTRL_LEN (sizeof(struct mrc_hdr))
/* The longest header before a DATA packet's payload: one carrying an ACK. */
#define MRC_DATA_ACKS_MAX_LEN (MRC_DATA_HDR_LEN + MRC_ACK_MAX_LEN)

/* Bytes before a well-formed DATA packet's payload (mrc_pkt_validate passed). */
static inline size_t mrc_data_hdr_len(const struct mrc_hdr *h)
{
    if (!(h->flags & MRC_F_ACKS))
        return MRC_DATA_HDR_LEN;
    const struct mrc_hdr *a = (const struct mrc_hdr *)((const uint8_t *)h + MRC_DATA_HDR_LEN);
    return MRC_DATA_HDR_LEN + MRC_ACK_LEN + a->len;
}

/* Checks that buf[0..len) is a well-formed packet: header, extension and
 * payload length agree, payload no larger than max_payload. Returns 0 or an
 * MRC_DROP_* reason. Pure: touches no state, so it runs before anything else. */
int mrc_pkt_validate(const void *buf, size_t len, uint32_t max_payload);

/* One-line description of a packet for logs; returns buf. */
char *mrc_pkt_to_string(const void *pkt, size_t len, char *buf, size_t buflen);

/* Serial-number arithmetic on 32-bit PSNs (RFC 1982). */
static inline int32_t psn_diff(uint32_t a, uint32_t b) { return (int32_t)(a - b); }
static inline int psn_lt(uint32_t a, uint32_t b) { return psn_diff(a, b) < 0; }

#endif /* MRC_WIRE_H */
