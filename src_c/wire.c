/* wire.c - validation and printing of mrc packets. */
#include "wire.h"

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "mrc.h"

static const char *const pkt_type_names[MRC_PKT_TYPE_MAX] = {
    [MRC_PKT_WRITE] = "WRITE", [MRC_PKT_SEND] = "SEND",   [MRC_PKT_ACK] = "ACK",
    [MRC_PKT_NAK] = "NAK",     [MRC_PKT_PROBE] = "PROBE", [MRC_PKT_PROBE_ACK] = "PROBE_ACK",
    [MRC_PKT_CLOSE] = "CLOSE",
};

/* Size of header + extension for each type; 0 = unknown type. */
static const size_t pkt_fixed_len[MRC_PKT_TYPE_MAX] = {
    [MRC_PKT_WRITE] = MRC_DATA_HDR_LEN, [MRC_PKT_SEND] = MRC_DATA_HDR_LEN,
    [MRC_PKT_ACK] = MRC_ACK_LEN,        [MRC_PKT_NAK] = MRC_NAK_LEN,
    [MRC_PKT_PROBE] = MRC_CTRL_LEN,     [MRC_PKT_PROBE_ACK] = MRC_CTRL_LEN,
    [MRC_PKT_CLOSE] = MRC_CTRL_LEN,
};

int mrc_pkt_validate(const void *buf, size_t len, uint32_t max_payload)
{
    const struct mrc_hdr *h = buf;

    if (len < sizeof(*h))
        return MRC_DROP_TRUNCATED;
    if (h->magic != MRC_MAGIC)
        return MRC_DROP_BAD_MAGIC;
    if (h->version != MRC_WIRE_VERSION)
        return MRC_DROP_BAD_VERSION;
    if (h->type == 0 || h->type >= MRC_PKT_TYPE_MAX)
        return MRC_DROP_BAD_TYPE;
    size_t fixed = pkt_fixed_len[h->type];
    if (len < fixed)
        return MRC_DROP_TRUNCATED;
    bool data = h->type == MRC_PKT_WRITE || h->type == MRC_PKT_SEND;
    if (data && (h->flags & MRC_F_ACKS)) {
        /* The ACK it carries is held to everything a lone ACK is, and must
         * be for the same connection. */
        const uint8_t *in = (const uint8_t *)buf + MRC_DATA_HDR_LEN;
        const struct mrc_hdr *a = (const struct mrc_hdr *)in;
        if (len < MRC_DATA_HDR_LEN + MRC_ACK_LEN)
            return MRC_DROP_TRUNCATED;
        if (a->type != MRC_PKT_ACK || a->flags || a->conn != h->conn)
            return MRC_DROP_BAD_ACK;
        if (a->len > len - MRC_DATA_HDR_LEN - MRC_ACK_LEN)
            return MRC_DROP_TRUNCATED;
        int bad = mrc_pkt_validate(in, MRC_ACK_LEN + a->len, 0);
        if (bad)
            return bad;
        fixed += MRC_ACK_LEN + a->len;
    }
    /* Only DATA carries a payload, and an ACK its further echoes; the length
     * must match the datagram exactly: a mismatch means truncation or
     * trailing garbage. */
    if (h->len != len - fixed)
        return MRC_DROP_BAD_LENGTH;
    if (h->type == MRC_PKT_ACK) {
        if (h->len % sizeof(struct mrc_ack_echo) ||
            h->len / sizeof(struct mrc_ack_echo) > MRC_ACK_ECHO_MAX)
            return MRC_DROP_BAD_LENGTH;
        return 0;
    }
    if (!data) {
        if (h->len != 0)
            return MRC_DROP_BAD_LENGTH;
        return 0;
    }
    if (h->len > max_payload)
        return MRC_DROP_BAD_LENGTH;
    const struct mrc_data_ext *d = (const void *)(h + 1);
    /* The packet must lie inside its message. A SEND's offset is inside the
     * message: offset + len <= msg_len, written so that it cannot overflow.
     * A WRITE's offset is in the remote region, checked against it later. */
    if (d->msg_len < h->len)
        return MRC_DROP_BAD_MSG;
    if (h->type == MRC_PKT_SEND && d->offset > d->msg_len - h->len)
        return MRC_DROP_BAD_MSG;
    return 0;
}

char *mrc_pkt_to_string(const void *pkt, size_t len, char *buf, size_t buflen)
{
    const struct mrc_hdr *h = pkt;
    if (len < sizeof(*h)) {
        snprintf(buf, buflen, "runt(%zu bytes)", len);
        return buf;
    }
    const char *tn = h->type < MRC_PKT_TYPE_MAX && pkt_type_names[h->type]
                         ? pkt_type_names[h->type] : "?";
    int n = snprintf(buf, buflen, "%s conn=%08x path=%u psn=%u len=%u flags=%#x", tn,
                     (unsigned)h->conn, h->path, (unsigned)h->psn, h->len, h->flags);
    if (n < 0 || (size_t)n >= buflen)
        return buf;
    if ((h->type == MRC_PKT_WRITE || h->type == MRC_PKT_SEND) && len >= MRC_DATA_HDR_LEN) {
        const struct mrc_data_ext *d = (const void *)(h + 1);
        snprintf(buf + n, buflen - (size_t)n, " msn=%u key=%#llx off=%llu msg_len=%llu%s",
                 (unsigned)d->msn, (unsigned long long)d->key, (unsigned long long)d->offset,
                 (unsigned long long)d->msg_len, h->flags & MRC_F_ACKS ? " +ACK" : "");
    } else if (h->type == MRC_PKT_ACK && len >= MRC_ACK_LEN) {
        const struct mrc_ack_ext *a = (const void *)(h + 1);
        snprintf(buf + n, buflen - (size_t)n, " sack_base=%u echo_psn=%u echoes=%u",
                 (unsigned)a->sack_base, (unsigned)a->echo_psn,
                 1u + (unsigned)(h->len / sizeof(struct mrc_ack_echo)));
    }
    return buf;
}
