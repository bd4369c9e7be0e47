/*
 * engine.c - the progress thread: one loop per endpoint that receives,
 * acknowledges, runs timers, transmits and publishes completions. It never
 * blocks while there is work and sleeps in epoll when there is none: until
 * the next timer that exists (ep->timed), or without a limit when no
 * connection has packets in flight, ops queued or paths to probe.
 */
#include "internal.h"

#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/epoll.h>
#include <unistd.h>

static void stats_pt(mrc_ep *ep, struct ctl *x)
{
    struct mrc_ep_stats *st = x->arg;
    struct mrc_path_stats *ps = x->arg2;
    *st = ep->st;
    st->nsocks = ep->nsocks;
    st->nsocks_seg6route = 0;
    for (int i = 0; i < ep->nsocks; i++)
        st->nsocks_seg6route += ep->socks[i]->mark != 0;
    st->nconns = 0;
    pthread_mutex_lock(&ep->lock); /* registering threads take slots under it */
    st->nmrs = (int)(MRC_SLOTS - 1 - ep->nmr_free); /* slot 0 is never used */
    pthread_mutex_unlock(&ep->lock);
    st->staged_bytes = 0;
    st->npaths = 0;
    /* The connections the datapath knows (failed ones too, until destroyed),
     * not all MRC_SLOTS slots. */
    st->conn_bytes = 0;
    for (mrc_conn *c = ep->pt_conns; c; c = c->pt_next) {
        st->staged_bytes += c->staged_bytes;
        st->conn_bytes += conn_bytes(c);
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
            o->conn_error = c->state == CONN_ACTIVE ? 0 : (c->error ? c->error : MRC_ECLOSED);
            memcpy(o->peer, c->peer_name, sizeof(o->peer)); /* NUL-terminated (handshake.c) */
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
    case CTL_TX_STALL:
        ep->tx_stall = x->iarg != 0;
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
        if (c->state != CONN_ACTIVE) {
            op_complete_pt(ep, op, c->error ? c->error : MRC_ECLOSED);
            continue;
        }
        if (op->kind == MRC_OP_RECV)
            rx_post_recv_pt(c, op);
        else
            tx_post_pt(c, op);
        conn_arm_timer_pt(c);
    }
    if (ctls) {
        for (struct ctl *x = ctls; x; x = x->next)
            ep_ctl_run_pt(ep, x);
        ep_hold_pt(ep, false);
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

/* When c's timers are next due, UINT64_MAX if it has none: then it leaves
 * ep->timed. Packets in flight (RTOs), ops queued (progress timeout, RNR
 * back-off) and paths suspect or probing tick every MRC_TIMER_NS; an
 * outstanding probe's answer is due by its deadline and a failed path's next
 * probe after its gap (a connection with a dead plane wakes the loop a few
 * times a second, not every MRC_TIMER_NS for as long as it is out); a
 * connection only waiting on posted RECVs needs its keepalives,
 * MRC_KEEPALIVE_NS apart, one path per turn (path_timers_pt). */
#define MRC_KEEPALIVE_GRID_NS 10000000ull

static uint64_t conn_next_timer_pt(const mrc_conn *c, uint64_t now)
{
    uint64_t tick = now + MRC_TIMER_NS;
    if (c->una != c->next_psn || c->txops_head || c->rnr_backoff)
        return tick;
    bool busy = c->recvq_head || c->staging;
    uint64_t due = UINT64_MAX, ka = UINT64_MAX;
    for (int i = 0; i < c->npaths; i++) {
        const struct path *p = &c->paths[i];
        uint64_t at = UINT64_MAX;
        if (p->probe_out)
            at = p->probe_sent_ns + 2 * path_rto(p) + 1;
        else if (p->state == MRC_PATH_FAILED)
            at = p->probe_sent_ns + p->probe_gap_ns;
        else if (p->state != MRC_PATH_GOOD)
            return tick; /* suspect or probing: a probe to send now */
        else if (busy && i == c->ka_path % c->npaths) {
            uint64_t last = p->last_rx_ns > p->probe_sent_ns ? p->last_rx_ns : p->probe_sent_ns;
            last = c->ka_sent_ns > last ? c->ka_sent_ns : last;
            uint64_t d = last + MRC_KEEPALIVE_NS + 1;
            d = d > tick ? d : tick;
            ka = d < ka ? d : ka;
        }
        if (at != UINT64_MAX) {
            at = at > tick ? at : tick;
            due = at < due ? at : due;
        }
    }
    /* Keepalives are rounded up to a common grid: those of many waiting
     * connections fall due together, one wake-up for all of them. */
    if (ka != UINT64_MAX)
        ka = (ka + MRC_KEEPALIVE_GRID_NS - 1) / MRC_KEEPALIVE_GRID_NS * MRC_KEEPALIVE_GRID_NS;
    return ka < due ? ka : due;
}

static void engine_conn_timers(mrc_ep *ep, mrc_conn *c, uint64_t now)
{
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
    /* A peer that keeps refusing (receiver not ready) counts as alive for
     * the timeout below; the RNR limit bounds how long we keep asking. */
    int32_t rnr = ep->cfg.rnr_timeout_ms;
    if (c->rnr_backoff && rnr >= 0 && now - c->rnr_since > (uint64_t)rnr * 1000000ull)
        conn_fail_pt(c, MRC_ERNR, MRC_ERNR);
    else if (c->txops_head && now - c->last_progress_ns > limit)
        conn_fail_pt(c, all_failed ? MRC_EPATHDOWN : MRC_ETIMEOUT,
                     all_failed ? MRC_EPATHDOWN : MRC_ETIMEOUT);
    else if (busy && all_failed && now - c->all_failed_since > limit)
        conn_fail_pt(c, MRC_EPATHDOWN, MRC_EPATHDOWN);
}

/* Runs the timers of the connections that have some (ep->timed), drops those
 * that have none left, and sets when the loop must wake next. */
static void engine_timers(mrc_ep *ep, uint64_t now)
{
    uint64_t next = UINT64_MAX;
    ep->next_timer_ns = UINT64_MAX;
    for (mrc_conn **pp = &ep->timed; *pp;) {
        mrc_conn *c = *pp;
        engine_conn_timers(ep, c, now);
        if (*pp != c)
            continue; /* it failed: conn_fail_pt took it off the list */
        uint64_t due = conn_next_timer_pt(c, now);
        if (due == UINT64_MAX) {
            *pp = c->next_timed;
            c->timed = false;
            continue;
        }
        next = due < next ? due : next;
        pp = &c->next_timed;
    }
    if (next < ep->next_timer_ns)
        ep->next_timer_ns = next;
}

/* A send batch the kernel refused (EAGAIN) is retried by the next loop. */
static bool engine_unsent(const mrc_ep *ep)
{
    for (int i = 0; i < ep->nsocks; i++)
        if (ep->socks[i]->batch.n)
            return true;
    return false;
}

/* Handles what epoll reported; returns the plane sockets that are readable. */
static uint32_t engine_events(mrc_ep *ep, const struct epoll_event *evs, int n)
{
    uint32_t ready = 0;
    for (int i = 0; i < n; i++) {
        uint32_t u = evs[i].data.u32;
        if (u == UINT32_MAX) {
            uint64_t v;
            if (read(ep->evfd, &v, sizeof(v)) < 0) {
            }
        } else if (u == UINT32_MAX - 1) {
            ep->nl_ready = true;
        } else if (u < MRC_MAX_PLANES) {
            ready |= 1u << u;
        }
    }
    return ready;
}

/* The plane sockets with datagrams waiting, asked without sleeping: one
 * epoll call instead of a recvmmsg per plane that mostly says EAGAIN (a
 * 4-plane endpoint made 28 of those per 8-byte all_reduce). Level
 * triggered, so a socket left with data is reported again. */
static uint32_t engine_ready(mrc_ep *ep)
{
    if (ep->nplanes <= 1)
        return 1u;
    struct epoll_event evs[MRC_MAX_PLANES + 2];
    int n = epoll_wait(ep->epfd, evs, MRC_MAX_PLANES + 2, 0);
    return n > 0 ? engine_events(ep, evs, n) : 0;
}

/* Sleeps in epoll until a socket, the eventfd, netlink or the next timer
 * (none: no limit) wakes the loop; while quiet, on the eventfd and netlink
 * only, until the quiet ends or a delayed ACK is due. Returns the readable
 * plane sockets, or UINT32_MAX when it did not sleep or does not know (the
 * caller asks engine_ready). */
static uint32_t engine_sleep(mrc_ep *ep, uint64_t now)
{
    struct epoll_event evs[MRC_MAX_PLANES + 2];
    uint64_t due = ep->next_timer_ns < ep->ack_due_ns ? ep->next_timer_ns : ep->ack_due_ns;
    if (engine_unsent(ep) && due > now + MRC_TIMER_NS)
        due = now + MRC_TIMER_NS;
    /* Quiet (mrc_ep_progress_end): the callers' passes run the timers too. */
    uint64_t quiet = atomic_load_explicit(&ep->quiet_until_ns, memory_order_relaxed);
    if (now < quiet) /* delayed ACKs still go out in time: a peer may wait on them */
        due = quiet < ep->ack_due_ns ? quiet : ep->ack_due_ns;
    pthread_mutex_lock(&ep->lock);
    bool idle = !ep->subq_head && !ep->ctlq_head && !ep->stopping;
    ep->sleeping = idle;
    ep->sleep_due = due; /* a caller's passes that need it sooner wake us */
    ep->sleep_quiet = now < quiet;
    pthread_mutex_unlock(&ep->lock);
    if (!idle)
        return UINT32_MAX;
    /* Callers may run passes while we sleep (mrc_ep_progress). */
    pthread_mutex_unlock(&ep->turn_lock);
    /* Busy-poll (mrc_ep_busy_poll): look without sleeping, yielding between
     * looks, so a post (the eventfd) or an arrival is seen without a wake-up. */
    int n = 0;
    uint64_t looks = 0;
    uint64_t poll_until = atomic_load_explicit(&ep->poll_until_ns, memory_order_relaxed);
    while (now < poll_until && now < due) {
        n = epoll_wait(ep->epfd, evs, MRC_MAX_PLANES + 2, 0);
        looks++;
        if (n)
            break;
        sched_yield();
        now = now_ns();
    }
    uint64_t wait = due > now ? due - now : 0;
    struct timespec ts = {.tv_sec = (time_t)(wait / 1000000000ull),
                          .tv_nsec = (long)(wait % 1000000000ull)};
    /* Quiet (mrc_ep_progress_end): the sockets are the callers' for now (an
     * arrival waits for the next call's passes, not for a wake-up here). */
    bool quiet_sleep = !n && now < quiet, nl = false;
    if (quiet_sleep) {
        struct pollfd pf[2] = {{.fd = ep->evfd, .events = POLLIN},
                               {.fd = ep->nl_fd, .events = POLLIN}};
        if (ppoll(pf, ep->nl_fd >= 0 ? 2 : 1, &ts, NULL) > 0) {
            uint64_t v;
            if (pf[0].revents && read(ep->evfd, &v, sizeof(v)) < 0) {
            }
            nl = ep->nl_fd >= 0 && pf[1].revents;
        }
    } else if (!n) {
        n = epoll_pwait2(ep->epfd, evs, MRC_MAX_PLANES + 2, due == UINT64_MAX ? NULL : &ts,
                         NULL);
    }
    pthread_mutex_lock(&ep->lock);
    ep->sleeping = false;
    pthread_mutex_unlock(&ep->lock);
    pthread_mutex_lock(&ep->turn_lock); /* a caller holding the progress: until it ends */
    ep->st.busy_polls += looks;
    if (quiet_sleep) {
        ep->nl_ready |= nl;
        return UINT32_MAX; /* the sockets: ask */
    }
    uint32_t ready = n > 0 ? engine_events(ep, evs, n) : 0;
    return ep->nplanes <= 1 ? 1u : ready;
}

/* One pass: takes posted work, receives, acknowledges, runs timers,
 * transmits and publishes completions; `ready` the plane sockets to read
 * (UINT32_MAX: ask epoll without sleeping). Runs under turn_lock, on the
 * progress thread or on a caller holding the progress (mrc_ep_progress).
 * Returns false when stopping. */
static bool engine_turn(mrc_ep *ep, uint32_t ready)
{
    ep->work = false;
    if (!engine_drain(ep))
        return false;
    if (ready == UINT32_MAX)
        ready = engine_ready(ep);
    for (int i = 0; i < ep->nplanes; i++) {
        if (!(ready & (1u << i)))
            continue;
        /* Bounded bursts per plane: one busy plane cannot starve the
         * others or the transmit side. */
        for (int k = 0; k < 4; k++) {
            int n = sock_recv_pt(ep, i);
            if (n < MRC_BATCH)
                break;
        }
    }
    uint64_t now = now_ns();
    rx_flush_acks_pt(ep, now);
    rx_copy_run_pt(ep); /* staged messages, a slice per pass */
    if (ep->nl_ready) {
        ep->nl_ready = false;
        link_poll_pt(ep);
    }
    if (now >= ep->next_timer_ns) {
        link_poll_pt(ep); /* a busy loop may not sleep to see netlink wake it */
        engine_timers(ep, now);
    }
    /* Only connections with timers can have something to send: data to
     * send means ops queued, retransmissions mean packets in flight. */
    for (mrc_conn *c = ep->timed; c; c = c->next_timed)
        if (tx_run_pt(c))
            ep->work = true;
    sock_flush_all_pt(ep);
    ep_hold_pt(ep, false);
    ep_publish_pt(ep);
    ep->st.loop_iters++;
    return true;
}

void *engine_main(void *arg)
{
    mrc_ep *ep = arg;
    ep->next_timer_ns = UINT64_MAX; /* nothing to time until something is posted */
    ep->ack_due_ns = UINT64_MAX;
    uint32_t ready = UINT32_MAX; /* plane sockets to read: the last epoll's answer */
    pthread_mutex_lock(&ep->turn_lock);
    while (engine_turn(ep, ready))
        ready = ep->work ? UINT32_MAX : engine_sleep(ep, now_ns());
    /* Stopping: every connection fails its pending operations. */
    while (ep->pt_conns)
        conn_del_pt(ep, ep->pt_conns);
    sock_flush_all_pt(ep);
    /* What the kernel still refuses is never sent: give it up, so no
     * pointer into a caller's buffer outlives the completions below. */
    for (int i = 0; i < ep->nsocks; i++) {
        struct txbatch *b = &ep->socks[i]->batch;
        b->retired += (uint64_t)b->n;
        b->n = b->sent = 0;
    }
    ep_hold_pt(ep, true);
    ep_publish_pt(ep);
    ep->pt_exited = true; /* no caller runs a pass from here on */
    pthread_mutex_unlock(&ep->turn_lock);
    pthread_mutex_lock(&ep->lock);
    ep->stopped = true; /* ep_ctl callers may answer now */
    pthread_cond_broadcast(&ep->cv);
    pthread_mutex_unlock(&ep->lock);
    return NULL;
}

/* ---- caller-driven progress (mrc_ep_progress) ----------------------------
 * The progress thread runs its passes under turn_lock and lets go of it only
 * to sleep; a caller holding it runs the passes itself, and the thread, if
 * something wakes it meanwhile, waits on the lock: a short exchange then
 * costs no hand-over between threads at either end (post, completion). */

/* The endpoint whose progress this thread holds: requests to the progress
 * thread made here run here (ep_ctl_here), since it waits for this thread. */
static _Thread_local const mrc_ep *held_here;

bool ep_progress_held_here(const mrc_ep *ep) { return held_here == ep; }

int mrc_ep_progress_begin(mrc_ep *ep)
{
    if (!ep || held_here)
        return MRC_EUSAGE; /* one endpoint per thread, and not twice */
    if (pthread_mutex_trylock(&ep->turn_lock))
        return 0; /* a pass is running on another thread */
    pthread_mutex_lock(&ep->lock);
    bool closing = ep->stopping || ep->pt_exited;
    if (!closing)
        ep->progress_held = true;
    pthread_mutex_unlock(&ep->lock);
    if (closing) {
        pthread_mutex_unlock(&ep->turn_lock);
        return MRC_ECLOSED;
    }
    held_here = ep;
    return 1;
}

int ep_ctl_here(mrc_ep *ep, struct ctl *x)
{
    engine_drain(ep); /* what was posted before it first, as the thread does */
    ep_ctl_run_pt(ep, x);
    ep_hold_pt(ep, false);
    ep_publish_pt(ep);
    ep->work = true;
    return x->rc;
}

int mrc_ep_progress(mrc_ep *ep)
{
    if (!ep || held_here != ep)
        return MRC_EUSAGE;
    ep->st.caller_passes++;
    if (!engine_turn(ep, UINT32_MAX))
        return MRC_ECLOSED; /* the progress thread stops: end now */
    return ep->work ? 1 : 0;
}

void mrc_ep_progress_end(mrc_ep *ep, uint32_t quiet_us)
{
    if (!ep || held_here != ep)
        return;
    held_here = NULL;
    uint64_t now = now_ns();
    atomic_store_explicit(&ep->quiet_until_ns, quiet_us ? now + (uint64_t)quiet_us * 1000u : 0,
                          memory_order_relaxed);
    /* A thread asleep sleeps until what it knew was due. Wake it for work
     * left, for a delayed ACK due sooner (a peer may wait on it), and, when
     * not quiet, for timers due sooner or to end a quiet sleep. */
    uint64_t due = ep->next_timer_ns < ep->ack_due_ns ? ep->next_timer_ns : ep->ack_due_ns;
    bool unsent = engine_unsent(ep);
    pthread_mutex_lock(&ep->lock);
    ep->progress_held = false;
    bool wake = ep->sleeping &&
                (ep->subq_head || ep->ctlq_head || ep->wake_deferred || unsent ||
                 ep->ack_due_ns < ep->sleep_due ||
                 (!quiet_us && (ep->sleep_quiet || due < ep->sleep_due)));
    ep->wake_deferred = false;
    pthread_mutex_unlock(&ep->lock);
    if (wake)
        ep_wake(ep);
    /* Last: once the thread has the lock it may be stopping, and the
     * endpoint gone as soon as it returns (mrc_ep_destroy on another thread). */
    pthread_mutex_unlock(&ep->turn_lock);
}
