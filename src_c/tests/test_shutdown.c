/*
 * test_shutdown.c - closing with operations in flight: every operation
 * completes (done, status 0 or a clear error), staged SENDs, unread
 * immediates and posted RECVs are freed, and so are connections and regions
 * left open when the endpoint goes. Run under ASan's leak checker by
 * `make asan-test`: nothing may leak.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

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

/* A connect in its hello exchange with a listener that never greets: the
 * endpoint's closing (mrc_ep_unlisten, from another thread) ends it with
 * MRC_ECLOSED within a slice, though its timeout is an hour. */
struct connect_arg {
    mrc_conn *c;
    uint16_t port;
    int rc;
};

static void *connect_thread(void *arg)
{
    struct connect_arg *x = arg;
    x->rc = mrc_conn_connect(x->c, "127.0.9.7", x->port, -1);
    return NULL;
}

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void connect_ends_on_close(void)
{
    int mute = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sin = {.sin_family = AF_INET};
    inet_pton(AF_INET, "127.0.9.7", &sin.sin_addr);
    CHECK(mute >= 0 && bind(mute, (struct sockaddr *)&sin, sizeof(sin)) == 0);
    CHECK(listen(mute, 4) == 0);
    socklen_t sl = sizeof(sin);
    CHECK(getsockname(mute, (struct sockaddr *)&sin, &sl) == 0);
    mrc_ep *ep = ep_new("127.0.9.8");
    struct connect_arg x = {.port = ntohs(sin.sin_port), .rc = 1};
    CHECK_RC(mrc_conn_create(ep, "", &x.c));
    pthread_t t;
    CHECK(pthread_create(&t, NULL, connect_thread, &x) == 0);
    int held = accept(mute, NULL, NULL); /* the connect is under way: in its hello */
    CHECK(held >= 0);
    double t0 = mono_s();
    CHECK_RC(mrc_ep_unlisten(ep));
    pthread_join(t, NULL);
    CHECK(x.rc == MRC_ECLOSED);
    CHECK(mono_s() - t0 < 1.0);
    mrc_conn_destroy(x.c);
    mrc_ep_destroy(ep);
    close(held);
    close(mute);
}

int main(void)
{
    run(0);
    run(1);
    run(2);
    connect_ends_on_close();
    DONE("test_shutdown");
    return 0;
}
