/*
 * engine.c - the progress thread: one loop per endpoint that receives,
 * acknowledges, runs timers, transmits and publishes completions. It never
 * blocks while there is work and sleeps in epoll when there is none.
 */
#include "internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <unistd.h>

static void active_unlink(mrc_ep *ep, mrc_conn *c)
{
    if (!c->active_listed)
        return;
    for (mrc_conn **pp = &ep->active; *pp; pp = &(*pp)->next_active)
        if (*pp == c) {
            *pp = c->next_active;
            break;
        }
    c->active_listed = false;
    if (c->in_ackq) {
        for (mrc_conn **pp = &ep->ackq; *pp; pp = &(*pp)->next_ack)
            if (*pp == c) {
                *pp = c->next_ack;
                break;
            }
        c->in_ackq = false;
    }
}

/* CLOSE on every live path: one is enough, losing all is unlikely. It
 * carries our next PSN: the peer accepts a CLOSE only if that PSN lies in its
 * receive window (rx.c), so a blind forger must guess it as well as the
 * connection id (RFC 5961 does the same for TCP RST). */
static void conn_send_close_pt(mrc_conn *c)
{
    uint64_t now = now_ns();
    c->closing_sent = true;
    for (int i = 0; i < c->npaths; i++)
        if (c->paths[i].state != MRC_PATH_FAILED)
            path_send_ctrl_pt(c, &c->paths[i], c->paths[i].id, MRC_PKT_CLOSE, c->next_psn, now);
}

/* Puts a live connection into error: every pending op fails with op_err,
 * the peer is told (unless it told us), the datapath forgets it. */
void conn_fail_pt(mrc_conn *c, int err, int op_err)
{
    mrc_ep *ep = c->ep;
    if (c->state != CONN_ACTIVE)
        return;
    if (err != MRC_ECLOSED && !c->closing_sent)
        conn_send_close_pt(c);
    pthread_mutex_lock(&ep->lock);
    c->state = CONN_FAILED;
    c->error = err;
    pthread_cond_broadcast(&ep->cv);
    pthread_mutex_unlock(&ep->lock);
    int saved = c->error;
    c->error = op_err;
    tx_release_pt(c);
    rx_release_pt(c);
    c->error = saved;
    active_unlink(ep, c);
}

static void conn_add_pt(mrc_ep *ep, struct ctl *x)
{
    mrc_conn *c = x->arg;
    for (int i = 0; i < c->npaths; i++) {
        struct path *p = &c->paths[i];
        if (p->nsegs) {
            int s = sock_path_pt(ep, p->plane, p->nsegs, p->segs);
            if (s < 0) {
                x->rc = s;
                return;
            }
            p->sock = s;
        } else {
            p->sock = p->plane;
        }
    }
    ep->conns[c->slot] = c;
    c->next_active = ep->active;
    ep->active = c;
    c->active_listed = true;
    pthread_mutex_lock(&ep->lock);
    c->state = CONN_ACTIVE;
    pthread_mutex_unlock(&ep->lock);
    x->rc = 0;
}

static void conn_del_pt(mrc_ep *ep, mrc_conn *c)
{
    if (c->state == CONN_ACTIVE) {
        conn_send_close_pt(c);
        conn_fail_pt(c, MRC_ECLOSED, MRC_ECLOSED);
    }
    active_unlink(ep, c);
    if (ep->conns[c->slot] == c)
        ep->conns[c->slot] = NULL;
    pthread_mutex_lock(&ep->lock);
    c->state = CONN_CLOSED;
    pthread_mutex_unlock(&ep->lock);
}

static void stats_pt(mrc_ep *ep, struct ctl *x)
{
    struct mrc_ep_stats *st = x->arg;
    struct mrc_path_stats *ps = x->arg2;
    *st = ep->st;
    st->nsocks = ep->nsocks;
    st->nconns = 0;
    st->staged_bytes = 0;
    st->npaths = 0;
    for (uint32_t s = 1; s < MRC_SLOTS; s++) {
        mrc_conn *c = ep->conns[s];
        if (!c)
            continue;
        st->staged_bytes += c->staged_bytes;
        for (int i = 0; i < c->npaths && ps && st->npaths < x->iarg; i++) {
            struct path *p = &c->paths[i];
            struct mrc_path_stats *o = &ps[st->npaths++];
            memset(o, 0, sizeof(*o));
            o->conn_index = st->nconns;
            o->conn_id = c->id;
            o->id = p->id;
            o->plane = p->plane;
            o->state = p->state;
            memcpy(o->dst, p->dst_str, sizeof(o->dst));
            o->nsegs = p->nsegs;
            o->tx_pkts = p->tx_pkts;
            o->tx_bytes = p->tx_bytes;
            o->rx_pkts = p->rx_pkts;
            o->rx_bytes = p->rx_bytes;
            o->retx = p->retx;
            o->lost = p->lost;
            o->injected = p->injected;
            o->probes = p->probes;
            o->srtt_ns = p->srtt;
            o->base_rtt_ns = p->base_rtt == UINT64_MAX ? 0 : p->base_rtt;
            o->cwnd_bytes = p->cwnd;
            o->inflight_bytes = p->inflight;
            o->state_changes = p->changes;
        }
        st->nconns++;
    }
    x->rc = 0;
}

void ep_ctl_run_pt(mrc_ep *ep, struct ctl *x)
{
    x->rc = 0;
    switch (x->type) {
    case CTL_CONN_ADD:
        conn_add_pt(ep, x);
        break;
    case CTL_CONN_DEL:
        conn_del_pt(ep, x->arg);
        break;
    case CTL_MR_ADD: {
        mrc_mr *mr = x->arg;
        ep->mrs[mr->key & 0xffff] = mr;
        break;
    }
    case CTL_MR_DEL: {
        mrc_mr *mr = x->arg;
        if (ep->mrs[mr->key & 0xffff] == mr)
            ep->mrs[mr->key & 0xffff] = NULL;
        break;
    }
    case CTL_STATS:
        stats_pt(ep, x);
        break;
    case CTL_RX_INJECT:
        testing_rx_inject_pt(ep, x->arg);
        break;
    case CTL_INJECT:
        ep->planes[x->iarg].tx_loss = *(double *)x->arg;
        ep->planes[x->iarg].down = *(int *)x->arg2 != 0;
        break;
    default:
        x->rc = MRC_EUSAGE;
    }
}

/* Takes posted work from the API threads. Returns false when stopping. */
static bool engine_drain(mrc_ep *ep)
{
    pthread_mutex_lock(&ep->lock);
    mrc_op *ops = ep->subq_head;
    struct ctl *ctls = ep->ctlq_head;
    ep->subq_head = ep->subq_tail = NULL;
    ep->ctlq_head = ep->ctlq_tail = NULL;
    bool stopping = ep->stopping;
    pthread_mutex_unlock(&ep->lock);

    for (mrc_op *op = ops, *n; op; op = n) {
        n = op->qnext;
        mrc_conn *c = op->conn;
        ep->work = true;
        if (c->state != CONN_ACTIVE)
            op_complete_pt(ep, op, c->error ? c->error : MRC_ECLOSED);
        else if (op->kind == MRC_OP_RECV)
            rx_post_recv_pt(c, op);
        else
            tx_post_pt(c, op);
    }
    if (ctls) {
        for (struct ctl *x = ctls; x; x = x->next)
            ep_ctl_run_pt(ep, x);
        ep_publish_pt(ep); /* ops failed by a CONN_DEL complete first */
        pthread_mutex_lock(&ep->lock);
        for (struct ctl *x = ctls, *n; x; x = n) {
            n = x->next;
            x->done = true; /* x may vanish as soon as this is seen */
        }
        pthread_cond_broadcast(&ep->cv);
        pthread_mutex_unlock(&ep->lock);
        ep->work = true;
    }
    return !stopping;
}

static void engine_timers(mrc_ep *ep, uint64_t now)
{
    for (mrc_conn *c = ep->active, *n; c; c = n) {
        n = c->next_active;
        bool busy = c->txops_head || c->recvq_head || c->staging;
        if (c->una != c->next_psn)
            tx_timers_pt(c, now);
        path_timers_pt(c, now, busy);
        bool all_failed = true;
        for (int i = 0; i < c->npaths && all_failed; i++)
            all_failed = c->paths[i].state == MRC_PATH_FAILED;
        if (!all_failed)
            c->all_failed_since = 0;
        else if (!c->all_failed_since)
            c->all_failed_since = now;
        uint64_t limit = (uint64_t)ep->cfg.timeout_ms * 1000000ull;
        if (c->txops_head && now - c->last_progress_ns > limit)
            conn_fail_pt(c, all_failed ? MRC_EPATHDOWN : MRC_ETIMEOUT,
                         all_failed ? MRC_EPATHDOWN : MRC_ETIMEOUT);
        else if (busy && all_failed && now - c->all_failed_since > limit)
            conn_fail_pt(c, MRC_EPATHDOWN, MRC_EPATHDOWN);
    }
}

static void engine_sleep(mrc_ep *ep, uint64_t now)
{
    pthread_mutex_lock(&ep->lock);
    bool idle = !ep->subq_head && !ep->ctlq_head && !ep->stopping;
    ep->sleeping = idle;
    pthread_mutex_unlock(&ep->lock);
    if (idle) {
        struct epoll_event evs[MRC_MAX_PLANES + 1];
        uint64_t wait = ep->next_timer_ns > now ? ep->next_timer_ns - now : 0;
        struct timespec ts = {.tv_sec = (time_t)(wait / 1000000000ull),
                              .tv_nsec = (long)(wait % 1000000000ull)};
        int n = epoll_pwait2(ep->epfd, evs, MRC_MAX_PLANES + 1, &ts, NULL);
        for (int i = 0; i < n; i++)
            if (evs[i].data.u32 == UINT32_MAX) {
                uint64_t v;
                if (read(ep->evfd, &v, sizeof(v)) < 0) {
                }
            }
        pthread_mutex_lock(&ep->lock);
        ep->sleeping = false;
        pthread_mutex_unlock(&ep->lock);
    }
}

void *engine_main(void *arg)
{
    mrc_ep *ep = arg;
    ep->next_timer_ns = now_ns() + MRC_TIMER_NS;
    for (;;) {
        ep->work = false;
        if (!engine_drain(ep))
            break;
        for (int i = 0; i < ep->nplanes; i++) {
            /* Bounded bursts per plane: one busy plane cannot starve the
             * others or the transmit side. */
            for (int k = 0; k < 4; k++) {
                int n = sock_recv_pt(ep, i);
                rx_flush_acks_pt(ep);
                if (n < MRC_BATCH)
                    break;
            }
        }
        uint64_t now = now_ns();
        if (now >= ep->next_timer_ns) {
            link_poll_pt(ep);
            engine_timers(ep, now);
            ep->next_timer_ns = now + MRC_TIMER_NS;
        }
        for (mrc_conn *c = ep->active; c; c = c->next_active)
            if (tx_run_pt(c))
                ep->work = true;
        sock_flush_all_pt(ep);
        ep_publish_pt(ep);
        ep->st.loop_iters++;
        if (!ep->work)
            engine_sleep(ep, now_ns());
    }
    /* Stopping: every connection fails its pending operations. */
    for (uint32_t s = 1; s < MRC_SLOTS; s++)
        if (ep->conns[s])
            conn_del_pt(ep, ep->conns[s]);
    sock_flush_all_pt(ep);
    ep_publish_pt(ep);
    return NULL;
}
