/*
 * rx.c - the receive path: validate, demultiplex, place data directly into
 * registered memory, deliver messages in order, generate ACKs.
 *
 * Every check that guards memory happens here, before a byte is copied:
 * the packet is validated (wire.c), the connection id must exist and the
 * source must be one of the peer's planes, the PSN must be inside the
 * receive window, and a WRITE must name a registered key and stay inside the
 * region. Anything else is dropped and counted by reason.
 */
#include "internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static inline bool rx_bit(const mrc_conn *c, uint32_t psn)
{
    uint32_t i = psn & c->wmask;
    return (c->rx_bits[i >> 6] >> (i & 63)) & 1;
}

static inline void rx_bit_set(mrc_conn *c, uint32_t psn, bool v)
{
    uint32_t i = psn & c->wmask;
    if (v)
        c->rx_bits[i >> 6] |= 1ull << (i & 63);
    else
        c->rx_bits[i >> 6] &= ~(1ull << (i & 63));
}

/* The 64 window bits of psn .. psn + 63 (their places wrap at the window). */
static inline uint64_t rx_bits64(const mrc_conn *c, uint32_t psn)
{
    uint32_t i = psn & c->wmask, w = i >> 6, s = i & 63;
    uint64_t lo = c->rx_bits[w] >> s;
    if (!s)
        return lo;
    return lo | c->rx_bits[(w + 1) & (c->wmask >> 6)] << (64 - s);
}

/* The receive window's bits (window / 8 bytes) and a first message table
 * (an attempt to connect before this one may have left another peer's). */
int rx_alloc(mrc_conn *c)
{
    free(c->rx_bits);
    free(c->msgs);
    c->msgs_cap = MRC_MSGS_CAP0;
    c->rx_bits = calloc(c->window / 64, sizeof(uint64_t));
    c->msgs = calloc(c->msgs_cap, sizeof(*c->msgs));
    return c->rx_bits && c->msgs ? 0 : -ENOMEM;
}

static inline struct rx_msg *rx_msg_at(mrc_conn *c, uint32_t msn)
{
    return &c->msgs[msn & (c->msgs_cap - 1)];
}

/* Message msn, msn - rx_deliver_msn < MRC_MSGW, arrived beyond the table:
 * doubled until it fits, every message in progress moved to its new place.
 * Messages in progress lie in [rx_deliver_msn, + msgs_cap) (delivery clears
 * an entry), so no two share a place in the larger table either. */
static int rx_msgs_grow_pt(mrc_conn *c, uint32_t msn)
{
    uint32_t cap = c->msgs_cap;
    while (msn - c->rx_deliver_msn >= cap)
        cap *= 2;
    struct rx_msg *msgs = calloc(cap, sizeof(*msgs));
    if (!msgs)
        return -ENOMEM;
    for (uint32_t i = 0; i < c->msgs_cap; i++)
        if (c->msgs[i].used)
            msgs[c->msgs[i].msn & (cap - 1)] = c->msgs[i];
    free(c->msgs);
    c->msgs = msgs;
    c->msgs_cap = cap;
    return 0;
}

/* An ACK's SACK block: bit i says psn base + i arrived, for the psns from the
 * cumulative ack (base >= rx_cum) up to the end of the window; a word at a
 * time (a bit at a time was the most expensive step of sending an ACK). */
void rx_sack_fill(const mrc_conn *c, uint32_t base, uint64_t sack[MRC_SACK_BITS / 64])
{
    for (uint32_t k = 0; k < MRC_SACK_BITS / 64; k++) {
        uint32_t psn = base + 64 * k;
        /* Bit j counts when 0 <= o + j < window (a place outside that is
         * another psn's). */
        int64_t o = psn_diff(psn, c->rx_cum);
        int64_t lo = o < 0 ? -o : 0, hi = (int64_t)c->window - o;
        hi = hi > 64 ? 64 : hi;
        if (hi <= lo) {
            sack[k] = 0;
            continue;
        }
        uint64_t mask = (hi == 64 ? ~0ull : (1ull << hi) - 1) & ~((1ull << lo) - 1);
        sack[k] = rx_bits64(c, psn) & mask;
    }
}

/* `now`: when the packet arrived, echoed so that the sender can tell its
 * path's one-way delay from the round trip (path.c, congested()). */
static void ack_need(mrc_conn *c, unsigned path, uint32_t psn, uint64_t ts, uint64_t now,
                     bool lazy)
{
    if (!c->ack_need) {
        c->ack_since = now;
        c->ack_lazy = 0;
        c->ack_now = false;
    }
    if (!lazy || ++c->ack_lazy > MRC_ACK_LAZY_PKTS)
        c->ack_now = true;
    c->ack_need |= 1ull << path;
    c->ack_echo_psn[path] = psn;
    c->ack_echo_ts[path] = ts;
    c->ack_echo_rx_ts[path] = now;
    if (!c->in_ackq) {
        c->in_ackq = true;
        c->next_ack = c->ep->ackq;
        c->ep->ackq = c;
    }
}

static void send_nak(mrc_conn *c, unsigned path, uint32_t psn, uint32_t msn, uint32_t code)
{
    struct path *p = path_for_ack_pt(c, (int)path);
    if (!p || sock_batch_full_pt(c->ep, p->sock) || inject_drop(c->ep, p))
        return;
    uint8_t *buf = sock_tx_slot_pt(c->ep, p, MRC_NAK_LEN, NULL, 0);
    struct mrc_hdr *h = (struct mrc_hdr *)buf;
    struct mrc_nak_ext *n = (struct mrc_nak_ext *)(h + 1);
    *h = (struct mrc_hdr){.magic = MRC_MAGIC, .version = MRC_WIRE_VERSION,
                          .type = MRC_PKT_NAK, .path = (uint8_t)path, .conn = c->peer_id,
                          .psn = psn, .ts = now_ns()};
    n->msn = msn;
    n->code = code;
}

static bool tag_match(uint64_t want, uint64_t tag) { return want == MRC_TAG_ANY || want == tag; }

static void recvq_unlink(mrc_conn *c, mrc_op *op)
{
    DL_UNLINK(c->recvq_head, c->recvq_tail, op, prev, next);
}

/* Ends a copy job (or an inline completion): data was staged, and is
 * charged against max_unexpected until it is freed here. Returns 0, or the
 * error that must fail the connection (no memory for an immediate). */
static int job_finish(mrc_conn *c, mrc_op *r, uint8_t *data, uint64_t len, uint64_t tag,
                      bool imm, uint32_t immv)
{
    if (data) {
        free(data);
        c->staged_bytes -= len;
        c->staged_count--;
    }
    if (r) {
        r->res_bytes = len;
        r->res_tag = tag;
        op_complete_pt(c->ep, r, len > r->len ? MRC_ETRUNC : 0);
    }
    /* Room was reserved when its last packet was admitted (imm_queued). */
    return imm ? conn_imm_pt(c, immv, len) : 0; /* on the conn's CQ if bound */
}

static void conn_copy_run(mrc_conn *c, uint64_t *budget);

/* Queues a completion (a RECV, or an immediate: imm) behind the copies in
 * progress on c, or does it now when there are none and the copy is small.
 * data (staged, may be NULL) is owned from here on. Returns nonzero if the
 * connection failed meanwhile (the caller must not touch its state). */
static int complete_in_order(mrc_conn *c, mrc_op *r, uint8_t *data, uint64_t len,
                             uint64_t tag, bool imm, uint32_t immv)
{
    uint64_t n = r ? (len < r->len ? len : r->len) : 0;
    struct copy_job *j = NULL;
    if (c->copy_head || (data && n > MRC_COPY_BUDGET))
        j = malloc(sizeof(*j));
    if (!j) { /* nothing to wait behind, or no memory for the job: now, in order */
        uint64_t all = UINT64_MAX;
        conn_copy_run(c, &all);
        if (c->state != CONN_ACTIVE) {
            free(data);
            return 1;
        }
        if (data && n)
            memcpy(r->mr->addr + r->loff, data, n);
        int rc = job_finish(c, r, data, len, tag, imm, immv);
        if (rc)
            conn_fail_pt(c, rc, rc);
        return rc;
    }
    *j = (struct copy_job){.r = r, .data = data, .len = len, .tag = tag, .imm = imm,
                           .immv = immv};
    if (c->copy_tail)
        c->copy_tail->next = j;
    else
        c->copy_head = j;
    c->copy_tail = j;
    if (!c->in_copyq) {
        c->in_copyq = true;
        c->next_copy = c->ep->copyq;
        c->ep->copyq = c;
    }
    return 0;
}

static void recv_complete(mrc_conn *c, mrc_op *r, uint8_t *data, uint64_t len, uint64_t tag)
{
    complete_in_order(c, r, data, len, tag, false, 0);
}

/* Runs c's jobs in order while *budget bytes of copying remain. */
static void conn_copy_run(mrc_conn *c, uint64_t *budget)
{
    while (c->copy_head) {
        struct copy_job *j = c->copy_head;
        uint64_t n = j->r ? (j->len < j->r->len ? j->len : j->r->len) : 0;
        if (j->data && j->off < n) {
            if (!*budget)
                return;
            uint64_t k = n - j->off < *budget ? n - j->off : *budget;
            memcpy(j->r->mr->addr + j->r->loff + j->off, j->data + j->off, k);
            j->off += k;
            *budget -= k;
            if (j->off < n)
                return;
        }
        c->copy_head = j->next;
        if (!c->copy_head)
            c->copy_tail = NULL;
        int rc = job_finish(c, j->r, j->data, j->len, j->tag, j->imm, j->immv);
        free(j);
        if (rc) {
            conn_fail_pt(c, rc, rc); /* frees the jobs left (rx_release_pt) */
            return;
        }
    }
}

static void copyq_unlink(mrc_ep *ep, mrc_conn *c)
{
    if (!c->in_copyq)
        return;
    for (mrc_conn **pp = &ep->copyq; *pp; pp = &(*pp)->next_copy)
        if (*pp == c) {
            *pp = c->next_copy;
            break;
        }
    c->in_copyq = false;
}

/* Copies at most MRC_COPY_BUDGET bytes out of staging, over the connections
 * that have copies queued (ep->copyq), finishing jobs in order; runs once per
 * progress-loop pass. */
void rx_copy_run_pt(mrc_ep *ep)
{
    uint64_t budget = MRC_COPY_BUDGET;
    for (mrc_conn **pp = &ep->copyq; *pp;) {
        mrc_conn *c = *pp;
        conn_copy_run(c, &budget);
        if (*pp != c)
            continue; /* it failed: rx_release_pt took it off the list */
        if (!c->copy_head) {
            *pp = c->next_copy;
            c->in_copyq = false;
            continue;
        }
        ep->work = true;
        pp = &c->next_copy;
    }
}

/*
 * Matching invariant: no message on the unexpected list matches any posted
 * RECV (a RECV is matched against that list when posted, and a message
 * against the posted RECVs when delivered). So only undelivered messages can
 * change an answer: a SEND may be placed straight into a posted RECV only if
 * matching it now gives the same answer as matching in message order would.
 *
 * Matching in order is simulated: every earlier message must be known (an
 * unknown one could have any tag); each earlier one not yet placed (staged,
 * or refused and still to come) claims, in message order, the first posted
 * RECV its tag matches that no one before it claimed, which is exactly the
 * RECV it will take when delivered (new RECVs go behind, and placing a later
 * message only takes an unclaimed one). This message gets the first
 * unclaimed RECV its tag matches. So a stream of distinct tags, or of one
 * tag into a ring of RECVs, is placed directly even while messages wait.
 */
/* Earlier unplaced messages simulated at most (each costs a walk of the
 * posted RECVs, per packet while refused); beyond, the message is staged. */
#define MRC_BIND_SCAN 16

static bool claimed(mrc_op *r, mrc_op *const *set, int n)
{
    for (int i = 0; i < n; i++)
        if (set[i] == r)
            return true;
    return false;
}

static mrc_op *first_unclaimed(mrc_conn *c, uint64_t tag, mrc_op *const *set, int n)
{
    mrc_op *r = c->recvq_head;
    while (r && (!tag_match(r->tag, tag) || claimed(r, set, n)))
        r = r->next;
    return r;
}

static mrc_op *rx_bind_recv(mrc_conn *c, struct rx_msg *m)
{
    mrc_op *set[MRC_BIND_SCAN];
    int n = 0, unplaced = 0;
    if (!c->recvq_head)
        return NULL;
    for (uint32_t msn = c->rx_deliver_msn; msn != m->msn; msn++) {
        struct rx_msg *e = rx_msg_at(c, msn);
        if (!e->used || e->msn != msn)
            return NULL;
        if (e->type != MRC_PKT_SEND || e->recv)
            continue;
        if (++unplaced > MRC_BIND_SCAN)
            return NULL;
        mrc_op *r = first_unclaimed(c, e->key, set, n);
        if (r) /* else it will take a RECV posted later, or none */
            set[n++] = r;
    }
    mrc_op *r = first_unclaimed(c, m->key, set, n);
    if (!r || r->len < m->msg_len)
        return NULL; /* staged; truncation is reported at delivery */
    recvq_unlink(c, r);
    return r;
}

static void rx_deliver_pt(mrc_conn *c)
{
    for (;;) {
        struct rx_msg *m = rx_msg_at(c, c->rx_deliver_msn);
        if (!m->used || m->msn != c->rx_deliver_msn || !m->have_last ||
            !psn_lt(m->last_psn, c->rx_cum))
            break;
        if (m->type == MRC_PKT_SEND && m->got != m->msg_len) {
            /* Every PSN up to its last arrived, yet its packets do not cover
             * it: the peer lied (one of its PSNs sent as another message's). */
            DROP(c->ep, BAD_MSG);
            conn_fail_pt(c, MRC_EPROTO, MRC_EPROTO);
            return;
        }
        if (m->type == MRC_PKT_WRITE && (m->flags & MRC_F_IMM)) {
            if (complete_in_order(c, NULL, NULL, m->msg_len, 0, true, m->imm))
                return; /* the connection failed: its state is gone */
        } else if (m->type == MRC_PKT_SEND && m->recv) {
            recv_complete(c, m->recv, NULL, m->msg_len, m->key);
        } else if (m->type == MRC_PKT_SEND) {
            c->staging--;
            c->undelivered_bytes -= m->msg_len;
            mrc_op *r = c->recvq_head;
            while (r && !tag_match(r->tag, m->key))
                r = r->next;
            if (r) {
                recvq_unlink(c, r);
                recv_complete(c, r, m->stage, m->msg_len, m->key); /* frees it */
            } else {
                struct staged_msg *s = malloc(sizeof(*s));
                if (!s) { /* a connection error, never abort() the process */
                    free(m->stage);
                    m->stage = NULL;
                    c->staged_bytes -= m->msg_len;
                    c->staged_count--;
                    conn_fail_pt(c, -ENOMEM, -ENOMEM);
                    return;
                }
                *s = (struct staged_msg){.tag = m->key, .len = m->msg_len, .data = m->stage};
                if (c->unexp_tail)
                    c->unexp_tail->next = s;
                else
                    c->unexp_head = s;
                c->unexp_tail = s;
            }
        }
        memset(m, 0, sizeof(*m));
        c->rx_deliver_msn++;
    }
}

void rx_post_recv_pt(mrc_conn *c, mrc_op *op)
{
    /* Room for a SEND this connection refused: the sender may stop backing
     * off now (the RECV below may take a staged message instead, which frees
     * staging room all the same). */
    if (c->rnr_owed) {
        c->rnr_owed = false;
        send_nak(c, c->rnr_owed_path, 0, 0, MRC_NAK_READY);
    }
    struct staged_msg *prev = NULL;
    for (struct staged_msg *s = c->unexp_head; s; prev = s, s = s->next) {
        if (!tag_match(op->tag, s->tag))
            continue;
        if (prev)
            prev->next = s->next;
        else
            c->unexp_head = s->next;
        if (c->unexp_tail == s)
            c->unexp_tail = prev;
        recv_complete(c, op, s->data, s->len, s->tag); /* frees s->data */
        free(s);
        return;
    }
    DL_APPEND(c->recvq_head, c->recvq_tail, op, prev, next);
}

/* The first accepted packet of a message records what every later one must
 * repeat (checked in rx_data_pt). */
static void rx_msg_note(struct rx_msg *m, const struct mrc_hdr *h, const struct mrc_data_ext *d)
{
    if (m->used)
        return;
    m->used = true;
    m->msn = d->msn;
    m->type = h->type;
    m->key = d->key;
    m->msg_len = d->msg_len;
    m->imm = d->imm;
    m->ref_psn = h->psn;
    m->ref_off = d->offset;
}

/* A SEND is cut into packets of the connection's mss in PSN order (tx.c), so
 * each packet's offset follows from its PSN and the message's first accepted
 * packet. Held to that, a message's packets are disjoint, and a delivered
 * message whose bytes add up to msg_len (rx_deliver_pt) has no holes: staging
 * need not be zeroed to keep old heap contents from a peer that lies about
 * offsets. */
static bool rx_send_offset_ok(const mrc_conn *c, const struct rx_msg *m,
                              const struct mrc_hdr *h, const struct mrc_data_ext *d)
{
    if (h->len > c->mss)
        return false;
    if (!m->used)
        return true;
    int64_t step = (int64_t)psn_diff(h->psn, m->ref_psn) * c->mss; /* < 2^47: no overflow */
    return d->offset == m->ref_off + (uint64_t)step;                 /* modulo 2^64 */
}

static void rx_data_pt(mrc_conn *c, const struct mrc_hdr *h, const uint8_t *payload,
                       uint64_t now)
{
    mrc_ep *ep = c->ep;
    const struct mrc_data_ext *d = (const void *)(h + 1);
    int32_t off = psn_diff(h->psn, c->rx_cum);
    if (off < 0 || (off < (int32_t)c->window && rx_bit(c, h->psn))) {
        DROP(ep, DUPLICATE);
        ack_need(c, h->path, h->psn, h->ts, now, false); /* its ACK was lost: send another */
        return;
    }
    if (off >= (int32_t)c->window) {
        DROP(ep, PSN_WINDOW);
        return;
    }
    if (d->msn - c->rx_deliver_msn >= MRC_MSGW) {
        DROP(ep, BAD_MSG);
        return;
    }
    if (d->msn - c->rx_deliver_msn >= c->msgs_cap && rx_msgs_grow_pt(c, d->msn)) {
        DROP(ep, NO_BUFFER); /* no memory for it now: the sender sends it again */
        return;
    }
    struct rx_msg *m = rx_msg_at(c, d->msn);
    if (m->used && (m->msn != d->msn || m->type != h->type || m->msg_len != d->msg_len ||
                    m->key != d->key || m->imm != d->imm)) {
        DROP(ep, BAD_MSG);
        return;
    }
    if (h->type == MRC_PKT_SEND && !rx_send_offset_ok(c, m, h, d)) {
        DROP(ep, BAD_MSG);
        return;
    }
    uint8_t *dst;
    if (h->type == MRC_PKT_WRITE) {
        uint64_t key = d->key;
        mrc_mr *mr = ep->mrs[key & 0xffff];
        if (!mr || mr->key != key || !(mr->access & MRC_ACCESS_REMOTE_WRITE)) {
            DROP(ep, BAD_KEY);
            send_nak(c, h->path, h->psn, d->msn, MRC_NAK_KEY);
            return;
        }
        if (h->len > mr->len || d->offset > mr->len - h->len) {
            DROP(ep, BAD_BOUNDS);
            send_nak(c, h->path, h->psn, d->msn, MRC_NAK_BOUNDS);
            return;
        }
        /* The immediate queue is bounded as staging is: while the application
         * leaves MRC_IMM_MAX immediates untaken, the packet that would
         * complete another is refused as not ready (the message cannot be
         * delivered without it), and the sender backs off. */
        if ((h->flags & (MRC_F_LAST | MRC_F_IMM)) == (MRC_F_LAST | MRC_F_IMM)) {
            uint32_t queued = c->imm_queued - atomic_load(&c->imm_taken);
            if (queued >= MRC_IMM_MAX) {
                DROP(ep, NO_BUFFER);
                send_nak(c, h->path, h->psn, d->msn, MRC_NAK_RNR);
                return;
            }
            c->imm_queued++;
        }
        dst = mr->addr + d->offset;
    } else {
        /* Known from its first packet on, even if refused below: later
         * messages need only its tag to be placed without waiting. */
        rx_msg_note(m, h, d);
        if (!m->recv && !m->stage && !(m->recv = rx_bind_recv(c, m))) {
            /* No RECV to place it in and no room to hold it: tell the sender to
             * back off and try again (RDMA's receiver-not-ready), so that a
             * receiver that stops posting RECVs holds at most max_unexpected
             * bytes of unexpected messages and the sender waits instead of
             * failing. The next message to deliver is measured against the
             * unexpected bytes only: messages that overtook it on other paths
             * (already acknowledged, so they cannot be dropped) must not
             * keep it out, or neither it nor they are ever delivered
             * (test_overtaken_message_is_admitted_when_staging_is_full).
             * Total staging stays below twice max_unexpected. Not zeroed
             * (the memset was 2% of the machine in an all_reduce): a
             * delivered message has no holes (rx_send_offset_ok). */
            /* Each message also costs MRC_STAGE_MSG_COST: 200,000 empty
             * SENDs were all staged (+16 MiB) when only bytes counted. */
            uint64_t max = ep->cfg.max_unexpected;
            uint64_t used = c->staged_bytes + (uint64_t)c->staged_count * MRC_STAGE_MSG_COST;
            if (d->msn == c->rx_deliver_msn)
                used -= c->undelivered_bytes + (uint64_t)c->staging * MRC_STAGE_MSG_COST;
            if (used > max || d->msg_len > max - used || /* no overflow */
                MRC_STAGE_MSG_COST > max - used - d->msg_len ||
                !(m->stage = malloc(d->msg_len ? d->msg_len : 1))) {
                DROP(ep, NO_BUFFER);
                send_nak(c, h->path, h->psn, d->msn, MRC_NAK_RNR);
                c->rnr_owed = true;
                c->rnr_owed_path = h->path;
                return;
            }
            c->staged_bytes += d->msg_len;
            c->staged_count++;
            c->undelivered_bytes += d->msg_len;
            ep->st.staged_msgs++;
            c->staging++;
        }
        dst = (m->recv ? m->recv->mr->addr + m->recv->loff : m->stage) + d->offset;
    }
    rx_msg_note(m, h, d);
    m->flags |= h->flags & MRC_F_IMM;
    memcpy(dst, payload, h->len);
    m->got += h->len;
    if (h->flags & MRC_F_LAST) {
        m->have_last = true;
        m->last_psn = h->psn;
    }
    rx_bit_set(c, h->psn, true);
    while (rx_bit(c, c->rx_cum)) {
        rx_bit_set(c, c->rx_cum, false);
        c->rx_cum++;
    }
    /* Held only while nothing is missing below it: a hole's SACK goes now. */
    ack_need(c, h->path, h->psn, h->ts, now,
             (h->flags & MRC_F_LAZY) && psn_lt(h->psn, c->rx_cum));
    rx_deliver_pt(c);
}

static mrc_conn *rx_conn(mrc_ep *ep, const struct mrc_hdr *h, const struct sockaddr_storage *from)
{
    mrc_conn *c = ep->conns[h->conn & 0xffff];
    if (!c || c->id != h->conn) {
        DROP(ep, UNKNOWN_CONN);
        return NULL;
    }
    if (c->state != CONN_ACTIVE) {
        DROP(ep, CLOSED_CONN);
        return NULL;
    }
    for (int i = 0; i < c->npeer_planes; i++)
        if (addr_same_host(from, &c->peer_planes[i]))
            return c;
    DROP(ep, BAD_PEER);
    return NULL;
}

void rx_packet_pt(mrc_ep *ep, int plane, const struct sockaddr_storage *from, uint8_t *buf,
                  size_t len, uint64_t now)
{
    if (unlikely(ep->planes[plane].down)) {
        DROP(ep, INJECTED);
        return;
    }
    int bad = mrc_pkt_validate(buf, len, ep->cfg.mss);
    if (unlikely(bad)) {
        ep->st.drops[bad]++;
        return;
    }
    const struct mrc_hdr *h = (const struct mrc_hdr *)buf;
    mrc_conn *c = rx_conn(ep, h, from);
    if (!c)
        return;
    struct path *p = conn_path(c, h->path);
    if (unlikely(!p)) {
        DROP(ep, BAD_PATH);
        return;
    }
    if (unlikely(!atomic_load_explicit(&c->rx_seen, memory_order_relaxed)))
        atomic_store_explicit(&c->rx_seen, true, memory_order_release);
    /* Bytes are payload bytes: an ACK's further echoes are not. */
    uint32_t payload = h->type == MRC_PKT_WRITE || h->type == MRC_PKT_SEND ? h->len : 0;
    ep->st.rx_pkts++;
    ep->st.rx_bytes += payload;
    p->rx_pkts++;
    p->rx_bytes += payload;
    switch (h->type) {
    case MRC_PKT_WRITE:
    case MRC_PKT_SEND:
        if (h->flags & MRC_F_ACKS) {
            /* The ACK it carries first, as if it had come alone: what it
             * acknowledges may free what this packet's delivery needs. */
            const struct mrc_hdr *a = (const struct mrc_hdr *)(buf + MRC_DATA_HDR_LEN);
            struct path *q = conn_path(c, a->path);
            if (q)
                tx_on_ack_pt(c, q, a, (const struct mrc_ack_ext *)(a + 1), now);
            else
                DROP(ep, BAD_ACK);
            if (c->state != CONN_ACTIVE)
                return;
        }
        rx_data_pt(c, h, buf + mrc_data_hdr_len(h), now);
        break;
    case MRC_PKT_ACK:
        tx_on_ack_pt(c, p, h, (const struct mrc_ack_ext *)(h + 1), now);
        break;
    case MRC_PKT_NAK:
        tx_on_nak_pt(c, p, h, (const struct mrc_nak_ext *)(h + 1));
        break;
    case MRC_PKT_PROBE:
        path_send_ctrl_pt(c, path_for_ack_pt(c, h->path), h->path, MRC_PKT_PROBE_ACK, 0, h->psn,
                          h->ts);
        path_probe_soon_pt(c, p); /* it came in on p: p may work again */
        break;
    case MRC_PKT_PROBE_ACK:
        path_on_probe_ack_pt(c, p, h->ts, now);
        break;
    case MRC_PKT_CLOSE:
        /* The peer's next PSN: every PSN below it was sent, and it never has
         * more than a window unacknowledged, so it lies in [rx_cum, rx_cum +
         * window]. Anything else is forged (was: any CLOSE with the right
         * connection id closed the connection). */
        if (unlikely((uint32_t)psn_diff(h->psn, c->rx_cum) > c->window)) {
            DROP(ep, PSN_WINDOW);
            break;
        }
        if (h->flags & MRC_F_CUM)
            tx_on_close_cum_pt(c, (uint32_t)h->ts, now);
        conn_fail_pt(c, MRC_ECLOSED, MRC_ECLOSED);
        break;
    }
}

/* The socket an ACK answering the paths in `ids` leaves on: the mirror of
 * one of them, taken in turn so that ACKs spread over the reverse paths and
 * one dead reverse direction costs only some of them, skipping mirrors this
 * side knows are not good; failing that, any live path. */
static struct path *ack_path(mrc_conn *c, const unsigned *ids, unsigned n)
{
    unsigned turn = c->ack_turn++;
    for (unsigned k = 0; k < n; k++) {
        struct path *p = conn_path(c, ids[(turn + k) % n]);
        if (p && p->state == MRC_PATH_GOOD && !sock_batch_full_pt(c->ep, p->sock))
            return p;
    }
    struct path *p = path_for_ack_pt(c, (int)ids[turn % n]);
    return p && !sock_batch_full_pt(c->ep, p->sock) ? p : NULL;
}

/* The echoes of one ACK, taken from `need` (path bits): at most
 * 1 + MRC_ACK_ECHO_MAX, whose packets all lie in one SACK block; the rest are
 * returned for another ACK. *base: where that block starts. */
static unsigned ack_group(const mrc_conn *c, uint64_t need, unsigned *ids, uint64_t *rest,
                          uint32_t *base)
{
    unsigned n = 0;
    uint32_t near = 0, far = 0; /* echoes beyond the cumulative ack */
    bool beyond = false;
    *rest = 0;
    while (need) {
        unsigned id = (unsigned)__builtin_ctzll(need);
        need &= need - 1;
        uint32_t psn = c->ack_echo_psn[id];
        if (n == 1 + MRC_ACK_ECHO_MAX) {
            *rest |= 1ull << id;
            continue;
        }
        if (psn_diff(psn, c->rx_cum) >= 0) {
            uint32_t hi = beyond && psn_lt(psn, far) ? far : psn;
            uint32_t lo = beyond && psn_lt(near, psn) ? near : psn;
            if (psn_diff(hi, c->rx_cum) >= MRC_SACK_BITS && psn_diff(hi, lo) >= MRC_SACK_BITS) {
                *rest |= 1ull << id; /* outside this ACK's block */
                continue;
            }
            far = hi;
            near = lo;
            beyond = true;
        }
        ids[n++] = id;
    }
    /* The SACK block starts at the cumulative ack, or ends at the furthest
     * echoed psn when that lies further out (then every echo is still inside
     * it: grouped so above). */
    *base = c->rx_cum;
    if (beyond && psn_diff(far, *base) >= MRC_SACK_BITS)
        *base = far - (MRC_SACK_BITS - 1);
    return n;
}

/* Writes the ACK echoing ids[0..n) to buf; returns its length. */
static size_t ack_write(const mrc_conn *c, uint8_t *buf, const unsigned *ids, unsigned n,
                        uint32_t base)
{
    struct mrc_hdr *h = (struct mrc_hdr *)buf;
    struct mrc_ack_ext *a = (struct mrc_ack_ext *)(h + 1);
    struct mrc_ack_echo *e = (struct mrc_ack_echo *)(a + 1);
    *h = (struct mrc_hdr){.magic = MRC_MAGIC, .version = MRC_WIRE_VERSION,
                          .type = MRC_PKT_ACK, .path = (uint8_t)ids[0],
                          .len = (uint16_t)((n - 1) * sizeof(*e)),
                          .conn = c->peer_id, .psn = c->rx_cum,
                          .ts = c->ack_echo_ts[ids[0]]};
    for (unsigned k = 1; k < n; k++)
        e[k - 1] = (struct mrc_ack_echo){.path = (uint8_t)ids[k],
                                         .psn = c->ack_echo_psn[ids[k]],
                                         .ts = c->ack_echo_ts[ids[k]],
                                         .rx_ts = c->ack_echo_rx_ts[ids[k]]};
    a->sack_base = base;
    a->echo_psn = c->ack_echo_psn[ids[0]];
    a->echo_rx_ts = c->ack_echo_rx_ts[ids[0]];
    rx_sack_fill(c, base, a->sack);
    return MRC_ACK_LEN + (n - 1) * sizeof(*e);
}

size_t rx_ack_carry_pt(mrc_conn *c, uint8_t *out)
{
    unsigned ids[1 + MRC_ACK_ECHO_MAX];
    uint64_t rest;
    uint32_t base;
    if (!c->ack_need)
        return 0;
    unsigned n = ack_group(c, c->ack_need, ids, &rest, &base);
    if (rest)
        return 0; /* takes more than one ACK: rx_flush_acks_pt sends them */
    c->ack_need = 0; /* it stays in ackq until the next flush passes it over */
    c->ep->st.acks_carried++;
    return ack_write(c, out, ids, n, base);
}

/* One ACK per connection that received data in the last pass: the SACK
 * block, and for each path the echo of the latest packet it delivered, whose
 * send time gives the sender that path's delay. Was one ACK per (connection,
 * path): on the 4-plane fabric 2.7 ACKs per connection and pass, a third of
 * the datagrams the fabric forwarded for a collective. More than one ACK when
 * over 1 + MRC_ACK_ECHO_MAX paths delivered, or when the echoed packets lie
 * further apart than one SACK block spans: every echoed packet must be in its
 * ACK's block, or a packet echoed but never reported would time out.
 *
 * An ACK owed only for LAZY packets waits (until MRC_ACK_DELAY_NS after the
 * first) for DATA of this connection to carry it (tx.c, rx_ack_carry_pt):
 * for back-to-back small collectives that is the next call's data, and one
 * datagram in two the fabric forwarded was such an ACK. */
void rx_flush_acks_pt(mrc_ep *ep, uint64_t now)
{
    ep->ack_due_ns = UINT64_MAX;
    for (mrc_conn **pp = &ep->ackq; *pp;) {
        mrc_conn *c = *pp;
        if (c->ack_need && !c->ack_now && now - c->ack_since < MRC_ACK_DELAY_NS) {
            uint64_t due = c->ack_since + MRC_ACK_DELAY_NS;
            if (due < ep->ack_due_ns)
                ep->ack_due_ns = due;
            pp = &c->next_ack;
            continue;
        }
        *pp = c->next_ack;
        c->in_ackq = false;
        uint64_t need = c->ack_need;
        c->ack_need = 0;
        while (need) {
            unsigned ids[1 + MRC_ACK_ECHO_MAX];
            uint32_t base;
            unsigned n = ack_group(c, need, ids, &need, &base);
            struct path *p = ack_path(c, ids, n);
            if (!p)
                continue;
            ep->st.acks_tx++;
            if (inject_drop(ep, p)) {
                p->injected++;
                continue;
            }
            uint8_t *buf = sock_tx_slot_pt(ep, p, MRC_ACK_LEN + (n - 1) * sizeof(struct mrc_ack_echo),
                                           NULL, 0);
            ack_write(c, buf, ids, n, base);
        }
    }
}

/* Frees receive state; posted RECVs fail with the connection's error. */
void rx_release_pt(mrc_conn *c, int err)
{
    err = err ? err : MRC_ECLOSED;
    while (c->copy_head) {
        struct copy_job *j = c->copy_head;
        c->copy_head = j->next;
        if (j->r)
            op_complete_pt(c->ep, j->r, err);
        free(j->data);
        free(j);
    }
    c->copy_tail = NULL;
    copyq_unlink(c->ep, c);
    while (c->recvq_head) {
        mrc_op *op = c->recvq_head;
        recvq_unlink(c, op);
        op_complete_pt(c->ep, op, err);
    }
    if (c->msgs) {
        for (uint32_t i = 0; i < c->msgs_cap; i++) {
            struct rx_msg *m = &c->msgs[i];
            if (m->recv)
                op_complete_pt(c->ep, m->recv, err);
            free(m->stage);
            memset(m, 0, sizeof(*m));
        }
    }
    while (c->unexp_head) {
        struct staged_msg *s = c->unexp_head;
        c->unexp_head = s->next;
        free(s->data);
        free(s);
    }
    c->unexp_tail = NULL;
    c->staged_bytes = 0;
    c->staged_count = 0;
    c->undelivered_bytes = 0;
    c->staging = 0;
}
