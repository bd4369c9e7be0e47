/*
 * test_cq.c - completion queues: hundreds of ops over several connections
 * complete exactly once each on their CQ with their ctx, immediates of bound
 * connections arrive as MRC_WC_IMM, the eventfd is readable exactly while
 * entries wait (once asked for), wait_min sleeps for a count, MRC_POST_MORE
 * posts go out on mrc_ep_kick, a caller may drive the progress itself
 * (mrc_ep_progress), wait times out, destroy refuses while in use, and an
 * endpoint destroyed with ops pending on open CQs frees everything (run under
 * ASan's leak checker by `make asan-test`).
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include <sched.h>

#include "check.h"
#include "connect.h"
#include "internal.h" /* only to see that a waiter is inside mrc_cq_wait */
#include "mrc.h"

enum { NCONN = 4, PER = 64, MSG = 3000 };

static mrc_ep *ep_new(const char *addr)
{
    struct mrc_ep_config cfg;
    mrc_ep_config_init(&cfg);
    cfg.nplanes = 1;
    snprintf(cfg.planes[0], sizeof(cfg.planes[0]), "%s", addr);
    cfg.timeout_ms = 3000;
    mrc_ep *ep;
    CHECK_RC(mrc_ep_create(&cfg, &ep));
    return ep;
}

static int fd_readable(int fd)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    return poll(&p, 1, 0) == 1 && (p.revents & POLLIN);
}

static mrc_ep *a, *b;
static uint16_t port;
static mrc_conn *ca[NCONN], *cb[NCONN];

static void setup(void)
{
    a = ep_new("127.0.0.1");
    b = ep_new("127.0.1.1");
    CHECK_RC(mrc_ep_listen(b, NULL, 0, &port));
    for (int i = 0; i < NCONN; i++)
        CHECK_RC(connect_pair(a, b, "127.0.1.1", port, "a", &ca[i], &cb[i]));
}

/* Drains n entries from cq through mrc_cq_wait batches of at most 7. */
static void drain(mrc_cq *cq, struct mrc_wc *out, int n)
{
    int got = 0;
    while (got < n) {
        int max = n - got < 7 ? n - got : 7;
        int r = mrc_cq_wait(cq, out + got, max, 10000);
        CHECK(r > 0 && r <= max);
        got += r;
    }
}

/* Per connection: PER SENDs a->b into RECVs posted on b's CQ, PER WRITEs
 * with immediates a->b; b's connections are bound to cqb with ctx 1000+i. */
static void many_ops(void)
{
    mrc_cq *cqa, *cqb;
    CHECK_RC(mrc_cq_create(a, &cqa));
    CHECK_RC(mrc_cq_create(b, &cqb));
    CHECK(mrc_cq_fd(cqa) >= 0 && mrc_cq_fd(cqb) >= 0);
    struct mrc_wc wc[8];
    CHECK(mrc_cq_poll(cqb, wc, 8) == 0);
    CHECK(!fd_readable(mrc_cq_fd(cqb)));

    size_t sz = (size_t)NCONN * PER * MSG;
    uint8_t *src = malloc(sz), *dst = calloc(sz, 1), *wdst = calloc(sz, 1);
    for (size_t i = 0; i < sz; i++)
        src[i] = (uint8_t)(i * 2654435761u >> 13);
    mrc_mr *ms, *md, *mw;
    CHECK_RC(mrc_mr_reg(a, src, sz, 0, &ms));
    CHECK_RC(mrc_mr_reg(b, dst, sz, 0, &md));
    CHECK_RC(mrc_mr_reg(b, wdst, sz, MRC_ACCESS_REMOTE_WRITE, &mw));
    for (int i = 0; i < NCONN; i++)
        CHECK_RC(mrc_conn_set_cq(cb[i], cqb, 1000 + (uint64_t)i));
    CHECK(mrc_cq_destroy(cqb) == MRC_EBUSY); /* connections are bound */

    for (int i = 0; i < NCONN; i++)
        for (int k = 0; k < PER; k++) {
            uint64_t off = ((uint64_t)i * PER + k) * MSG;
            struct mrc_wr r = {.kind = MRC_OP_RECV, .mr = md, .loff = off, .len = MSG,
                               .tag = (uint64_t)k, .cq = cqb, .ctx = off};
            CHECK_RC(mrc_post(cb[i], &r, NULL));
        }
    for (int i = 0; i < NCONN; i++)
        for (int k = 0; k < PER; k++) {
            uint64_t off = ((uint64_t)i * PER + k) * MSG;
            struct mrc_wr s = {.kind = MRC_OP_SEND, .mr = ms, .loff = off, .len = MSG,
                               .tag = (uint64_t)k, .cq = cqa, .ctx = off};
            CHECK_RC(mrc_post(ca[i], &s, NULL));
            struct mrc_wr w = {.kind = MRC_OP_WRITE, .flags = MRC_WRITE_IMM, .mr = ms,
                               .loff = off, .len = MSG, .rkey = mrc_mr_key(mw), .roff = off,
                               .imm = (uint32_t)(off / MSG), .cq = cqa, .ctx = off + 1};
            CHECK_RC(mrc_post(ca[i], &w, NULL));
        }

    enum { NA = NCONN * PER * 2, NB = NCONN * PER * 2 };
    static struct mrc_wc ea[NA], eb[NB];
    drain(cqa, ea, NA);
    static uint8_t seen[NCONN * PER * MSG / MSG * 2];
    memset(seen, 0, sizeof(seen));
    for (int i = 0; i < NA; i++) {
        CHECK(ea[i].status == 0);
        CHECK(ea[i].bytes == MSG);
        uint64_t idx = ea[i].ctx / MSG * 2 + (ea[i].ctx % MSG);
        CHECK(ea[i].kind == (ea[i].ctx % MSG ? MRC_WC_WRITE : MRC_WC_SEND));
        CHECK(idx < sizeof(seen) && !seen[idx]);
        seen[idx] = 1;
        int conn = (int)(ea[i].ctx / MSG / PER);
        CHECK(ea[i].conn == ca[conn]);
    }
    drain(cqb, eb, NB);
    memset(seen, 0, sizeof(seen));
    uint32_t next_imm[NCONN];
    for (int i = 0; i < NCONN; i++)
        next_imm[i] = (uint32_t)(i * PER);
    for (int i = 0; i < NB; i++) {
        CHECK(eb[i].status == 0);
        CHECK(eb[i].bytes == MSG);
        if (eb[i].kind == MRC_WC_IMM) {
            int conn = (int)(eb[i].ctx - 1000);
            CHECK(conn >= 0 && conn < NCONN && eb[i].conn == cb[conn]);
            CHECK(eb[i].imm == next_imm[conn]); /* in order per connection */
            next_imm[conn]++;
            /* every byte of the WRITE is in place once its immediate is seen */
            uint64_t off = (uint64_t)eb[i].imm * MSG;
            CHECK(memcmp(wdst + off, src + off, MSG) == 0);
        } else {
            CHECK(eb[i].kind == MRC_WC_RECV);
            uint64_t off = eb[i].ctx;
            CHECK(eb[i].tag == off / MSG % PER);
            CHECK(!seen[off / MSG]);
            seen[off / MSG] = 1;
            CHECK(eb[i].conn == cb[off / MSG / PER]);
        }
    }
    for (int i = 0; i < NCONN; i++)
        CHECK(next_imm[i] == (uint32_t)((i + 1) * PER));
    CHECK(memcmp(dst, src, sz) == 0);
    CHECK(memcmp(wdst, src, sz) == 0);
    CHECK(!fd_readable(mrc_cq_fd(cqa)) && !fd_readable(mrc_cq_fd(cqb)));
    CHECK(mrc_cq_poll(cqa, wc, 8) == 0);

    /* Unbound, immediates go back to mrc_conn_wait_imm. */
    for (int i = 0; i < NCONN; i++)
        CHECK_RC(mrc_conn_set_cq(cb[i], NULL, 0));
    mrc_op *op;
    CHECK_RC(mrc_post_write(ca[0], ms, 0, 100, mrc_mr_key(mw), 0, 77, MRC_WRITE_IMM, &op));
    uint32_t imm;
    uint64_t len;
    CHECK_RC(mrc_conn_wait_imm(cb[0], 10000, &imm, &len));
    CHECK(imm == 77 && len == 100);
    CHECK_RC(mrc_op_wait(op, 10000));
    mrc_op_release(op);
    /* An immediate that arrived before binding moves onto the CQ. */
    CHECK_RC(mrc_post_write(ca[1], ms, 0, 10, mrc_mr_key(mw), 0, 88, MRC_WRITE_IMM, &op));
    CHECK_RC(mrc_op_wait(op, 10000));
    mrc_op_release(op);
    /* b queued the immediate before it acknowledged the last packet */
    CHECK_RC(mrc_conn_set_cq(cb[1], cqb, 5));
    CHECK(fd_readable(mrc_cq_fd(cqb)));
    CHECK(mrc_cq_poll(cqb, wc, 8) == 1);
    CHECK(wc[0].kind == MRC_WC_IMM && wc[0].imm == 88 && wc[0].ctx == 5 && wc[0].bytes == 10);
    CHECK(!fd_readable(mrc_cq_fd(cqb)));
    CHECK_RC(mrc_conn_set_cq(cb[1], NULL, 0));

    /* An op with both a handle and a CQ completes on both. */
    struct mrc_wr s = {.kind = MRC_OP_SEND, .mr = ms, .len = 5, .tag = 9, .cq = cqa, .ctx = 42};
    struct mrc_wr r = {.kind = MRC_OP_RECV, .mr = md, .len = 5, .tag = 9};
    mrc_op *rop;
    CHECK_RC(mrc_post(cb[2], &r, &rop));
    CHECK_RC(mrc_post(ca[2], &s, &op));
    CHECK(mrc_cq_wait(cqa, wc, 8, 10000) == 1);
    CHECK(wc[0].ctx == 42 && wc[0].kind == MRC_WC_SEND && wc[0].status == 0);
    CHECK_RC(mrc_op_wait(op, 0));
    CHECK_RC(mrc_op_wait(rop, 10000));
    struct mrc_op_result res;
    mrc_op_get_result(rop, &res);
    CHECK(res.status == 0 && res.bytes == 5 && res.tag == 9);
    mrc_op_release(op);
    mrc_op_release(rop);

    CHECK_RC(mrc_cq_destroy(cqa));
    CHECK_RC(mrc_cq_destroy(cqb));
    mrc_mr_dereg(ms);
    mrc_mr_dereg(md);
    mrc_mr_dereg(mw);
    free(src);
    free(dst);
    free(wdst);
}

static double secs(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* wait times out; destroy is refused while an op is pending; a closed
 * connection fails it into the CQ with MRC_ECLOSED. */
static void timeout_and_busy(void)
{
    mrc_cq *cq;
    CHECK_RC(mrc_cq_create(b, &cq));
    struct mrc_wc wc[4];
    double t0 = secs();
    CHECK(mrc_cq_wait(cq, wc, 4, 50) == -ETIMEDOUT);
    CHECK(secs() - t0 >= 0.045);
    CHECK(mrc_cq_wait(cq, wc, 4, 0) == -ETIMEDOUT);

    uint8_t buf[64];
    mrc_mr *mr;
    CHECK_RC(mrc_mr_reg(b, buf, sizeof(buf), 0, &mr));
    struct mrc_wr r = {.kind = MRC_OP_RECV, .mr = mr, .len = 64, .tag = 12345, .cq = cq,
                       .ctx = 7};
    CHECK_RC(mrc_post(cb[3], &r, NULL));
    CHECK(mrc_cq_destroy(cq) == MRC_EBUSY);
    mrc_conn_destroy(cb[3]);
    cb[3] = NULL;
    CHECK(mrc_cq_wait(cq, wc, 4, 10000) == 1);
    CHECK(wc[0].ctx == 7 && wc[0].status == MRC_ECLOSED && wc[0].kind == MRC_WC_RECV);
    CHECK_RC(mrc_cq_destroy(cq));
    mrc_mr_dereg(mr);
}

static void usage_errors(void)
{
    mrc_cq *cqa;
    CHECK_RC(mrc_cq_create(a, &cqa));
    uint8_t buf[64];
    mrc_mr *mr;
    CHECK_RC(mrc_mr_reg(b, buf, sizeof(buf), 0, &mr));
    struct mrc_wr r = {.kind = MRC_OP_RECV, .mr = mr, .len = 64};
    CHECK(mrc_post(cb[0], &r, NULL) == MRC_EUSAGE); /* neither handle nor CQ */
    r.cq = cqa;                                      /* a CQ of another endpoint */
    CHECK(mrc_post(cb[0], &r, NULL) == MRC_EUSAGE);
    CHECK(mrc_conn_set_cq(cb[0], cqa, 0) == MRC_EUSAGE);
    r.cq = NULL;
    r.kind = 9;
    mrc_op *op = NULL;
    CHECK(mrc_post(cb[0], &r, &op) == MRC_EUSAGE);
    r.kind = MRC_OP_SEND;
    r.flags = MRC_WRITE_IMM; /* only a WRITE carries an immediate */
    CHECK(mrc_post(cb[0], &r, &op) == MRC_EUSAGE);
    r.flags = 0;
    r.len = 65;
    CHECK(mrc_post(cb[0], &r, &op) == MRC_EUSAGE);
    CHECK(op == NULL);
    CHECK(mrc_cq_poll(cqa, NULL, 1) == MRC_EUSAGE);
    /* shut down: posts fail, waits return at once */
    mrc_cq_shutdown(cqa);
    struct mrc_wc wc[2];
    CHECK(mrc_cq_wait(cqa, wc, 2, -1) == MRC_ECLOSED);
    uint8_t abuf[8];
    mrc_mr *amr;
    CHECK_RC(mrc_mr_reg(a, abuf, sizeof(abuf), 0, &amr));
    struct mrc_wr s = {.kind = MRC_OP_SEND, .mr = amr, .len = 8, .cq = cqa};
    CHECK(mrc_post(ca[0], &s, NULL) == MRC_ECLOSED);
    mrc_mr_dereg(amr);
    CHECK(mrc_cq_wait(cqa, NULL, 1, 0) == MRC_EUSAGE);
    CHECK_RC(mrc_cq_destroy(cqa));
    mrc_mr_dereg(mr);
}

struct op_waiter {
    mrc_op *op;
    int rc;
};

static void *op_wait_thread(void *arg)
{
    struct op_waiter *w = arg;
    w->rc = mrc_op_wait(w->op, 10000);
    return NULL;
}

/* Op waiters sleep on buckets of condition variables, woken only for a batch
 * holding one of their ops: each of many concurrent waiters still sees its
 * own op complete, whatever the order. */
static void op_waiters(void)
{
    enum { NT = 24 };
    uint8_t *buf = calloc(NT, 64), *src = malloc(64);
    memset(src, 0xab, 64);
    mrc_mr *mb, *ms;
    CHECK_RC(mrc_mr_reg(b, buf, NT * 64, 0, &mb));
    CHECK_RC(mrc_mr_reg(a, src, 64, 0, &ms));
    struct op_waiter w[NT];
    pthread_t t[NT];
    for (int i = 0; i < NT; i++) {
        CHECK_RC(mrc_post_recv(cb[0], mb, (uint64_t)i * 64, 64, 500 + (uint64_t)i, &w[i].op));
        CHECK(pthread_create(&t[i], NULL, op_wait_thread, &w[i]) == 0);
    }
    mrc_op *s[NT];
    for (int i = NT - 1; i >= 0; i--)
        CHECK_RC(mrc_post_send(ca[0], ms, 0, 64, 500 + (uint64_t)i, &s[i]));
    for (int i = 0; i < NT; i++) {
        pthread_join(t[i], NULL);
        CHECK(w[i].rc == 0);
        struct mrc_op_result r;
        mrc_op_get_result(w[i].op, &r);
        CHECK(r.status == 0 && r.tag == 500 + (uint64_t)i && r.bytes == 64);
        CHECK(memcmp(buf + i * 64, src, 64) == 0);
        CHECK_RC(mrc_op_wait(s[i], 10000));
        mrc_op_release(s[i]);
        mrc_op_release(w[i].op);
    }
    mrc_mr_dereg(mb);
    mrc_mr_dereg(ms);
    free(buf);
    free(src);
}

struct waiter {
    mrc_cq *cq;
    int rc;
};

static void *wait_thread(void *arg)
{
    struct waiter *w = arg;
    struct mrc_wc wc[4];
    w->rc = mrc_cq_wait(w->cq, wc, 4, -1);
    return NULL;
}

/* The endpoints go with ops pending on open CQs, entries not polled, a
 * thread waiting on a CQ: the waiter returns, everything is freed. */
static void destroy_with_pending(void)
{
    mrc_cq *cqa, *cqb, *cqw;
    CHECK_RC(mrc_cq_create(a, &cqa));
    CHECK_RC(mrc_cq_create(b, &cqb));
    CHECK_RC(mrc_cq_create(b, &cqw));
    uint8_t *buf = calloc(1 << 20, 1);
    mrc_mr *ma, *mb;
    CHECK_RC(mrc_mr_reg(a, buf, 1 << 20, 0, &ma));
    CHECK_RC(mrc_mr_reg(b, buf, 1 << 20, 0, &mb));
    CHECK_RC(mrc_conn_set_cq(cb[0], cqb, 1));
    mrc_op *kept;
    struct mrc_wr s = {.kind = MRC_OP_SEND, .mr = ma, .len = 1 << 20, .tag = 1, .cq = cqa};
    CHECK_RC(mrc_post(ca[0], &s, &kept)); /* staged at b: no RECV with tag 1 */
    for (int i = 0; i < 50; i++) {
        struct mrc_wr r = {.kind = MRC_OP_RECV, .mr = mb, .len = 100, .tag = 2, .cq = cqb,
                           .ctx = (uint64_t)i};
        CHECK_RC(mrc_post(cb[i % 3], &r, NULL));
        s.len = 1000;
        s.tag = 3;
        CHECK_RC(mrc_post(ca[i % 3], &s, NULL));
    }
    struct waiter w = {.cq = cqw};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, wait_thread, &w) == 0);
    for (int in = 0; !in;) { /* the waiter is inside mrc_cq_wait */
        pthread_mutex_lock(&b->lock);
        in = cqw->waiters;
        pthread_mutex_unlock(&b->lock);
        if (!in)
            sched_yield();
    }
    mrc_ep_destroy(a);
    mrc_ep_destroy(b);
    pthread_join(t, NULL);
    CHECK(w.rc == MRC_ECLOSED);
    mrc_op_release(kept);
    free(buf);
}

/* mrc_cq_wait_min sleeps until min entries wait (fewer only on timeout);
 * posts with MRC_POST_MORE go out once mrc_ep_kick (or a plain post) wakes
 * the progress thread; an eventfd asked for after entries queued is readable
 * at once. */
static void wait_min_and_more(void)
{
    enum { N = 5, LEN = 64 };
    mrc_cq *cqa, *cqb;
    CHECK_RC(mrc_cq_create(a, &cqa));
    CHECK_RC(mrc_cq_create(b, &cqb));
    uint8_t *src = malloc(N * LEN), *dst = calloc(N, LEN);
    for (int i = 0; i < N * LEN; i++)
        src[i] = (uint8_t)(i * 7 + 1);
    mrc_mr *ms, *md;
    CHECK_RC(mrc_mr_reg(a, src, N * LEN, 0, &ms));
    CHECK_RC(mrc_mr_reg(b, dst, N * LEN, 0, &md));
    for (int i = 0; i < N; i++) {
        struct mrc_wr r = {.kind = MRC_OP_RECV, .flags = MRC_POST_MORE, .mr = md,
                           .loff = (uint64_t)i * LEN, .len = LEN, .tag = MRC_TAG_ANY,
                           .cq = cqb, .ctx = (uint64_t)i};
        CHECK_RC(mrc_post(cb[0], &r, NULL));
    }
    mrc_ep_kick(b);
    for (int i = 0; i < N; i++) {
        struct mrc_wr w = {.kind = MRC_OP_SEND, .flags = MRC_POST_MORE, .mr = ms,
                           .loff = (uint64_t)i * LEN, .len = LEN, .tag = (uint64_t)i,
                           .cq = cqa, .ctx = (uint64_t)i};
        CHECK_RC(mrc_post(ca[0], &w, NULL));
    }
    mrc_ep_kick(a);
    struct mrc_wc wc[8];
    int n = mrc_cq_wait_min(cqb, wc, 8, N, 10000);
    CHECK(n == N);
    for (int i = 0; i < n; i++)
        CHECK(wc[i].status == 0 && wc[i].kind == MRC_WC_RECV && wc[i].ctx == (uint64_t)i);
    CHECK(memcmp(dst, src, N * LEN) == 0);
    /* The sends' completions, all at once; then the fd, asked for late. */
    int got = 0;
    while (got < N) {
        int r = mrc_cq_wait_min(cqa, wc, 8, N - got, 10000);
        CHECK(r > 0);
        got += r > 0 ? r : N;
    }
    CHECK(got == N);
    /* Nothing queued: a timeout, not a hang, whatever min says. */
    CHECK(mrc_cq_wait_min(cqa, wc, 8, 3, 20) == -ETIMEDOUT);
    struct mrc_wr w = {.kind = MRC_OP_SEND, .mr = ms, .len = LEN, .tag = 9, .cq = cqa};
    struct mrc_wr r = {.kind = MRC_OP_RECV, .mr = md, .len = LEN, .tag = MRC_TAG_ANY, .cq = cqb};
    CHECK_RC(mrc_post(cb[0], &r, NULL));
    CHECK_RC(mrc_post(ca[0], &w, NULL));
    /* min above what will come: returns what came once the timeout passes */
    CHECK(mrc_cq_wait_min(cqb, wc, 8, 4, 300) == 1);
    while (mrc_cq_poll(cqa, wc, 8) == 0)
        sched_yield();
    CHECK(!fd_readable(mrc_cq_fd(cqa)));
    CHECK_RC(mrc_post(cb[0], &r, NULL));
    CHECK_RC(mrc_post(ca[0], &w, NULL));
    CHECK(mrc_cq_wait(cqb, wc, 8, 10000) == 1);
    while (mrc_cq_wait(cqa, wc, 1, 0) == -ETIMEDOUT)
        sched_yield();
    /* An entry queued before the eventfd is asked for: readable at once. */
    mrc_cq *cqc;
    CHECK_RC(mrc_cq_create(b, &cqc));
    r.cq = cqc;
    mrc_op *op;
    CHECK_RC(mrc_post(cb[0], &r, &op));
    CHECK_RC(mrc_post(ca[0], &w, NULL));
    CHECK_RC(mrc_op_wait(op, 10000));
    mrc_op_release(op);
    CHECK(fd_readable(mrc_cq_fd(cqc)));
    CHECK(mrc_cq_poll(cqc, wc, 8) == 1 && !fd_readable(mrc_cq_fd(cqc)));
    CHECK_RC(mrc_cq_destroy(cqc));
    while (mrc_cq_wait(cqa, wc, 1, 0) == -ETIMEDOUT)
        sched_yield();
    /* The usage check still refuses unknown flags. */
    struct mrc_wr bad = w;
    bad.flags = 0x400;
    CHECK(mrc_post(ca[0], &bad, NULL) == MRC_EUSAGE);
    /* A RECV has no ACKs to make lazy. */
    struct mrc_wr lazy_recv = r;
    lazy_recv.flags = MRC_POST_LAZY_ACK;
    lazy_recv.cq = NULL;
    CHECK(mrc_post(cb[0], &lazy_recv, &op) == MRC_EUSAGE);
    CHECK_RC(mrc_mr_dereg(ms));
    CHECK_RC(mrc_mr_dereg(md));
    CHECK_RC(mrc_cq_destroy(cqa));
    CHECK_RC(mrc_cq_destroy(cqb));
    free(src);
    free(dst);
}

static uint64_t busy_polls(mrc_ep *ep)
{
    struct mrc_ep_stats st;
    CHECK_RC(mrc_ep_get_stats(ep, &st, NULL, 0));
    return st.busy_polls;
}

/* mrc_ep_busy_poll: the idle progress thread looks at its sockets instead of
 * sleeping until the deadline, a message exchanged meanwhile completes, and
 * after the deadline it sleeps again (the count stands still). No deadline,
 * no polls; a shorter one does not cut a longer one short. */
static void busy_poll(void)
{
    enum { LEN = 64 };
    mrc_ep_busy_poll(NULL, 1000);
    mrc_ep_busy_poll(a, 0);
    CHECK(busy_polls(a) == 0); /* never asked: it only ever slept */
    mrc_ep_busy_poll(a, 300000);   /* 300 ms */
    mrc_ep_busy_poll(a, 1);        /* shorter: changes nothing */
    uint64_t t0 = now_ns() / 1000000u;
    while (busy_polls(a) < 100 && now_ns() / 1000000u - t0 < 250)
        sched_yield();
    CHECK(busy_polls(a) >= 100);
    mrc_cq *cqa, *cqb;
    CHECK_RC(mrc_cq_create(a, &cqa));
    CHECK_RC(mrc_cq_create(b, &cqb));
    uint8_t src[LEN], dst[LEN] = {0};
    for (int i = 0; i < LEN; i++)
        src[i] = (uint8_t)(i * 5 + 3);
    mrc_mr *ms, *md;
    CHECK_RC(mrc_mr_reg(a, src, LEN, 0, &ms));
    CHECK_RC(mrc_mr_reg(b, dst, LEN, 0, &md));
    struct mrc_wr r = {.kind = MRC_OP_RECV, .mr = md, .len = LEN, .tag = MRC_TAG_ANY, .cq = cqb};
    struct mrc_wr w = {.kind = MRC_OP_SEND, .mr = ms, .len = LEN, .tag = 4, .cq = cqa};
    CHECK_RC(mrc_post(cb[0], &r, NULL));
    CHECK_RC(mrc_post(ca[0], &w, NULL));
    struct mrc_wc wc[2];
    CHECK(mrc_cq_wait_min(cqb, wc, 2, 1, 5000) == 1 && wc[0].status == 0);
    CHECK(mrc_cq_wait_min(cqa, wc, 2, 1, 5000) == 1 && wc[0].status == 0);
    CHECK(memcmp(src, dst, LEN) == 0);
    /* Past the deadline (and any timer of that exchange) it sleeps again. */
    struct timespec ms20 = {0, 20 * 1000000};
    while (now_ns() / 1000000u - t0 < 700)
        nanosleep(&ms20, NULL);
    uint64_t after = busy_polls(a);
    struct timespec ms50 = {0, 50 * 1000000};
    nanosleep(&ms50, NULL);
    CHECK(busy_polls(a) == after);
    CHECK_RC(mrc_mr_dereg(ms));
    CHECK_RC(mrc_mr_dereg(md));
    CHECK_RC(mrc_cq_destroy(cqa));
    CHECK_RC(mrc_cq_destroy(cqb));
}

static struct mrc_ep_stats stats_of(mrc_ep *ep)
{
    struct mrc_ep_stats st;
    CHECK_RC(mrc_ep_get_stats(ep, &st, NULL, 0));
    return st;
}

/* Until ep's progress thread sleeps with nothing due for 20 ms (the last
 * exchange's timers done), up to 2 s. */
static void wait_asleep(mrc_ep *ep)
{
    uint64_t t0 = now_ns();
    for (bool idle = false; !idle && now_ns() - t0 < 2000000000ull;) {
        pthread_mutex_lock(&ep->lock);
        idle = ep->sleeping && !ep->subq_head && ep->sleep_due > now_ns() + 20000000ull;
        pthread_mutex_unlock(&ep->lock);
        if (!idle)
            sched_yield();
    }
}

/* A LAZY SEND's ACK waits for DATA going back to carry it; DATA that is a
 * full datagram (mss of payload) has no room for it, so it goes alone at
 * once (acks_no_room) and the SEND completes. B's full SEND is posted with
 * MRC_POST_MORE while B's progress thread sleeps, so the thread takes it in
 * the pass that A's packet wakes, behind that packet; should the thread wake
 * for something else in between, it goes before any ACK is owed and the
 * round goes again. */
static void lazy_ack_no_room(void)
{
    uint32_t mss = cb[2]->mss;
    uint8_t *big = calloc(mss, 1), *small = calloc(64, 1);
    for (uint32_t i = 0; i < mss; i++)
        big[i] = (uint8_t)(i * 13 + 5);
    mrc_mr *ma, *mb, *msa, *msb;
    CHECK_RC(mrc_mr_reg(a, big, mss, 0, &ma));
    uint8_t *got = calloc(mss, 1);
    CHECK_RC(mrc_mr_reg(a, got, mss, 0, &msa));
    CHECK_RC(mrc_mr_reg(b, big, mss, 0, &mb));
    CHECK_RC(mrc_mr_reg(b, small, 64, 0, &msb));
    mrc_cq *cqa, *cqb;
    CHECK_RC(mrc_cq_create(a, &cqa));
    CHECK_RC(mrc_cq_create(b, &cqb));
    bool seen = false;
    for (int round = 0; round < 5 && !seen; round++) {
        uint64_t before = stats_of(b).acks_no_room;
        struct mrc_wc wc[4];
        struct mrc_wr ra = {.kind = MRC_OP_RECV, .mr = msa, .len = mss, .tag = 21, .cq = cqa};
        struct mrc_wr rb = {.kind = MRC_OP_RECV, .mr = msb, .len = 1, .tag = 20, .cq = cqb};
        CHECK_RC(mrc_post(ca[2], &ra, NULL));
        CHECK_RC(mrc_post(cb[2], &rb, NULL));
        struct mrc_wr sb = {.kind = MRC_OP_SEND, .mr = mb, .len = mss, .tag = 21, .cq = cqb,
                            .flags = MRC_POST_LAZY_ACK | MRC_POST_MORE};
        wait_asleep(b);
        CHECK_RC(mrc_post(cb[2], &sb, NULL));
        struct mrc_wr sa = {.kind = MRC_OP_SEND, .mr = ma, .len = 1, .tag = 20, .cq = cqa,
                            .flags = MRC_POST_LAZY_ACK};
        CHECK_RC(mrc_post(ca[2], &sa, NULL));
        /* a: its RECV of b's data and its SEND (acknowledged); b: the same */
        drain(cqa, wc, 2);
        CHECK(wc[0].status == 0 && wc[1].status == 0);
        drain(cqb, wc, 2);
        CHECK(wc[0].status == 0 && wc[1].status == 0);
        CHECK(memcmp(got, big, mss) == 0 && small[0] == big[0]);
        memset(got, 0, mss);
        seen = stats_of(b).acks_no_room > before;
    }
    CHECK(seen);
    CHECK_RC(mrc_mr_dereg(ma));
    CHECK_RC(mrc_mr_dereg(mb));
    CHECK_RC(mrc_mr_dereg(msa));
    CHECK_RC(mrc_mr_dereg(msb));
    CHECK_RC(mrc_cq_destroy(cqa));
    CHECK_RC(mrc_cq_destroy(cqb));
    free(big);
    free(small);
    free(got);
}

static uint64_t caller_passes(mrc_ep *ep)
{
    struct mrc_ep_stats st;
    CHECK_RC(mrc_ep_get_stats(ep, &st, NULL, 0));
    return st.caller_passes;
}

static void *try_begin(void *arg)
{
    return (void *)(intptr_t)mrc_ep_progress_begin(arg);
}

/* A SEND a -> b of LEN bytes; with `drive`, this thread runs a's passes
 * (mrc_ep_progress) until it completes, else it waits on the CQ. */
static void exchange(mrc_cq *cqa, mrc_cq *cqb, mrc_mr *ms, mrc_mr *md, size_t len, bool drive)
{
    struct mrc_wr r = {.kind = MRC_OP_RECV, .mr = md, .len = len, .tag = MRC_TAG_ANY, .cq = cqb};
    struct mrc_wr w = {.kind = MRC_OP_SEND, .mr = ms, .len = len, .tag = 9, .cq = cqa};
    CHECK_RC(mrc_post(cb[1], &r, NULL));
    CHECK_RC(mrc_post(ca[1], &w, NULL));
    struct mrc_wc wc[2];
    if (drive) {
        uint64_t t0 = now_ns();
        int n = 0;
        while (!n && now_ns() - t0 < 5000000000ull) {
            CHECK(mrc_ep_progress(a) >= 0);
            n = mrc_cq_poll(cqa, wc, 2);
        }
        CHECK(n == 1 && wc[0].status == 0);
    } else {
        CHECK(mrc_cq_wait_min(cqa, wc, 2, 1, 5000) == 1 && wc[0].status == 0);
    }
    CHECK(mrc_cq_wait_min(cqb, wc, 2, 1, 5000) == 1 && wc[0].status == 0);
}

/* Caller-driven progress: while this thread holds a's progress it runs a's
 * passes and an exchange completes through them (caller_passes counts
 * them); a request to the progress thread made meanwhile (stats) runs here;
 * a second hold (same or another endpoint) on this thread and mrc_ep_progress
 * without one are refused, another thread's begin finds it busy. After the
 * end, quiet or not, exchanges complete without a holder (a post ends the
 * quiet), and a holder whose endpoint is destroyed by another thread
 * sees MRC_ECLOSED instead of hanging either of them. */
static void *destroyer(void *arg)
{
    mrc_ep_destroy(arg);
    return NULL;
}

static void caller_progress(void)
{
    enum { LEN = 3000 };
    CHECK(mrc_ep_progress(a) == MRC_EUSAGE);
    CHECK(mrc_ep_progress_begin(NULL) == MRC_EUSAGE);
    mrc_ep_progress_end(a, 0); /* not held: nothing */
    mrc_cq *cqa, *cqb;
    CHECK_RC(mrc_cq_create(a, &cqa));
    CHECK_RC(mrc_cq_create(b, &cqb));
    static uint8_t src[LEN], dst[LEN];
    for (int i = 0; i < LEN; i++)
        src[i] = (uint8_t)(i * 7 + 1);
    mrc_mr *ms, *md;
    CHECK_RC(mrc_mr_reg(a, src, LEN, 0, &ms));
    CHECK_RC(mrc_mr_reg(b, dst, LEN, 0, &md));
    uint64_t before = caller_passes(a);
    CHECK(before == 0);
    int h;
    while ((h = mrc_ep_progress_begin(a)) == 0) /* the thread was in a pass */
        sched_yield();
    CHECK(h == 1);
    CHECK(mrc_ep_progress_begin(a) == MRC_EUSAGE);
    CHECK(mrc_ep_progress_begin(b) == MRC_EUSAGE);
    pthread_t t;
    void *res;
    CHECK(pthread_create(&t, NULL, try_begin, a) == 0);
    CHECK(pthread_join(t, &res) == 0);
    CHECK((intptr_t)res == 0);
    exchange(cqa, cqb, ms, md, LEN, true);
    CHECK(memcmp(src, dst, LEN) == 0);
    CHECK(caller_passes(a) > 0); /* the request ran on this thread */
    mrc_ep_progress_end(a, 10000000); /* quiet for 10 s */
    CHECK(mrc_ep_progress(a) == MRC_EUSAGE);
    uint64_t passes = caller_passes(a);
    memset(dst, 0, LEN);
    /* No holder: a post ends the quiet and a's thread reads its sockets again:
     * b's SEND into a RECV posted on a arrives (the CQ wait gives up after
     * 5 s, the quiet was 10), and so does an exchange the other way. */
    mrc_mr *ma2, *mb2;
    CHECK_RC(mrc_mr_reg(a, dst, LEN, 0, &ma2));
    CHECK_RC(mrc_mr_reg(b, src, LEN, 0, &mb2));
    struct mrc_wr ra = {.kind = MRC_OP_RECV, .mr = ma2, .len = LEN, .tag = MRC_TAG_ANY, .cq = cqa};
    struct mrc_wr sb = {.kind = MRC_OP_SEND, .mr = mb2, .len = LEN, .tag = 9, .cq = cqb};
    CHECK_RC(mrc_post(ca[1], &ra, NULL));
    CHECK_RC(mrc_post(cb[1], &sb, NULL));
    struct mrc_wc wc[2];
    CHECK(mrc_cq_wait_min(cqa, wc, 2, 1, 5000) == 1 && wc[0].status == 0);
    CHECK(mrc_cq_wait_min(cqb, wc, 2, 1, 5000) == 1 && wc[0].status == 0);
    CHECK(memcmp(src, dst, LEN) == 0);
    memset(dst, 0, LEN);
    exchange(cqa, cqb, ms, md, LEN, false);
    CHECK(memcmp(src, dst, LEN) == 0);
    CHECK(caller_passes(a) == passes);
    CHECK_RC(mrc_mr_dereg(ma2));
    CHECK_RC(mrc_mr_dereg(mb2));
    CHECK_RC(mrc_mr_dereg(ms));
    CHECK_RC(mrc_mr_dereg(md));
    CHECK_RC(mrc_cq_destroy(cqa));
    CHECK_RC(mrc_cq_destroy(cqb));

    /* Destroyed by another thread while held: the holder's next pass says
     * so, it ends, and the destroy (which joins the progress thread, waiting
     * for the end) returns. */
    mrc_ep *x = ep_new("127.0.0.1");
    while ((h = mrc_ep_progress_begin(x)) == 0)
        sched_yield();
    CHECK(h == 1);
    CHECK(pthread_create(&t, NULL, destroyer, x) == 0);
    int rc;
    while ((rc = mrc_ep_progress(x)) >= 0)
        sched_yield();
    CHECK(rc == MRC_ECLOSED);
    mrc_ep_progress_end(x, 0);
    CHECK(pthread_join(t, NULL) == 0);
    /* Destroyed by the holder itself: it ends first. */
    x = ep_new("127.0.0.1");
    while ((h = mrc_ep_progress_begin(x)) == 0)
        sched_yield();
    mrc_ep_destroy(x);
    x = ep_new("127.0.0.1"); /* and this thread may hold another */
    while ((h = mrc_ep_progress_begin(x)) == 0)
        sched_yield();
    CHECK(h == 1);
    mrc_ep_progress_end(x, 0);
    mrc_ep_destroy(x);
}

int main(void)
{
    setup();
    many_ops();
    wait_min_and_more();
    busy_poll();
    caller_progress();
    lazy_ack_no_room();
    timeout_and_busy();
    usage_errors();
    op_waiters();
    destroy_with_pending();
    DONE("test_cq");
    return 0;
}
