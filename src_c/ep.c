/* ep.c - endpoints: configuration, create/destroy, control requests to the
 * progress thread, fault injection, stats; posting and completing operations. */
#include "internal.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older glibc headers lack it */
#endif
#include <sys/random.h>
#include <unistd.h>

const char *mrc_strerror(int rc)
{
    switch (rc) {
    case 0: return "success";
    case MRC_EKEY: return "remote key rejected by the peer";
    case MRC_EBOUNDS: return "write outside the remote region's bounds";
    case MRC_ETIMEOUT: return "no progress on any path within the timeout";
    case MRC_EPATHDOWN: return "every path to the peer has failed";
    case MRC_ECLOSED: return "connection closed";
    case MRC_EPROTO: return "protocol mismatch with the peer";
    case MRC_ETRUNC: return "message larger than the receive buffer";
    case MRC_EUNREACH: return "peer unreachable";
    case MRC_EUSAGE: return "invalid argument";
    case MRC_EREMOTE: return "connection failed after a remote access error";
    case MRC_ENOBUFS: return "table full";
    case MRC_EABORT: return "collective aborted";
    case MRC_EMISMATCH: return "ranks called the collective with different arguments";
    case MRC_ENOTMRC: return "not an mrc endpoint (it answered in another protocol)";
    case MRC_EGONE: return "the peer closed its communicator without this call";
    case MRC_ESTALLED: return "nothing of the collective completed within its timeout";
    case MRC_EBUSY: return "still in use by pending operations";
    case MRC_ERNR: return "receiver not ready: the peer posted no RECV (or took no immediate) within the RNR limit";
    default: return rc < 0 && rc > -4096 ? strerror(-rc) : "unknown error";
    }
}

const char *mrc_drop_str(int reason)
{
    static const char *const names[MRC_DROP_MAX] = {
#define MRC_X_STR(name, str) str,
        MRC_DROP_REASONS(MRC_X_STR)
#undef MRC_X_STR
    };
    return reason >= 0 && reason < MRC_DROP_MAX ? names[reason] : "?";
}

uint64_t rand_u64(void)
{
    uint64_t v = 0;
    /* getrandom on a 8-byte request does not return short. */
    if (getrandom(&v, sizeof(v), 0) != (ssize_t)sizeof(v))
        v = now_ns() * 0x9E3779B97F4A7C15ull;
    return v;
}

void mrc_ep_config_init(struct mrc_ep_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
}

/* MRC_LOSS="PLANE:PERCENT,..." or "all:PERCENT" (e.g. "1:5" or "1:5%"): loss
 * injection without code. Percent, like every mrc command line (mrc-perf
 * --loss, mrc-fabric loss); only the C and Python calls take a probability. */
static int ep_env_loss(mrc_ep *ep)
{
    const char *env = getenv("MRC_LOSS");
    if (!env || !*env)
        return 0;
    char buf[256];
    snprintf(buf, sizeof(buf), "%s", env);
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *colon = strchr(tok, ':');
        if (!colon)
            return MRC_EUSAGE;
        *colon = 0;
        char *end;
        double p = strtod(colon + 1, &end);
        if (end == colon + 1 || (*end && strcmp(end, "%") != 0) || p < 0 || p > 100)
            return MRC_EUSAGE;
        p /= 100.0;
        if (strcmp(tok, "all") == 0) {
            for (int i = 0; i < ep->nplanes; i++)
                ep->planes[i].tx_loss = p;
        } else {
            long i = strtol(tok, &end, 10);
            if (*end || i < 0 || i >= ep->nplanes)
                return MRC_EUSAGE;
            ep->planes[i].tx_loss = p;
        }
    }
    return 0;
}

int mrc_ep_create(const struct mrc_ep_config *cfg, mrc_ep **out)
{
    if (cfg->nplanes < 1 || cfg->nplanes > MRC_MAX_PLANES)
        return MRC_EUSAGE;
    if (cfg->mss > MRC_MAX_MSS || (cfg->mss && cfg->mss < 64))
        return MRC_EUSAGE;
    if (cfg->window && (cfg->window & (cfg->window - 1) || cfg->window < 64 ||
                        cfg->window > (1u << 20)))
        return MRC_EUSAGE;
    mrc_ep *ep = calloc(1, sizeof(*ep));
    if (!ep)
        return -ENOMEM;
    int rc = 0;
    ep->cfg = *cfg;
    if (!ep->cfg.mss)
        ep->cfg.mss = MRC_DEFAULT_MSS;
    if (!ep->cfg.timeout_ms)
        ep->cfg.timeout_ms = 5000;
    if (!ep->cfg.sockbuf)
        ep->cfg.sockbuf = 8u << 20;
    if (!ep->cfg.window)
        ep->cfg.window = 4096;
    if (!ep->cfg.max_unexpected)
        ep->cfg.max_unexpected = 64ull << 20;
    if (!ep->cfg.rnr_timeout_ms)
        ep->cfg.rnr_timeout_ms = (int32_t)(ep->cfg.timeout_ms > INT32_MAX ? INT32_MAX
                                                                          : ep->cfg.timeout_ms);
    atomic_init(&ep->refs, 1);
    ep->nplanes = cfg->nplanes;
    ep->epfd = ep->evfd = ep->nl_fd = -1;
    ep->rng = rand_u64() | 1;
    for (uint32_t i = 1; i < MRC_SLOTS; i++) { /* slot 0 unused: ids are never 0 */
        ep->conn_free[ep->nconn_free++] = MRC_SLOTS - i;
        ep->mr_free[ep->nmr_free++] = MRC_SLOTS - i;
    }
    pthread_mutex_init(&ep->lock, NULL);
    pthread_mutex_init(&ep->turn_lock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&ep->cv, &ca);
    for (int i = 0; i < MRC_OP_CVS; i++)
        pthread_cond_init(&ep->op_cv[i], &ca);
    pthread_condattr_destroy(&ca);

    ep->rxbuf = aligned_alloc(64, (size_t)(MRC_BATCH + 1) * MRC_RX_SLOT);
    ep->epfd = epoll_create1(EPOLL_CLOEXEC);
    ep->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (!ep->rxbuf || ep->epfd < 0 || ep->evfd < 0) {
        rc = -errno ? -errno : -ENOMEM;
        goto err_free;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = UINT32_MAX};
    if (epoll_ctl(ep->epfd, EPOLL_CTL_ADD, ep->evfd, &ev) < 0) {
        rc = -errno;
        goto err_free;
    }
    for (int i = 0; i < ep->nplanes; i++) {
        snprintf(ep->planes[i].addr_str, MRC_ADDR_STRLEN, "%s", cfg->planes[i]);
        rc = sock_open_plane(ep, i);
        if (rc)
            goto err_socks;
    }
    rc = ep_env_loss(ep);
    if (rc)
        goto err_socks;
    link_open(ep);
    rc = -pthread_create(&ep->thread, NULL, engine_main, ep);
    if (rc)
        goto err_socks;
    /* Named for top -H, perf and gdb: a rank's CPU splits into its own
     * threads and this one (at most 15 characters). */
    pthread_setname_np(ep->thread, "mrc-progress");
    ep->pt_clock_ok = pthread_getcpuclockid(ep->thread, &ep->pt_clock) == 0;
    *out = ep;
    return 0;

err_socks:
    for (int i = 0; i < ep->nsocks; i++) {
        close(ep->socks[i]->fd);
        free(ep->socks[i]);
    }
    if (ep->nl_fd >= 0)
        close(ep->nl_fd);
err_free:
    if (ep->epfd >= 0)
        close(ep->epfd);
    if (ep->evfd >= 0)
        close(ep->evfd);
    free(ep->rxbuf);
    pthread_mutex_destroy(&ep->lock);
    pthread_mutex_destroy(&ep->turn_lock);
    pthread_cond_destroy(&ep->cv);
    for (int i = 0; i < MRC_OP_CVS; i++)
        pthread_cond_destroy(&ep->op_cv[i]);
    free(ep);
    return rc;
}

void mrc_ep_destroy(mrc_ep *ep)
{
    if (!ep)
        return;
    if (ep_progress_held_here(ep))
        mrc_ep_progress_end(ep, 0); /* the thread we join waits for it */
    hs_free(ep); /* first: waits for accept calls in other threads to return */
    pthread_mutex_lock(&ep->lock);
    ep->stopping = true;
    pthread_mutex_unlock(&ep->lock);
    ep_wake(ep);
    pthread_join(ep->thread, NULL);
    /* The thread failed every pending op and freed every connection's
     * datapath state before it returned (engine_main); ops posted to a CQ
     * have their MRC_ECLOSED entry there. What the caller did not destroy
     * goes now: its handles are dangling from here on. Connections go before
     * CQs: freeing one unbinds it from its CQ. */
    cq_stop_waiters(ep);
    while (ep->own_conns)
        conn_free(ep->own_conns);
    while (ep->own_mrs)
        mr_free(ep->own_mrs);
    cq_free_all(ep);
    for (int i = 0; i < ep->nsocks; i++) {
        close(ep->socks[i]->fd);
        free(ep->socks[i]);
    }
    if (ep->nl_fd >= 0)
        close(ep->nl_fd);
    close(ep->epfd);
    close(ep->evfd);
    free(ep->rxbuf);
    ep->rxbuf = NULL;
    ep_unref(ep); /* ops still held by the caller keep the lock alive */
}

void ep_unref(mrc_ep *ep)
{
    if (atomic_fetch_sub(&ep->refs, 1) != 1)
        return;
    pthread_mutex_destroy(&ep->lock);
    pthread_mutex_destroy(&ep->turn_lock);
    pthread_cond_destroy(&ep->cv);
    for (int i = 0; i < MRC_OP_CVS; i++)
        pthread_cond_destroy(&ep->op_cv[i]);
    free(ep);
}

int mrc_ep_nplanes(const mrc_ep *ep) { return ep->nplanes; }

uint64_t mrc_ep_progress_cpu_ns(const mrc_ep *ep)
{
    struct timespec ts;
    if (!ep->pt_clock_ok || clock_gettime(ep->pt_clock, &ts) != 0)
        return 0; /* e.g. the thread already ended (the endpoint is closing) */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int mrc_ep_srh_offload(const mrc_ep *ep)
{
    for (int i = 0; i < ep->nplanes; i++) {
        const struct plane *pl = &ep->planes[i];
        if (pl->ifindex <= 0)
            continue;
        if (!sock_seg6route_wanted(pl))
            return 0;
        int rc = seg6route_probe(pl->ifindex);
        if (rc != -ENETDOWN) /* a plane whose link is down cannot say: ask the next */
            return rc == 0;
    }
    return 0; /* no plane on a known interface that is up: every route socket is sticky */
}

int mrc_ep_plane(const mrc_ep *ep, int plane, char *addr, size_t addrlen, uint16_t *port)
{
    if (plane < 0 || plane >= ep->nplanes)
        return MRC_EUSAGE;
    if (addr)
        addr_format(&ep->planes[plane].addr, addr, addrlen);
    if (port)
        *port = ep->planes[plane].port;
    return 0;
}

void mrc_ep_kick(mrc_ep *ep)
{
    if (!ep)
        return;
    pthread_mutex_lock(&ep->lock);
    /* A caller holding the progress drains the posts; its end wakes the thread. */
    bool wake = !ep->progress_held && ep->wake_deferred && ep->sleeping;
    if (!ep->progress_held)
        ep->wake_deferred = false;
    pthread_mutex_unlock(&ep->lock);
    if (wake)
        ep_wake(ep);
}

void mrc_ep_busy_poll(mrc_ep *ep, uint32_t us)
{
    if (!ep || !us)
        return;
    uint64_t until = now_ns() + (uint64_t)us * 1000u;
    uint64_t cur = atomic_load_explicit(&ep->poll_until_ns, memory_order_relaxed);
    while (cur < until &&
           !atomic_compare_exchange_weak_explicit(&ep->poll_until_ns, &cur, until,
                                                  memory_order_relaxed, memory_order_relaxed)) {
    }
}

void ep_wake(mrc_ep *ep)
{
    uint64_t one = 1;
    /* A full eventfd counter still wakes the thread: ignore EAGAIN. */
    if (write(ep->evfd, &one, sizeof(one)) < 0) {
    }
}

/* Runs a control request on the progress thread and waits for it. */
int ep_ctl(mrc_ep *ep, struct ctl *c)
{
    if (ep_progress_held_here(ep))
        return ep_ctl_here(ep, c); /* this thread runs the passes now */
    c->done = false;
    c->next = NULL;
    pthread_mutex_lock(&ep->lock);
    if (ep->stopping) {
        /* Not before the thread has returned: until then it may still touch
         * the object this request is about (a connection or region that the
         * caller frees as soon as we answer). */
        while (!ep->stopped)
            pthread_cond_wait(&ep->cv, &ep->lock);
        pthread_mutex_unlock(&ep->lock);
        return MRC_ECLOSED;
    }
    if (ep->ctlq_tail)
        ep->ctlq_tail->next = c;
    else
        ep->ctlq_head = c;
    ep->ctlq_tail = c;
    pthread_mutex_unlock(&ep->lock);
    ep_wake(ep);
    pthread_mutex_lock(&ep->lock);
    while (!c->done)
        pthread_cond_wait(&ep->cv, &ep->lock);
    pthread_mutex_unlock(&ep->lock);
    return c->rc;
}

int mrc_ep_inject(mrc_ep *ep, int plane, double tx_loss, int down)
{
    if (plane < 0 || plane >= ep->nplanes || !(tx_loss >= 0 && tx_loss <= 1))
        return MRC_EUSAGE;
    struct ctl c = {.type = CTL_INJECT, .iarg = plane, .arg = &tx_loss, .arg2 = &down};
    return ep_ctl(ep, &c);
}

int mrc_ep_get_stats(mrc_ep *ep, struct mrc_ep_stats *st, struct mrc_path_stats *paths,
                 int max_paths)
{
    struct ctl c = {.type = CTL_STATS, .arg = st, .arg2 = paths, .iarg = paths ? max_paths : 0};
    return ep_ctl(ep, &c);
}

/* ---- regions ------------------------------------------------------------- */

/* ---- operations ---------------------------------------------------------- */

/* Hands op to the progress thread. References: the progress thread's until
 * it publishes the completion, the caller's if out, the CQ entry's if cq. */
static int op_post(mrc_conn *c, mrc_op *op, mrc_op **out)
{
    mrc_ep *ep = c->ep;
    atomic_init(&op->refs, 1 + (out != NULL) + (op->cq != NULL));
    pthread_mutex_lock(&ep->lock);
    if (ep->stopping || c->state != CONN_ACTIVE || (op->cq && op->cq->shut) || op->mr->dereg) {
        int err = op->mr->dereg ? MRC_EUSAGE
                  : c->state == CONN_ACTIVE ? MRC_ECLOSED
                                            : (c->error ? c->error : MRC_ECLOSED);
        pthread_mutex_unlock(&ep->lock);
        free(op);
        return err;
    }
    if (op->cq)
        op->cq->npending++;
    op->mr->ops++; /* until published: mrc_mr_dereg refuses meanwhile */
    op->mr_counted = true;
    atomic_fetch_add(&ep->refs, 1); /* dropped when the op is freed */
    op->qnext = NULL;
    if (ep->subq_tail)
        ep->subq_tail->qnext = op;
    else
        ep->subq_head = op;
    ep->subq_tail = op;
    /* A caller holding the progress drains it; ending, it wakes the thread
     * for what is left (mrc_ep_progress_end). */
    bool more = op->flags & MRC_POST_MORE;
    bool wake = false;
    if (!ep->progress_held) {
        wake = ep->sleeping && !more;
        ep->wake_deferred = ep->sleeping && more;
        /* Work not driven by a caller: the thread reads the sockets again. */
        if (atomic_load_explicit(&ep->quiet_until_ns, memory_order_relaxed))
            atomic_store_explicit(&ep->quiet_until_ns, 0, memory_order_relaxed);
    }
    pthread_mutex_unlock(&ep->lock);
    if (wake)
        ep_wake(ep);
    if (out)
        *out = op;
    return 0;
}

static mrc_op *op_new(mrc_conn *c, const struct mrc_wr *wr)
{
    mrc_mr *lmr = wr->mr;
    if (!lmr || lmr->ep != c->ep || wr->len > lmr->len || wr->loff > lmr->len - wr->len ||
        (wr->kind == MRC_OP_RECV && (lmr->access & MRC_ACCESS_READONLY)))
        return NULL;
    mrc_op *op = calloc(1, sizeof(*op));
    if (!op)
        return NULL;
    op->kind = wr->kind;
    op->flags = wr->flags;
    op->ep = c->ep;
    op->conn = c;
    op->mr = lmr;
    op->loff = wr->loff;
    op->len = wr->len;
    op->rkey = wr->rkey;
    op->roff = wr->roff;
    op->imm = wr->imm;
    op->tag = wr->tag;
    op->cq = wr->cq;
    op->ctx = wr->ctx;
    op->cqe.op = op;
    return op;
}

int mrc_post(mrc_conn *c, const struct mrc_wr *wr, mrc_op **out)
{
    if (!c || !wr || (!out && !wr->cq) || (wr->cq && wr->cq->ep != c->ep))
        return MRC_EUSAGE;
    if (wr->kind != MRC_OP_WRITE && wr->kind != MRC_OP_SEND && wr->kind != MRC_OP_RECV)
        return MRC_EUSAGE;
    int allowed = MRC_POST_MORE;
    if (wr->kind == MRC_OP_WRITE)
        allowed |= MRC_WRITE_IMM | MRC_POST_LAZY_ACK;
    else if (wr->kind == MRC_OP_SEND)
        allowed |= MRC_POST_LAZY_ACK;
    if (wr->flags & ~allowed)
        return MRC_EUSAGE;
    mrc_op *op = op_new(c, wr);
    if (!op)
        return MRC_EUSAGE;
    return op_post(c, op, out);
}

int mrc_post_write(mrc_conn *c, mrc_mr *lmr, uint64_t loff, uint64_t len, uint64_t rkey,
                   uint64_t roff, uint32_t imm, int flags, mrc_op **out)
{
    struct mrc_wr wr = {.kind = MRC_OP_WRITE, .flags = flags, .mr = lmr, .loff = loff,
                        .len = len, .rkey = rkey, .roff = roff, .imm = imm};
    return out ? mrc_post(c, &wr, out) : MRC_EUSAGE;
}

int mrc_post_send(mrc_conn *c, mrc_mr *lmr, uint64_t loff, uint64_t len, uint64_t tag,
                  mrc_op **out)
{
    struct mrc_wr wr = {.kind = MRC_OP_SEND, .mr = lmr, .loff = loff, .len = len, .tag = tag};
    return out ? mrc_post(c, &wr, out) : MRC_EUSAGE;
}

int mrc_post_recv(mrc_conn *c, mrc_mr *lmr, uint64_t loff, uint64_t len, uint64_t tag,
                  mrc_op **out)
{
    struct mrc_wr wr = {.kind = MRC_OP_RECV, .mr = lmr, .loff = loff, .len = len, .tag = tag};
    return out ? mrc_post(c, &wr, out) : MRC_EUSAGE;
}

void op_unref(mrc_op *op)
{
    if (atomic_fetch_sub(&op->refs, 1) == 1) {
        mrc_ep *ep = op->ep;
        free(op);
        ep_unref(ep);
    }
}

/* Waits on cv, with ep->lock held, until ready(arg) or timeout_ms pass
 * (0: just look, <0: no limit). Returns ready(arg). */
bool ep_wait_locked(mrc_ep *ep, pthread_cond_t *cv, int timeout_ms,
                    bool (*ready)(const void *), const void *arg)
{
    struct timespec dl;
    clock_gettime(CLOCK_MONOTONIC, &dl);
    if (timeout_ms > 0) {
        dl.tv_sec += timeout_ms / 1000;
        dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (dl.tv_nsec >= 1000000000L) {
            dl.tv_sec++;
            dl.tv_nsec -= 1000000000L;
        }
    }
    while (!ready(arg) && timeout_ms != 0) {
        int rc = timeout_ms < 0 ? pthread_cond_wait(cv, &ep->lock)
                                : pthread_cond_timedwait(cv, &ep->lock, &dl);
        if (rc == ETIMEDOUT)
            break;
    }
    return ready(arg);
}

static bool op_ready(const void *arg) { return ((const mrc_op *)arg)->done; }

int mrc_op_wait(mrc_op *op, int timeout_ms)
{
    mrc_ep *ep = op->ep;
    pthread_mutex_lock(&ep->lock);
    op->waiters++; /* ep_publish_pt wakes the op's bucket only if someone waits */
    bool done = ep_wait_locked(ep, &ep->op_cv[op_cv_index(op)], timeout_ms, op_ready, op);
    op->waiters--;
    pthread_mutex_unlock(&ep->lock);
    return done ? 0 : -ETIMEDOUT;
}

int mrc_op_done(mrc_op *op) { return mrc_op_wait(op, 0) == 0; }

void mrc_op_get_result(mrc_op *op, struct mrc_op_result *res)
{
    mrc_ep *ep = op->ep;
    pthread_mutex_lock(&ep->lock);
    res->status = op->done ? op->status : -EINPROGRESS;
    res->kind = op->kind;
    res->bytes = op->res_bytes;
    res->tag = op->res_tag;
    pthread_mutex_unlock(&ep->lock);
}

void mrc_op_release(mrc_op *op)
{
    if (op)
        op_unref(op);
}

static bool imm_ready(const void *arg)
{
    const mrc_conn *c = arg;
    return c->imm_head || c->state != CONN_ACTIVE;
}

int mrc_conn_wait_imm(mrc_conn *c, int timeout_ms, uint32_t *imm, uint64_t *len)
{
    mrc_ep *ep = c->ep;
    pthread_mutex_lock(&ep->lock);
    ep_wait_locked(ep, &ep->cv, timeout_ms, imm_ready, c);
    struct imm_ev *ev = c->imm_head;
    if (ev) {
        c->imm_head = ev->next;
        if (!c->imm_head)
            c->imm_tail = NULL;
        atomic_fetch_add(&c->imm_taken, 1); /* room for one more (MRC_IMM_MAX) */
    }
    int state = c->state, err = c->error;
    pthread_mutex_unlock(&ep->lock);
    if (!ev)
        return state == CONN_ACTIVE ? -ETIMEDOUT : (err ? err : MRC_ECLOSED);
    *imm = ev->imm;
    *len = ev->len;
    free(ev);
    return 0;
}

/* ---- progress-thread side of completion ---------------------------------- */

/* Queues op's completion; ep_publish_pt makes a batch visible at once. */
void op_complete_pt(mrc_ep *ep, mrc_op *op, int status)
{
    op->pt_status = status;
    op->qnext = ep->done_head;
    ep->done_head = op;
}

/* Makes a batch of completions visible: done on their handles, entries on
 * their CQs (in completion order). Only the op_cv buckets of ops a thread
 * waits on are broadcast; CQ waiters are woken by their own CQ (cq_push_locked). */
void ep_publish_pt(mrc_ep *ep)
{
    if (!ep->done_head)
        return;
    mrc_op *list = NULL;
    for (mrc_op *op = ep->done_head, *n; op; op = n) { /* newest first: reverse */
        n = op->qnext;
        op->qnext = list;
        list = op;
    }
    ep->done_head = NULL;
    uint32_t wake = 0;
    pthread_mutex_lock(&ep->lock);
    for (mrc_op *op = list; op; op = op->qnext) {
        op->status = op->pt_status;
        op->done = 1;
        if (op->mr_counted) {
            op->mr->ops--;
            op->mr_counted = false;
        }
        if (op->waiters)
            wake |= 1u << op_cv_index(op);
        if (op->cq) {
            op->cqe.wc = (struct mrc_wc){.ctx = op->ctx, .status = op->status,
                                         .kind = op->kind, .bytes = op->res_bytes,
                                         .tag = op->res_tag, .conn = op->conn};
            op->cq->npending--;
            cq_push_locked(op->cq, &op->cqe);
        }
    }
    for (int i = 0; wake; i++, wake >>= 1)
        if (wake & 1)
            pthread_cond_broadcast(&ep->op_cv[i]);
    pthread_mutex_unlock(&ep->lock);
    for (mrc_op *op = list, *n; op; op = n) {
        n = op->qnext;
        op_unref(op);
    }
}

/* ---- completions held while their packets may still be read -------------- */

/* A batch that sendmmsg did not take completely (EAGAIN) keeps pointers into
 * the callers' buffers until a later pass sends it. An op whose last packet
 * was acknowledged meanwhile (its original arrived; the copy in the batch is
 * a retransmission) or that failed (connection closed) must not be reported
 * complete yet: the caller would reuse or free the buffer, or deregister the
 * region, and the retransmission would read it. So completions wait until
 * every socket has sent what it held when they were made. */

static bool batches_unsent(const mrc_ep *ep)
{
    for (int i = 0; i < ep->nsocks; i++)
        if (ep->socks[i]->batch.sent < ep->socks[i]->batch.n)
            return true;
    return false;
}

static void held_snapshot(mrc_ep *ep)
{
    for (int i = 0; i < ep->nsocks; i++) {
        const struct txbatch *b = &ep->socks[i]->batch;
        ep->held_need[i] = b->retired + (uint64_t)b->n;
    }
}

static bool held_sent(const mrc_ep *ep)
{
    for (int i = 0; i < ep->nsocks; i++) {
        const struct txbatch *b = &ep->socks[i]->batch;
        if (b->retired + (uint64_t)b->sent < ep->held_need[i])
            return false;
    }
    return true;
}

/* Lists are newest first, as ep->done_head is (ep_publish_pt reverses it). */
static void oplist_prepend(mrc_op **head, mrc_op *newer)
{
    if (!newer)
        return;
    mrc_op *last = newer;
    while (last->qnext)
        last = last->qnext;
    last->qnext = *head;
    *head = newer;
}

/* Runs before ep_publish_pt: leaves in ep->done_head only the completions
 * that may be seen now, in completion order. force: the sockets will never
 * send again (stopping; the caller discarded their batches): release all.
 * A held list implies an unsent batch, so the loop sleeps at most a timer
 * tick (engine_sleep) before it retries the send and looks again. */
void ep_hold_pt(mrc_ep *ep, bool force)
{
    mrc_op *fresh = ep->done_head, *out = NULL;
    ep->done_head = NULL;
    while (ep->held && (force || held_sent(ep))) {
        oplist_prepend(&out, ep->held); /* oldest first: each later one goes in front */
        ep->held = ep->next_held;
        ep->next_held = NULL;
        if (ep->held)
            held_snapshot(ep);
    }
    if (fresh && !force && (ep->held || batches_unsent(ep))) {
        if (!ep->held) {
            ep->held = fresh;
            held_snapshot(ep);
        } else {
            oplist_prepend(&ep->next_held, fresh);
        }
    } else {
        oplist_prepend(&out, fresh);
    }
    ep->done_head = out;
}
