/*
 * test_shutdown.c - closing with operations in flight: every operation
 * completes (done, status 0 or a clear error), staged SENDs, unread
 * immediates and posted RECVs are freed, and so are connections and regions
 * left open when the endpoint goes. Run under ASan's leak checker by
 * `make asan-test`: nothing may leak.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "connect.h"
#include "mrc.h"

static mrc_ep *a, *b;
static mrc_conn *ca, *cb;
static uint16_t port;

static mrc_ep *ep_new(const char *addr)
{
    struct mrc_ep_config cfg;
    mrc_ep_config_init(&cfg);
    cfg.nplanes = 1;
    snprintf(cfg.planes[0], sizeof(cfg.planes[0]), "%s", addr);
    cfg.timeout_ms = 2000;
    mrc_ep *ep;
    CHECK_RC(mrc_ep_create(&cfg, &ep));
    return ep;
}

static void pair_up(void)
{
    a = ep_new("127.0.0.1");
    b = ep_new("127.0.1.1");
    CHECK_RC(mrc_ep_listen(b, NULL, 0, &port));
    CHECK_RC(connect_pair(a, b, "127.0.1.1", port, "a", &ca, &cb));
}

/* Done, and either succeeded or failed with a connection error. */
static void settle(mrc_op *op)
{
    CHECK(mrc_op_wait(op, 10000) == 0);
    struct mrc_op_result r;
    mrc_op_get_result(op, &r);
    CHECK(r.status == 0 || r.status == MRC_ECLOSED || r.status == MRC_EREMOTE ||
          r.status == MRC_ETIMEOUT || r.status == MRC_EPATHDOWN);
    mrc_op_release(op);
}

/* side: which connection goes first (the writer's or the reader's), or 2:
 * neither, the endpoints are destroyed with everything still open */
static void run(int side)
{
    enum { NW = 8, NS = 4, NR = 4, SZ = 4 << 20 };
    pair_up();
    uint8_t *src = calloc(SZ, 1), *dst = calloc(SZ, 1);
    mrc_mr *ms, *md;
    CHECK_RC(mrc_mr_reg(a, src, SZ, 0, &ms));
    CHECK_RC(mrc_mr_reg(b, dst, SZ, MRC_ACCESS_REMOTE_WRITE, &md));
    mrc_op *ops[NW + NS + NR];
    int n = 0;
    /* SENDs with no RECV: staged at b (tag 1); RECVs that nothing matches (tag 2) */
    for (int i = 0; i < NS; i++)
        CHECK_RC(mrc_post_send(ca, ms, 0, 100000, 1, &ops[n++]));
    for (int i = 0; i < NR; i++)
        CHECK_RC(mrc_post_recv(cb, md, 0, 1000, 2, &ops[n++]));
    /* big WRITEs with immediates nobody reads */
    for (int i = 0; i < NW; i++)
        CHECK_RC(mrc_post_write(ca, ms, 0, SZ, mrc_mr_key(md), 0, (uint32_t)i, MRC_WRITE_IMM,
                                &ops[n++]));
    mrc_op_wait(ops[NS + NR], 10000); /* some data is on its way */
    if (side == 2) {
        /* The endpoints go first: they free the connections (one of them
         * never connected) and regions left to them; the operations are
         * only released. */
        mrc_conn *unused;
        CHECK_RC(mrc_conn_create(a, "never connected", &unused));
        mrc_ep_destroy(a);
        mrc_ep_destroy(b);
        ca = cb = unused = NULL; /* dangling now; nothing else may keep them reachable */
        for (int i = 0; i < n; i++)
            mrc_op_release(ops[i]);
        free(src);
        free(dst);
        return;
    }
    if (side == 0) {
        mrc_conn_destroy(ca);
        mrc_conn_destroy(cb);
    } else {
        mrc_conn_destroy(cb);
        mrc_conn_destroy(ca);
    }
    for (int i = 0; i < n; i++)
        settle(ops[i]);
    mrc_mr_dereg(ms);
    mrc_mr_dereg(md);
    mrc_ep_destroy(a);
    mrc_ep_destroy(b);
    free(src);
    free(dst);
}

int main(void)
{
    run(0);
    run(1);
    run(2);
    DONE("test_shutdown");
    return 0;
}
