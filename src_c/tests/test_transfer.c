/*
 * test_transfer.c - two endpoints in one process over loopback planes:
 * byte-exact WRITE and SEND/RECV with loss injected, a refused key, garbage
 * datagrams, close with operations in flight. Run under ASan+UBSan by
 * `make asan-test`, which also checks that nothing leaks.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "check.h"
#include "connect.h"
#include "mrc.h"
#include "mrc_testing.h"

#define NPLANES 4

struct pair {
    mrc_ep *a, *b;
    mrc_conn *ca, *cb;
    uint16_t port;
};

static mrc_ep *ep_new(int base)
{
    struct mrc_ep_config cfg;
    mrc_ep_config_init(&cfg);
    cfg.nplanes = NPLANES;
    for (int i = 0; i < NPLANES; i++)
        snprintf(cfg.planes[i], sizeof(cfg.planes[i]), "127.0.%d.%d", base, i + 1);
    cfg.timeout_ms = 2000;
    mrc_ep *ep;
    CHECK_RC(mrc_ep_create(&cfg, &ep));
    return ep;
}

static void pair_up(struct pair *p)
{
    p->a = ep_new(0);
    p->b = ep_new(1);
    CHECK_RC(mrc_ep_listen(p->b, NULL, 0, &p->port));
    CHECK_RC(connect_pair(p->a, p->b, "127.0.1.1", p->port, "a", &p->ca, &p->cb));
    CHECK(mrc_conn_npaths(p->ca) == NPLANES);
}

static void pair_down(struct pair *p)
{
    mrc_conn_destroy(p->ca);
    mrc_conn_destroy(p->cb);
    mrc_ep_destroy(p->a);
    mrc_ep_destroy(p->b);
}

static void fill(uint8_t *b, size_t n, uint32_t seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        b[i] = (uint8_t)(seed >> 16);
    }
}

static int wait_status(mrc_op *op)
{
    CHECK(mrc_op_wait(op, 10000) == 0);
    struct mrc_op_result r;
    mrc_op_get_result(op, &r);
    mrc_op_release(op);
    if (getenv("MRC_TEST_VERBOSE"))
        fprintf(stderr, "op status %d (%s)\n", r.status, mrc_strerror(r.status));
    return r.status;
}

/* 16 writes of `size` in flight, then compare. */
static void test_write(struct pair *p, size_t size)
{
    enum { N = 16 };
    uint8_t *src = malloc(size * N), *dst = calloc(size * N + 64, 1);
    fill(src, size * N, (uint32_t)size);
    memset(dst, 0xAB, 32);
    memset(dst + 32 + size * N, 0xAB, 32);
    mrc_mr *ms, *md;
    CHECK_RC(mrc_mr_reg(p->a, src, size * N, 0, &ms));
    CHECK_RC(mrc_mr_reg(p->b, dst + 32, size * N, MRC_ACCESS_REMOTE_WRITE, &md));
    mrc_op *ops[N];
    for (int i = 0; i < N; i++)
        CHECK_RC(mrc_post_write(p->ca, ms, size * i, size, mrc_mr_key(md), size * i, 7, 0,
                                &ops[i]));
    for (int i = 0; i < N; i++)
        CHECK(wait_status(ops[i]) == 0);
    CHECK(memcmp(src, dst + 32, size * N) == 0);
    for (int i = 0; i < 32; i++)
        CHECK(dst[i] == 0xAB && dst[32 + size * N + i] == 0xAB);
    mrc_mr_dereg(ms);
    mrc_mr_dereg(md);
    free(src);
    free(dst);
}

static void test_send_recv(struct pair *p)
{
    size_t size = 300000;
    uint8_t *src = malloc(size * 2), *dst = calloc(size * 2, 1);
    fill(src, size * 2, 99);
    mrc_mr *ms, *md;
    CHECK_RC(mrc_mr_reg(p->a, src, size * 2, 0, &ms));
    CHECK_RC(mrc_mr_reg(p->b, dst, size * 2, 0, &md));
    mrc_op *r1, *s1, *s2, *r2;
    CHECK_RC(mrc_post_recv(p->cb, md, 0, size, 5, &r1));     /* posted before */
    CHECK_RC(mrc_post_send(p->ca, ms, 0, size, 5, &s1));
    CHECK_RC(mrc_post_send(p->ca, ms, size, size, 6, &s2));  /* unexpected */
    CHECK(wait_status(s1) == 0);
    CHECK(wait_status(s2) == 0);
    CHECK_RC(mrc_post_recv(p->cb, md, size, size, MRC_TAG_ANY, &r2));
    CHECK(mrc_op_wait(r1, 5000) == 0 && mrc_op_wait(r2, 5000) == 0);
    struct mrc_op_result res;
    mrc_op_get_result(r2, &res);
    CHECK(res.status == 0 && res.tag == 6 && res.bytes == size);
    CHECK(wait_status(r1) == 0);
    mrc_op_release(r2);
    CHECK(memcmp(src, dst, size * 2) == 0);
    mrc_mr_dereg(ms);
    mrc_mr_dereg(md);
    free(src);
    free(dst);
}

static void test_imm(struct pair *p)
{
    uint8_t src[5000], dst[5000];
    fill(src, sizeof(src), 3);
    mrc_mr *ms, *md;
    CHECK_RC(mrc_mr_reg(p->a, src, sizeof(src), 0, &ms));
    CHECK_RC(mrc_mr_reg(p->b, dst, sizeof(dst), MRC_ACCESS_REMOTE_WRITE, &md));
    mrc_op *op;
    CHECK_RC(mrc_post_write(p->ca, ms, 0, sizeof(src), mrc_mr_key(md), 0, 0xfeed, MRC_WRITE_IMM,
                            &op));
    uint32_t imm = 0;
    uint64_t len = 0;
    CHECK_RC(mrc_conn_wait_imm(p->cb, 5000, &imm, &len));
    CHECK(imm == 0xfeed && len == sizeof(src));
    CHECK(memcmp(src, dst, sizeof(src)) == 0); /* placed before the imm is seen */
    CHECK(wait_status(op) == 0);
    mrc_mr_dereg(ms);
    mrc_mr_dereg(md);
}

static void garbage(struct pair *p)
{
    char addr[64];
    uint16_t port;
    CHECK_RC(mrc_ep_plane(p->b, 0, addr, sizeof(addr), &port));
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, addr, &sa.sin_addr);
    uint8_t junk[200];
    for (int i = 0; i < 200; i++) {
        fill(junk, sizeof(junk), (uint32_t)i);
        if (i % 2) { /* valid magic/version, random rest */
            junk[0] = 0x52;
            junk[1] = 0x4d;
            junk[2] = 1;
        }
        sendto(fd, junk, (size_t)(i % 100), 0, (struct sockaddr *)&sa, sizeof(sa));
    }
    close(fd);
}

static void test_bad_key(void)
{
    struct pair p;
    pair_up(&p);
    uint8_t src[4096], dst[4096 + 64];
    memset(dst, 0x5A, sizeof(dst));
    fill(src, sizeof(src), 1);
    mrc_mr *ms, *md;
    CHECK_RC(mrc_mr_reg(p.a, src, sizeof(src), 0, &ms));
    CHECK_RC(mrc_mr_reg(p.b, dst + 32, 4096, MRC_ACCESS_REMOTE_WRITE, &md));
    mrc_op *op;
    CHECK_RC(mrc_post_write(p.ca, ms, 0, 4096, mrc_mr_key(md) ^ (1ull << 40), 0, 0, 0, &op));
    CHECK(wait_status(op) == MRC_EKEY);
    CHECK(mrc_conn_error(p.ca) == MRC_EREMOTE);
    for (size_t i = 0; i < sizeof(dst); i++)
        CHECK(dst[i] == 0x5A);
    struct mrc_ep_stats st;
    CHECK_RC(mrc_ep_get_stats(p.b, &st, NULL, 0));
    CHECK(st.drops[MRC_DROP_BAD_KEY] >= 1);
    mrc_mr_dereg(ms);
    mrc_mr_dereg(md);
    pair_down(&p);

    pair_up(&p);
    CHECK_RC(mrc_mr_reg(p.a, src, sizeof(src), 0, &ms));
    CHECK_RC(mrc_mr_reg(p.b, dst + 32, 4096, MRC_ACCESS_REMOTE_WRITE, &md));
    CHECK_RC(mrc_post_write(p.ca, ms, 0, 4096, mrc_mr_key(md), 1, 0, 0, &op));
    CHECK(wait_status(op) == MRC_EBOUNDS);
    for (size_t i = 0; i < sizeof(dst); i++)
        CHECK(dst[i] == 0x5A);
    mrc_mr_dereg(ms);
    mrc_mr_dereg(md);
    pair_down(&p);
}

static void test_close_in_flight(void)
{
    struct pair p;
    pair_up(&p);
    size_t size = 8 << 20;
    uint8_t *src = calloc(size, 1), *dst = calloc(size, 1);
    mrc_mr *ms, *md;
    CHECK_RC(mrc_mr_reg(p.a, src, size, 0, &ms));
    CHECK_RC(mrc_mr_reg(p.b, dst, size, MRC_ACCESS_REMOTE_WRITE, &md));
    mrc_op *op, *rv;
    CHECK_RC(mrc_post_write(p.ca, ms, 0, size, mrc_mr_key(md), 0, 0, 0, &op));
    CHECK_RC(mrc_post_recv(p.cb, md, 0, 16, 1, &rv));
    mrc_conn_destroy(p.cb); /* the receiver goes away mid-transfer */
    p.cb = NULL;
    int st = wait_status(op);
    CHECK(st == 0 || st == MRC_ECLOSED || st == MRC_ETIMEOUT || st == MRC_EPATHDOWN);
    CHECK(wait_status(rv) == MRC_ECLOSED);
    mrc_mr_dereg(ms);
    mrc_mr_dereg(md);
    pair_down(&p);
    free(src);
    free(dst);
}

/* The receiver's ACKs are held (its sockets refuse to send) until the sender
 * has timed packets out: the data had arrived, so those timeouts are found
 * spurious once the ACKs go, and no path stays suspect or failed for them. */
static void test_slow_acks(void)
{
    struct pair p;
    pair_up(&p);
    size_t size = 1 << 20;
    uint8_t *src = malloc(size), *dst = calloc(size, 1);
    fill(src, size, 99);
    mrc_mr *ms, *md;
    CHECK_RC(mrc_mr_reg(p.a, src, size, 0, &ms));
    CHECK_RC(mrc_mr_reg(p.b, dst, size, MRC_ACCESS_REMOTE_WRITE, &md));
    CHECK_RC(mrc_ep_testing_tx_stall(p.b, 1));
    mrc_op *op;
    CHECK_RC(mrc_post_write(p.ca, ms, 0, size, mrc_mr_key(md), 0, 0, 0, &op));
    struct mrc_ep_stats st;
    struct mrc_path_stats ps[NPLANES];
    for (int i = 0; i < 2000; i++) { /* poll: the sender's RTO is >= 5 ms */
        CHECK_RC(mrc_ep_get_stats(p.a, &st, NULL, 0));
        if (st.lost_rto)
            break;
        usleep(1000);
    }
    CHECK(st.lost_rto > 0);
    CHECK_RC(mrc_ep_testing_tx_stall(p.b, 0));
    CHECK(wait_status(op) == 0);
    CHECK(memcmp(src, dst, size) == 0);
    CHECK_RC(mrc_ep_get_stats(p.a, &st, ps, NPLANES));
    CHECK(st.spurious_rto > 0);
    int good = 0;
    for (int i = 0; i < NPLANES; i++)
        good += ps[i].state == MRC_PATH_GOOD;
    CHECK(good > 0);
    if (getenv("MRC_TEST_VERBOSE"))
        fprintf(stderr, "slow acks: lost_rto %llu spurious %llu good paths %d\n",
                (unsigned long long)st.lost_rto, (unsigned long long)st.spurious_rto, good);
    mrc_mr_dereg(ms);
    mrc_mr_dereg(md);
    pair_down(&p);
    free(src);
    free(dst);
}

int main(void)
{
    struct pair p;
    pair_up(&p);
    test_write(&p, 1);
    test_write(&p, 4096);
    test_write(&p, 1 << 20);
    test_write(&p, 100003);
    test_send_recv(&p);
    test_imm(&p);
    garbage(&p);
    CHECK_RC(mrc_ep_inject(p.a, 1, 0.05, 0));
    CHECK_RC(mrc_ep_inject(p.b, 1, 0.05, 0));
    test_write(&p, 1 << 20);
    for (int i = 0; i < NPLANES; i++) {
        CHECK_RC(mrc_ep_inject(p.a, i, 0.01, 0));
        CHECK_RC(mrc_ep_inject(p.b, i, 0.01, 0));
    }
    test_write(&p, 1 << 20);
    test_send_recv(&p);
    CHECK_RC(mrc_ep_inject(p.a, 2, 0, 1)); /* plane 2 dies */
    test_write(&p, 1 << 20);
    struct mrc_ep_stats st;
    struct mrc_path_stats ps[16];
    CHECK_RC(mrc_ep_get_stats(p.a, &st, ps, 16));
    CHECK(st.retx > 0 && st.drops[MRC_DROP_INJECTED] > 0);
    CHECK(ps[2].state == MRC_PATH_FAILED || ps[2].state == MRC_PATH_SUSPECT);
    CHECK_RC(mrc_ep_get_stats(p.b, &st, NULL, 0));
    uint64_t junk = st.drops[MRC_DROP_TRUNCATED] + st.drops[MRC_DROP_BAD_MAGIC] +
                    st.drops[MRC_DROP_BAD_TYPE] + st.drops[MRC_DROP_BAD_LENGTH] +
                    st.drops[MRC_DROP_UNKNOWN_CONN] + st.drops[MRC_DROP_BAD_VERSION] +
                    st.drops[MRC_DROP_BAD_MSG];
    CHECK(junk == 200);
    pair_down(&p);
    test_bad_key();
    test_close_in_flight();
    test_slow_acks();
    DONE("test_transfer");
    return 0;
}
