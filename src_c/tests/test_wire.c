/* test_wire.c - packet validation accepts exactly the well-formed packets. */
#include <string.h>

#include "check.h"
#include "mrc.h"
#include "wire.h"

static size_t data_pkt(uint8_t *buf, uint16_t len, uint64_t off, uint64_t msg_len)
{
    struct mrc_hdr *h = (struct mrc_hdr *)buf;
    struct mrc_data_ext *d = (struct mrc_data_ext *)(h + 1);
    memset(buf, 0, MRC_DATA_HDR_LEN + len);
    h->magic = MRC_MAGIC;
    h->version = MRC_WIRE_VERSION;
    h->type = MRC_PKT_WRITE;
    h->len = len;
    d->offset = off;
    d->msg_len = msg_len;
    return MRC_DATA_HDR_LEN + len;
}

/* A SEND of `len` payload bytes carrying an ACK with `echoes` further echoes. */
static size_t data_ack_pkt(uint8_t *buf, uint16_t len, unsigned echoes)
{
    size_t acklen = MRC_ACK_LEN + echoes * sizeof(struct mrc_ack_echo);
    memset(buf, 0, MRC_DATA_HDR_LEN + acklen + len);
    struct mrc_hdr *h = (struct mrc_hdr *)buf;
    struct mrc_data_ext *d = (struct mrc_data_ext *)(h + 1);
    struct mrc_hdr *a = (struct mrc_hdr *)(buf + MRC_DATA_HDR_LEN);
    *h = (struct mrc_hdr){.magic = MRC_MAGIC, .version = MRC_WIRE_VERSION, .type = MRC_PKT_SEND,
                          .flags = MRC_F_FIRST | MRC_F_LAST | MRC_F_ACKS, .len = len,
                          .conn = 7};
    d->msg_len = len;
    *a = (struct mrc_hdr){.magic = MRC_MAGIC, .version = MRC_WIRE_VERSION, .type = MRC_PKT_ACK,
                          .len = (uint16_t)(echoes * sizeof(struct mrc_ack_echo)), .conn = 7};
    memset(buf + MRC_DATA_HDR_LEN + acklen, 0xab, len);
    return MRC_DATA_HDR_LEN + acklen + len;
}

/* DATA carrying an ACK (flag ACKS): the ACK inside is held to what a lone ACK
 * is, belongs to the same connection, and the payload follows it. */
static void carried_acks(void)
{
    static uint8_t buf[MRC_DATA_ACKS_MAX_LEN + 64];
    for (unsigned e = 0; e <= MRC_ACK_ECHO_MAX; e++) {
        size_t n = data_ack_pkt(buf, 8, e);
        const struct mrc_hdr *h = (const struct mrc_hdr *)buf;
        CHECK(mrc_pkt_validate(buf, n, 8192) == 0);
        CHECK(mrc_data_hdr_len(h) == n - 8);
        CHECK(buf[mrc_data_hdr_len(h)] == 0xab);
        for (size_t cut = 0; cut < n; cut++) /* every truncation is caught */
            CHECK(mrc_pkt_validate(buf, cut, 8192) != 0);
        CHECK(mrc_pkt_validate(buf, n + 1, 8192) == MRC_DROP_BAD_LENGTH);
    }
    size_t n = data_ack_pkt(buf, 8, 1);
    struct mrc_hdr *a = (struct mrc_hdr *)(buf + MRC_DATA_HDR_LEN);
    a->conn = 8; /* another connection's */
    CHECK(mrc_pkt_validate(buf, n, 8192) == MRC_DROP_BAD_ACK);
    a->conn = 7;
    a->type = MRC_PKT_SEND; /* not an ACK */
    CHECK(mrc_pkt_validate(buf, n, 8192) == MRC_DROP_BAD_ACK);
    a->type = MRC_PKT_ACK;
    a->flags = MRC_F_ACKS; /* no nesting, no flags */
    CHECK(mrc_pkt_validate(buf, n, 8192) == MRC_DROP_BAD_ACK);
    a->flags = 0;
    a->version = MRC_WIRE_VERSION - 1;
    CHECK(mrc_pkt_validate(buf, n, 8192) == MRC_DROP_BAD_VERSION);
    a->version = MRC_WIRE_VERSION;
    a->magic = 0;
    CHECK(mrc_pkt_validate(buf, n, 8192) == MRC_DROP_BAD_MAGIC);
    a->magic = MRC_MAGIC;
    a->len = 17; /* not whole echoes (the payload makes up the bytes) */
    CHECK(mrc_pkt_validate(buf, n, 8192) == MRC_DROP_BAD_LENGTH);
    a->len = 4000; /* beyond the datagram */
    CHECK(mrc_pkt_validate(buf, n, 8192) == MRC_DROP_TRUNCATED);
    n = data_ack_pkt(buf, 0, 0);
    a->len = 0;
    ((struct mrc_hdr *)buf)->len = 0;
    CHECK(mrc_pkt_validate(buf, n, 8192) == 0);
    char s[200];
    CHECK(strstr(mrc_pkt_to_string(buf, n, s, sizeof(s)), "+ACK") != NULL);
}

int main(void)
{
    carried_acks();
    static uint8_t buf[MRC_DATA_HDR_LEN + 9000];
    size_t n = data_pkt(buf, 100, 0, 100);
    CHECK(mrc_pkt_validate(buf, n, 8192) == 0);
    for (size_t cut = 0; cut < n; cut++) /* every truncation is caught */
        CHECK(mrc_pkt_validate(buf, cut, 8192) != 0);
    CHECK(mrc_pkt_validate(buf, n + 1, 8192) == MRC_DROP_BAD_LENGTH);
    n = data_pkt(buf, 100, UINT64_MAX - 10, 100);
    CHECK(mrc_pkt_validate(buf, n, 8192) == 0); /* WRITE: region offset, checked later */
    ((struct mrc_hdr *)buf)->type = MRC_PKT_SEND;
    CHECK(mrc_pkt_validate(buf, n, 8192) == MRC_DROP_BAD_MSG);
    n = data_pkt(buf, 100, 1, 100);
    ((struct mrc_hdr *)buf)->type = MRC_PKT_SEND;
    CHECK(mrc_pkt_validate(buf, n, 8192) == MRC_DROP_BAD_MSG);
    n = data_pkt(buf, 100, 0, 99);
    CHECK(mrc_pkt_validate(buf, n, 8192) == MRC_DROP_BAD_MSG);
    n = data_pkt(buf, 8193, 0, 9000);
    CHECK(mrc_pkt_validate(buf, n, 8192) == MRC_DROP_BAD_LENGTH);
    n = data_pkt(buf, 0, 0, 0);
    CHECK(mrc_pkt_validate(buf, n, 8192) == 0);
    struct mrc_hdr *h = (struct mrc_hdr *)buf;
    h->magic = 0x1234;
    CHECK(mrc_pkt_validate(buf, n, 8192) == MRC_DROP_BAD_MAGIC);
    h->magic = MRC_MAGIC;
    h->version = MRC_WIRE_VERSION + 1;
    CHECK(mrc_pkt_validate(buf, n, 8192) == MRC_DROP_BAD_VERSION);
    h->version = MRC_WIRE_VERSION;
    for (int t = 0; t < 256; t++) {
        h->type = (uint8_t)t;
        int r = mrc_pkt_validate(buf, n, 8192);
        CHECK(t >= 1 && t < MRC_PKT_TYPE_MAX ? r != MRC_DROP_BAD_TYPE : r == MRC_DROP_BAD_TYPE);
    }
    /* An ACK is header + extension + len bytes of further echoes: whole
     * 24-byte echoes, at most MRC_ACK_ECHO_MAX of them. */
    memset(buf, 0, sizeof(buf));
    h->magic = MRC_MAGIC;
    h->version = MRC_WIRE_VERSION;
    h->type = MRC_PKT_ACK;
    CHECK(mrc_pkt_validate(buf, MRC_ACK_LEN, 8192) == 0);
    CHECK(mrc_pkt_validate(buf, MRC_ACK_LEN - 1, 8192) == MRC_DROP_TRUNCATED);
    CHECK(mrc_pkt_validate(buf, MRC_ACK_LEN + 1, 8192) == MRC_DROP_BAD_LENGTH);
    for (unsigned k = 1; k <= MRC_ACK_ECHO_MAX + 1; k++) {
        h->len = (uint16_t)(k * sizeof(struct mrc_ack_echo));
        CHECK(mrc_pkt_validate(buf, MRC_ACK_LEN + h->len, 8192) ==
              (k <= MRC_ACK_ECHO_MAX ? 0 : MRC_DROP_BAD_LENGTH));
        CHECK(mrc_pkt_validate(buf, MRC_ACK_LEN + h->len - 1, 8192) == MRC_DROP_BAD_LENGTH);
    }
    h->len = 17; /* not whole echoes */
    CHECK(mrc_pkt_validate(buf, MRC_ACK_LEN + 17, 8192) == MRC_DROP_BAD_LENGTH);
    h->len = 16; /* v2's echo size */
    CHECK(mrc_pkt_validate(buf, MRC_ACK_LEN + 16, 8192) == MRC_DROP_BAD_LENGTH);
    h->len = 48;
    char s[160];
    CHECK(strstr(mrc_pkt_to_string(buf, MRC_ACK_LEN + 48, s, sizeof(s)), "echoes=3") != NULL);
    h->len = 0;
    CHECK(strstr(mrc_pkt_to_string(buf, MRC_ACK_LEN, s, sizeof(s)), "ACK") != NULL);
    CHECK(strcmp(mrc_drop_str(MRC_DROP_BAD_KEY), "bad_key") == 0);
    DONE("test_wire");
    return 0;
}
