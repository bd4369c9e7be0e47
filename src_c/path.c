/*
 * path.c - per-path state: delay, congestion window, and the state machine
 * that takes a path out of service when it loses packets and back in when
 * probes get through.
 *
 *   GOOD --loss without queueing delay--> SUSPECT --probe answered--> GOOD
 *   GOOD/SUSPECT --repeated loss, RTO, lost probe--> FAILED
 *   FAILED --probe answered--> PROBING --MRC_PROBES_TO_GOOD answers--> GOOD
 *   SUSPECT/FAILED from an RTO --a later packet delivered (path_on_delivered_pt)--> GOOD
 *
 * Congestion: a window per path, NSCC-like: grow while the path's delay
 * stays within a target above its base RTT, shrink in proportion to the
 * excess delay, and on loss that comes with queueing. Spraying fills each
 * path only up to its window, so a slow or degraded path carries less.
 */
#include "internal.h"

#include <string.h>

static const char *const path_state_names[] = {"good", "suspect", "failed", "probing"};

const char *mrc_path_state_str(int state)
{
    return state >= 0 && state <= MRC_PATH_PROBING ? path_state_names[state] : "?";
}

#define INIT_CWND_PKTS 32

void path_init(struct path *p, uint32_t mss)
{
    p->state = MRC_PATH_GOOD;
    p->probe_gap_ns = MRC_PROBE_INTERVAL_NS;
    p->cwnd = (uint64_t)INIT_CWND_PKTS * (mss + MRC_PKT_OVERHEAD);
    p->ssthresh = UINT64_MAX;
    p->base_rtt = UINT64_MAX;
    p->base_owd = INT64_MAX;
}

static uint64_t target_delay(const struct path *p)
{
    uint64_t base = p->base_rtt == UINT64_MAX ? 0 : p->base_rtt;
    /* A software datapath's delay is mostly batching and scheduling, not
     * queueing (a veth fabric on two cores shows 1-1.5 ms RTTs with empty
     * queues): allow 2 ms before calling it congestion. That is a few MB at
     * tens of Gbit/s, well inside the socket buffers and tbf's 20 ms. A
     * 0.5 ms floor, to keep queues short for mid-size collectives, was
     * slower at every size (4 ranks on the shaped fabric, interleaved:
     * 1 MiB all_reduce 8.5-8.7 vs 6.5-7.4 ms, 64 MiB 358-393 vs 321-326). */
    return base > 2000000 ? base : 2000000;
}

/*
 * The queueing delay on the way out: the one-way delay above its floor. Not
 * the round trip's: an ACK queues behind the data other flows send out of
 * the receiver's host, and on the 4-host ring (each host sends and receives
 * at line rate) that made a bistable fabric: the flows whose ACKs waited
 * behind a busy uplink saw 3-7 ms round trips with nothing queued ahead of
 * their own data, cut their windows to the floor and stayed there, leaving
 * that uplink idle for the other flows' ACKs (two hops at 0.8-1.7 Gbit/s, two
 * at 3.9, in a third of the runs). Round trip only until a first echo.
 */
static uint64_t queue_delay(const struct path *p)
{
    if (p->base_owd != INT64_MAX)
        return p->last_owd > p->base_owd ? (uint64_t)(p->last_owd - p->base_owd) : 0;
    if (p->base_rtt == UINT64_MAX || p->last_rtt < p->base_rtt)
        return 0;
    return p->last_rtt - p->base_rtt;
}

static bool congested(const struct path *p)
{
    return queue_delay(p) > target_delay(p);
}

uint64_t path_rto(const struct path *p)
{
    if (!p->srtt)
        return 4 * MRC_MIN_RTO_NS;
    uint64_t rto = 2 * p->srtt + 4 * p->rttvar;
    return rto > MRC_MIN_RTO_NS ? rto : MRC_MIN_RTO_NS;
}

/* The timeout for a path that stays silent while the connection's other paths
 * deliver: then silence is not the peer being slow but this path being gone,
 * and waiting out the full RTO floor only stretches the failover gap. */
uint64_t path_quick_rto(const struct path *p)
{
    if (!p->srtt)
        return path_rto(p);
    /* At least 1 ms above srtt (RFC 6298's max(G, 4 rttvar)): batched
     * ACKs make rttvar tiny, and a path whose srtt is 3 ms and rttvar 6 us
     * was declared lost on a 3.1 ms silence. */
    uint64_t var = 4 * p->rttvar;
    return p->srtt + (var > MRC_MIN_QUICK_RTO_NS ? var : MRC_MIN_QUICK_RTO_NS);
}

static int path_class(const struct path *p)
{
    switch (p->state) {
    case MRC_PATH_GOOD: return 0;
    case MRC_PATH_SUSPECT:
    case MRC_PATH_PROBING: return 1;
    default: return 2;
    }
}

/*
 * Next path for a packet of len bytes, round-robin over the best class of
 * paths (good, else suspect/probing) that have window room. avoid >= 0 is the
 * path that lost a retransmitted packet; it is used only when nothing else is.
 *
 * New data (rest > 0: the bytes of its message not yet sent, this packet's
 * included) goes in bursts: a good path keeps the next packets until it has
 * taken c->burst or its window is full, and a path that already has packets
 * in flight starts a burst only once its window has room for a whole one
 * (or half the window, or the rest of the message). Why: the packets of one
 * path in a pass leave as one GSO datagram, which the kernel and every
 * forwarding hop move as one buffer. Sprayed one packet per path in turn,
 * the room an ACK opens (a few packets per path) made data datagrams of
 * 4.3-4.8 packets where 7 fit; on a CPU-bound fabric the per-datagram work
 * is most of the cost (docs/architecture.md, "Batching").
 */
struct path *path_pick_pt(mrc_conn *c, uint32_t len, uint64_t rest, int avoid)
{
    uint64_t need = len + MRC_PKT_OVERHEAD;
    if (c->burst_left > 0 && c->burst_path < c->npaths) {
        struct path *p = &c->paths[c->burst_path];
        if (path_class(p) == 0 && p->id != avoid && p->inflight + need <= p->cwnd) {
            c->burst_left--;
            return p;
        }
        c->burst_left = 0;
    }
    uint64_t burst = (uint64_t)c->burst * need;
    if (burst > rest + MRC_PKT_OVERHEAD)
        burst = rest + MRC_PKT_OVERHEAD;
    for (int cls = 0; cls < 2; cls++) {
        bool any = false;
        struct path *fallback = NULL;
        for (int k = 0; k < c->npaths; k++) {
            int i = (c->rr + k) % c->npaths;
            struct path *p = &c->paths[i];
            if (path_class(p) != cls)
                continue;
            any = true;
            if (p->inflight + need > p->cwnd && p->inflight)
                continue;
            if (rest && p->inflight && p->cwnd - p->inflight < burst &&
                p->cwnd - p->inflight < p->cwnd / 2)
                continue; /* wait for room for a burst */
            if (p->id == avoid) {
                fallback = p;
                continue;
            }
            c->rr = (i + 1) % c->npaths;
            c->burst_path = i;
            c->burst_left = rest ? c->burst - 1 : 0;
            return p;
        }
        if (fallback)
            return fallback;
        if (any)
            return NULL; /* usable paths exist but their windows are full */
    }
    return NULL;
}

/* The path an ACK or probe answer for the peer's path `id` leaves on: its
 * mirror when alive, else any live path. */
struct path *path_for_ack_pt(mrc_conn *c, int id)
{
    struct path *p = conn_path(c, (unsigned)id);
    if (p && p->state != MRC_PATH_FAILED)
        return p;
    struct path *best = NULL;
    for (int i = 0; i < c->npaths; i++) {
        struct path *q = &c->paths[i];
        if (!best || path_class(q) < path_class(best))
            best = q;
    }
    return best && path_class(best) < 2 ? best : (p ? p : best);
}

/* A header-only packet on path p. `id` goes in the path field: p's own id for
 * a PROBE, the echoed id for a PROBE_ACK (which may leave on another path
 * when the mirror is down: the id, not the socket, names what is answered). */
int path_send_ctrl_pt(mrc_conn *c, struct path *p, int id, int type, int flags, uint32_t psn,
                      uint64_t ts)
{
    mrc_ep *ep = c->ep;
    if (!p || sock_batch_full_pt(ep, p->sock))
        return -1;
    if (inject_drop(ep, p)) {
        p->injected++;
        return 0;
    }
    uint8_t *buf = sock_tx_slot_pt(ep, p, MRC_CTRL_LEN, NULL, 0);
    *(struct mrc_hdr *)buf = (struct mrc_hdr){.magic = MRC_MAGIC, .version = MRC_WIRE_VERSION,
                                              .type = (uint8_t)type, .flags = (uint8_t)flags,
                                              .path = (uint8_t)id,
                                              .conn = c->peer_id, .psn = psn, .ts = ts};
    return 0;
}

static void path_probe_pt(mrc_conn *c, struct path *p, uint64_t now)
{
    p->probe_seq++;
    p->probe_sent_ns = now;
    p->probe_out = true;
    p->probes++;
    path_send_ctrl_pt(c, p, p->id, MRC_PKT_PROBE, 0, p->probe_seq, now);
}

void path_set_state_pt(mrc_conn *c, struct path *p, int state, uint64_t now)
{
    if (p->state == state)
        return;
    p->state = state;
    p->state_since = now;
    p->changes++;
    p->probe_ok = 0;
    if (state != MRC_PATH_GOOD)
        conn_arm_timer_pt(c); /* probes to send, a failure to time */
    switch (state) {
    case MRC_PATH_GOOD:
        p->consec_loss = 0;
        p->cwnd = (uint64_t)INIT_CWND_PKTS * (c->mss + MRC_PKT_OVERHEAD);
        p->ssthresh = UINT64_MAX;
        break;
    case MRC_PATH_SUSPECT:
        path_probe_pt(c, p, now);
        break;
    case MRC_PATH_FAILED:
        p->probe_out = false;
        p->probe_gap_ns = MRC_PROBE_INTERVAL_NS;
        tx_flush_path_pt(c, p);
        break;
    default:
        break;
    }
}

/* Evidence that a failed path may work again (a probe came in on it, or its
 * local link came up): probe it at the shortest gap from now on. */
void path_probe_soon_pt(mrc_conn *c, struct path *p)
{
    if (p->state != MRC_PATH_FAILED || p->probe_gap_ns == MRC_PROBE_INTERVAL_NS)
        return;
    p->probe_gap_ns = MRC_PROBE_INTERVAL_NS;
    conn_arm_timer_pt(c);
}

void path_on_rtt_pt(struct path *p, uint64_t rtt, uint64_t now)
{
    p->last_rtt = rtt;
    if (!p->srtt) {
        p->srtt = rtt;
        p->rttvar = rtt / 2;
    } else {
        uint64_t dev = p->srtt > rtt ? p->srtt - rtt : rtt - p->srtt;
        p->rttvar = (3 * p->rttvar + dev) / 4;
        p->srtt = (7 * p->srtt + rtt) / 8;
    }
    /* The base RTT is the minimum over a 10 s window, so a re-routed or
     * re-shaped path finds its new floor. */
    if (rtt < p->base_rtt || now > p->base_rtt_until) {
        p->base_rtt = rtt;
        p->base_rtt_until = now + 10000000000ull;
    }
}

void path_on_owd_pt(struct path *p, int64_t owd, uint64_t now)
{
    p->last_owd = owd;
    /* Its floor over 10 s, as for the base RTT. */
    if (owd < p->base_owd || now > p->base_owd_until) {
        p->base_owd = owd;
        p->base_owd_until = now + 10000000000ull;
    }
}

void path_on_acked_pt(struct path *p, uint64_t bytes, uint64_t now)
{
    uint64_t pkt = bytes + MRC_PKT_OVERHEAD;
    if (!congested(p)) {
        if (p->cwnd < p->ssthresh)
            p->cwnd += pkt;                          /* quick start */
        else
            p->cwnd += pkt * 8192 / (p->cwnd ? p->cwnd : 1) + 1; /* additive */
    } else if (now - p->last_cut_ns > p->srtt) {
        /* Cut in proportion to how far the delay is above target (at most
         * half), once per round trip. */
        uint64_t excess = queue_delay(p) - target_delay(p);
        uint64_t frac = excess * 1024 / (2 * (p->last_rtt > excess ? p->last_rtt : excess));
        if (frac > 512)
            frac = 512;
        p->cwnd -= p->cwnd * frac / 1024;
        p->ssthresh = p->cwnd;
        p->last_cut_ns = now;
    }
    if (p->cwnd < 2 * pkt)
        p->cwnd = 2 * pkt;
}

void path_on_loss_pt(mrc_conn *c, struct path *p, bool timeout, uint64_t sent_ns, uint64_t now)
{
    /* One loss event, one count: packets sent before the last counted loss
     * was detected (a burst in flight when a path stalled, all timing out
     * in one timer scan) are the same evidence again. Counting each of them
     * took a path from good through suspect to failed in one scan and
     * flushed everything in flight on it, on a fabric with no faults. */
    if (sent_ns < p->loss_event_ns)
        return;
    if (!timeout && congested(p)) {
        /* Loss with queueing: congestion, not a broken path. */
        if (now - p->last_cut_ns > p->srtt) {
            p->cwnd = p->cwnd * 7 / 10;
            p->ssthresh = p->cwnd;
            p->last_cut_ns = now;
        }
        return;
    }
    p->loss_event_ns = now;
    p->consec_loss++;
    if (timeout) {
        p->rto_loss_ns = now;
        p->rto_loss_sent_ns = sent_ns;
    }
    if (p->state == MRC_PATH_FAILED)
        return;
    if (p->consec_loss >= MRC_LOSSES_TO_FAIL ||
        (timeout && p->state != MRC_PATH_GOOD)) {
        path_set_state_pt(c, p, MRC_PATH_FAILED, now);
        return;
    }
    /* Suspect: no new data until a probe gets through. What is in flight
     * stays: if the path is dead it times out packet by packet within about
     * a millisecond, and if it was only slow it still arrives. */
    if (p->state == MRC_PATH_GOOD)
        path_set_state_pt(c, p, MRC_PATH_SUSPECT, now);
}

/*
 * What an ACK on p for a packet p carried, sent at ts, says about p's state.
 * A suspect path that delivered a packet sent after it became suspect is good.
 * And after a timeout on p, a packet sent no earlier than the one that timed
 * out, and before the timeout fired, getting through says p was slow, not
 * lossy: a path is FIFO, so the "lost" packet went ahead of it. The state that
 * timeout put p in is undone (suspect or failed: no new data, probes to heal)
 * and the timeout is counted as spurious. A dead path delivers nothing sent
 * after its lost packet, so a real failure never looks like this.
 *
 * On a host whose cores are busy (two cores forwarding four ranks' fabric)
 * scheduling delay is most of the RTT and most timeouts are of this kind
 * (lost_rto with no drop anywhere, as many duplicates at the receivers).
 * Raising the quick-RTO floor to the delay seen was tried: it halved
 * lost_rto and did not make 64 MiB all_reduce faster (A/B within the +-15%
 * noise of that machine; the retransmission on another path sometimes beats
 * the slow original), so the 1 ms floor and its failover gap stay.
 */
void path_on_delivered_pt(mrc_conn *c, struct path *p, uint64_t ts, uint64_t now)
{
    if (p->rto_loss_ns && ts >= p->rto_loss_sent_ns && ts < p->rto_loss_ns) {
        c->ep->st.spurious_rto++;
        if (p->state != MRC_PATH_GOOD && p->state_since == p->rto_loss_ns)
            path_set_state_pt(c, p, MRC_PATH_GOOD, now);
        p->rto_loss_ns = 0; /* one verdict per timeout */
    }
    if (p->state == MRC_PATH_SUSPECT && ts > p->state_since)
        path_set_state_pt(c, p, MRC_PATH_GOOD, now);
}

void path_on_probe_ack_pt(mrc_conn *c, struct path *p, uint64_t ts, uint64_t now)
{
    if (!p->probe_out || ts != p->probe_sent_ns) {
        /* An answer to an older probe (given up on) is late, not hostile;
         * one for a probe never sent is forged. */
        if (ts > p->probe_sent_ns || ts > now)
            DROP(c->ep, BAD_ACK);
        return;
    }
    p->probe_out = false;
    p->last_rx_ns = now;
    path_on_rtt_pt(p, now - ts, now);
    p->consec_loss = 0;
    switch (p->state) {
    case MRC_PATH_SUSPECT:
        path_set_state_pt(c, p, MRC_PATH_GOOD, now);
        break;
    case MRC_PATH_FAILED:
        path_set_state_pt(c, p, MRC_PATH_PROBING, now);
        p->probe_ok = 1;
        break;
    case MRC_PATH_PROBING:
        if (++p->probe_ok >= MRC_PROBES_TO_GOOD)
            path_set_state_pt(c, p, MRC_PATH_GOOD, now);
        break;
    default:
        break;
    }
}

/* Probes: answer overdue -> lost; send the next one when due. `busy`: the
 * connection has operations pending, so idle paths are kept checked. */
void path_timers_pt(mrc_conn *c, uint64_t now, bool busy)
{
    for (int i = 0; i < c->npaths; i++) {
        struct path *p = &c->paths[i];
        uint64_t rto = path_rto(p);
        if (p->probe_out && now - p->probe_sent_ns > 2 * rto) {
            p->probe_out = false;
            c->ep->st.probe_timeouts++;
            p->consec_loss++;
            if (p->state == MRC_PATH_FAILED) /* still dead: back off (MRC_PROBE_GAP_MAX_NS) */
                p->probe_gap_ns = p->probe_gap_ns >= MRC_PROBE_GAP_MAX_NS / 2
                                      ? MRC_PROBE_GAP_MAX_NS
                                      : 2 * p->probe_gap_ns;
            else
                path_set_state_pt(c, p, p->state == MRC_PATH_GOOD ? MRC_PATH_SUSPECT
                                                                   : MRC_PATH_FAILED, now);
        }
        if (p->probe_out)
            continue;
        switch (p->state) {
        case MRC_PATH_SUSPECT:
            path_probe_pt(c, p, now);
            break;
        case MRC_PATH_FAILED:
            if (now - p->probe_sent_ns >= p->probe_gap_ns)
                path_probe_pt(c, p, now);
            break;
        case MRC_PATH_PROBING:
            path_probe_pt(c, p, now); /* back to back: heal fast */
            break;
        default:
            /* One good path per turn: a waiting connection's keepalives cost
             * one probe per MRC_KEEPALIVE_NS, not one per path (256 RECV-waiting
             * connections over 4 planes: 0.6% of a core with every path probed).
             * A dead peer is still found by the first unanswered probe; the
             * other paths of a live one are checked in turn. */
            if (busy && i == c->ka_path % c->npaths && now - p->last_rx_ns > MRC_KEEPALIVE_NS &&
                now - p->probe_sent_ns > MRC_KEEPALIVE_NS &&
                now - c->ka_sent_ns > MRC_KEEPALIVE_NS) {
                path_probe_pt(c, p, now);
                c->ka_path = (i + 1) % c->npaths;
                c->ka_sent_ns = now;
            }
            break;
        }
    }
}
