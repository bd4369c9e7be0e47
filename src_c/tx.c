/*
 * tx.c - the sender: segmentation into packets, spraying over paths, SACK
 * processing, loss detection and retransmission on another path.
 *
 * Every packet of a connection takes the next connection-wide PSN and is
 * remembered in the tx ring (psn % tx_cap) until acknowledged. Payload is not
 * copied: a retransmission reads the caller's region again, which is why an
 * operation's local buffer must stay untouched until it completes (as with
 * RDMA verbs).
 */
#include "internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static inline struct tx_pkt *tx_slot(mrc_conn *c, uint32_t psn)
{
    return &c->tx[psn & c->tx_mask];
}

/* The connection's first tx ring and retransmit queue (an attempt to
 * connect before this one may have left another peer's). */
int tx_alloc(mrc_conn *c)
{
    free(c->tx);
    free(c->rtxq);
    c->tx_cap = c->window < MRC_TX_CAP0 ? c->window : MRC_TX_CAP0;
    c->tx_mask = c->tx_cap - 1;
    c->tx = calloc(c->tx_cap, sizeof(*c->tx));
    c->rtxq = calloc(c->tx_cap, sizeof(*c->rtxq));
    return c->tx && c->rtxq ? 0 : -ENOMEM;
}

/* Packets in flight fill the ring and the window allows more: twice the
 * room, each packet moved to its new slot, the queue to the front of its
 * new ring. Fails only for want of memory, and then the connection goes on
 * within the ring it has. */
static int tx_grow_pt(mrc_conn *c)
{
    uint32_t cap = c->tx_cap * 2, mask = cap - 1;
    struct tx_pkt *tx = calloc(cap, sizeof(*tx));
    uint32_t *rtxq = calloc(cap, sizeof(*rtxq));
    if (!tx || !rtxq) {
        free(tx);
        free(rtxq);
        return -ENOMEM;
    }
    for (uint32_t psn = c->una; psn != c->next_psn; psn++)
        tx[psn & mask] = *tx_slot(c, psn);
    for (uint32_t k = 0; k < c->rtx_count; k++)
        rtxq[k] = c->rtxq[(c->rtx_head + k) & c->tx_mask];
    free(c->tx);
    free(c->rtxq);
    c->tx = tx;
    c->rtxq = rtxq;
    c->tx_cap = cap;
    c->tx_mask = mask;
    c->rtx_head = 0;
    return 0;
}

void tx_post_pt(mrc_conn *c, mrc_op *op)
{
    op->msn = c->next_msn++;
    if (!c->txops_head) /* the connection was idle: the no-progress clock starts now */
        c->last_progress_ns = now_ns();
    DL_APPEND(c->txops_head, c->txops_tail, op, prev, next);
    if (!c->seg_op)
        c->seg_op = op;
}

static void txops_unlink(mrc_conn *c, mrc_op *op)
{
    DL_UNLINK(c->txops_head, c->txops_tail, op, prev, next);
}

/* Puts packet t on the wire on path p (or loses it to fault injection). */
static void tx_emit_pt(mrc_conn *c, struct tx_pkt *t, struct path *p, uint64_t now)
{
    mrc_ep *ep = c->ep;
    mrc_op *op = t->op;
    t->path = (uint8_t)p->id;
    t->sent_ns = now;
    p->inflight += t->len + MRC_PKT_OVERHEAD;
    p->tx_pkts++;
    p->tx_bytes += t->len;
    p->last_tx_ns = now;
    ep->st.tx_pkts++;
    ep->st.tx_bytes += t->len;
    if (inject_drop(ep, p)) {
        p->injected++;
        ep->st.drops[MRC_DROP_INJECTED]++;
        return;
    }
    /* An ACK this connection owes rides along when the datagram stays within
     * the largest one (mss of payload): one datagram fewer each way. A full
     * datagram cannot take it: a LAZY one that waited for this data goes
     * alone at the next flush, not at its delay (a back-to-back loop of
     * 8 KiB all_reduces, one full datagram each way, ran at that delay's
     * pace: 280 us a call at 2 ranks against 40 us for 12 KiB). */
    uint8_t ack[MRC_ACK_MAX_LEN];
    size_t acklen = 0;
    if (c->ack_need && t->len + MRC_ACK_MAX_LEN <= c->mss)
        acklen = rx_ack_carry_pt(c, ack);
    else if (c->ack_need && !c->ack_now) {
        c->ack_now = true;
        ep->st.acks_no_room++;
    }
    uint8_t *buf = sock_tx_slot_pt(ep, p, MRC_DATA_HDR_LEN + acklen,
                                   op->mr->addr + op->loff + t->off, t->len);
    struct mrc_hdr *h = (struct mrc_hdr *)buf;
    struct mrc_data_ext *d = (struct mrc_data_ext *)(h + 1);
    if (acklen)
        memcpy(buf + MRC_DATA_HDR_LEN, ack, acklen);
    h->magic = MRC_MAGIC;
    h->version = MRC_WIRE_VERSION;
    h->type = op->kind == MRC_OP_WRITE ? MRC_PKT_WRITE : MRC_PKT_SEND;
    h->flags = (uint8_t)(t->flags | (acklen ? MRC_F_ACKS : 0));
    h->path = (uint8_t)p->id;
    h->len = (uint16_t)t->len;
    h->conn = c->peer_id;
    h->psn = t->psn;
    h->ts = now;
    d->msn = op->msn;
    d->imm = op->imm;
    d->key = op->kind == MRC_OP_WRITE ? op->rkey : op->tag;
    d->offset = op->kind == MRC_OP_WRITE ? op->roff + t->off : t->off;
    d->msg_len = op->len;
}

/* The packet at psn if it waits in the queue to go again (not acknowledged
 * since, nor sent again out of turn). */
static struct tx_pkt *tx_waiting(mrc_conn *c, uint32_t psn)
{
    struct tx_pkt *t = tx_slot(c, psn);
    return t->op && t->psn == psn && t->lost && !t->acked ? t : NULL;
}

/* Sends t, which waited, again on p. */
static void tx_resend_pt(mrc_conn *c, struct tx_pkt *t, struct path *p, uint64_t now)
{
    t->lost = 0;
    t->flags &= (uint8_t)~MRC_F_LAZY; /* it was lost once: its ACK may not wait */
    t->ntx++;
    p->retx++;
    c->ep->st.retx++;
    tx_emit_pt(c, t, p, now);
}

static bool tx_retransmit_pt(mrc_conn *c, uint64_t now)
{
    bool sent = false;
    while (c->rtx_count) {
        struct tx_pkt *t = tx_waiting(c, c->rtxq[c->rtx_head]);
        if (!t) {
            c->rtx_head = (c->rtx_head + 1) & c->tx_mask;
            c->rtx_count--;
            continue;
        }
        /* Always another path than the one that lost it, when there is one. */
        struct path *p = path_pick_pt(c, t->len, 0, t->path);
        if (!p || sock_batch_full_pt(c->ep, p->sock))
            break;
        tx_resend_pt(c, t, p, now);
        c->rtx_head = (c->rtx_head + 1) & c->tx_mask;
        c->rtx_count--;
        sent = true;
    }
    return sent;
}

/* Backing off and the wait is over (or the receiver said it is ready): one
 * packet asks whether the receiver takes data again, and the next waits a
 * round. Its ACK ends the back-off and everything follows; a refusal starts
 * the next round. The window sent again every round was the window refused
 * again: 2 MiB a round, seven rounds in the first 127 ms. The packet is the
 * oldest unacknowledged one when it waits to go again: the receiver always
 * admits the next message to deliver (a lost one that others overtook), and
 * a probe from the queue's head could be a refused later one for ever. Its
 * place in the queue is skipped when reached (tx_waiting). */
static bool tx_rnr_probe_pt(mrc_conn *c, uint64_t now)
{
    c->rnr_until = now + c->rnr_backoff;
    struct tx_pkt *t = tx_waiting(c, c->una);
    for (uint32_t k = 0; !t && k < c->rtx_count; k++)
        t = tx_waiting(c, c->rtxq[(c->rtx_head + k) & c->tx_mask]);
    if (!t) { /* nothing refused waits to go again: new data may go */
        c->rnr_backoff = c->rnr_until = 0;
        return false;
    }
    struct path *p = path_pick_pt(c, t->len, 0, -1);
    if (!p || sock_batch_full_pt(c->ep, p->sock)) {
        c->rnr_until = 0; /* try again next pass */
        return false;
    }
    tx_resend_pt(c, t, p, now);
    return true;
}

/* Sends retransmissions, then new packets, while windows allow. */
bool tx_run_pt(mrc_conn *c)
{
    if (!c->rtx_count && !c->seg_op)
        return false;
    uint64_t now = now_ns();
    if (now < c->rnr_until)
        return false; /* the receiver asked us to wait */
    if (c->rnr_backoff) {
        bool probed = tx_rnr_probe_pt(c, now);
        if (c->rnr_backoff)
            return probed;
    }
    bool sent = tx_retransmit_pt(c, now);
    if (c->rtx_count)
        return sent; /* losses first: new data waits behind them */
    while (c->seg_op) {
        mrc_op *op = c->seg_op;
        if ((uint32_t)(c->next_psn - c->una) >= c->tx_cap &&
            (c->tx_cap >= c->window || tx_grow_pt(c)))
            break;
        /* The receiver tracks MRC_MSGW messages; never send beyond them. */
        if (op->msn - c->txops_head->msn >= MRC_MSGW)
            break;
        uint64_t left = op->len - op->seg_off;
        uint32_t len = left < c->mss ? (uint32_t)left : c->mss;
        struct path *p = path_pick_pt(c, len, left, -1);
        if (!p || sock_batch_full_pt(c->ep, p->sock))
            break;
        struct tx_pkt *t = tx_slot(c, c->next_psn);
        bool last = op->seg_off + len == op->len;
        *t = (struct tx_pkt){
            .op = op,
            .off = op->seg_off,
            .len = len,
            .psn = c->next_psn,
            .flags = (uint8_t)((op->seg_off == 0 ? MRC_F_FIRST : 0) | (last ? MRC_F_LAST : 0) |
                               (op->flags & MRC_WRITE_IMM ? MRC_F_IMM : 0) |
                               (op->flags & MRC_POST_LAZY_ACK ? MRC_F_LAZY : 0)),
        };
        c->next_psn++;
        op->seg_off += len;
        op->outstanding++;
        tx_emit_pt(c, t, p, now);
        sent = true;
        if (last) {
            op->seg_done = true;
            c->seg_op = op->next;
        }
    }
    return sent;
}

/* Drops the queue's stale and repeated entries. A packet sent again out of
 * turn (the receiver-not-ready probe) leaves its entry behind, and a refusal
 * of the probe queues it once more: round after round of refusals grew the
 * queue past its ring, which wrote over waiting packets' entries, and those
 * were never sent again (the connection failed at its timeout once the
 * receiver was ready). What waits is at most what is in flight, so after
 * this there is room for one more. */
static void rtxq_compact_pt(mrc_conn *c)
{
    uint32_t n = 0;
    for (uint32_t k = 0; k < c->rtx_count; k++) {
        uint32_t psn = c->rtxq[(c->rtx_head + k) & c->tx_mask];
        struct tx_pkt *t = tx_waiting(c, psn);
        if (!t || t->lost != 1)
            continue;
        t->lost = 2; /* kept: another entry for it is a repeat */
        c->rtxq[(c->rtx_head + n++) & c->tx_mask] = psn;
    }
    for (uint32_t k = 0; k < n; k++)
        tx_slot(c, c->rtxq[(c->rtx_head + k) & c->tx_mask])->lost = 1;
    c->rtx_count = n;
}

/* Queues t for retransmission; `lost`: it counts as lost on its path (a
 * refusal by a receiver that is not ready does not). */
static void tx_requeue_pt(mrc_conn *c, struct tx_pkt *t, bool lost)
{
    struct path *p = conn_path(c, t->path);
    if (p) {
        p->inflight -= t->len + MRC_PKT_OVERHEAD;
        p->lost += lost;
    }
    if (c->rtx_count >= c->tx_cap)
        rtxq_compact_pt(c); /* before t counts as waiting */
    t->lost = 1;
    c->rtxq[(c->rtx_head + c->rtx_count) & c->tx_mask] = t->psn;
    c->rtx_count++;
}

void tx_lose_pt(mrc_conn *c, struct tx_pkt *t) { tx_requeue_pt(c, t, true); }

/* Every unacknowledged packet on p is lost: the path is gone. */
void tx_flush_path_pt(mrc_conn *c, struct path *p)
{
    for (uint32_t psn = c->una; psn != c->next_psn; psn++) {
        struct tx_pkt *t = tx_slot(c, psn);
        if (t->op && !t->acked && !t->lost && t->path == p->id) {
            c->ep->st.lost_flush++;
            tx_lose_pt(c, t);
        }
    }
}

static void tx_ack_one_pt(mrc_conn *c, uint32_t psn, uint64_t now)
{
    struct tx_pkt *t = tx_slot(c, psn);
    if (!t->op || t->psn != psn || t->acked)
        return;
    t->acked = 1;
    c->last_acked_ns = now;
    /* The receiver is ready again once it takes a packet sent since it first
     * refused; a late ACK for an older one says nothing about that. */
    if (c->rnr_backoff && t->sent_ns > c->rnr_since)
        c->rnr_backoff = c->rnr_until = 0;
    c->ep->st.acked_bytes += t->len;
    struct path *p = conn_path(c, t->path);
    if (p) {
        if (!t->lost)
            p->inflight -= t->len + MRC_PKT_OVERHEAD;
        path_on_acked_pt(p, t->len, now);
    }
    if (psn_lt(c->highest_acked, psn))
        c->highest_acked = psn;
    mrc_op *op = t->op;
    if (--op->outstanding == 0 && op->seg_done) {
        txops_unlink(c, op);
        op->res_bytes = op->len;
        op_complete_pt(c->ep, op, 0);
    }
}

/* The peer's CLOSE says it received every PSN below cum: those packets are
 * acknowledged, so operations they complete succeed before the rest fail. */
void tx_on_close_cum_pt(mrc_conn *c, uint32_t cum, uint64_t now)
{
    /* Nothing may be acknowledged that was never sent, nor acked twice. */
    if (psn_diff(cum, c->next_psn) > 0 || psn_diff(cum, c->una) <= 0)
        return;
    for (uint32_t psn = c->una; psn != cum; psn++)
        tx_ack_one_pt(c, psn, now);
    while (c->una != cum && tx_slot(c, c->una)->acked) {
        tx_slot(c, c->una)->op = NULL;
        c->una++;
    }
}

/* What an echo says about its path: the delay of the packet echoed (sent at
 * ts, received at rx_ts of the peer's clock), and that the path delivered
 * everything it carried up to it. A timestamp from the future or from long
 * ago is forged or stale, and not a sample. */
static void tx_on_echo_pt(mrc_conn *c, struct path *p, uint64_t ts, uint64_t rx_ts,
                          uint64_t now)
{
    if (ts > now || now - ts >= 10000000000ull)
        return;
    path_on_rtt_pt(p, now - ts, now);
    path_on_owd_pt(p, (int64_t)(rx_ts - ts), now);
    if (ts > p->delivered_ts)
        p->delivered_ts = ts;
    p->last_rx_ns = now;
    p->consec_loss = 0;
    path_on_delivered_pt(c, p, ts, now);
}

/*
 * An ACK: cumulative psn, a 512-bit SACK block, and the echo of the latest
 * packet the receiver got on path h->path (its send timestamp), then the same
 * for each further path that delivered (wire.h, struct mrc_ack_echo).
 */
void tx_on_ack_pt(mrc_conn *c, struct path *p, const struct mrc_hdr *h,
                  const struct mrc_ack_ext *a, uint64_t now)
{
    mrc_ep *ep = c->ep;
    uint32_t cum = h->psn;
    const struct mrc_ack_echo *e = (const struct mrc_ack_echo *)(a + 1);
    unsigned nextra = h->len / (unsigned)sizeof(*e); /* wire.c bounds it */
    /* Nothing may be acknowledged that was never sent, nor echoed from a
     * path the connection does not have. */
    if (psn_diff(cum, c->next_psn) > 0 || psn_diff(a->echo_psn, c->next_psn) >= 0) {
        DROP(ep, BAD_ACK);
        return;
    }
    for (unsigned k = 0; k < nextra; k++)
        if (psn_diff(e[k].psn, c->next_psn) >= 0 || !conn_path(c, e[k].path)) {
            DROP(ep, BAD_ACK);
            return;
        }
    int32_t base_off = psn_diff(a->sack_base, c->next_psn);
    for (int w = 0; w < MRC_SACK_BITS / 64; w++) {
        uint64_t bits = a->sack[w];
        if (!bits)
            continue;
        int hi = w * 64 + 63 - __builtin_clzll(bits);
        if (base_off + hi >= 0) {
            DROP(ep, BAD_ACK);
            return;
        }
    }
    ep->st.acks_rx++;
    uint32_t una0 = c->una;
    if (psn_diff(cum, c->una) > 0)
        for (uint32_t psn = c->una; psn != cum; psn++)
            tx_ack_one_pt(c, psn, now);
    /* SACK bits below una are old news; above next_psn were rejected. */
    for (int w = 0; w < MRC_SACK_BITS / 64; w++) {
        uint64_t bits = a->sack[w];
        while (bits) {
            int b = __builtin_ctzll(bits);
            bits &= bits - 1;
            uint32_t psn = a->sack_base + (uint32_t)(w * 64 + b);
            if (psn_diff(psn, c->una) >= 0)
                tx_ack_one_pt(c, psn, now);
        }
    }
    while (c->una != c->next_psn && tx_slot(c, c->una)->acked) {
        tx_slot(c, c->una)->op = NULL;
        c->una++;
    }
    if (c->una != una0)
        c->last_progress_ns = now;

    /* The echoed paths, before loss detection reads their delivered_ts. */
    if (p)
        tx_on_echo_pt(c, p, h->ts, a->echo_rx_ts, now);
    for (unsigned k = 0; k < nextra; k++)
        tx_on_echo_pt(c, conn_path(c, e[k].path), e[k].ts, e[k].rx_ts, now);

    /* RACK-style loss detection, per path: a packet is lost when a packet
     * sent after it on the same path has been delivered (paths are FIFO).
     * Only packets this ACK's SACK block speaks for are judged: one below the
     * block may have arrived and been reported elsewhere. */
    uint32_t from = psn_diff(a->sack_base, c->una) > 0 ? a->sack_base : c->una;
    uint32_t to = a->sack_base + MRC_SACK_BITS;
    if (psn_lt(c->highest_acked, to))
        to = c->highest_acked;
    for (uint32_t psn = from; psn_lt(psn, to); psn++) {
        struct tx_pkt *t = tx_slot(c, psn);
        /* t->psn: a forged sack_base can put [from, to) outside [una,
         * next_psn), where slots hold other PSNs that this ACK says nothing
         * about (they were marked lost and their path blamed). */
        if (!t->op || t->psn != psn || t->acked || t->lost)
            continue;
        struct path *q = conn_path(c, t->path);
        if (q && q->delivered_ts > t->sent_ns) {
            c->ep->st.lost_rack++;
            tx_lose_pt(c, t);
            path_on_loss_pt(c, q, false, t->sent_ns, now);
        }
    }
}

/* Receiver not ready: the packet waits to go again. After a back-off that
 * doubles with each round of refusals while the receiver stays full, or as
 * soon as the receiver says it has room (tx_on_ready_pt), one packet asks
 * again (tx_rnr_probe_pt). A round is what was sent
 * before the back-off last doubled: a window of packets refused together
 * answers with a NAK each, and doubling per NAK took the first refusal
 * straight to MRC_RNR_MAX_NS (a receiver 1 ms late with its RECVs delayed a
 * 4 MiB SEND by 64 ms). Not a loss: no path is blamed, and the connection
 * counts as alive (the peer answered). */
static void tx_on_rnr_pt(mrc_conn *c, struct path *p, struct tx_pkt *t, uint64_t now)
{
    c->ep->st.rnr_naks++;
    c->last_progress_ns = now;
    c->rnr_last_ns = now;
    if (!c->rnr_backoff) {
        c->rnr_since = now;
        c->rnr_backoff = MRC_RNR_MIN_NS;
        c->rnr_raised_ns = now;
    } else if (t->sent_ns > c->rnr_raised_ns) {
        c->rnr_backoff *= 2;
        c->rnr_raised_ns = now;
    }
    if (c->rnr_backoff > MRC_RNR_MAX_NS)
        c->rnr_backoff = MRC_RNR_MAX_NS;
    if (c->rnr_until < now + c->rnr_backoff)
        c->rnr_until = now + c->rnr_backoff;
    if (p) { /* the path the answer came back on works */
        p->last_rx_ns = now;
        p->consec_loss = 0;
    }
    if (!t->lost)
        tx_requeue_pt(c, t, false);
}

/* The receiver that refused us has posted a RECV: send again now rather
 * than at the end of the back-off. The back-off stays as it is: if the room
 * is taken before our packets arrive they are refused again and the next
 * round waits twice as long (or until the next READY). */
static void tx_on_ready_pt(mrc_conn *c)
{
    c->ep->st.rnr_ready++;
    if (c->rnr_backoff)
        c->rnr_until = 0;
}

/* The peer refused a packet. Receiver not ready: back off and retry. Bad key
 * or bounds: RDMA's remote access error: the operation fails with the reason
 * and the connection goes to error, as an RC queue pair does; the peer is
 * told with a CLOSE. */
void tx_on_nak_pt(mrc_conn *c, struct path *p, const struct mrc_hdr *h,
                  const struct mrc_nak_ext *n)
{
    if (n->code == MRC_NAK_READY) {
        tx_on_ready_pt(c);
        return;
    }
    struct tx_pkt *t = tx_slot(c, h->psn);
    if (!t->op || t->psn != h->psn || t->acked || t->op->msn != n->msn ||
        (n->code != MRC_NAK_KEY && n->code != MRC_NAK_BOUNDS && n->code != MRC_NAK_RNR)) {
        DROP(c->ep, BAD_ACK);
        return;
    }
    if (n->code == MRC_NAK_RNR) {
        tx_on_rnr_pt(c, p, t, now_ns());
        return;
    }
    mrc_op *op = t->op;
    txops_unlink(c, op);
    if (c->seg_op == op)
        c->seg_op = NULL; /* conn_fail_pt below drops everything else */
    op_complete_pt(c->ep, op, n->code == MRC_NAK_KEY ? MRC_EKEY : MRC_EBOUNDS);
    conn_fail_pt(c, MRC_EREMOTE, MRC_EREMOTE);
}

/* Retransmission timeouts: a packet unacknowledged for its path's RTO, on a
 * path that has been silent as long, is lost, and so, most likely, is the
 * path. (While a path still answers, RACK above finds its losses; a slow
 * answer is not a loss.) */
void tx_timers_pt(mrc_conn *c, uint64_t now)
{
    for (uint32_t psn = c->una; psn != c->next_psn; psn++) {
        struct tx_pkt *t = tx_slot(c, psn);
        if (!t->op || t->acked || t->lost)
            continue;
        struct path *p = conn_path(c, t->path);
        if (!p)
            continue;
        /* Packets sent after this one were acknowledged on other paths: the
         * connection is alive, so this path's silence counts sooner. */
        uint64_t rto = c->last_acked_ns > t->sent_ns ? path_quick_rto(p) : path_rto(p);
        if (now - t->sent_ns < rto || now - p->last_rx_ns < rto)
            continue;
        c->ep->st.lost_rto++;
        tx_lose_pt(c, t);
        /* While the receiver is refusing (RNR since the last new ACK) a
         * silent packet was most likely refused too and its NAK lost, and
         * the paths are quiet because we are backing off: not their fault.
         * Nor when the receiver refused anything after this packet left:
         * it takes the rest of a message it already staged while refusing
         * new ones, and an ACK of that ends the back-off (tx_ack_one_pt)
         * with refused packets still in flight; blaming their paths made
         * healthy paths suspect under load (test_receiver_not_ready_blames_
         * no_path, 1 run in 7 of the full suite). */
        if (!c->rnr_backoff && c->rnr_last_ns < t->sent_ns)
            path_on_loss_pt(c, p, true, t->sent_ns, now);
    }
}

/* Fails every operation still queued for sending (connection going away). */
void tx_release_pt(mrc_conn *c, int err)
{
    err = err ? err : MRC_ECLOSED;
    while (c->txops_head) {
        mrc_op *op = c->txops_head;
        txops_unlink(c, op);
        op_complete_pt(c->ep, op, err);
    }
    c->seg_op = NULL;
    c->rtx_count = 0;
    if (c->tx)
        memset(c->tx, 0, sizeof(*c->tx) * c->tx_cap);
    for (int i = 0; i < c->npaths; i++)
        c->paths[i].inflight = 0;
    c->una = c->next_psn;
}
