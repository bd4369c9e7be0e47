/*
 * handshake.c - connection set-up: a small out-of-band TCP exchange, so no
 * external service is needed. The server listens on every plane and the
 * client races a TCP connect to every address it was given (the server's
 * planes), so set-up works while any plane is up.
 *
 *   client                         server
 *   hello(conn id, planes, psn) -->
 *                              <-- hello(conn id, planes, psn)   [server active]
 *   ready                      -->                               [client active]
 *
 * The server's connection enters the datapath before its hello leaves, and
 * mrc_conn_establish() returns only after `ready` (or the client's first
 * packet on the datapath, which it sends only once it has our hello), so
 * neither side can send data the other would drop as unknown.
 */
#include "internal.h"
#include "mrc_testing.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
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

#define CLOSE_SLICE_NS 50000000ull /* a set-up looks for the endpoint closing this often */

static bool setup_closing(mrc_ep *ep)
{
    return atomic_load_explicit(&ep->setup_closing, memory_order_acquire);
}

static int io_wait(mrc_ep *ep, int fd, short events, uint64_t deadline)
{
    for (;;) {
        uint64_t now = now_ns();
        if (setup_closing(ep))
            return MRC_ECLOSED;
        if (now >= deadline)
            return MRC_ETIMEOUT;
        uint64_t wait = deadline - now < CLOSE_SLICE_NS ? deadline - now : CLOSE_SLICE_NS;
        struct pollfd p = {.fd = fd, .events = events};
        int n = poll(&p, 1, (int)(wait / 1000000ull) + 1);
        if (n > 0)
            return 0;
        if (n < 0 && errno != EINTR)
            return -errno;
    }
}

static int io_all(mrc_ep *ep, int fd, void *buf, size_t len, bool wr, uint64_t deadline)
{
    uint8_t *b = buf;
    while (len) {
        int rc = io_wait(ep, fd, wr ? POLLOUT : POLLIN, deadline);
        if (rc)
            return rc;
        ssize_t n = wr ? send(fd, b, len, MSG_NOSIGNAL | MSG_DONTWAIT)
                       : recv(fd, b, len, MSG_DONTWAIT);
        if (n == 0)
            return MRC_ECLOSED; /* peer hung up mid-hello */
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR)
                continue;
            return errno == ECONNRESET || errno == EPIPE ? MRC_ECLOSED : -errno;
        }
        b += n;
        len -= (size_t)n;
    }
    return 0;
}

static void sleep_until(uint64_t t)
{
    for (uint64_t now = now_ns(); now < t; now = now_ns()) {
        struct timespec ts = {(time_t)((t - now) / 1000000000ull), (long)((t - now) % 1000000000ull)};
        nanosleep(&ts, NULL);
    }
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
    c->burst = (int)(MRC_GSO_MAX_BYTES / (c->mss + MRC_DATA_HDR_LEN));
    if (c->burst < 1)
        c->burst = 1;
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

/* Allocates the datapath state and hands the connection to the engine. A
 * failed activation may be tried again (the engine did not take c); a
 * successful one is final. */
static int conn_activate(mrc_conn *c)
{
    int rc = paths_finish(c);
    if (rc)
        return rc;
    /* An attempt before this one may have got this far, with another peer's
     * window: its tables go (the engine never took them). */
    if (tx_alloc(c) || rx_alloc(c))
        return -ENOMEM;
    c->last_progress_ns = now_ns();
    struct ctl x = {.type = CTL_CONN_ADD, .arg = c};
    return ep_ctl(c->ep, &x);
}

static void sa_set_port(struct sockaddr_storage *sa, uint16_t port)
{
    if (sa->ss_family == AF_INET)
        ((struct sockaddr_in *)sa)->sin_port = htons(port);
    else
        ((struct sockaddr_in6 *)sa)->sin6_port = htons(port);
}

/* Reads the peer's hello, its magic first: a peer that speaks another
 * protocol (an SSH banner, an HTTP error page) is told apart at once instead
 * of after the timeout. */
static int hello_read(mrc_ep *ep, int fd, struct hello *h, uint64_t deadline)
{
    int rc = io_all(ep, fd, h, sizeof(h->magic), false, deadline);
    if (rc)
        return rc;
    if (h->magic != HELLO_MAGIC)
        return MRC_ENOTMRC;
    return io_all(ep, fd, (uint8_t *)h + sizeof(h->magic), sizeof(*h) - sizeof(h->magic), false,
                  deadline);
}

/* Starts a non-blocking TCP connect to each address in `mask` at once;
 * returns the first socket that connects (the others are closed) and its
 * index in *win, or -1 with errs[] saying why each failed. The source address
 * is left to the kernel, which picks the interface that routes to that
 * destination: binding plane 0's address would send every attempt through
 * plane 0, down or not. */
static int connect_race(mrc_ep *ep, const struct sockaddr_storage *sa, const socklen_t *sl,
                        int n, unsigned mask, uint64_t dl, int *errs, int *win)
{
    int fds[MRC_MAX_PLANES];
    int live = 0;
    *win = -1;
    for (int i = 0; i < n; i++) {
        fds[i] = -1;
        if (!(mask & (1u << i)))
            continue;
        fds[i] = socket(sa[i].ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fds[i] < 0) {
            errs[i] = -errno;
            continue;
        }
        if (connect(fds[i], (const struct sockaddr *)&sa[i], sl[i]) < 0 && errno != EINPROGRESS) {
            errs[i] = -errno;
            close(fds[i]);
            fds[i] = -1;
            continue;
        }
        live++;
    }
    while (live && *win < 0) {
        uint64_t now = now_ns();
        if (now >= dl || setup_closing(ep))
            break;
        struct pollfd pf[MRC_MAX_PLANES];
        int idx[MRC_MAX_PLANES], np = 0;
        for (int i = 0; i < n; i++)
            if (fds[i] >= 0) {
                pf[np] = (struct pollfd){.fd = fds[i], .events = POLLOUT};
                idx[np++] = i;
            }
        uint64_t wait = dl - now < CLOSE_SLICE_NS ? dl - now : CLOSE_SLICE_NS;
        int r = poll(pf, (nfds_t)np, (int)((wait + 999999) / 1000000ull));
        if (r < 0 && errno != EINTR) {
            for (int k = 0; k < np; k++)
                errs[idx[k]] = -errno;
            break;
        }
        for (int k = 0; k < np && r > 0; k++) {
            int i = idx[k];
            if (!pf[k].revents)
                continue;
            int soerr = 0;
            socklen_t el = sizeof(soerr);
            getsockopt(fds[i], SOL_SOCKET, SO_ERROR, &soerr, &el);
            if (!soerr && *win < 0) {
                *win = i;
                errs[i] = 0;
                continue;
            }
            if (soerr) {
                errs[i] = -soerr;
                close(fds[i]);
                fds[i] = -1;
                live--;
            }
        }
    }
    int fd = -1;
    for (int i = 0; i < n; i++) {
        if (fds[i] < 0)
            continue;
        if (i == *win) {
            fd = fds[i];
        } else {
            if (*win < 0)
                errs[i] = -ETIMEDOUT; /* no answer within the attempt */
            close(fds[i]);
        }
    }
    return fd;
}

/* Worth another attempt: the network may come back (a plane flapping, routes
 * being changed) or the peer dropped a stalled set-up. Refusal is an answer. */
static bool hs_transient(int rc)
{
    return rc == -ENETUNREACH || rc == -EHOSTUNREACH || rc == -ENETDOWN || rc == -EHOSTDOWN ||
           rc == -ETIMEDOUT || rc == MRC_ETIMEOUT || rc == MRC_ECLOSED;
}

/* hello, hello, ready over a connected socket; the hellos within the
 * attempt's deadline adl, `ready` within the set-up's dl. Until conn_activate
 * nothing of c is final, so a failed exchange may be tried again on another
 * socket; once c is in the datapath (*activated) it may not: the engine knows
 * it by its id, on its lists. */
static int hello_exchange(mrc_conn *c, int fd, uint64_t adl, uint64_t dl, bool *activated)
{
    struct hello mine, theirs;
    hello_fill(c, &mine);
    int rc;
    *activated = false;
    if ((rc = io_all(c->ep, fd, &mine, sizeof(mine), true, adl)) ||
        (rc = hello_read(c->ep, fd, &theirs, adl)))
        return rc;
    /* An echo service returns our own hello. */
    if (theirs.conn_id == mine.conn_id && theirs.init_psn == mine.init_psn)
        return MRC_ENOTMRC;
    if ((rc = hello_apply(c, &theirs)) || (rc = conn_activate(c)))
        return rc == MRC_ECLOSED ? -EIO : rc; /* final: not to be retried */
    *activated = true;
    if (c->ep->testing_no_ready)
        return 0;
    if (c->ep->testing_late_ready)
        sleep_until(adl); /* as when the engine took c only at the deadline */
    /* `ready` is not bounded by the attempt: the hellos made it in time, and
     * activation (a round trip to a busy progress thread) may end past adl.
     * It was: `ready` then timed out, the set-up was tried again, and the
     * second activation put c on the engine's active list twice, a cycle
     * that its next walk (a link event) never left, every later ep_ctl
     * waiting on it (test_setup's burst while a plane flaps, CI at d337e9b). */
    uint8_t ready = READY_BYTE;
    rc = io_all(c->ep, fd, &ready, 1, true, dl);
    return rc == MRC_ECLOSED ? -EPIPE : rc;
}

#define HS_ATTEMPT_NS 1000000000ull /* first attempt's share of the timeout; doubles */
#define HS_RETRY_NS 20000000ull     /* pause after every address failed at once */

int mrc_conn_connect_any(mrc_conn *c, const char *const *addrs, int naddrs, uint16_t port,
                         int timeout_ms, int *errs)
{
    int scratch[MRC_MAX_PLANES];
    if (!errs)
        errs = scratch;
    if (c->state != CONN_NEW || c->hs_fd >= 0 || naddrs < 1 || naddrs > MRC_MAX_PLANES ||
        port == 0)
        return MRC_EUSAGE;
    struct sockaddr_storage sa[MRC_MAX_PLANES];
    socklen_t sl[MRC_MAX_PLANES];
    int bad = 0;
    for (int i = 0; i < naddrs; i++) {
        errs[i] = addr_parse(addrs[i], port, &sa[i], &sl[i]);
        bad |= errs[i];
    }
    if (bad)
        return MRC_EUSAGE;
    uint64_t dl = deadline_of(timeout_ms), share = HS_ATTEMPT_NS;
    unsigned all = (1u << naddrs) - 1, stalled = 0; /* addresses whose exchange stalled */
    int rc = MRC_EUNREACH;
    /* Attempts until one works or the deadline: an address whose exchange
     * stalled (its plane went down after the TCP connect) races again only if
     * the others fail. */
    for (;;) {
        uint64_t now = now_ns();
        if (setup_closing(c->ep))
            return MRC_ECLOSED;
        if (now >= dl)
            return rc;
        uint64_t adl = dl - now > share ? now + share : dl;
        int win = -1, fd = -1;
        if (stalled != all)
            fd = connect_race(c->ep, sa, sl, naddrs, all & ~stalled, adl, errs, &win);
        if (fd < 0 && stalled)
            fd = connect_race(c->ep, sa, sl, naddrs, stalled, adl, errs, &win);
        if (fd < 0 && setup_closing(c->ep))
            return MRC_ECLOSED;
        if (fd < 0) {
            rc = MRC_EUNREACH;
            bool again = false;
            for (int i = 0; i < naddrs; i++)
                again |= hs_transient(errs[i]);
            if (!again)
                return rc;
            stalled = 0;
            struct timespec ts = {0, (long)HS_RETRY_NS};
            nanosleep(&ts, NULL);
            continue;
        }
        bool activated;
        rc = hello_exchange(c, fd, adl, dl, &activated);
        if (!rc && c->ep->testing_no_ready) {
            c->hs_fd = fd; /* testing: the exchange stalls after the hellos, open */
            return 0;
        }
        close(fd);
        if (!rc || activated || !hs_transient(rc))
            return rc;
        /* A fresh id for the next attempt: the server may have made a connection
         * for this one and, dropping it, tells our id that it closed. */
        conn_new_id(c);
        errs[win] = rc;
        stalled |= 1u << win;
        share *= 2;
    }
}

int mrc_conn_connect(mrc_conn *c, const char *addr, uint16_t port, int timeout_ms)
{
    return mrc_conn_connect_any(c, &addr, 1, port, timeout_ms, NULL);
}

/* ---- the server side ------------------------------------------------------
 * Accepted sockets wait in a pending table until their hello is complete;
 * each accept call serves every pending socket and the listening ones in one
 * poll. So a client that connects and sends nothing, sends slowly, or goes
 * away costs the next accept nothing, and a hello that straddles the end of
 * one accept call's timeout is finished by the next call instead of being
 * dropped (the cause of the intermittent "protocol mismatch": the hello read
 * shared the accept's deadline, and a server looping on accept(0.5) closed
 * half-read clients). A pending socket is dropped after the endpoint's
 * timeout. */
#define HS_PENDING_MAX 256
#define HS_SLICE_NS 50000000ull /* hs->lock is let go this often during an accept */

struct hs_pending {
    int fd;
    uint64_t deadline;
    size_t got;
    struct hello h;
};

struct hs_state {
    int active;           /* [ep->lock] accept calls under way */
    bool closing;         /* [ep->lock] mrc_ep_destroy is waiting for them */
    pthread_cond_t idle;  /* with ep->lock: active dropped to 0 */
    pthread_mutex_t lock; /* one accept or listen at a time */
    int nlisten;
    int listen_fds[MRC_MAX_PLANES];
    uint16_t port;
    int npend;
    struct hs_pending pend[HS_PENDING_MAX];
};

static struct hs_state *hs_get(mrc_ep *ep)
{
    pthread_mutex_lock(&ep->lock);
    if (!ep->hs) {
        ep->hs = calloc(1, sizeof(*ep->hs));
        if (ep->hs) {
            pthread_mutex_init(&ep->hs->lock, NULL);
            pthread_cond_init(&ep->hs->idle, NULL);
        }
    }
    struct hs_state *hs = ep->hs;
    pthread_mutex_unlock(&ep->lock);
    return hs;
}

/* The endpoint is going: accept calls in other threads end (MRC_ECLOSED at
 * their next slice, within HS_SLICE_NS) before the listeners go. */
void hs_free(mrc_ep *ep)
{
    pthread_mutex_lock(&ep->lock);
    struct hs_state *hs = ep->hs;
    if (hs) {
        hs->closing = true;
        while (hs->active)
            pthread_cond_wait(&hs->idle, &ep->lock);
    }
    ep->hs = NULL;
    pthread_mutex_unlock(&ep->lock);
    if (!hs)
        return;
    for (int i = 0; i < hs->nlisten; i++)
        close(hs->listen_fds[i]);
    for (int i = 0; i < hs->npend; i++)
        close(hs->pend[i].fd);
    pthread_mutex_destroy(&hs->lock);
    pthread_cond_destroy(&hs->idle);
    free(hs);
}

static void close_all(int *fds, int n)
{
    for (int i = 0; i < n; i++)
        close(fds[i]);
}

/* Binds and listens on every address with one port (the first socket's, when
 * port is 0). */
static int listen_all(struct sockaddr_storage *sa, const socklen_t *sl, int n, uint16_t port,
                      int *fds, uint16_t *bound)
{
    for (int i = 0; i < n; i++) {
        sa_set_port(&sa[i], i ? *bound : port);
        fds[i] = socket(sa[i].ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        int one = 1;
        if (fds[i] < 0 || setsockopt(fds[i], SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) < 0 ||
            bind(fds[i], (struct sockaddr *)&sa[i], sl[i]) < 0 || listen(fds[i], 256) < 0) {
            int rc = -errno;
            close_all(fds, fds[i] < 0 ? i : i + 1);
            return rc;
        }
        if (i == 0) {
            struct sockaddr_storage got;
            socklen_t gl = sizeof(got);
            getsockname(fds[0], (struct sockaddr *)&got, &gl);
            *bound = ntohs(got.ss_family == AF_INET ? ((struct sockaddr_in *)&got)->sin_port
                                                    : ((struct sockaddr_in6 *)&got)->sin6_port);
        }
    }
    return 0;
}

int mrc_ep_listen(mrc_ep *ep, const char *addr, uint16_t port, uint16_t *bound_port)
{
    struct sockaddr_storage sa[MRC_MAX_PLANES];
    socklen_t sl[MRC_MAX_PLANES];
    int n = 0;
    if (addr && *addr) {
        if (addr_parse(addr, port, &sa[0], &sl[0]))
            return MRC_EUSAGE;
        n = 1;
    } else {
        /* Every plane, so a client reaches us while any plane is up. */
        for (int i = 0; i < ep->nplanes; i++) {
            int j;
            for (j = 0; j < n; j++)
                if (addr_same_host(&sa[j], &ep->planes[i].addr))
                    break;
            if (j < n)
                continue;
            sa[n] = ep->planes[i].addr;
            sl[n++] = ep->planes[i].addrlen;
        }
    }
    int fds[MRC_MAX_PLANES];
    uint16_t bound = 0;
    int rc = listen_all(sa, sl, n, port, fds, &bound);
    /* An ephemeral port of the first plane may be taken on another one. */
    for (int tries = 0; rc == -EADDRINUSE && port == 0 && n > 1 && tries < 16; tries++)
        rc = listen_all(sa, sl, n, port, fds, &bound);
    if (rc)
        return rc;
    struct hs_state *hs = hs_get(ep);
    if (!hs) {
        close_all(fds, n);
        return -ENOMEM;
    }
    pthread_mutex_lock(&hs->lock);
    close_all(hs->listen_fds, hs->nlisten);
    memcpy(hs->listen_fds, fds, sizeof(int) * (size_t)n);
    hs->nlisten = n;
    hs->port = bound;
    pthread_mutex_unlock(&hs->lock);
    if (bound_port)
        *bound_port = bound;
    return 0;
}

static void pend_drop(struct hs_state *hs, int j, bool close_fd)
{
    if (close_fd)
        close(hs->pend[j].fd);
    hs->pend[j] = hs->pend[--hs->npend];
}

/* 1: the hello is complete; 0: more to come; -1: drop it (hung up, not mrc). */
static int pend_read(struct hs_pending *p)
{
    ssize_t n = recv(p->fd, (uint8_t *)&p->h + p->got, sizeof(p->h) - p->got, MSG_DONTWAIT);
    if (n == 0)
        return -1;
    if (n < 0)
        return errno == EAGAIN || errno == EINTR ? 0 : -1;
    p->got += (size_t)n;
    if (p->got >= sizeof(p->h.magic) && p->h.magic != HELLO_MAGIC)
        return -1;
    return p->got == sizeof(p->h);
}

/* A complete hello: 0 and *out, or drops the socket (-EAGAIN: keep going)
 * or fails the accept (a full connection table). */
static int pend_finish(mrc_ep *ep, struct hs_state *hs, int j, mrc_conn **out)
{
    mrc_conn *c;
    int rc = mrc_conn_create(ep, "", &c);
    if (rc) {
        pend_drop(hs, j, true);
        return rc;
    }
    c->hs_fd = hs->pend[j].fd; /* mrc_conn_destroy closes it from here on */
    rc = hello_apply(c, &hs->pend[j].h);
    pend_drop(hs, j, false);
    if (rc) {
        mrc_conn_destroy(c); /* another version: the client sees the hang-up */
        return -EAGAIN;
    }
    *out = c;
    return 0;
}

static int accept_new(mrc_ep *ep, struct hs_state *hs, int lfd)
{
    while (hs->npend < HS_PENDING_MAX) {
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED)
                return 0;
            return -errno;
        }
        struct hs_pending *p = &hs->pend[hs->npend++];
        memset(p, 0, sizeof(*p));
        p->fd = fd;
        p->deadline = now_ns() + (uint64_t)ep->cfg.timeout_ms * 1000000ull;
    }
    return 0;
}

/* One poll of the pending and listening sockets, at most HS_SLICE_NS.
 * 0 and *out, -EAGAIN (nothing complete yet), or an error. */
static int accept_slice(mrc_ep *ep, struct hs_state *hs, uint64_t dl, mrc_conn **out)
{
    uint64_t now = now_ns();
    for (int j = hs->npend - 1; j >= 0; j--)
        if (now >= hs->pend[j].deadline)
            pend_drop(hs, j, true);
    struct pollfd pf[MRC_MAX_PLANES + HS_PENDING_MAX];
    int nl = hs->nlisten, np = hs->npend;
    short lev = np < HS_PENDING_MAX ? POLLIN : 0;
    for (int i = 0; i < nl; i++)
        pf[i] = (struct pollfd){.fd = hs->listen_fds[i], .events = lev};
    for (int j = 0; j < np; j++)
        pf[nl + j] = (struct pollfd){.fd = hs->pend[j].fd, .events = POLLIN};
    uint64_t wait = dl > now ? dl - now : 0;
    if (wait > HS_SLICE_NS)
        wait = HS_SLICE_NS;
    int r = poll(pf, (nfds_t)(nl + np), (int)((wait + 999999) / 1000000ull));
    if (r < 0)
        return errno == EINTR ? -EAGAIN : -errno;
    /* Descending, so pend_drop's swap with the last entry only moves one
     * already looked at. */
    for (int j = np - 1; j >= 0 && r > 0; j--) {
        if (!pf[nl + j].revents)
            continue;
        int st = pend_read(&hs->pend[j]);
        if (st < 0)
            pend_drop(hs, j, true);
        else if (st > 0) {
            int rc = pend_finish(ep, hs, j, out);
            if (rc != -EAGAIN)
                return rc;
        }
    }
    for (int i = 0; i < nl && r > 0; i++) {
        if (!pf[i].revents)
            continue;
        int rc = accept_new(ep, hs, hs->listen_fds[i]);
        if (rc)
            return rc;
    }
    return -EAGAIN;
}

int mrc_ep_accepts_active(mrc_ep *ep)
{
    pthread_mutex_lock(&ep->lock);
    int n = ep->hs ? ep->hs->active : 0;
    pthread_mutex_unlock(&ep->lock);
    return n;
}

/* A blocked accept returns MRC_ECLOSED at its next slice (HS_SLICE_NS); new
 * ones find no listener. The sockets go with mrc_ep_destroy. */
int mrc_ep_unlisten(mrc_ep *ep)
{
    atomic_store_explicit(&ep->setup_closing, true, memory_order_release);
    pthread_mutex_lock(&ep->lock);
    if (ep->hs)
        ep->hs->closing = true;
    pthread_mutex_unlock(&ep->lock);
    return 0;
}

static bool hs_closing(mrc_ep *ep, struct hs_state *hs)
{
    pthread_mutex_lock(&ep->lock);
    bool closing = hs->closing;
    pthread_mutex_unlock(&ep->lock);
    return closing;
}

int mrc_ep_accept(mrc_ep *ep, int timeout_ms, mrc_conn **out)
{
    pthread_mutex_lock(&ep->lock);
    struct hs_state *hs = ep->hs;
    if (hs && !hs->closing)
        hs->active++;
    else
        hs = NULL;
    pthread_mutex_unlock(&ep->lock);
    if (!hs)
        return MRC_EUSAGE; /* not listening */
    uint64_t dl = deadline_of(timeout_ms);
    int rc;
    for (;;) {
        if (hs_closing(ep, hs)) {
            rc = MRC_ECLOSED;
            break;
        }
        pthread_mutex_lock(&hs->lock);
        rc = hs->nlisten ? accept_slice(ep, hs, dl, out) : MRC_EUSAGE;
        pthread_mutex_unlock(&hs->lock);
        if (rc != -EAGAIN)
            break;
        if (now_ns() >= dl) {
            rc = MRC_ETIMEOUT;
            break;
        }
    }
    pthread_mutex_lock(&ep->lock);
    if (--hs->active == 0)
        pthread_cond_signal(&hs->idle);
    pthread_mutex_unlock(&ep->lock);
    return rc;
}

/* How often the server, waiting for `ready`, looks whether the datapath has
 * heard from the client meanwhile. */
#define READY_SLICE_NS 5000000ull

/* The client's `ready`, or any packet from it on the datapath: it sends one
 * only after it took our hello, so either says it is live. The TCP exchange
 * runs on one plane; when that plane fails after our hello went out, `ready`
 * may come late or never (the TCP connection stalls or is reset), while the
 * client, connected, already sends on the other planes: waiting for `ready`
 * alone failed such a set-up after the timeout (and the CLOSE of the dropped
 * connection then closed the client's, which had returned connected). */
static int ready_wait(mrc_conn *c, uint64_t dl)
{
    for (;;) {
        if (atomic_load_explicit(&c->rx_seen, memory_order_acquire))
            return 0;
        uint64_t now = now_ns();
        if (now >= dl)
            return MRC_ETIMEOUT;
        int rc = io_wait(c->ep, c->hs_fd, POLLIN,
                         dl - now > READY_SLICE_NS ? now + READY_SLICE_NS : dl);
        if (rc == MRC_ETIMEOUT)
            continue; /* a slice: look at the datapath again */
        if (rc)
            return rc;
        uint8_t ready = 0;
        ssize_t got = recv(c->hs_fd, &ready, 1, MSG_DONTWAIT);
        if (got == 1)
            return ready == READY_BYTE ? 0 : MRC_EPROTO;
        if (got < 0 && (errno == EAGAIN || errno == EINTR))
            continue;
        /* Hung up or reset: the client is gone, unless it is on the datapath
         * (its TCP connection died with the plane it used). */
        if (atomic_load_explicit(&c->rx_seen, memory_order_acquire))
            return 0;
        return got == 0 || errno == ECONNRESET ? MRC_ECLOSED : -errno;
    }
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
    if (!(rc = io_all(c->ep, c->hs_fd, &mine, sizeof(mine), true, dl)))
        rc = ready_wait(c, dl);
    close(c->hs_fd);
    c->hs_fd = -1;
    return rc;
}
