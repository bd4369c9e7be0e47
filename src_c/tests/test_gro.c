/*
 * test_gro.c - UDP GRO on the receive side, over loopback planes: the
 * sender's GSO batches arrive as one read each and are cut back into the
 * same packets. WRITEs of sizes that are not a multiple of the MSS are
 * checked byte for byte, a hand-made GSO datagram of foreign packets shows
 * that each segment is validated on its own (at the right boundaries), and
 * MRC_GRO=0 gives the same bytes with every datagram read alone.
 */
#include <arpa/inet.h>
#include <netinet/udp.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "check.h"
#include "connect.h"
#include "mrc.h"
#include "wire.h"

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif

struct pair {
    mrc_ep *a, *b;
    mrc_conn *ca, *cb;
};

static mrc_ep *ep_new(int base)
{
    struct mrc_ep_config cfg;
    mrc_ep_config_init(&cfg);
    cfg.nplanes = 2;
    for (int i = 0; i < cfg.nplanes; i++)
        snprintf(cfg.planes[i], sizeof(cfg.planes[i]), "127.0.%d.%d", base, i + 1);
    mrc_ep *ep;
    CHECK_RC(mrc_ep_create(&cfg, &ep));
    return ep;
}

static void pair_up(struct pair *p, int base)
{
    uint16_t port;
    p->a = ep_new(base);
    p->b = ep_new(base + 1);
    CHECK_RC(mrc_ep_listen(p->b, NULL, 0, &port));
    char addr[32];
    snprintf(addr, sizeof(addr), "127.0.%d.1", base + 1);
    CHECK_RC(connect_pair(p->a, p->b, addr, port, "gro", &p->ca, &p->cb));
}

static void pair_down(struct pair *p)
{
    mrc_conn_destroy(p->ca);
    mrc_conn_destroy(p->cb);
    mrc_ep_destroy(p->a);
    mrc_ep_destroy(p->b);
}

static uint64_t fnv1a(const uint8_t *b, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* One WRITE of `size` bytes a -> b; the bytes must arrive exactly. */
static void write_check(struct pair *p, size_t size)
{
    uint8_t *src = malloc(size), *dst = calloc(size, 1);
    CHECK(src && dst);
    uint32_t x = (uint32_t)size;
    for (size_t i = 0; i < size; i++) {
        x = x * 1103515245u + 12345u;
        src[i] = (uint8_t)(x >> 16);
    }
    mrc_mr *ms, *md;
    CHECK_RC(mrc_mr_reg(p->a, src, size, 0, &ms));
    CHECK_RC(mrc_mr_reg(p->b, dst, size, MRC_ACCESS_REMOTE_WRITE, &md));
    mrc_op *op;
    CHECK_RC(mrc_post_write(p->ca, ms, 0, size, mrc_mr_key(md), 0, 0, 0, &op));
    CHECK(mrc_op_wait(op, 20000) == 0);
    struct mrc_op_result r;
    mrc_op_get_result(op, &r);
    mrc_op_release(op);
    CHECK_RC(r.status);
    CHECK(fnv1a(src, size) == fnv1a(dst, size) && memcmp(src, dst, size) == 0);
    mrc_mr_dereg(ms);
    mrc_mr_dereg(md);
    free(src);
    free(dst);
}

static struct mrc_ep_stats stats(mrc_ep *ep)
{
    struct mrc_ep_stats st;
    CHECK_RC(mrc_ep_get_stats(ep, &st, NULL, 0));
    return st;
}

/*
 * One UDP GSO datagram to b's plane 0: four 300-byte segments and a 200-byte
 * last one, each a well-formed WRITE for a connection that does not exist.
 * Cut at the segment size, each is refused as unknown_conn; cut anywhere
 * else, the length field would not match and it would be bad_length.
 */
static void foreign_batch(mrc_ep *b, bool gro)
{
    enum { SEG = 300, NSEG = 5, LAST = 200 };
    uint8_t buf[SEG * (NSEG - 1) + LAST];
    memset(buf, 0xab, sizeof(buf));
    for (int i = 0; i < NSEG; i++) {
        size_t len = i == NSEG - 1 ? LAST : SEG;
        struct mrc_hdr h = {.magic = MRC_MAGIC,
                            .version = MRC_WIRE_VERSION,
                            .type = MRC_PKT_WRITE,
                            .len = (uint16_t)(len - MRC_DATA_HDR_LEN),
                            .conn = 0x12340000u, /* slot 0 is never used */
                            .psn = (uint32_t)i};
        struct mrc_data_ext d = {.msg_len = 1 << 20, .offset = (uint64_t)i * SEG};
        memcpy(buf + i * SEG, &h, sizeof(h));
        memcpy(buf + i * SEG + sizeof(h), &d, sizeof(d));
    }
    char addr[64];
    uint16_t port;
    CHECK_RC(mrc_ep_plane(b, 0, addr, sizeof(addr), &port));
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, addr, &sa.sin_addr);
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    CHECK(fd >= 0);
    union {
        char c[CMSG_SPACE(sizeof(uint16_t))];
        struct cmsghdr align;
    } ctl;
    struct iovec iov = {.iov_base = buf, .iov_len = sizeof(buf)};
    struct msghdr m = {.msg_name = &sa,
                       .msg_namelen = sizeof(sa),
                       .msg_iov = &iov,
                       .msg_iovlen = 1,
                       .msg_control = ctl.c,
                       .msg_controllen = sizeof(ctl.c)};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
    cm->cmsg_level = SOL_UDP;
    cm->cmsg_type = UDP_SEGMENT;
    cm->cmsg_len = CMSG_LEN(sizeof(uint16_t));
    uint16_t seg = SEG;
    memcpy(CMSG_DATA(cm), &seg, sizeof(seg));

    struct mrc_ep_stats before = stats(b);
    CHECK(sendmsg(fd, &m, 0) == (ssize_t)sizeof(buf));
    close(fd);
    /* The five refusals are counted once the progress thread has read the
     * datagram: poll the counter (bounded), it is the event waited for. */
    struct mrc_ep_stats after;
    for (int i = 0; i < 2000; i++) {
        after = stats(b);
        if (after.drops[MRC_DROP_UNKNOWN_CONN] - before.drops[MRC_DROP_UNKNOWN_CONN] >= NSEG)
            break;
        usleep(1000);
    }
    CHECK(after.drops[MRC_DROP_UNKNOWN_CONN] - before.drops[MRC_DROP_UNKNOWN_CONN] == NSEG);
    CHECK(after.drops[MRC_DROP_BAD_LENGTH] == before.drops[MRC_DROP_BAD_LENGTH]);
    if (gro) {
        CHECK(after.rx_gro_reads - before.rx_gro_reads == 1);
        CHECK(after.rx_reads - before.rx_reads == 1);
    } else {
        CHECK(after.rx_gro_reads == 0);
        CHECK(after.rx_reads - before.rx_reads == NSEG);
    }
}

static void run(int base, bool gro)
{
    struct pair p;
    pair_up(&p, base);
    write_check(&p, 1);
    write_check(&p, 8192 * 7 + 1);
    write_check(&p, (8 << 20) + 777);
    struct mrc_ep_stats st = stats(p.b);
    if (gro) {
        /* A GSO batch of up to 7 packets arrived as one read. */
        CHECK(st.rx_gro_reads > 0);
        CHECK(st.rx_reads < st.rx_pkts);
    } else {
        CHECK(st.rx_gro_reads == 0);
        CHECK(st.rx_reads >= st.rx_pkts);
    }
    CHECK(stats(p.a).tx_sends < stats(p.a).tx_pkts); /* the sender used GSO */
    foreign_batch(p.b, gro);
    pair_down(&p);
}

int main(void)
{
    run(20, true);
    setenv("MRC_GRO", "0", 1);
    run(22, false);
    DONE("test_gro");
    return 0;
}
