/* conn.c - the connection object's life: created and given paths by the API,
 * added to the datapath by the progress thread, failed, closed (the peer told),
 * removed and freed. Set-up itself (the hello exchange) is handshake.c. */
#include "internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Id and initial PSN of a connection not yet in the datapath. */
void conn_new_id(mrc_conn *c)
{
    /* 16 random bits above the slot: stale or guessed ids rarely match. */
    c->id = (uint32_t)((rand_u64() & 0xffff) << 16) | c->slot;
    c->next_psn = (uint32_t)rand_u64();
    c->una = c->highest_acked = c->next_psn;
    c->highest_acked--;
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
    conn_new_id(c);
    c->hs_fd = -1;
    snprintf(c->name, sizeof(c->name), "%s", name ? name : "");
    for (int i = 0; i < MRC_MAX_PATHS; i++)
        c->path_index[i] = -1;
    *out = c;
    return 0;
}

int mrc_conn_set_name(mrc_conn *c, const char *name)
{
    /* Read by the hello, which mrc_conn_establish sends: no later. The
     * progress thread writes the state, under the lock. */
    pthread_mutex_lock(&c->ep->lock);
    int state = c->state;
    pthread_mutex_unlock(&c->ep->lock);
    if (state != CONN_NEW)
        return MRC_EUSAGE;
    snprintf(c->name, sizeof(c->name), "%s", name ? name : "");
    return 0;
}

int mrc_conn_add_path(mrc_conn *c, const struct mrc_path_spec *s)
{
    if (c->state != CONN_NEW || c->npaths >= MRC_MAX_PATHS || s->id < 0 ||
        s->id >= MRC_MAX_PATHS || c->path_index[s->id] >= 0 || s->plane < 0 ||
        s->plane >= c->ep->nplanes || s->nsegs < 0 || s->nsegs > MRC_MAX_SEGS)
        return MRC_EUSAGE;
    if (c->npaths == c->paths_cap) { /* new: nothing else holds a path yet */
        int cap = c->paths_cap ? 2 * c->paths_cap : 4;
        struct path *paths = realloc(c->paths, (size_t)cap * sizeof(*paths));
        if (!paths)
            return -ENOMEM;
        c->paths = paths;
        c->paths_cap = cap;
    }
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

const char *mrc_conn_peer_name(const mrc_conn *c) { return c->peer_name; }

uint64_t conn_bytes(const mrc_conn *c)
{
    uint64_t n = sizeof(*c) + (uint64_t)c->paths_cap * sizeof(*c->paths);
    if (c->tx)
        n += (uint64_t)c->tx_cap * (sizeof(*c->tx) + sizeof(*c->rtxq));
    if (c->rx_bits)
        n += c->window / 8;
    if (c->msgs)
        n += (uint64_t)c->msgs_cap * sizeof(*c->msgs);
    return n;
}

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
    free(c->paths);
    pthread_mutex_lock(&ep->lock);
    cq_conn_unbind_locked(c);
    ep->conn_free[ep->nconn_free++] = c->slot;
    DL_UNLINK(ep->own_conns, ep->own_conns_tail, c, own_prev, own_next);
    pthread_mutex_unlock(&ep->lock);
    free(c);
}

static void timed_unlink(mrc_ep *ep, mrc_conn *c)
{
    if (!c->timed)
        return;
    for (mrc_conn **pp = &ep->timed; *pp; pp = &(*pp)->next_timed)
        if (*pp == c) {
            *pp = c->next_timed;
            break;
        }
    c->timed = false;
}

/* c has a timer to run (ops posted, a path to probe): the loop ticks again
 * within MRC_TIMER_NS, also when c is on ep->timed already with its timers
 * due later (a SEND posted on a connection that only waited for RECVs needs
 * its RTO scans now). Only connections on ep->timed are ever scanned. */
void conn_arm_timer_pt(mrc_conn *c)
{
    mrc_ep *ep = c->ep;
    if (!c->active_listed)
        return;
    if (!c->timed) {
        c->timed = true;
        c->next_timed = ep->timed;
        ep->timed = c;
    }
    uint64_t due = now_ns() + MRC_TIMER_NS;
    if (due < ep->next_timer_ns)
        ep->next_timer_ns = due;
}

static void active_unlink(mrc_ep *ep, mrc_conn *c)
{
    timed_unlink(ep, c);
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
 * carries our cumulative receive PSN (in ts, MRC_F_CUM): what we received is
 * acknowledged by it, since the ACK that said so may arrive after the CLOSE on
 * another path (a SEND whose RECV completed here would otherwise fail at the
 * peer). And it carries our next PSN: the peer accepts a CLOSE only if that
 * PSN lies in its receive window (rx.c), so a blind forger must guess it as well as the
 * connection id (RFC 5961 does the same for TCP RST). */
static void conn_send_close_pt(mrc_conn *c)
{
    c->closing_sent = true;
    for (int i = 0; i < c->npaths; i++)
        if (c->paths[i].state != MRC_PATH_FAILED)
            path_send_ctrl_pt(c, &c->paths[i], c->paths[i].id, MRC_PKT_CLOSE, MRC_F_CUM,
                              c->next_psn, c->rx_cum);
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
    /* op_err is passed, not parked in c->error: API threads read c->error
     * under the lock at any time (was: written here without it). */
    tx_release_pt(c, op_err);
    rx_release_pt(c, op_err);
    active_unlink(ep, c);
}

void conn_add_pt(mrc_ep *ep, struct ctl *x)
{
    mrc_conn *c = x->arg;
    /* Twice on the active list is a cycle every walk of it spins in. */
    if (c->active_listed || ep->conns[c->slot]) {
        x->rc = MRC_EUSAGE;
        return;
    }
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
    DL_APPEND(ep->pt_conns, ep->pt_conns_tail, c, pt_prev, pt_next);
    c->next_active = ep->active;
    ep->active = c;
    c->active_listed = true;
    pthread_mutex_lock(&ep->lock);
    c->state = CONN_ACTIVE;
    pthread_mutex_unlock(&ep->lock);
    x->rc = 0;
}

void conn_del_pt(mrc_ep *ep, mrc_conn *c)
{
    if (c->state == CONN_ACTIVE) {
        conn_send_close_pt(c);
        conn_fail_pt(c, MRC_ECLOSED, MRC_ECLOSED);
    }
    active_unlink(ep, c);
    if (ep->conns[c->slot] == c) {
        ep->conns[c->slot] = NULL;
        DL_UNLINK(ep->pt_conns, ep->pt_conns_tail, c, pt_prev, pt_next);
    }
    pthread_mutex_lock(&ep->lock);
    c->state = CONN_CLOSED;
    pthread_mutex_unlock(&ep->lock);
}
