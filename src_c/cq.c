/*
 * cq.c - completion queues: where operations posted with a cq complete, and
 * where immediates of a bound connection arrive, as a FIFO of entries.
 *
 * An op's entry is embedded in the op (struct cq_ent cqe) and holds one
 * reference to it until it is polled, so the queue needs no memory of its own
 * and can never lose a completion: its length is bounded by the ops that
 * exist. Immediates get an entry allocated on arrival.
 *
 * Waking: the progress thread signals cq->cv only when a thread waits on this
 * CQ, and writes the eventfd only when the queue goes from empty to non-empty;
 * the poll that empties the queue reads it back, so the fd is readable exactly
 * while entries wait. Everything here is under ep->lock.
 */
#include "internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

int mrc_cq_create(mrc_ep *ep, mrc_cq **out)
{
    if (!ep || !out)
        return MRC_EUSAGE;
    mrc_cq *cq = calloc(1, sizeof(*cq));
    if (!cq)
        return -ENOMEM;
    cq->ep = ep;
    cq->fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (cq->fd < 0) {
        int rc = -errno;
        free(cq);
        return rc;
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&cq->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_lock(&ep->lock);
    DL_APPEND(ep->own_cqs, ep->own_cqs_tail, cq, own_prev, own_next);
    pthread_mutex_unlock(&ep->lock);
    *out = cq;
    return 0;
}

static void ent_release(struct cq_ent *e)
{
    if (!e->op) {
        free(e);
        return;
    }
    op_unref(e->op); /* the op's last reference also drops its endpoint's */
}

/* Entries taken off a queue: the ops' references are dropped outside the
 * lock, as ep_publish_pt does. */
static void ent_release_list(struct cq_ent *e)
{
    for (struct cq_ent *n; e; e = n) {
        n = e->next;
        ent_release(e);
    }
}

static void cq_free(mrc_cq *cq)
{
    ent_release_list(cq->head);
    close(cq->fd);
    pthread_cond_destroy(&cq->cv);
    free(cq);
}

int mrc_cq_destroy(mrc_cq *cq)
{
    if (!cq)
        return 0;
    mrc_ep *ep = cq->ep;
    pthread_mutex_lock(&ep->lock);
    if (cq->npending || cq->nbound || cq->waiters) {
        pthread_mutex_unlock(&ep->lock);
        return MRC_EBUSY;
    }
    DL_UNLINK(ep->own_cqs, ep->own_cqs_tail, cq, own_prev, own_next);
    pthread_mutex_unlock(&ep->lock);
    cq_free(cq); /* entries not polled yet are dropped */
    return 0;
}

/* mrc_ep_destroy, once the progress thread has stopped and completed every
 * op (the last ones with MRC_ECLOSED into their CQs) and the connections are
 * freed. */
void cq_free_all(mrc_ep *ep)
{
    while (ep->own_cqs) {
        mrc_cq *cq = ep->own_cqs;
        DL_UNLINK(ep->own_cqs, ep->own_cqs_tail, cq, own_prev, own_next);
        cq_free(cq);
    }
}

/* mrc_ep_destroy, with ep->stopping set: threads in mrc_cq_wait return, and
 * the CQs are not freed under them. */
void cq_stop_waiters(mrc_ep *ep)
{
    pthread_mutex_lock(&ep->lock);
    for (mrc_cq *cq = ep->own_cqs; cq; cq = cq->own_next)
        pthread_cond_broadcast(&cq->cv);
    for (;;) {
        bool busy = false;
        for (mrc_cq *cq = ep->own_cqs; cq && !busy; cq = cq->own_next)
            busy = cq->waiters > 0;
        if (!busy)
            break;
        pthread_cond_wait(&ep->cv, &ep->lock);
    }
    pthread_mutex_unlock(&ep->lock);
}

void mrc_cq_shutdown(mrc_cq *cq)
{
    if (!cq)
        return;
    pthread_mutex_lock(&cq->ep->lock);
    cq->shut = true;
    pthread_cond_broadcast(&cq->cv);
    pthread_mutex_unlock(&cq->ep->lock);
}

int mrc_cq_fd(mrc_cq *cq)
{
    if (!cq)
        return MRC_EUSAGE;
    pthread_mutex_lock(&cq->ep->lock);
    if (!cq->fd_used) {
        cq->fd_used = true;
        uint64_t one = 1;
        if (cq->head && !cq->fd_set && write(cq->fd, &one, sizeof(one)) == (ssize_t)sizeof(one))
            cq->fd_set = true;
    }
    pthread_mutex_unlock(&cq->ep->lock);
    return cq->fd;
}

void cq_push_locked(mrc_cq *cq, struct cq_ent *e)
{
    e->next = NULL;
    if (cq->tail)
        cq->tail->next = e;
    else
        cq->head = e;
    cq->tail = e;
    cq->len++;
    if (cq->fd_used && !cq->fd_set) {
        uint64_t one = 1;
        /* Never full: the counter is read back to 0 whenever the queue empties. */
        if (write(cq->fd, &one, sizeof(one)) == (ssize_t)sizeof(one))
            cq->fd_set = true;
    }
    /* One waiter with a threshold sleeps until it is met; several may
     * want different counts, so each entry wakes one of them. */
    if (cq->waiters && (cq->waiters > 1 || cq->len >= (uint32_t)cq->want))
        pthread_cond_signal(&cq->cv);
}

/* Takes up to max entries (ep->lock held); *taken gets them for release. */
static int cq_take_locked(mrc_cq *cq, struct mrc_wc *wc, int max, struct cq_ent **taken)
{
    int n = 0;
    struct cq_ent *first = cq->head, *last = NULL;
    while (n < max && cq->head) {
        last = cq->head;
        wc[n++] = last->wc;
        cq->head = last->next;
        cq->len--;
    }
    if (last)
        last->next = NULL;
    else
        first = NULL;
    if (!cq->head) {
        cq->tail = NULL;
        if (cq->fd_set) {
            uint64_t v;
            if (read(cq->fd, &v, sizeof(v)) == (ssize_t)sizeof(v) || errno == EAGAIN)
                cq->fd_set = false;
        }
    } else if (cq->waiters) {
        pthread_cond_signal(&cq->cv); /* what this caller left is for another waiter */
    }
    *taken = first;
    return n;
}

int mrc_cq_poll(mrc_cq *cq, struct mrc_wc *wc, int max)
{
    if (!cq || max < 0 || (!wc && max))
        return MRC_EUSAGE;
    struct cq_ent *taken;
    pthread_mutex_lock(&cq->ep->lock);
    int n = cq_take_locked(cq, wc, max, &taken);
    pthread_mutex_unlock(&cq->ep->lock);
    ent_release_list(taken);
    return n;
}

/* A waiter returns when entries wait or the CQ (or its endpoint) shuts down. */
static bool cq_wakeable(const void *arg)
{
    const mrc_cq *cq = arg;
    return cq->len >= (uint32_t)(cq->want > 1 && cq->waiters == 1 ? cq->want : 1) ||
           cq->ep->stopping || cq->shut;
}

int mrc_cq_wait(mrc_cq *cq, struct mrc_wc *wc, int max, int timeout_ms)
{
    return mrc_cq_wait_min(cq, wc, max, 1, timeout_ms);
}

int mrc_cq_wait_min(mrc_cq *cq, struct mrc_wc *wc, int max, int min, int timeout_ms)
{
    if (!cq || max < 1 || !wc)
        return MRC_EUSAGE;
    mrc_ep *ep = cq->ep;
    pthread_mutex_lock(&ep->lock);
    cq->waiters++;
    cq->want = min < 1 ? 1 : min > max ? max : min;
    ep_wait_locked(ep, &cq->cv, timeout_ms, cq_wakeable, cq);
    cq->waiters--;
    cq->want = 1;
    bool stopping = ep->stopping || cq->shut;
    if (ep->stopping && !cq->waiters)
        pthread_cond_broadcast(&ep->cv); /* cq_stop_waiters */
    struct cq_ent *taken;
    int n = cq_take_locked(cq, wc, max, &taken);
    pthread_mutex_unlock(&ep->lock);
    ent_release_list(taken);
    if (n)
        return n;
    return stopping ? MRC_ECLOSED : -ETIMEDOUT;
}

/* Moves the immediates already waiting on c's own queue onto its new CQ, in
 * order, so binding late loses none. */
static int cq_move_imms_locked(mrc_conn *c)
{
    while (c->imm_head) {
        struct imm_ev *ev = c->imm_head;
        struct cq_ent *e = malloc(sizeof(*e));
        if (!e)
            return -ENOMEM;
        *e = (struct cq_ent){.wc = {.ctx = c->cq_ctx, .kind = MRC_WC_IMM, .bytes = ev->len,
                                    .imm = ev->imm, .conn = c}};
        cq_push_locked(c->cq, e);
        c->imm_head = ev->next;
        if (!c->imm_head)
            c->imm_tail = NULL;
        free(ev);
    }
    return 0;
}

int mrc_conn_set_cq(mrc_conn *c, mrc_cq *cq, uint64_t ctx)
{
    if (!c || (cq && cq->ep != c->ep))
        return MRC_EUSAGE;
    mrc_ep *ep = c->ep;
    pthread_mutex_lock(&ep->lock);
    cq_conn_unbind_locked(c);
    c->cq = cq;
    c->cq_ctx = ctx;
    int rc = 0;
    if (cq) {
        cq->nbound++;
        rc = cq_move_imms_locked(c);
    }
    pthread_mutex_unlock(&ep->lock);
    return rc;
}

void cq_conn_unbind_locked(mrc_conn *c)
{
    if (c->cq)
        c->cq->nbound--;
    c->cq = NULL;
}

/* A WRITE-with-immediate was delivered on c: onto its CQ if bound, else its
 * own queue for mrc_conn_wait_imm. -ENOMEM if no entry could be allocated. */
int conn_imm_pt(mrc_conn *c, uint32_t imm, uint64_t len)
{
    mrc_ep *ep = c->ep;
    /* Allocated before taking the lock; the spare one is freed after. */
    struct cq_ent *e = malloc(sizeof(*e));
    struct imm_ev *ev = malloc(sizeof(*ev));
    int rc = 0;
    pthread_mutex_lock(&ep->lock);
    if (c->cq && e) {
        *e = (struct cq_ent){.wc = {.ctx = c->cq_ctx, .kind = MRC_WC_IMM, .bytes = len,
                                    .imm = imm, .conn = c}};
        cq_push_locked(c->cq, e);
        e = NULL;
        /* MRC_IMM_MAX bounds the connection's own list (rx.c); a CQ entry is
         * not on it, so it counts as taken at once. */
        atomic_fetch_add(&c->imm_taken, 1);
    } else if (!c->cq && ev) {
        *ev = (struct imm_ev){.imm = imm, .len = len};
        if (c->imm_tail)
            c->imm_tail->next = ev;
        else
            c->imm_head = ev;
        c->imm_tail = ev;
        ev = NULL;
        pthread_cond_broadcast(&ep->cv);
    } else {
        rc = -ENOMEM;
    }
    pthread_mutex_unlock(&ep->lock);
    free(e);
    free(ev);
    return rc;
}
