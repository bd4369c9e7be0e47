/* sock.c - path I/O: plane sockets, SRv6 route sockets, batched send/receive. */
#include "internal.h"

#include <errno.h>
#include <netinet/ip6.h>
#include <netinet/udp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <unistd.h>

static void sock_bufs(int fd, int size)
{
    /* SO_*BUFFORCE goes past net.core.{r,w}mem_max when we have
     * CAP_NET_ADMIN; otherwise take what the sysctl allows. */
    if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &size, sizeof(size)) < 0)
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof(size));
    if (setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &size, sizeof(size)) < 0)
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof(size));
}

#ifndef UDP_GRO
#define UDP_GRO 104
#endif

/* MRC_GSO=0 / MRC_GRO=0 turn UDP segmentation offload off (to measure what
 * it is worth, or to rule it out); anything else leaves it on. */
static bool env_off(const char *name)
{
    const char *v = getenv(name);
    return v && strcmp(v, "0") == 0;
}

static struct msock *sock_new(mrc_ep *ep, int fd, int plane)
{
    if (ep->nsocks >= MRC_MAX_SOCKS)
        return NULL;
    struct msock *s = aligned_alloc(64, (sizeof(*s) + 63) & ~(size_t)63);
    if (!s)
        return NULL;
    memset(s, 0, sizeof(*s));
    s->fd = fd;
    s->plane = plane;
    s->no_gso = env_off("MRC_GSO");
    ep->socks[ep->nsocks++] = s;
    return s;
}

int sock_open_plane(mrc_ep *ep, int i)
{
    struct plane *pl = &ep->planes[i];
    if (addr_parse(pl->addr_str, ep->cfg.udp_port, &pl->addr, &pl->addrlen))
        return MRC_EUSAGE;
    int fd = socket(pl->addr.ss_family, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    sock_bufs(fd, (int)ep->cfg.sockbuf);
    int rc;
    if (bind(fd, (struct sockaddr *)&pl->addr, pl->addrlen) < 0) {
        rc = -errno;
        goto err_close;
    }
    struct sockaddr_storage bound;
    socklen_t blen = sizeof(bound);
    if (getsockname(fd, (struct sockaddr *)&bound, &blen) < 0) {
        rc = -errno;
        goto err_close;
    }
    pl->port = ntohs(((struct sockaddr_in *)&bound)->sin_port); /* same offset in v6 */
    if (pl->addr.ss_family == AF_INET)
        ((struct sockaddr_in *)&pl->addr)->sin_port = htons(pl->port);
    else
        ((struct sockaddr_in6 *)&pl->addr)->sin6_port = htons(pl->port);
    /* The plane socket's index in ep->socks is the plane number. */
    struct msock *s = sock_new(ep, fd, i);
    if (!s) {
        rc = MRC_ENOBUFS;
        goto err_close;
    }
    /* UDP GRO: the kernel hands up a run of equal-sized datagrams of one
     * flow (a peer's GSO batch, still whole after loopback or veth hops) as
     * one buffer and says the segment size in a cmsg; sock_recv_pt cuts it
     * back into packets. Kernels without it (ENOPROTOOPT) deliver datagram
     * by datagram, which the same receive loop handles. */
    int one = 1;
    s->gro = !env_off("MRC_GRO") && setsockopt(fd, SOL_UDP, UDP_GRO, &one, sizeof(one)) == 0;
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)i};
    if (epoll_ctl(ep->epfd, EPOLL_CTL_ADD, fd, &ev) < 0)
        return -errno; /* the socket is in ep->socks: the caller closes it */
    return 0;

err_close:
    close(fd);
    return rc;
}

size_t sock_srh_build(uint8_t *srh, int nsegs, const struct in6_addr *segs)
{
    srh[0] = 0;                        /* next header: filled by the kernel */
    srh[1] = (uint8_t)(2 * nsegs);     /* length in 8-octet units, minus the first */
    srh[2] = 4;                        /* routing type 4: segment routing (RFC 8754) */
    srh[3] = (uint8_t)(nsegs - 1);     /* segments left */
    srh[4] = (uint8_t)(nsegs - 1);     /* last entry */
    srh[5] = 0;                        /* flags */
    srh[6] = srh[7] = 0;               /* tag */
    /* segments[0]: a placeholder the kernel replaces with each packet's
     * destination; the first connection's is as good as any. */
    for (int k = 0; k < nsegs; k++)
        memcpy(srh + 8 + 16 * k, &segs[nsegs - 1 - k], 16);
    return 8 + 16 * (size_t)nsegs;
}

/*
 * The socket for an SRv6 route from a plane: a UDP/IPv6 socket bound to the
 * plane's address whose packets get the segment list as a type-4 routing
 * header, from a kernel seg6 route chosen by its mark or, failing that, as a
 * sticky IPV6_RTHDR (both the sock_srh_build header above).
 * Linux refuses a per-packet SRH in sendmsg ancillary data but accepts it per
 * socket; segments are stored in reverse order and the kernel overwrites
 * segments[0] (the last segment, where the packet ends) with the sendto()
 * destination. So a socket is keyed by its plane and the segments before the
 * destination only: one socket serves every peer behind the same spines, and
 * an endpoint needs one per (plane, spine route), not one per peer path (a
 * full mesh of 64 endpoints on a 32-path fabric fits; test_routes.py).
 */
bool sock_seg6route_wanted(const struct plane *pl)
{
    const char *how = getenv("MRC_SRH");
    return !(how && strcmp(how, "socket") == 0) && !pl->loopback;
}

static bool sock_route_is(const struct msock *s, int plane, int nsegs,
                          const struct in6_addr *segs)
{
    return s->plane == plane && s->nsegs == nsegs &&
           memcmp(s->segs, segs, sizeof(*segs) * (size_t)(nsegs - 1)) == 0;
}

int sock_path_pt(mrc_ep *ep, int plane, int nsegs, const struct in6_addr *segs)
{
    for (int i = ep->nplanes; i < ep->nsocks; i++)
        if (sock_route_is(ep->socks[i], plane, nsegs, segs))
            return i;
    struct plane *pl = &ep->planes[plane];
    if (pl->addr.ss_family != AF_INET6)
        return MRC_EUSAGE;
    if (ep->nsocks >= MRC_MAX_SOCKS)
        return MRC_ENOBUFS;
    int fd = socket(AF_INET6, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    sock_bufs(fd, (int)ep->cfg.sockbuf);
    struct sockaddr_in6 a = *(struct sockaddr_in6 *)&pl->addr;
    a.sin6_port = 0;
    uint8_t srh[MRC_SRH_MAX];
    size_t srhlen = sock_srh_build(srh, nsegs, segs);
    int rc;
    if (bind(fd, (struct sockaddr *)&a, sizeof(a)) < 0) {
        rc = -errno;
        close(fd);
        return rc;
    }
    /* Preferred: a kernel seg6 route picked by this socket's mark inserts
     * the header after GSO, so batches stay whole (seg6route.c). Else (no
     * CAP_NET_ADMIN, MRC_SRH=socket, or a plane on `lo`, where a test's
     * endpoints would leave rules in the host's own namespace) the sticky
     * header: the same packets on the wire, each batch cut into datagrams at
     * the sender. */
    uint32_t mark = 0;
    bool routed = sock_seg6route_wanted(pl) &&
                  seg6route_mark(pl->ifindex, nsegs, segs, &mark) == 0 &&
                  setsockopt(fd, SOL_SOCKET, SO_MARK, &mark, sizeof(mark)) == 0;
    if (!routed && setsockopt(fd, IPPROTO_IPV6, IPV6_RTHDR, srh, (socklen_t)srhlen) < 0) {
        rc = -errno;
        close(fd);
        return rc;
    }
    struct msock *s = sock_new(ep, fd, plane);
    if (!s) {
        close(fd);
        return -ENOMEM;
    }
    s->mark = routed ? mark : 0;
    s->nsegs = nsegs;
    memcpy(s->segs, segs, sizeof(*segs) * (size_t)nsegs);
    return ep->nsocks - 1;
}

void sock_seg6route_restore_pt(mrc_ep *ep, int plane)
{
    for (int i = ep->nplanes; i < ep->nsocks; i++) {
        struct msock *s = ep->socks[i];
        if (s->mark && s->plane == plane &&
            seg6route_restore(s->mark, ep->planes[plane].ifindex, s->nsegs, s->segs) != 0)
            ep->st.seg6route_failures++;
    }
}

bool sock_batch_full_pt(mrc_ep *ep, int sock)
{
    struct txbatch *b = &ep->socks[sock]->batch;
    if (b->n < MRC_BATCH)
        return false;
    sock_flush_pt(ep, ep->socks[sock]);
    return b->n == MRC_BATCH;
}

/*
 * Reserves the next packet slot of path p's socket batch and returns the
 * header buffer to fill; payload (may be NULL) is sent from the caller's
 * memory without a copy. The batch must not be full (sock_batch_full_pt).
 */
uint8_t *sock_tx_slot_pt(mrc_ep *ep, struct path *p, size_t hdrlen, const void *payload,
                         uint32_t len)
{
    struct msock *s = ep->socks[p->sock];
    struct txbatch *b = &s->batch;
    int i = b->n++;
    struct mmsghdr *m = &b->msg[i];
    memcpy(&b->dst[i], &p->dst, p->dstlen);
    m->msg_hdr.msg_name = &b->dst[i];
    m->msg_hdr.msg_namelen = p->dstlen;
    m->msg_hdr.msg_iov = b->iov[i];
    m->msg_hdr.msg_iovlen = payload && len ? 2 : 1;
    m->msg_hdr.msg_control = NULL;
    m->msg_hdr.msg_controllen = 0;
    m->msg_hdr.msg_flags = 0;
    b->iov[i][0].iov_base = b->hdr[i];
    b->iov[i][0].iov_len = hdrlen;
    b->iov[i][1].iov_base = (void *)payload;
    b->iov[i][1].iov_len = payload ? len : 0;
    return b->hdr[i];
}

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
/* A UDP GSO datagram: at most 64 segments, and its IPv6 payload (with the
 * routing header) within 64 KiB. */
#define GSO_MAX_SEGS 64

static size_t pkt_len(const struct txbatch *b, int i)
{
    return b->iov[i][0].iov_len + b->iov[i][1].iov_len;
}

/*
 * Groups the unsent packets into what one sendmmsg passes. A run of packets
 * to one address, all as long as the first but the last, which may be
 * shorter, goes as one UDP GSO datagram: the kernel moves one buffer through
 * the stack (and through forwarding namespaces) and cuts it into the same
 * datagrams on the wire, so the peer sees no difference. Packets of one
 * path's SRv6 socket are all runs; on the loopback fabric this cut the
 * per-packet cost that bounded throughput. Returns the number of entries.
 */
static int gso_group(struct msock *s, struct txbatch *b)
{
    int ng = 0;
    for (int i = b->sent; i < b->n;) {
        size_t seg = pkt_len(b, i);
        int k = i + 1;
        if (!s->no_gso) {
            size_t total = seg;
            while (k < b->n && k - i < GSO_MAX_SEGS && total + pkt_len(b, k) <= MRC_GSO_MAX_BYTES &&
                   pkt_len(b, k - 1) == seg && pkt_len(b, k) <= seg &&
                   b->msg[k].msg_hdr.msg_namelen == b->msg[i].msg_hdr.msg_namelen &&
                   memcmp(&b->dst[k], &b->dst[i], b->msg[i].msg_hdr.msg_namelen) == 0)
                total += pkt_len(b, k++);
        }
        struct mmsghdr *g = &b->gmsg[ng];
        *g = b->msg[i];
        b->gcount[ng] = k - i;
        if (k - i > 1) {
            g->msg_hdr.msg_iov = &b->iov[i][0];
            g->msg_hdr.msg_iovlen = (size_t)(2 * (k - i));
            g->msg_hdr.msg_control = b->gctl[ng].buf;
            g->msg_hdr.msg_controllen = sizeof(b->gctl[ng].buf);
            struct cmsghdr *cm = CMSG_FIRSTHDR(&g->msg_hdr);
            cm->cmsg_level = SOL_UDP;
            cm->cmsg_type = UDP_SEGMENT;
            cm->cmsg_len = CMSG_LEN(sizeof(uint16_t));
            uint16_t gso = (uint16_t)seg;
            memcpy(CMSG_DATA(cm), &gso, sizeof(gso));
        }
        ng++;
        i = k;
    }
    return ng;
}

/* Sends what the batch holds; what the kernel does not take stays queued. */
int sock_flush_pt(mrc_ep *ep, struct msock *s)
{
    struct txbatch *b = &s->batch;
    if (unlikely(ep->tx_stall) && b->sent < b->n)
        return -EAGAIN; /* mrc_ep_testing_tx_stall: a socket that stays full */
    while (b->sent < b->n) {
        int ng = gso_group(s, b);
        int r = sendmmsg(s->fd, b->gmsg, (unsigned)ng, MSG_DONTWAIT);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == ENOBUFS)
                return -EAGAIN; /* keep the rest for the next loop */
            if (b->gcount[0] > 1 && (errno == EINVAL || errno == EIO || errno == EOPNOTSUPP)) {
                s->no_gso = true; /* no UDP GSO on this socket's route: one by one */
                continue;
            }
            /* A hard error on one datagram (EHOSTUNREACH on a dead plane,
             * ENETUNREACH): its packets are lost like on a wire; skip them
             * and let loss detection act. */
            b->sent += b->gcount[0];
            continue;
        }
        for (int k = 0; k < r; k++)
            b->sent += b->gcount[k];
        ep->st.tx_sends += (uint64_t)r;
        ep->work = true;
    }
    b->retired += (uint64_t)b->n; /* ep_hold_pt counts what left */
    b->n = b->sent = 0;
    return 0;
}

void sock_flush_all_pt(mrc_ep *ep)
{
    for (int i = 0; i < ep->nsocks; i++)
        if (ep->socks[i]->batch.n)
            sock_flush_pt(ep, ep->socks[i]);
}

/* The segment size of a UDP GRO read, or 0 when the read is one datagram. */
static size_t gro_segment(struct msghdr *h)
{
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(h); cm; cm = CMSG_NXTHDR(h, cm))
        if (cm->cmsg_level == SOL_UDP && cm->cmsg_type == UDP_GRO &&
            cm->cmsg_len >= CMSG_LEN(sizeof(int))) {
            int seg;
            memcpy(&seg, CMSG_DATA(cm), sizeof(seg));
            return seg > 0 ? (size_t)seg : 0;
        }
    return 0;
}

/*
 * Receives one burst on plane socket `sock`; returns the reads made (the
 * caller reads again while a burst fills every slot). Each read is one
 * datagram or, with UDP GRO, a run of them coalesced by the kernel: all of
 * segment size but the last, which may be shorter. Every packet of a read
 * goes through rx_packet_pt (and so mrc_pkt_validate) on its own, exactly as
 * if it had been read alone; the copy into its region is the only one.
 */
int sock_recv_pt(mrc_ep *ep, int sock)
{
    struct msock *s = ep->socks[sock];
    struct mmsghdr msgs[MRC_BATCH];
    struct iovec iov[MRC_BATCH];
    struct sockaddr_storage from[MRC_BATCH];
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } ctl[MRC_BATCH];
    for (int i = 0; i < MRC_BATCH; i++) {
        iov[i].iov_base = ep->rxbuf + (size_t)i * MRC_RX_SLOT;
        iov[i].iov_len = MRC_RX_SLOT;
        msgs[i].msg_hdr = (struct msghdr){.msg_name = &from[i],
                                          .msg_namelen = sizeof(from[i]),
                                          .msg_iov = &iov[i],
                                          .msg_iovlen = 1,
                                          .msg_control = s->gro ? ctl[i].buf : NULL,
                                          .msg_controllen = s->gro ? sizeof(ctl[i].buf) : 0};
    }
    int n = recvmmsg(s->fd, msgs, MRC_BATCH, MSG_DONTWAIT, NULL);
    if (n <= 0)
        return 0;
    uint64_t now = now_ns();
    ep->st.rx_reads += (uint64_t)n;
    for (int i = 0; i < n; i++) {
        size_t len = msgs[i].msg_len;
        uint8_t *buf = iov[i].iov_base;
        if (msgs[i].msg_hdr.msg_flags & MSG_TRUNC) {
            /* Larger than the 64 KiB a UDP datagram or GRO read can be. */
            DROP(ep, BAD_LENGTH);
            continue;
        }
        size_t seg = s->gro ? gro_segment(&msgs[i].msg_hdr) : 0;
        if (seg == 0 || seg >= len) {
            rx_packet_pt(ep, s->plane, &from[i], buf, len, now);
            continue;
        }
        ep->st.rx_gro_reads++;
        for (size_t off = 0; off < len; off += seg) {
            size_t plen = len - off < seg ? len - off : seg;
            uint8_t *pkt = buf + off;
            if (seg % 8) {
                /* Headers are read in place as structs: a packet at an
                 * offset that is not a multiple of 8 (small or odd-MSS
                 * packets) is copied to the aligned spare slot first. */
                pkt = ep->rxbuf + (size_t)MRC_BATCH * MRC_RX_SLOT;
                memcpy(pkt, buf + off, plen);
            }
            rx_packet_pt(ep, s->plane, &from[i], pkt, plen, now);
        }
    }
    ep->work = true;
    return n;
}
