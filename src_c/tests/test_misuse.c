/*
 * test_misuse.c - call orders a careless caller (or a hostile peer) can
 * produce, each of which used to touch freed memory or grow without bound.
 * Run under ASan+UBSan with leak checking by `make asan-test`: every case
 * must end without a report, and with the result the API promises.
 *
 *   dereg_busy         mrc_mr_dereg with ops in flight: MRC_EBUSY, never a free
 *                      the progress thread reads afterwards (heap-use-after-free
 *                      in tx_emit_pt before)
 *   op_after_destroy   wait/done/result/release of ops after mrc_ep_destroy
 *                      (mrc_op_wait locked a freed endpoint's lock before)
 *   held_while_queued  sendmmsg EAGAIN (mrc_ep_testing_tx_stall) keeps packets in a
 *                      batch: the op failed by closing its connection is reported
 *                      complete only once they left (before: at once, and the
 *                      batch then read a buffer the caller had freed)
 *   reuse_after_done   tiny socket buffers and loss: a buffer freed right after
 *                      its op completed is never read again (on loopback the
 *                      kernel rarely answers EAGAIN, so this smoke-tests the
 *                      held-completion path rather than forcing it)
 *   empty_sends        20,000 empty SENDs against max_unexpected = 4096: staged
 *                      messages are bounded, the sender is told to back off
 *   imm_bound          WRITE-with-immediate nobody takes: bounded, then all arrive
 *   rnr_limit          a receiver that never posts its RECV: MRC_ERNR, not a hang
 *   staged_copy_out    multi-MiB staged SENDs are copied out in slices (was one
 *                      memcpy on the progress thread: spurious RTOs): bytes exact,
 *                      every RECV completes with its bytes
 *   readonly           read-only memory is a SEND/WRITE source, never a RECV target
 */
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "check.h"
#include "connect.h"
#include "mrc.h"
#include "mrc_testing.h"

struct pair {
    mrc_ep *a, *b;
    mrc_conn *ca, *cb;
};

static uint64_t ms_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static mrc_ep *ep_new(const char *addr, struct mrc_ep_config *over)
{
    struct mrc_ep_config cfg;
    if (over)
        cfg = *over;
    else
        mrc_ep_config_init(&cfg);
    cfg.nplanes = 1;
    snprintf(cfg.planes[0], sizeof(cfg.planes[0]), "%s", addr);
    if (!cfg.timeout_ms)
        cfg.timeout_ms = 3000;
    mrc_ep *ep;
    CHECK_RC(mrc_ep_create(&cfg, &ep));
    return ep;
}

static void pair_up(struct pair *p, struct mrc_ep_config *ca, struct mrc_ep_config *cb)
{
    uint16_t port;
    p->a = ep_new("127.0.0.1", ca);
    p->b = ep_new("127.0.1.1", cb);
    CHECK_RC(mrc_ep_listen(p->b, NULL, 0, &port));
    CHECK_RC(connect_pair(p->a, p->b, "127.0.1.1", port, "a", &p->ca, &p->cb));
}

static void pair_down(struct pair *p)
{
    mrc_conn_destroy(p->ca);
    mrc_conn_destroy(p->cb);
    mrc_ep_destroy(p->a);
    mrc_ep_destroy(p->b);
}

static int status_of(mrc_op *op)
{
    struct mrc_op_result r;
    mrc_op_get_result(op, &r);
    return r.status;
}

static void dereg_busy(void)
{
    enum { SZ = 8 << 20 };
    struct pair p;
    pair_up(&p, NULL, NULL);
    uint8_t *src = calloc(SZ, 1), *dst = calloc(SZ, 1);
    mrc_mr *ms, *md;
    CHECK_RC(mrc_mr_reg(p.a, src, SZ, 0, &ms));
    CHECK_RC(mrc_mr_reg(p.b, dst, SZ, MRC_ACCESS_REMOTE_WRITE, &md));
    mrc_op *w[4];
    for (int i = 0; i < 4; i++)
        CHECK_RC(mrc_post_write(p.ca, ms, 0, SZ, mrc_mr_key(md), 0, 0, 0, &w[i]));
    /* 32 MiB cannot have gone yet: the region is in use */
    CHECK(mrc_mr_dereg(ms) == MRC_EBUSY);
    /* the region still works: a post after the refusal is accepted */
    mrc_op *more;
    CHECK_RC(mrc_post_write(p.ca, ms, 0, 4096, mrc_mr_key(md), 0, 0, 0, &more));
    /* a RECV placed into a region counts too */
    mrc_op *r;
    CHECK_RC(mrc_post_recv(p.cb, md, 0, 100, 7, &r));
    CHECK(mrc_mr_dereg(md) == MRC_EBUSY);
    /* closing the connection fails them: then dereg succeeds */
    mrc_conn_destroy(p.cb);
    CHECK(mrc_op_wait(r, 10000) == 0);
    CHECK(status_of(r) == MRC_ECLOSED);
    CHECK_RC(mrc_mr_dereg(md));
    for (int i = 0; i < 4; i++) {
        CHECK(mrc_op_wait(w[i], 10000) == 0);
        mrc_op_release(w[i]);
    }
    CHECK(mrc_op_wait(more, 10000) == 0);
    mrc_op_release(more);
    mrc_op_release(r);
    CHECK_RC(mrc_mr_dereg(ms)); /* every op is done: no longer busy */
    free(src);
    free(dst);
    p.cb = NULL;
    pair_down(&p);
}

static void op_after_destroy(void)
{
    enum { SZ = 4 << 20 };
    struct pair p;
    pair_up(&p, NULL, NULL);
    uint8_t *src = calloc(SZ, 1), *dst = calloc(SZ, 1);
    mrc_mr *ms, *md;
    CHECK_RC(mrc_mr_reg(p.a, src, SZ, 0, &ms));
    CHECK_RC(mrc_mr_reg(p.b, dst, SZ, MRC_ACCESS_REMOTE_WRITE, &md));
    mrc_op *w, *s, *r;
    CHECK_RC(mrc_post_write(p.ca, ms, 0, SZ, mrc_mr_key(md), 0, 1, MRC_WRITE_IMM, &w));
    CHECK_RC(mrc_post_send(p.ca, ms, 0, 1000, 3, &s));
    CHECK_RC(mrc_post_recv(p.cb, md, 0, 10, 4, &r));
    mrc_ep_destroy(p.a); /* frees ca and ms with it */
    mrc_ep_destroy(p.b);
    mrc_op *ops[] = {w, s, r};
    for (int i = 0; i < 3; i++) {
        CHECK(mrc_op_wait(ops[i], 1000) == 0);
        CHECK(mrc_op_wait(ops[i], -1) == 0);
        CHECK(mrc_op_done(ops[i]));
        int st = status_of(ops[i]);
        CHECK(st == 0 || st == MRC_ECLOSED || st == MRC_EREMOTE);
    }
    CHECK(status_of(r) == MRC_ECLOSED);
    for (int i = 0; i < 3; i++)
        mrc_op_release(ops[i]); /* the last one frees what is left of the endpoints */
    free(src);
    free(dst);
}

static void held_while_queued(void)
{
    enum { SZ = 64 << 10 };
    struct pair p;
    pair_up(&p, NULL, NULL);
    uint8_t *src = calloc(SZ, 1), *dst = calloc(SZ, 1);
    mrc_mr *ms, *md;
    CHECK_RC(mrc_mr_reg(p.a, src, SZ, 0, &ms));
    CHECK_RC(mrc_mr_reg(p.b, dst, SZ, MRC_ACCESS_REMOTE_WRITE, &md));
    CHECK_RC(mrc_ep_testing_tx_stall(p.a, 1));
    mrc_op *w;
    CHECK_RC(mrc_post_write(p.ca, ms, 0, SZ, mrc_mr_key(md), 0, 0, 0, &w));
    /* Two round trips to the progress thread: the second request is taken
     * in a later loop than the post, after that loop queued the packets. */
    struct mrc_ep_stats st;
    CHECK_RC(mrc_ep_get_stats(p.a, &st, NULL, 0));
    CHECK_RC(mrc_ep_get_stats(p.a, &st, NULL, 0));
    CHECK(st.tx_pkts >= SZ / 8192);
    mrc_conn_destroy(p.ca); /* fails the write: ECLOSED */
    /* its packets still sit in the batch, pointing into src */
    CHECK(mrc_op_wait(w, 200) == -ETIMEDOUT);
    CHECK(mrc_mr_dereg(ms) == MRC_EBUSY);
    CHECK_RC(mrc_ep_testing_tx_stall(p.a, 0));
    CHECK(mrc_op_wait(w, 10000) == 0);
    CHECK(status_of(w) == MRC_ECLOSED);
    mrc_op_release(w);
    CHECK_RC(mrc_mr_dereg(ms));
    free(src); /* nothing may read it now (ASan checks sendmmsg's iovecs) */
    CHECK_RC(mrc_mr_dereg(md));
    free(dst);
    p.ca = NULL;
    pair_down(&p);
}

static void reuse_after_done(void)
{
    enum { SZ = 256 << 10, ROUNDS = 40 };
    struct mrc_ep_config small;
    mrc_ep_config_init(&small);
    small.sockbuf = 4096; /* the kernel's minimum: sendmmsg answers EAGAIN often */
    struct pair p;
    pair_up(&p, &small, NULL);
    CHECK_RC(mrc_ep_inject(p.a, 0, 0.2, 0)); /* retransmissions */
    uint8_t *dst = calloc(SZ, 1);
    mrc_mr *md;
    CHECK_RC(mrc_mr_reg(p.b, dst, SZ, MRC_ACCESS_REMOTE_WRITE, &md));
    for (int i = 0; i < ROUNDS; i++) {
        uint8_t *src = malloc(SZ);
        memset(src, i, SZ);
        mrc_mr *ms;
        CHECK_RC(mrc_mr_reg(p.a, src, SZ, 0, &ms));
        mrc_op *w;
        CHECK_RC(mrc_post_write(p.ca, ms, 0, SZ, mrc_mr_key(md), 0, 0, 0, &w));
        CHECK(mrc_op_wait(w, 20000) == 0);
        CHECK_RC(status_of(w));
        mrc_op_release(w);
        /* Complete means the transport is done with the buffer: freeing it
         * now must not be seen by a send still queued (ASan's sendmmsg
         * interceptor reads every iovec). */
        CHECK_RC(mrc_mr_dereg(ms));
        free(src);
        CHECK(dst[0] == (uint8_t)i && dst[SZ - 1] == (uint8_t)i);
    }
    CHECK_RC(mrc_mr_dereg(md));
    free(dst);
    pair_down(&p);
}

static void empty_sends(void)
{
    enum { N = 20000 };
    struct mrc_ep_config cb;
    mrc_ep_config_init(&cb);
    cb.max_unexpected = 4096;
    struct mrc_ep_config ca;
    mrc_ep_config_init(&ca);
    ca.rnr_timeout_ms = -1; /* keep trying: this case is about the receiver's memory */
    struct pair p;
    pair_up(&p, &ca, &cb);
    static uint8_t one[1];
    mrc_mr *ms;
    CHECK_RC(mrc_mr_reg(p.a, one, sizeof(one), 0, &ms));
    mrc_op **ops = calloc(N, sizeof(*ops));
    for (int i = 0; i < N; i++)
        CHECK_RC(mrc_post_send(p.ca, ms, 0, 0, 1, &ops[i]));
    struct mrc_ep_stats sa, sb;
    uint64_t t0 = ms_now();
    do {
        CHECK_RC(mrc_ep_get_stats(p.a, &sa, NULL, 0));
    } while (sa.rnr_naks == 0 && ms_now() - t0 < 20000);
    CHECK(sa.rnr_naks > 0);
    CHECK_RC(mrc_ep_get_stats(p.b, &sb, NULL, 0));
    /* 4096 / 256 per message unexpected, as many again of overtakers */
    CHECK(sb.staged_msgs <= 2 * 4096 / 256);
    CHECK(sb.drops[MRC_DROP_NO_BUFFER] > 0);
    mrc_conn_destroy(p.ca);
    for (int i = 0; i < N; i++) {
        CHECK(mrc_op_wait(ops[i], 10000) == 0);
        mrc_op_release(ops[i]);
    }
    free(ops);
    p.ca = NULL;
    CHECK_RC(mrc_mr_dereg(ms));
    pair_down(&p);
}

static void imm_bound(void)
{
    enum { N = 4096 + 500 };
    struct pair p;
    pair_up(&p, NULL, NULL);
    static uint8_t src[64], dst[64];
    mrc_mr *ms, *md;
    CHECK_RC(mrc_mr_reg(p.a, src, sizeof(src), 0, &ms));
    CHECK_RC(mrc_mr_reg(p.b, dst, sizeof(dst), MRC_ACCESS_REMOTE_WRITE, &md));
    mrc_op **ops = calloc(N, sizeof(*ops));
    for (int i = 0; i < N; i++)
        CHECK_RC(mrc_post_write(p.ca, ms, 0, 8, mrc_mr_key(md), 0, (uint32_t)i, MRC_WRITE_IMM,
                                &ops[i]));
    struct mrc_ep_stats sa;
    uint64_t t0 = ms_now();
    do {
        CHECK_RC(mrc_ep_get_stats(p.a, &sa, NULL, 0));
    } while (sa.rnr_naks == 0 && ms_now() - t0 < 20000);
    CHECK(sa.rnr_naks > 0); /* the receiver's queue filled: the sender waits */
    /* Taking them makes room: every immediate arrives, in order, none lost. */
    for (int i = 0; i < N; i++) {
        uint32_t imm;
        uint64_t len;
        CHECK_RC(mrc_conn_wait_imm(p.cb, 20000, &imm, &len));
        CHECK(imm == (uint32_t)i && len == 8);
    }
    for (int i = 0; i < N; i++) {
        CHECK(mrc_op_wait(ops[i], 10000) == 0);
        CHECK_RC(status_of(ops[i]));
        mrc_op_release(ops[i]);
    }
    free(ops);
    CHECK_RC(mrc_mr_dereg(ms));
    CHECK_RC(mrc_mr_dereg(md));
    pair_down(&p);
}

static void rnr_limit(void)
{
    struct mrc_ep_config ca, cb;
    mrc_ep_config_init(&ca);
    ca.rnr_timeout_ms = 300;
    mrc_ep_config_init(&cb);
    cb.max_unexpected = 1000; /* the message cannot be staged: refused until a RECV */
    struct pair p;
    pair_up(&p, &ca, &cb);
    static uint8_t src[4096];
    mrc_mr *ms;
    CHECK_RC(mrc_mr_reg(p.a, src, sizeof(src), 0, &ms));
    mrc_op *s;
    uint64_t t0 = ms_now();
    CHECK_RC(mrc_post_send(p.ca, ms, 0, sizeof(src), 9, &s));
    CHECK(mrc_op_wait(s, 20000) == 0);
    CHECK(status_of(s) == MRC_ERNR);
    CHECK(ms_now() - t0 >= 300);
    CHECK(mrc_conn_error(p.ca) == MRC_ERNR);
    CHECK(strstr(mrc_strerror(MRC_ERNR), "receiver not ready") != NULL);
    mrc_op_release(s);
    CHECK_RC(mrc_mr_dereg(ms));
    pair_down(&p);
}

static void staged_copy_out(void)
{
    enum { SZ = 3 << 20, N = 3 };
    struct pair p;
    pair_up(&p, NULL, NULL);
    uint8_t *src = malloc(SZ), *dst = calloc(N, SZ), *wdst = calloc(1, 64);
    for (size_t i = 0; i < SZ; i++)
        src[i] = (uint8_t)(i * 7 + i / 4096);
    mrc_mr *ms, *md, *mw;
    CHECK_RC(mrc_mr_reg(p.a, src, SZ, 0, &ms));
    CHECK_RC(mrc_mr_reg(p.b, dst, (size_t)N * SZ, 0, &md));
    CHECK_RC(mrc_mr_reg(p.b, wdst, 64, MRC_ACCESS_REMOTE_WRITE, &mw));
    mrc_op *s[N], *r[N], *w;
    for (int i = 0; i < N; i++)
        CHECK_RC(mrc_post_send(p.ca, ms, 0, SZ, 5, &s[i]));
    CHECK_RC(mrc_post_write(p.ca, ms, 0, 64, mrc_mr_key(mw), 0, 77, MRC_WRITE_IMM, &w));
    for (int i = 0; i < N; i++) /* acknowledged: all staged at b */
        CHECK(mrc_op_wait(s[i], 10000) == 0 && status_of(s[i]) == 0);
    CHECK(mrc_op_wait(w, 10000) == 0 && status_of(w) == 0);
    for (int i = 0; i < N; i++)
        CHECK_RC(mrc_post_recv(p.cb, md, (uint64_t)i * SZ, SZ, 5, &r[i]));
    uint32_t imm;
    uint64_t len;
    CHECK_RC(mrc_conn_wait_imm(p.cb, 10000, &imm, &len));
    CHECK(imm == 77 && len == 64);
    for (int i = 0; i < N; i++) {
        CHECK(mrc_op_wait(r[i], 10000) == 0);
        CHECK_RC(status_of(r[i]));
        CHECK(memcmp(dst + (size_t)i * SZ, src, SZ) == 0);
        mrc_op_release(r[i]);
        mrc_op_release(s[i]);
    }
    mrc_op_release(w);
    CHECK_RC(mrc_mr_dereg(ms));
    CHECK_RC(mrc_mr_dereg(md));
    CHECK_RC(mrc_mr_dereg(mw));
    free(src);
    free(dst);
    free(wdst);
    pair_down(&p);
}

static const uint8_t rodata[4096] = {1, 2, 3, 4, 5};

static void readonly(void)
{
    struct pair p;
    pair_up(&p, NULL, NULL);
    mrc_mr *ro, *bad, *md;
    CHECK(mrc_mr_reg(p.a, (void *)rodata, sizeof(rodata),
                     MRC_ACCESS_READONLY | MRC_ACCESS_REMOTE_WRITE, &bad) == MRC_EUSAGE);
    CHECK_RC(mrc_mr_reg(p.a, (void *)rodata, sizeof(rodata), MRC_ACCESS_READONLY, &ro));
    static uint8_t dst[4096];
    CHECK_RC(mrc_mr_reg(p.b, dst, sizeof(dst), MRC_ACCESS_REMOTE_WRITE, &md));
    mrc_op *op;
    CHECK(mrc_post_recv(p.ca, ro, 0, 16, 1, &op) == MRC_EUSAGE); /* would write rodata */
    CHECK_RC(mrc_post_write(p.ca, ro, 0, sizeof(rodata), mrc_mr_key(md), 0, 0, 0, &op));
    CHECK(mrc_op_wait(op, 10000) == 0);
    CHECK_RC(status_of(op));
    mrc_op_release(op);
    CHECK(memcmp(dst, rodata, sizeof(dst)) == 0);
    CHECK_RC(mrc_mr_dereg(ro));
    CHECK_RC(mrc_mr_dereg(md));
    pair_down(&p);
}

int main(void)
{
    dereg_busy();
    op_after_destroy();
    held_while_queued();
    reuse_after_done();
    empty_sends();
    imm_bound();
    rnr_limit();
    staged_copy_out();
    readonly();
    DONE("test_misuse");
    return 0;
}
