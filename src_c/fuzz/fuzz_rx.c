/*
 * fuzz_rx.c - libFuzzer harness for the receive path, under ASan + UBSan.
 *
 * Once (LLVMFuzzerInitialize): two endpoints on loopback, connected; the
 * receiver registers a remotely writable region and a read-only one, both
 * with canary guard bytes around them, keeps a third buffer unregistered, and
 * posts RECVs into a guarded buffer so SENDs can be placed directly.
 *
 * Per input: byte 0 says how to use the rest (the packet):
 *   bits 0-1  0: as is; else rewrite the header into a well-formed one for the
 *             live connection (magic, version, type, len, conn id, a PSN near
 *             the window, and for DATA a known key and an offset near the
 *             region) so that the deep checks are reached
 *   bit 2     DATA: use the read-only region's key instead
 *   bit 3     target the sender side (ACK/NAK/PROBE processing) instead
 *   bit 4     claim to come from a host that is not the peer
 * and the packet goes through mrc_ep_rx_inject(). Afterwards every canary
 * must be intact; a connection the input closed (CLOSE, NAK) is rebuilt.
 *
 * The harness reads two receive-side fields (rx_cum, window) through
 * internal.h: only the progress thread writes them, and it runs nothing for
 * these connections between injections (the sender has nothing in flight).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "mrc.h"
#include "mrc_testing.h"
#include "tests/connect.h"

#define REGION 65536u
#define GUARD 4096u
#define CANARY 0xA5
#define UNREG_BYTE 0x5A
#define NRECV 4
#define RECV_LEN 8192u

static mrc_ep *ep_a, *ep_b;          /* a: sender, b: receiver under test */
static mrc_conn *conn_a, *conn_b;
static uint16_t listen_port;
static uint8_t *rw_buf, *ro_buf, *recv_buf, *unreg;
static mrc_mr *mr_rw, *mr_ro, *mr_recv;
static mrc_op *recvs[NRECV];

#define DIE(...)                                                                   \
    do {                                                                           \
        fprintf(stderr, "fuzz_rx: " __VA_ARGS__);                                  \
        abort();                                                                   \
    } while (0)
#define OK(expr)                                                                   \
    do {                                                                           \
        int rc_ = (expr);                                                          \
        if (rc_)                                                                   \
            DIE("%s -> %d (%s)\n", #expr, rc_, mrc_strerror(rc_));                 \
    } while (0)

static mrc_ep *ep_new(const char *addr)
{
    struct mrc_ep_config cfg;
    mrc_ep_config_init(&cfg);
    cfg.nplanes = 1;
    snprintf(cfg.planes[0], sizeof(cfg.planes[0]), "%s", addr);
    cfg.window = 256;
    cfg.timeout_ms = 60000;
    mrc_ep *ep;
    OK(mrc_ep_create(&cfg, &ep));
    return ep;
}

static void recvs_post(void)
{
    for (int i = 0; i < NRECV; i++) {
        if (recvs[i] && !mrc_op_done(recvs[i]))
            continue;
        if (recvs[i])
            mrc_op_release(recvs[i]);
        recvs[i] = NULL;
        if (!mrc_conn_error(conn_b))
            mrc_post_recv(conn_b, mr_recv, (uint64_t)i * RECV_LEN, RECV_LEN, MRC_TAG_ANY,
                          &recvs[i]);
    }
}

static void conns_up(void)
{
    OK(connect_pair(ep_a, ep_b, "127.0.1.1", listen_port, "fuzz-a", &conn_a, &conn_b));
    recvs_post();
}

static void conns_down(void)
{
    mrc_conn_destroy(conn_a);
    mrc_conn_destroy(conn_b); /* fails the posted RECVs */
    for (int i = 0; i < NRECV; i++) {
        if (recvs[i]) {
            mrc_op_wait(recvs[i], -1);
            mrc_op_release(recvs[i]);
        }
        recvs[i] = NULL;
    }
}

static uint8_t *guarded(size_t len)
{
    uint8_t *b = malloc(len + 2 * GUARD);
    if (!b)
        DIE("out of memory\n");
    memset(b, CANARY, GUARD);
    memset(b + GUARD, 0, len);
    memset(b + GUARD + len, CANARY, GUARD);
    return b;
}

static uint8_t ref_canary[GUARD], ref_zero[REGION], ref_unreg[REGION];

static void guards_check(const uint8_t *b, size_t len, const char *what)
{
    if (memcmp(b, ref_canary, GUARD) || memcmp(b + GUARD + len, ref_canary, GUARD))
        DIE("%s: a guard byte changed: a write outside a region\n", what);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    ep_a = ep_new("127.0.0.1");
    ep_b = ep_new("127.0.1.1");
    OK(mrc_ep_listen(ep_b, NULL, 0, &listen_port));
    rw_buf = guarded(REGION);
    ro_buf = guarded(REGION);
    recv_buf = guarded(NRECV * RECV_LEN);
    unreg = malloc(REGION);
    memset(unreg, UNREG_BYTE, REGION);
    memset(ref_canary, CANARY, GUARD);
    memset(ref_unreg, UNREG_BYTE, REGION);
    OK(mrc_mr_reg(ep_b, rw_buf + GUARD, REGION, MRC_ACCESS_REMOTE_WRITE, &mr_rw));
    OK(mrc_mr_reg(ep_b, ro_buf + GUARD, REGION, 0, &mr_ro));
    OK(mrc_mr_reg(ep_b, recv_buf + GUARD, NRECV * RECV_LEN, MRC_ACCESS_REMOTE_WRITE, &mr_recv));
    conns_up();
    return 0;
}

static uint64_t rd64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* Makes pkt[0..len) a well-formed header for the live connection. */
static void fixup(uint8_t *pkt, size_t len, uint8_t mode, bool to_sender)
{
    static const size_t fixed[MRC_PKT_TYPE_MAX] = {
        0, MRC_DATA_HDR_LEN, MRC_DATA_HDR_LEN, MRC_ACK_LEN, MRC_NAK_LEN,
        MRC_CTRL_LEN, MRC_CTRL_LEN, MRC_CTRL_LEN};
    struct mrc_hdr h;
    memcpy(&h, pkt, sizeof(h));
    h.magic = MRC_MAGIC;
    h.version = MRC_WIRE_VERSION;
    h.type = (uint8_t)(1 + h.type % (MRC_PKT_TYPE_MAX - 1));
    if (len < fixed[h.type])
        h.type = len >= MRC_DATA_HDR_LEN ? MRC_PKT_WRITE : MRC_PKT_PROBE;
    h.len = (uint16_t)(h.type <= MRC_PKT_SEND ? len - fixed[h.type] : 0);
    /* An ACK keeps what follows its extension as further echoes when that is
     * whole echoes the format allows (their path ids and psns stay fuzzed). */
    if (h.type == MRC_PKT_ACK && (len - fixed[h.type]) % sizeof(struct mrc_ack_echo) == 0 &&
        len - fixed[h.type] <= MRC_ACK_ECHO_MAX * sizeof(struct mrc_ack_echo))
        h.len = (uint16_t)(len - fixed[h.type]);
    mrc_conn *c = to_sender ? conn_a : conn_b;
    h.conn = c->id;
    h.path = h.path & 1 ? h.path : 0;
    /* PSN: mostly inside the receive window, sometimes just outside it */
    uint32_t span = c->window + 16;
    uint32_t base = to_sender ? c->una : c->rx_cum;
    h.psn = base + h.psn % span - 8;
    /* DATA carrying an ACK (flag ACKS): that ACK well-formed too, for c's own
     * sends, its echoes and PSNs fuzzed as a lone ACK's are. */
    if (h.type <= MRC_PKT_SEND && (h.flags & MRC_F_ACKS) &&
        len >= MRC_DATA_HDR_LEN + MRC_ACK_LEN) {
        struct mrc_hdr a;
        memcpy(&a, pkt + MRC_DATA_HDR_LEN, sizeof(a));
        size_t room = len - MRC_DATA_HDR_LEN - MRC_ACK_LEN;
        size_t echoes = a.len % (MRC_ACK_ECHO_MAX + 1);
        if (echoes * sizeof(struct mrc_ack_echo) > room)
            echoes = room / sizeof(struct mrc_ack_echo);
        a.magic = MRC_MAGIC;
        a.version = MRC_WIRE_VERSION;
        a.type = MRC_PKT_ACK;
        a.flags = 0;
        a.conn = h.conn;
        a.path = a.path & 1 ? a.path : 0;
        a.len = (uint16_t)(echoes * sizeof(struct mrc_ack_echo));
        a.psn = c->una + a.psn % span - 8;
        memcpy(pkt + MRC_DATA_HDR_LEN, &a, sizeof(a));
        h.len = (uint16_t)(room - a.len);
    }
    memcpy(pkt, &h, sizeof(h));
    for (size_t off = MRC_ACK_LEN; h.type == MRC_PKT_ACK && off < MRC_ACK_LEN + h.len;
         off += sizeof(struct mrc_ack_echo))
        pkt[off] &= 1; /* a further echo's path: mostly one the connection has */
    if (h.type > MRC_PKT_SEND || len < MRC_DATA_HDR_LEN)
        return;
    struct mrc_data_ext d;
    memcpy(&d, pkt + sizeof(h), sizeof(d));
    if ((mode & 3) != 1) {
        d.key = h.type == MRC_PKT_SEND ? d.key : mrc_mr_key(mode & 4 ? mr_ro : mr_rw);
        /* near the region's end, or an overflow-prone value */
        d.offset = (mode & 3) == 2 ? d.offset % (REGION + 64) : UINT64_MAX - (d.offset & 0xffff);
        if (h.type == MRC_PKT_SEND)
            d.offset = d.offset % (RECV_LEN + 64);
        d.msg_len = h.len + d.msg_len % (2 * RECV_LEN);
        d.msn = (uint32_t)(c->rx_deliver_msn + d.msn % 48); /* past the first table */
    }
    memcpy(pkt + sizeof(h), &d, sizeof(d));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static uint8_t pkt[MRC_DATA_HDR_LEN + MRC_MAX_MSS];
    if (size < 1 || size - 1 > MRC_RX_SLOT || size - 1 > sizeof(pkt))
        return -1;
    uint8_t mode = data[0];
    size_t len = size - 1;
    memcpy(pkt, data + 1, len);
    bool to_sender = mode & 8;
    if ((mode & 3) && len >= MRC_CTRL_LEN)
        fixup(pkt, len, mode, to_sender);
    const char *src = mode & 16 ? "127.0.9.9" : to_sender ? "127.0.1.1" : "127.0.0.1";
    uint16_t sport = (uint16_t)(len >= 8 ? rd64(pkt) : 4793);
    OK(mrc_ep_rx_inject(to_sender ? ep_a : ep_b, 0, pkt, len, src, sport));

    guards_check(rw_buf, REGION, "remote-writable region");
    guards_check(recv_buf, NRECV * RECV_LEN, "recv buffer");
    guards_check(ro_buf, REGION, "read-only region");
    if (memcmp(ro_buf + GUARD, ref_zero, REGION))
        DIE("the region without remote write access was written\n");
    if (memcmp(unreg, ref_unreg, REGION))
        DIE("the unregistered buffer was written\n");
    if (mrc_conn_error(conn_a) || mrc_conn_error(conn_b)) {
        conns_down();
        conns_up();
    } else {
        recvs_post();
    }
    return 0;
}
