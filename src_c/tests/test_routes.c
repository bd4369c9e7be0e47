/*
 * test_routes.c - route sockets are shared by every peer behind the same
 * spine. In a private network namespace (root; skipped otherwise) whose
 * loopback holds 32 "spine" SIDs with SRv6 enabled, one hub endpoint connects
 * to 63 peers over 32 SRv6 paths each (SID k, then the peer): the per-endpoint
 * load of a full mesh of 64 endpoints on a 32-path fabric. It must fit in one
 * plane socket plus 32 route sockets (one per path would be 2,016), and a
 * WRITE to every peer must land exactly, through sockets the kernel fills in
 * with each peer's address.
 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "mrc.h"

#define NPEERS 63
#define NSPINES 32
#define SIZE (64 * 1024)

#define HUB_ADDR "fd00:2::1"

/* Peer i's address (its one plane). */
static void peer_addr(int i, char *buf, size_t len) { snprintf(buf, len, "fd00:1::%x", i + 1); }

static mrc_ep *ep_new(const char *addr)
{
    struct mrc_ep_config cfg;
    mrc_ep_config_init(&cfg);
    cfg.nplanes = 1;
    snprintf(cfg.planes[0], sizeof(cfg.planes[0]), "%s", addr);
    cfg.window = 256; /* 64 endpoints in one process: keep each small */
    cfg.sockbuf = 1 << 20;
    mrc_ep *ep;
    CHECK_RC(mrc_ep_create(&cfg, &ep));
    return ep;
}

/* Path k: through SID k, then to dst. */
static void add_paths(mrc_conn *c, const char *dst)
{
    for (int k = 0; k < NSPINES; k++) {
        struct mrc_path_spec s = {.id = k, .plane = 0, .nsegs = 2};
        snprintf(s.dst, sizeof(s.dst), "%s", dst);
        snprintf(s.segs[0], sizeof(s.segs[0]), "fd00:ff::%x", k + 1);
        snprintf(s.segs[1], sizeof(s.segs[1]), "%s", dst);
        CHECK_RC(mrc_conn_add_path(c, &s));
    }
}

struct peer {
    mrc_ep *ep;
    mrc_conn *conn;
    uint16_t port;
    uint8_t *buf;
    mrc_mr *mr;
    int rc;
};

static void *accept_thread(void *arg)
{
    struct peer *p = arg;
    p->rc = mrc_ep_accept(p->ep, 10000, &p->conn);
    if (!p->rc) {
        add_paths(p->conn, HUB_ADDR); /* mirrors of the hub's: the peer ACKs on path k */
        p->rc = mrc_conn_establish(p->conn, 10000);
    }
    return NULL;
}

/* A namespace of our own: nothing we send can leave the machine, and the
 * SIDs on its loopback are ours to add. */
static bool private_netns(void)
{
    if (unshare(CLONE_NEWNET) != 0)
        return false;
    FILE *ip = popen("ip -batch -", "w");
    CHECK(ip);
    fprintf(ip, "link set lo up\n");
    for (int k = 0; k < NSPINES; k++)
        fprintf(ip, "addr add fd00:ff::%x/128 dev lo nodad\n", k + 1);
    for (int i = 0; i < NPEERS; i++)
        fprintf(ip, "addr add fd00:1::%x/128 dev lo nodad\n", i + 1);
    fprintf(ip, "addr add %s/128 dev lo nodad\n", HUB_ADDR);
    CHECK(pclose(ip) == 0);
    const char *knobs[] = {"/proc/sys/net/ipv6/conf/all/seg6_enabled",
                           "/proc/sys/net/ipv6/conf/lo/seg6_enabled"};
    for (int i = 0; i < 2; i++) {
        FILE *f = fopen(knobs[i], "w");
        CHECK(f && fputs("1", f) >= 0 && fclose(f) == 0);
    }
    return true;
}

int main(void)
{
    if (!private_netns()) {
        printf("test_routes: skipped (a network namespace needs root: %s)\n", strerror(errno));
        return 0;
    }
    static struct peer peers[NPEERS];
    mrc_ep *hub = ep_new(HUB_ADDR);
    char addr[MRC_ADDR_STRLEN];
    mrc_conn *conns[NPEERS];
    for (int i = 0; i < NPEERS; i++) {
        struct peer *p = &peers[i];
        peer_addr(i, addr, sizeof(addr));
        p->ep = ep_new(addr);
        CHECK_RC(mrc_ep_listen(p->ep, NULL, 0, &p->port));
        pthread_t t;
        CHECK(pthread_create(&t, NULL, accept_thread, p) == 0);
        CHECK_RC(mrc_conn_create(hub, "hub", &conns[i]));
        add_paths(conns[i], addr);
        CHECK_RC(mrc_conn_connect(conns[i], addr, p->port, 10000));
        pthread_join(t, NULL);
        CHECK_RC(p->rc);
    }
    struct mrc_ep_stats st;
    CHECK_RC(mrc_ep_get_stats(hub, &st, NULL, 0));
    CHECK(st.nconns == NPEERS);
    CHECK(st.nsocks == 1 + NSPINES);
    /* The plane is on lo: its route sockets carry the sticky header (no
     * kernel seg6 routes there), and the endpoint says so. */
    CHECK(st.nsocks_seg6route == 0);
    CHECK(mrc_ep_srh_offload(hub) == 0);

    /* A different pattern to every peer: a socket that sent to the wrong
     * peer would place another's bytes or none. */
    static uint8_t src[NPEERS][SIZE];
    mrc_mr *smr[NPEERS];
    mrc_op *ops[NPEERS];
    for (int i = 0; i < NPEERS; i++) {
        struct peer *p = &peers[i];
        for (int j = 0; j < SIZE; j++)
            src[i][j] = (uint8_t)(i * 131 + j * 7 + (j >> 9));
        p->buf = calloc(SIZE, 1);
        CHECK(p->buf);
        CHECK_RC(mrc_mr_reg(p->ep, p->buf, SIZE, MRC_ACCESS_REMOTE_WRITE, &p->mr));
        CHECK_RC(mrc_mr_reg(hub, src[i], SIZE, 0, &smr[i]));
        CHECK_RC(mrc_post_write(conns[i], smr[i], 0, SIZE, mrc_mr_key(p->mr), 0, 0, 0, &ops[i]));
    }
    for (int i = 0; i < NPEERS; i++) {
        CHECK(mrc_op_wait(ops[i], 20000) == 0);
        struct mrc_op_result r;
        mrc_op_get_result(ops[i], &r);
        mrc_op_release(ops[i]);
        CHECK_RC(r.status);
        CHECK(memcmp(src[i], peers[i].buf, SIZE) == 0);
    }
    CHECK_RC(mrc_ep_get_stats(peers[0].ep, &st, NULL, 0));
    CHECK(st.nsocks == 1 + NSPINES && st.rx_pkts > 0);

    for (int i = 0; i < NPEERS; i++) {
        mrc_conn_destroy(conns[i]);
        mrc_conn_destroy(peers[i].conn);
        mrc_mr_dereg(smr[i]);
        mrc_mr_dereg(peers[i].mr);
        mrc_ep_destroy(peers[i].ep);
        free(peers[i].buf);
    }
    mrc_ep_destroy(hub);
    DONE("test_routes");
    return 0;
}
