/*
 * test_handshake.c - connection set-up: accept() before listen(), listening
 * on every plane, the connect race over several addresses (one of them dead),
 * clients that connect and vanish or say nothing while the server accepts in
 * short slices, and a port that speaks another protocol.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "mrc.h"
#include "mrc_testing.h"

static mrc_ep *ep_new(int n, const char *base)
{
    struct mrc_ep_config cfg;
    mrc_ep_config_init(&cfg);
    cfg.nplanes = n;
    for (int i = 0; i < n; i++)
        snprintf(cfg.planes[i], sizeof(cfg.planes[i]), "%s%d", base, i + 1);
    cfg.timeout_ms = 2000;
    mrc_ep *ep;
    CHECK_RC(mrc_ep_create(&cfg, &ep));
    return ep;
}

/* A raw TCP client to addr:port: connects, and writes `len` bytes of junk. */
static int raw_client(const char *addr, uint16_t port, size_t len)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, addr, &sa.sin_addr);
    CHECK(connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0);
    char junk[64];
    memset(junk, 'x', sizeof(junk));
    if (len)
        CHECK(write(fd, junk, len) == (ssize_t)len);
    return fd;
}

struct server {
    mrc_ep *ep;
    int want;
    int got;
    const char *name; /* mrc_conn_set_name before establishing, if set */
    char peer[64];    /* the last client's name */
};

/* Accepts in 10 ms slices, swallowing timeouts, as a polling server does. */
static void *serve(void *arg)
{
    struct server *s = arg;
    while (s->got < s->want) {
        mrc_conn *c;
        int rc = mrc_ep_accept(s->ep, 10, &c);
        if (rc == MRC_ETIMEOUT)
            continue;
        CHECK_RC(rc);
        snprintf(s->peer, sizeof(s->peer), "%s", mrc_conn_peer_name(c));
        if (s->name)
            CHECK_RC(mrc_conn_set_name(c, s->name));
        CHECK_RC(mrc_conn_establish(c, 5000));
        CHECK(mrc_conn_set_name(c, "late") == MRC_EUSAGE); /* the hello has gone */
        mrc_conn_destroy(c);
        s->got++;
    }
    return NULL;
}

static void test_accept_before_listen(void)
{
    mrc_ep *b = ep_new(1, "127.0.1.");
    mrc_conn *c;
    CHECK(mrc_ep_accept(b, 10, &c) == MRC_EUSAGE);
    mrc_ep_destroy(b);
}

/* Each end learns the other's name from its hello; an accepted connection's
 * own name is set before establishing. */
static void test_names(void)
{
    mrc_ep *a = ep_new(1, "127.0.0."), *b = ep_new(1, "127.0.1.");
    uint16_t port;
    CHECK_RC(mrc_ep_listen(b, NULL, 0, &port));
    struct server s = {.ep = b, .want = 1, .name = "server-b"};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, serve, &s) == 0);
    mrc_conn *c;
    CHECK_RC(mrc_conn_create(a, "client-a", &c));
    CHECK_RC(mrc_conn_connect(c, "127.0.1.1", port, 5000));
    CHECK(strcmp(mrc_conn_peer_name(c), "server-b") == 0);
    pthread_join(t, NULL);
    CHECK(strcmp(s.peer, "client-a") == 0);
    mrc_conn_destroy(c);
    mrc_ep_destroy(a);
    mrc_ep_destroy(b);
}

static void test_race_and_junk(void)
{
    mrc_ep *a = ep_new(2, "127.0.0."), *b = ep_new(2, "127.0.1.");
    uint16_t port;
    CHECK_RC(mrc_ep_listen(b, NULL, 0, &port));
    struct server s = {.ep = b, .want = 6};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, serve, &s) == 0);
    int silent = raw_client("127.0.1.2", port, 0); /* says nothing, stays */
    for (int i = 0; i < s.want; i++) {
        close(raw_client("127.0.1.1", port, (size_t)(i * 10) % 64)); /* vanishes */
        mrc_conn *c;
        CHECK_RC(mrc_conn_create(a, "a", &c));
        /* The first address is dead (nobody listens): the race takes the other. */
        const char *addrs[] = {i % 2 ? "127.0.1.9" : "127.0.1.1", i % 2 ? "127.0.1.2" : "127.0.1.9"};
        int errs[2] = {1, 1};
        CHECK_RC(mrc_conn_connect_any(c, addrs, 2, port, 5000, errs));
        mrc_conn_destroy(c);
    }
    pthread_join(t, NULL);
    CHECK(s.got == s.want);
    close(silent);

    /* No address answers: each one's reason comes back. */
    mrc_conn *c;
    CHECK_RC(mrc_conn_create(a, "a", &c));
    const char *dead[] = {"127.0.1.9", "127.0.1.10"};
    int errs[2] = {0, 0};
    CHECK(mrc_conn_connect_any(c, dead, 2, port, 2000, errs) == MRC_EUNREACH);
    CHECK(errs[0] == -ECONNREFUSED && errs[1] == -ECONNREFUSED);
    CHECK(mrc_conn_connect_any(c, dead, 2, 0, 2000, errs) == MRC_EUSAGE); /* port 0 */
    mrc_conn_destroy(c);
    mrc_ep_destroy(a);
    mrc_ep_destroy(b);
}

static void *banner(void *arg)
{
    int ls = *(int *)arg;
    int fd = accept(ls, NULL, NULL);
    const char msg[] = "SSH-2.0-OpenSSH_9.6\r\n";
    CHECK(write(fd, msg, sizeof(msg) - 1) > 0);
    char buf[512];
    while (read(fd, buf, sizeof(buf)) > 0) {
    }
    close(fd);
    return NULL;
}

static void test_not_mrc(void)
{
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    socklen_t sl = sizeof(sa);
    CHECK(bind(ls, (struct sockaddr *)&sa, sl) == 0 && listen(ls, 4) == 0);
    getsockname(ls, (struct sockaddr *)&sa, &sl);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, banner, &ls) == 0);
    mrc_ep *a = ep_new(1, "127.0.0.");
    mrc_conn *c;
    CHECK_RC(mrc_conn_create(a, "a", &c));
    CHECK(mrc_conn_connect(c, "127.0.0.1", ntohs(sa.sin_port), 30000) == MRC_ENOTMRC);
    mrc_conn_destroy(c);
    mrc_ep_destroy(a);
    pthread_join(t, NULL);
    close(ls);
}

static void *accept_forever(void *arg)
{
    mrc_conn *c;
    *(int *)((void **)arg)[1] = mrc_ep_accept(((void **)arg)[0], -1, &c);
    return NULL;
}

/* An accept blocked in another thread ends with MRC_ECLOSED when the endpoint
 * is destroyed, which waits for it (nothing of the endpoint is touched after). */
static void test_destroy_during_accept(void)
{
    mrc_ep *b = ep_new(2, "127.0.1.");
    uint16_t port;
    CHECK_RC(mrc_ep_listen(b, NULL, 0, &port));
    int rc = 0;
    void *args[2] = {b, &rc};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, accept_forever, args) == 0);
    while (!mrc_ep_accepts_active(b))
        sched_yield(); /* until the thread is inside mrc_ep_accept */
    mrc_ep_destroy(b);
    pthread_join(t, NULL);
    CHECK(rc == MRC_ECLOSED);
}

struct establish_job {
    mrc_ep *ep;
    mrc_conn *c;
    int rc;
    double ms;
};

static void *accept_establish(void *arg)
{
    struct establish_job *j = arg;
    j->rc = mrc_ep_accept(j->ep, 5000, &j->c);
    if (j->rc)
        return NULL;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    j->rc = mrc_conn_establish(j->c, 5000);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    j->ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
    return NULL;
}

/* The hellos went through, then the TCP exchange stalled: `ready` never
 * comes (the plane that carried it failed). The client is connected and
 * sends on the datapath; the server takes that as ready, at once, and the
 * data is there. Before, the server waited for `ready` until its timeout,
 * dropped the connection, and its CLOSE failed the client's, which had
 * returned connected (test_setup's burst while a plane flaps, 1 run in 6). */
static void test_ready_lost_client_live(void)
{
    mrc_ep *a = ep_new(2, "127.0.2."), *b = ep_new(2, "127.0.3.");
    uint16_t port;
    CHECK_RC(mrc_ep_listen(b, NULL, 0, &port));
    CHECK_RC(mrc_ep_testing_no_ready(a, 1));
    struct establish_job j = {.ep = b};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, accept_establish, &j) == 0);
    mrc_conn *ca;
    CHECK_RC(mrc_conn_create(a, "no-ready", &ca));
    CHECK_RC(mrc_conn_connect(ca, "127.0.3.1", port, 5000));
    enum { LEN = 100000 };
    static uint8_t src[LEN], dst[LEN];
    for (int i = 0; i < LEN; i++)
        src[i] = (uint8_t)(i * 7 + 3);
    mrc_mr *mra, *mrb;
    CHECK_RC(mrc_mr_reg(a, src, LEN, 0, &mra));
    CHECK_RC(mrc_mr_reg(b, dst, LEN, 0, &mrb));
    mrc_op *s;
    CHECK_RC(mrc_post_send(ca, mra, 0, LEN, 42, &s));
    pthread_join(t, NULL);
    CHECK_RC(j.rc);
    CHECK(j.ms < 1500); /* the data's arrival, not the 5 s timeout */
    mrc_op *r;
    CHECK_RC(mrc_post_recv(j.c, mrb, 0, LEN, 42, &r));
    CHECK_RC(mrc_op_wait(r, 5000));
    CHECK_RC(mrc_op_wait(s, 5000));
    struct mrc_op_result res;
    mrc_op_get_result(r, &res);
    CHECK_RC(res.status);
    CHECK(res.bytes == LEN && memcmp(src, dst, LEN) == 0);
    mrc_op_get_result(s, &res);
    CHECK_RC(res.status);
    CHECK(mrc_conn_error(ca) == 0);
    mrc_op_release(r);
    mrc_op_release(s);
    mrc_conn_destroy(j.c);
    mrc_conn_destroy(ca);
    CHECK_RC(mrc_mr_dereg(mra));
    CHECK_RC(mrc_mr_dereg(mrb));
    mrc_ep_destroy(a);
    mrc_ep_destroy(b);
}

/* The engine took the client's connection only after the attempt's deadline
 * had passed (a busy progress thread), the hellos in time. The set-up is
 * final from there: `ready` goes within the set-up's timeout, the connect
 * succeeds once, the server makes one connection, and data flows. Before,
 * `ready` timed out against the attempt's deadline, the set-up was tried
 * again, and the second activation put the connection on the engine's active
 * list twice: a cycle that the next link event spun in for ever (the hang of
 * test_setup's burst while a plane flaps). */
static void test_late_activation_is_final(void)
{
    mrc_ep *a = ep_new(2, "127.0.2."), *b = ep_new(2, "127.0.3.");
    uint16_t port;
    CHECK_RC(mrc_ep_listen(b, NULL, 0, &port));
    CHECK_RC(mrc_ep_testing_late_ready(a, 1));
    struct establish_job j = {.ep = b};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, accept_establish, &j) == 0);
    mrc_conn *ca;
    CHECK_RC(mrc_conn_create(a, "late", &ca));
    CHECK_RC(mrc_conn_connect(ca, "127.0.3.1", port, 5000));
    pthread_join(t, NULL);
    CHECK_RC(j.rc);
    mrc_conn *extra = NULL;
    CHECK(mrc_ep_accept(b, 200, &extra) == MRC_ETIMEOUT); /* no second attempt */
    enum { LEN = 100000 };
    static uint8_t src[LEN], dst[LEN];
    for (int i = 0; i < LEN; i++)
        src[i] = (uint8_t)(i * 13 + 1);
    mrc_mr *mra, *mrb;
    CHECK_RC(mrc_mr_reg(a, src, LEN, 0, &mra));
    CHECK_RC(mrc_mr_reg(b, dst, LEN, 0, &mrb));
    mrc_op *s, *r;
    CHECK_RC(mrc_post_recv(j.c, mrb, 0, LEN, 7, &r));
    CHECK_RC(mrc_post_send(ca, mra, 0, LEN, 7, &s));
    CHECK_RC(mrc_op_wait(s, 5000));
    CHECK_RC(mrc_op_wait(r, 5000));
    struct mrc_op_result res;
    mrc_op_get_result(r, &res);
    CHECK_RC(res.status);
    CHECK(res.bytes == LEN && memcmp(src, dst, LEN) == 0);
    CHECK(mrc_conn_error(ca) == 0 && mrc_conn_error(j.c) == 0);
    mrc_op_release(r);
    mrc_op_release(s);
    mrc_conn_destroy(j.c);
    mrc_conn_destroy(ca);
    CHECK_RC(mrc_mr_dereg(mra));
    CHECK_RC(mrc_mr_dereg(mrb));
    mrc_ep_destroy(a);
    mrc_ep_destroy(b);
}

int main(void)
{
    test_late_activation_is_final();
    test_ready_lost_client_live();
    test_accept_before_listen();
    test_destroy_during_accept();
    test_race_and_junk();
    test_names();
    test_not_mrc();
    DONE("test_handshake");
    return 0;
}
