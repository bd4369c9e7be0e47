/*
 * handshake.c - connection set-up: a small out-of-band TCP exchange on the
 * first plane, so no external service is needed.
 *
 *   client                         server
 *   hello(conn id, planes, psn) -->
 *                              <-- hello(conn id, planes, psn)   [server active]
 *   ready                      -->                               [client active]
 *
 * The server's connection enters the datapath before its hello leaves, and
 * mrc_conn_establish() returns only after `ready`, so neither side can send
 * data the other would drop as unknown.
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define HELLO_MAGIC 0x4843524du /* "MRCH" */
#define HELLO_VERSION 1u
#define READY_BYTE 0x52u

struct hello_plane {
    uint16_t family; /* 4 or 6 */
    uint16_t port;
    uint8_t addr[16];
};

struct hello {
    uint32_t magic;
    uint16_t version;
    uint16_t nplanes;
    uint32_t conn_id;
    uint32_t mss;
    uint32_t window;
    uint32_t init_psn;
    char name[64];
    struct hello_plane planes[MRC_MAX_PLANES];
};
static_assert(sizeof(struct hello) == 88 + 20 * MRC_MAX_PLANES, "hello layout");

static int io_wait(int fd, short events, uint64_t deadline)
{
    for (;;) {
        uint64_t now = now_ns();
        if (now >= deadline)
            return MRC_ETIMEOUT;
        struct pollfd p = {.fd = fd, .events = events};
        int n = poll(&p, 1, (int)((deadline - now) / 1000000ull) + 1);
        if (n > 0)
            return 0;
        if (n < 0 && errno != EINTR)
            return -errno;
    }
}

static int io_all(int fd, void *buf, size_t len, bool wr, uint64_t deadline)
{
    uint8_t *b = buf;
    while (len) {
        int rc = io_wait(fd, wr ? POLLOUT : POLLIN, deadline);
        if (rc)
            return rc;
        ssize_t n = wr ? send(fd, b, len, MSG_NOSIGNAL | MSG_DONTWAIT)
                       : recv(fd, b, len, MSG_DONTWAIT);
        if (n == 0)
            return MRC_EPROTO; /* peer hung up mid-hello */
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR)
                continue;
            return errno == ECONNRESET ? MRC_EPROTO : -errno;
        }
        b += n;
        len -= (size_t)n;
    }
    return 0;
}

static uint64_t deadline_of(int timeout_ms)
{
    return now_ns() + (uint64_t)(timeout_ms < 0 ? 3600000 : timeout_ms) * 1000000ull;
}

static void hello_fill(const mrc_conn *c, struct hello *h)
{
    const mrc_ep *ep = c->ep;
    memset(h, 0, sizeof(*h));
    h->magic = HELLO_MAGIC;
    h->version = HELLO_VERSION;
    h->nplanes = (uint16_t)ep->nplanes;
    h->conn_id = c->id;
    h->mss = ep->cfg.mss;
    h->window = ep->cfg.window;
    h->init_psn = c->next_psn;
    snprintf(h->name, sizeof(h->name), "%s", c->name);
    for (int i = 0; i < ep->nplanes; i++) {
        const struct sockaddr_storage *a = &ep->planes[i].addr;
        struct hello_plane *hp = &h->planes[i];
        hp->port = ep->planes[i].port;
        if (a->ss_family == AF_INET) {
            hp->family = 4;
            memcpy(hp->addr, &((const struct sockaddr_in *)a)->sin_addr, 4);
        } else {
            hp->family = 6;
            memcpy(hp->addr, &((const struct sockaddr_in6 *)a)->sin6_addr, 16);
        }
    }
}

/* Validates the peer's hello and takes what it says. */
static int hello_apply(mrc_conn *c, const struct hello *h)
{
    if (h->magic != HELLO_MAGIC || h->version != HELLO_VERSION || h->nplanes < 1 ||
        h->nplanes > MRC_MAX_PLANES || h->conn_id == 0 || h->mss < 64 ||
        h->mss > MRC_MAX_MSS || h->window < 64 || (h->window & (h->window - 1)))
        return MRC_EPROTO;
    c->peer_id = h->conn_id;
    c->rx_cum = h->init_psn;
    c->mss = h->mss < c->ep->cfg.mss ? h->mss : c->ep->cfg.mss;
    c->window = h->window < c->ep->cfg.window ? h->window : c->ep->cfg.window;
    c->wmask = c->window - 1;
    memcpy(c->peer_name, h->name, sizeof(c->peer_name));
    c->peer_name[sizeof(c->peer_name) - 1] = 0;
    c->npeer_planes = h->nplanes;
    for (int i = 0; i < h->nplanes; i++) {
        const struct hello_plane *hp = &h->planes[i];
        struct sockaddr_storage *a = &c->peer_planes[i];
        memset(a, 0, sizeof(*a));
        if (hp->family == 4) {
            struct sockaddr_in *in = (struct sockaddr_in *)a;
            in->sin_family = AF_INET;
            in->sin_port = htons(hp->port);
            memcpy(&in->sin_addr, hp->addr, 4);
        } else if (hp->family == 6) {
            struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)a;
            in6->sin6_family = AF_INET6;
            in6->sin6_port = htons(hp->port);
            memcpy(&in6->sin6_addr, hp->addr, 16);
        } else {
            return MRC_EPROTO;
        }
    }
    return 0;
}

int mrc_conn_create(mrc_ep *ep, const char *name, mrc_conn **out)
{
    mrc_conn *c = calloc(1, sizeof(*c));
    if (!c)
        return -ENOMEM;
    pthread_mutex_lock(&ep->lock);
    if (!ep->nconn_free) {
        pthread_mutex_unlock(&ep->lock);
        free(c);
        return MRC_ENOBUFS;
    }
    c->slot = ep->conn_free[--ep->nconn_free];
    DL_APPEND(ep->own_conns, ep->own_conns_tail, c, own_prev, own_next);
    pthread_mutex_unlock(&ep->lock);
    c->ep = ep;
    /* 16 random bits above the slot: stale or guessed ids rarely match. */
    c->id = (uint32_t)((rand_u64() & 0xffff) << 16) | c->slot;
    c->next_psn = (uint32_t)rand_u64();
    c->una = c->highest_acked = c->next_psn;
    c->highest_acked--;
    c->hs_fd = -1;
    snprintf(c->name, sizeof(c->name), "%s", name ? name : "");
    for (int i = 0; i < MRC_MAX_PATHS; i++)
        c->path_index[i] = -1;
    *out = c;
    return 0;
}

int mrc_conn_add_path(mrc_conn *c, const struct mrc_path_spec *s)
{
    if (c->state != CONN_NEW || c->npaths >= MRC_MAX_PATHS || s->id < 0 ||
        s->id >= MRC_MAX_PATHS || c->path_index[s->id] >= 0 || s->plane < 0 ||
        s->plane >= c->ep->nplanes || s->nsegs < 0 || s->nsegs > MRC_MAX_SEGS)
        return MRC_EUSAGE;
    struct path *p = &c->paths[c->npaths];
    memset(p, 0, sizeof(*p));
    if (addr_parse(s->dst, 0, &p->dst, &p->dstlen))
        return MRC_EUSAGE;
    for (int k = 0; k < s->nsegs; k++) {
        struct sockaddr_storage seg;
        socklen_t sl;
        if (addr_parse(s->segs[k], 0, &seg, &sl) || seg.ss_family != AF_INET6)
            return MRC_EUSAGE;
        p->segs[k] = ((struct sockaddr_in6 *)&seg)->sin6_addr;
    }
    if (s->nsegs && p->dst.ss_family != AF_INET6)
        return MRC_EUSAGE;
    p->id = s->id;
    p->plane = s->plane;
    p->nsegs = s->nsegs;
    snprintf(p->dst_str, sizeof(p->dst_str), "%s", s->dst);
    c->path_index[s->id] = c->npaths++;
    return 0;
}

/* Gives every path its destination port (the peer's plane with that
 * address), or makes the default paths plane k -> peer plane k. */
static int paths_finish(mrc_conn *c)
{
    if (!c->npaths) {
        int n = c->ep->nplanes < c->npeer_planes ? c->ep->nplanes : c->npeer_planes;
        for (int k = 0; k < n; k++) {
            struct mrc_path_spec s = {.id = k, .plane = k};
            addr_format(&c->peer_planes[k], s.dst, sizeof(s.dst));
            int rc = mrc_conn_add_path(c, &s);
            if (rc)
                return rc;
        }
    }
    for (int i = 0; i < c->npaths; i++) {
        struct path *p = &c->paths[i];
        int j;
        for (j = 0; j < c->npeer_planes; j++)
            if (addr_same_host(&p->dst, &c->peer_planes[j]))
                break;
        if (j == c->npeer_planes ||
            p->dst.ss_family != c->ep->planes[p->plane].addr.ss_family)
            return MRC_EUSAGE; /* not one of the peer's planes, or family mismatch */
        p->dst = c->peer_planes[j];
        p->dstlen = p->dst.ss_family == AF_INET ? sizeof(struct sockaddr_in)
                                                : sizeof(struct sockaddr_in6);
        path_init(p, c->mss);
    }
    return c->npaths ? 0 : MRC_EUSAGE;
}

/* Allocates the datapath state and hands the connection to the engine. */
static int conn_activate(mrc_conn *c)
{
    int rc = paths_finish(c);
    if (rc)
        return rc;
    c->tx = calloc(c->window, sizeof(*c->tx));
    c->rtxq = calloc(c->window, sizeof(*c->rtxq));
    c->rx_bits = calloc(c->window / 64, sizeof(uint64_t));
    c->msgs = calloc(MRC_MSGW, sizeof(*c->msgs));
    if (!c->tx || !c->rtxq || !c->rx_bits || !c->msgs)
        return -ENOMEM;
    c->last_progress_ns = now_ns();
    struct ctl x = {.type = CTL_CONN_ADD, .arg = c};
    return ep_ctl(c->ep, &x);
}

static int map_connect_errno(int e)
{
    switch (e) {
    case ECONNREFUSED:
    case EHOSTUNREACH:
    case ENETUNREACH:
    case ETIMEDOUT:
        return MRC_EUNREACH;
    default:
        return -e;
    }
}

int mrc_conn_connect(mrc_conn *c, const char *addr, uint16_t port, int timeout_ms)
{
    if (c->state != CONN_NEW || c->hs_fd >= 0)
        return MRC_EUSAGE;
    struct sockaddr_storage sa;
    socklen_t sl;
    if (addr_parse(addr, port, &sa, &sl))
        return MRC_EUSAGE;
    uint64_t dl = deadline_of(timeout_ms);
    int fd = socket(sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    int rc;
    /* From the first plane's address, so the peer sees who we are. */
    struct sockaddr_storage src = c->ep->planes[0].addr;
    if (src.ss_family == sa.ss_family) {
        ((struct sockaddr_in *)&src)->sin_port = 0; /* same offset for v6 */
        if (src.ss_family == AF_INET6)
            ((struct sockaddr_in6 *)&src)->sin6_port = 0;
        if (bind(fd, (struct sockaddr *)&src, sl) < 0) {
            rc = -errno;
            goto out;
        }
    }
    if (connect(fd, (struct sockaddr *)&sa, sl) < 0 && errno != EINPROGRESS) {
        rc = map_connect_errno(errno);
        goto out;
    }
    rc = io_wait(fd, POLLOUT, dl);
    if (rc) {
        rc = rc == MRC_ETIMEOUT ? MRC_EUNREACH : rc;
        goto out;
    }
    int soerr = 0;
    socklen_t el = sizeof(soerr);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &el);
    if (soerr) {
        rc = map_connect_errno(soerr);
        goto out;
    }
    struct hello mine, theirs;
    hello_fill(c, &mine);
    if ((rc = io_all(fd, &mine, sizeof(mine), true, dl)) ||
        (rc = io_all(fd, &theirs, sizeof(theirs), false, dl)) ||
        (rc = hello_apply(c, &theirs)) || (rc = conn_activate(c)))
        goto out;
    uint8_t ready = READY_BYTE;
    rc = io_all(fd, &ready, 1, true, dl);
out:
    close(fd);
    return rc;
}

int mrc_ep_listen(mrc_ep *ep, const char *addr, uint16_t port, uint16_t *bound_port)
{
    struct sockaddr_storage sa;
    socklen_t sl;
    char a0[MRC_ADDR_STRLEN];
    if (!addr || !*addr) {
        addr_format(&ep->planes[0].addr, a0, sizeof(a0));
        addr = a0;
    }
    if (addr_parse(addr, port, &sa, &sl))
        return MRC_EUSAGE;
    int fd = socket(sa.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, (struct sockaddr *)&sa, sl) < 0 || listen(fd, 128) < 0) {
        int rc = -errno;
        close(fd);
        return rc;
    }
    socklen_t bl = sizeof(sa);
    getsockname(fd, (struct sockaddr *)&sa, &bl);
    if (bound_port)
        *bound_port = ntohs(((struct sockaddr_in *)&sa)->sin_port);
    pthread_mutex_lock(&ep->lock);
    int old = ep->listen_fd;
    ep->listen_fd = fd;
    pthread_mutex_unlock(&ep->lock);
    if (old >= 0)
        close(old);
    return 0;
}

int mrc_ep_accept(mrc_ep *ep, int timeout_ms, mrc_conn **out)
{
    if (ep->listen_fd < 0)
        return MRC_EUSAGE;
    uint64_t dl = deadline_of(timeout_ms);
    int rc = io_wait(ep->listen_fd, POLLIN, dl);
    if (rc)
        return rc;
    int fd = accept4(ep->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0)
        return -errno;
    mrc_conn *c;
    if ((rc = mrc_conn_create(ep, "", &c))) {
        close(fd);
        return rc;
    }
    c->hs_fd = fd;
    struct hello theirs;
    if ((rc = io_all(fd, &theirs, sizeof(theirs), false, dl)) || (rc = hello_apply(c, &theirs))) {
        mrc_conn_destroy(c);
        return rc;
    }
    *out = c;
    return 0;
}

int mrc_conn_establish(mrc_conn *c, int timeout_ms)
{
    if (c->state != CONN_NEW || c->hs_fd < 0)
        return MRC_EUSAGE;
    uint64_t dl = deadline_of(timeout_ms);
    int rc = conn_activate(c);
    if (rc)
        return rc;
    struct hello mine;
    hello_fill(c, &mine);
    uint8_t ready = 0;
    if (!(rc = io_all(c->hs_fd, &mine, sizeof(mine), true, dl)) &&
        !(rc = io_all(c->hs_fd, &ready, 1, false, dl)) && ready != READY_BYTE)
        rc = MRC_EPROTO;
    close(c->hs_fd);
    c->hs_fd = -1;
    return rc;
}

const char *mrc_conn_peer_name(const mrc_conn *c) { return c->peer_name; }
int mrc_conn_npaths(const mrc_conn *c) { return c->npaths; }

int mrc_conn_peer_plane(const mrc_conn *c, int plane, char *addr, size_t addrlen)
{
    if (plane < 0 || plane >= c->npeer_planes)
        return MRC_EUSAGE;
    addr_format(&c->peer_planes[plane], addr, addrlen);
    return 0;
}

int mrc_conn_error(const mrc_conn *c)
{
    mrc_ep *ep = c->ep;
    pthread_mutex_lock(&ep->lock);
    int e = c->state == CONN_ACTIVE ? 0 : (c->error ? c->error : MRC_ECLOSED);
    pthread_mutex_unlock(&ep->lock);
    return e;
}

void mrc_conn_destroy(mrc_conn *c)
{
    if (!c)
        return;
    mrc_ep *ep = c->ep;
    pthread_mutex_lock(&ep->lock);
    int state = c->state;
    pthread_mutex_unlock(&ep->lock);
    if (state != CONN_NEW) {
        struct ctl x = {.type = CTL_CONN_DEL, .arg = c};
        ep_ctl(ep, &x); /* the engine may have stopped: then it already forgot c */
    }
    conn_free(c);
}

/* Frees what the API side of c owns. The progress thread no longer knows c
 * (CTL_CONN_DEL, or it has stopped). */
void conn_free(mrc_conn *c)
{
    mrc_ep *ep = c->ep;
    if (c->hs_fd >= 0)
        close(c->hs_fd);
    while (c->imm_head) {
        struct imm_ev *e = c->imm_head;
        c->imm_head = e->next;
        free(e);
    }
    free(c->tx);
    free(c->rtxq);
    free(c->rx_bits);
    free(c->msgs);
    pthread_mutex_lock(&ep->lock);
    cq_conn_unbind_locked(c);
    ep->conn_free[ep->nconn_free++] = c->slot;
    DL_UNLINK(ep->own_conns, ep->own_conns_tail, c, own_prev, own_next);
    pthread_mutex_unlock(&ep->lock);
    free(c);
}
