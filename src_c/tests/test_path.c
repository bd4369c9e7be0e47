/*
 * test_path.c - the path state machine and timeouts (path.c), and what an
 * ACK tells the paths (rx.c builds it, tx.c reads it), driven directly on the
 * progress-thread functions with a bare endpoint whose only plane is down, so
 * probes go nowhere and nothing runs concurrently.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "internal.h"

#define MS 1000000ull
#define US 1000ull

static mrc_ep *ep;
static mrc_conn *c;

static struct path *setup(void)
{
    ep = calloc(1, sizeof(*ep));
    ep->nplanes = 1;
    ep->planes[0].down = true; /* probes are "sent" and dropped */
    ep->nsocks = 1;
    ep->socks[0] = calloc(1, sizeof(*ep->socks[0]));
    c = calloc(1, sizeof(*c));
    c->ep = ep;
    c->mss = 8192;
    c->paths_cap = MRC_MAX_PATHS;
    c->paths = calloc(MRC_MAX_PATHS, sizeof(*c->paths));
    c->npaths = 1;
    for (int i = 0; i < MRC_MAX_PATHS; i++)
        c->path_index[i] = -1;
    c->path_index[0] = 0;
    struct path *p = &c->paths[0];
    path_init(p, c->mss);
    p->id = 0;
    return p;
}

static void teardown(void)
{
    free(ep->socks[0]);
    free(ep);
    free(c->paths);
    free(c);
}

/* A stall: every packet in flight times out in one timer scan. That is one
 * loss event, not one per packet: the path becomes suspect, not failed. */
static void test_one_event_per_stall(void)
{
    struct path *p = setup();
    uint64_t now = 100 * MS;
    for (int i = 0; i < 50; i++) /* sent at 90 ms + i us, all found at 100 ms */
        path_on_loss_pt(c, p, true, 90 * MS + (uint64_t)i * US, now);
    CHECK(p->state == MRC_PATH_SUSPECT);
    CHECK(p->consec_loss == 1);
    /* A packet sent after that loss was seen, and lost too: new evidence. */
    path_on_loss_pt(c, p, true, now + 1 * MS, now + 10 * MS);
    CHECK(p->state == MRC_PATH_FAILED);
    teardown();
}

/* Losses found by RACK count once per event too: three packets of one burst
 * do not fail a path, three separate events do. */
static void test_three_events_fail(void)
{
    struct path *p = setup();
    uint64_t t = 100 * MS;
    path_on_loss_pt(c, p, false, t - 1 * MS, t);
    path_on_loss_pt(c, p, false, t - 1 * MS + 1, t);
    path_on_loss_pt(c, p, false, t - 1 * MS + 2, t);
    CHECK(p->state == MRC_PATH_SUSPECT && p->consec_loss == 1);
    path_set_state_pt(c, p, MRC_PATH_GOOD, t); /* a probe got through */
    path_on_loss_pt(c, p, false, t + 1 * MS, t + 2 * MS);
    path_on_loss_pt(c, p, false, t + 3 * MS, t + 4 * MS);
    CHECK(p->consec_loss == 2);
    path_on_loss_pt(c, p, false, t + 5 * MS, t + 6 * MS);
    CHECK(p->state == MRC_PATH_FAILED);
    teardown();
}

/* The quick RTO leaves at least 1 ms above srtt however small rttvar is
 * (batched ACKs made it 6 us on a 3 ms path: a 3.1 ms silence was a loss). */
static void test_quick_rto_slack(void)
{
    struct path *p = setup();
    p->srtt = 3 * MS;
    p->rttvar = 6 * US;
    CHECK(path_quick_rto(p) >= 4 * MS);
    p->rttvar = 1 * MS; /* a noisy path: 4 rttvar */
    CHECK(path_quick_rto(p) == 7 * MS);
    CHECK(path_rto(p) >= path_quick_rto(p));
    teardown();
}

/* A timeout, then an ACK for a packet sent after the one that timed out and
 * before the timeout: the path was slow. The timeout's state is undone (also
 * a failure it caused) and the timeout counted as spurious, once. */
static void test_spurious_timeout(void)
{
    struct path *p = setup();
    path_on_loss_pt(c, p, true, 95 * MS, 100 * MS);
    CHECK(p->state == MRC_PATH_SUSPECT);
    path_on_delivered_pt(c, p, 96 * MS, 102 * MS);
    CHECK(p->state == MRC_PATH_GOOD);
    CHECK(ep->st.spurious_rto == 1);
    path_on_delivered_pt(c, p, 97 * MS, 103 * MS); /* the same timeout: one verdict */
    CHECK(ep->st.spurious_rto == 1);
    /* Suspect by RACK, failed by a timeout, then the path delivers. */
    path_on_loss_pt(c, p, false, 110 * MS, 111 * MS);
    p->consec_loss = MRC_LOSSES_TO_FAIL - 1;
    path_on_loss_pt(c, p, true, 115 * MS, 120 * MS);
    CHECK(p->state == MRC_PATH_FAILED);
    path_on_delivered_pt(c, p, 116 * MS, 124 * MS);
    CHECK(p->state == MRC_PATH_GOOD && ep->st.spurious_rto == 2);
    teardown();
}

/* A real loss is not undone: what arrives after a timeout was sent before the
 * packet that timed out (it was ahead of it), or nothing arrives at all. */
static void test_real_timeout_kept(void)
{
    struct path *p = setup();
    path_on_loss_pt(c, p, true, 95 * MS, 100 * MS);
    path_on_delivered_pt(c, p, 94 * MS, 101 * MS);
    CHECK(p->state == MRC_PATH_SUSPECT);
    CHECK(ep->st.spurious_rto == 0);
    /* Sent after the timeout fired: a new packet, no verdict on the old one. */
    path_on_delivered_pt(c, p, 100 * MS + 1, 101 * MS);
    CHECK(ep->st.spurious_rto == 0);
    /* A RACK loss (not a timeout) opens no verdict. */
    path_set_state_pt(c, p, MRC_PATH_GOOD, 110 * MS);
    p->rto_loss_ns = 0;
    path_on_loss_pt(c, p, false, 111 * MS, 112 * MS);
    path_on_delivered_pt(c, p, 111 * MS + 1, 113 * MS);
    CHECK(p->state == MRC_PATH_SUSPECT && ep->st.spurious_rto == 0);
    teardown();
}

/* A bare connection with n paths, path i on socket i; receive window of 1024. */
static void setup_paths(int n)
{
    setup();
    ep->planes[0].down = false; /* ACKs reach their socket batch (nothing sends it) */
    ep->nsocks = n;
    for (int i = 1; i < n; i++)
        ep->socks[i] = calloc(1, sizeof(*ep->socks[i]));
    c->npaths = n;
    for (int i = 0; i < n; i++) {
        struct path *p = &c->paths[i];
        path_init(p, c->mss);
        p->id = i;
        p->sock = i;
        c->path_index[i] = i;
    }
    c->window = 1024;
    c->wmask = 1023;
    c->tx_cap = c->window; /* the tests that use a tx ring allocate it whole */
    c->tx_mask = c->wmask;
    c->rx_bits = calloc(1024 / 64, sizeof(uint64_t));
}

static void teardown_paths(void)
{
    free(c->rx_bits);
    for (int i = 1; i < ep->nsocks; i++)
        free(ep->socks[i]);
    teardown();
}

/* The latest packet on path ids[k] was psn[k] (sent at (ids[k] + 1) us,
 * received at RX_CLOCK + 10 * (ids[k] + 1) us of the receiver's clock), for
 * each k; then the pass ends: flush. The caller marks what was received. */
#define RX_CLOCK (5000 * MS) /* the receiver's clock is 5 s ahead of ours */
static void arrive_psns(const int *ids, const uint32_t *psn, int n)
{
    for (int k = 0; k < n; k++) {
        c->ack_need |= 1ull << ids[k];
        c->ack_echo_psn[ids[k]] = psn[k];
        c->ack_echo_ts[ids[k]] = (uint64_t)ids[k] * US + US;
        c->ack_echo_rx_ts[ids[k]] = RX_CLOCK + 10 * ((uint64_t)ids[k] * US + US);
    }
    c->in_ackq = true;
    c->next_ack = NULL;
    ep->ackq = c;
    rx_flush_acks_pt(ep, now_ns());
}

/* The same with psn 90 + id on path id (below rx_cum in the tests: delivered). */
static void arrive(const int *ids, int n)
{
    uint32_t psn[MRC_MAX_PATHS];
    for (int k = 0; k < n; k++)
        psn[k] = 90u + (uint32_t)ids[k];
    arrive_psns(ids, psn, n);
}

/* The ACKs queued on every socket, in socket order. */
static int queued_acks(const struct mrc_hdr **out, size_t *len, int max)
{
    int n = 0;
    for (int s = 0; s < ep->nsocks; s++)
        for (int i = 0; i < ep->socks[s]->batch.n && n < max; i++) {
            out[n] = (const struct mrc_hdr *)ep->socks[s]->batch.hdr[i];
            len[n++] = ep->socks[s]->batch.iov[i][0].iov_len;
        }
    return n;
}

/* One ACK per connection and pass answers every path that delivered (was one
 * per path): the header echoes the first, the rest follow the extension; the
 * sender takes each echo as its path's delay and delivery. */
static void test_one_ack_echoes_every_path(void)
{
    setup_paths(4);
    c->rx_cum = 100; /* 90..99 were all delivered: nothing below is missing */
    arrive((const int[]){0, 2, 3}, 3);
    const struct mrc_hdr *h[8];
    size_t len[8];
    CHECK(queued_acks(h, len, 8) == 1);
    CHECK(ep->st.acks_tx == 1);
    CHECK(len[0] == MRC_ACK_LEN + 2 * sizeof(struct mrc_ack_echo));
    CHECK(mrc_pkt_validate(h[0], len[0], 8192) == 0);
    CHECK(h[0]->type == MRC_PKT_ACK && h[0]->path == 0 && h[0]->ts == 1 * US && h[0]->psn == 100);
    const struct mrc_ack_ext *a = (const struct mrc_ack_ext *)(h[0] + 1);
    const struct mrc_ack_echo *e = (const struct mrc_ack_echo *)(a + 1);
    CHECK(a->echo_psn == 90 && a->echo_rx_ts == RX_CLOCK + 10 * US);
    CHECK(e[0].path == 2 && e[0].psn == 92 && e[0].ts == 3 * US &&
          e[0].rx_ts == RX_CLOCK + 30 * US);
    CHECK(e[1].path == 3 && e[1].psn == 93 && e[1].ts == 4 * US &&
          e[1].rx_ts == RX_CLOCK + 40 * US);

    /* The sender's side of it, on a connection that sent 90..99. */
    c->next_psn = c->una = 100;
    c->highest_acked = 99;
    uint64_t now = 1 * MS;
    tx_on_ack_pt(c, conn_path(c, h[0]->path), h[0], a, now);
    CHECK(ep->st.drops[MRC_DROP_BAD_ACK] == 0);
    CHECK(c->paths[0].delivered_ts == 1 * US && c->paths[0].last_rtt == now - 1 * US);
    CHECK(c->paths[2].delivered_ts == 3 * US && c->paths[2].last_rtt == now - 3 * US);
    CHECK(c->paths[3].delivered_ts == 4 * US && c->paths[3].last_rtt == now - 4 * US);
    /* ... and its one-way delay, in the two clocks (offset included). */
    CHECK(c->paths[0].last_owd == (int64_t)(RX_CLOCK + 9 * US));
    CHECK(c->paths[3].last_owd == (int64_t)(RX_CLOCK + 36 * US));
    CHECK(c->paths[3].base_owd == c->paths[3].last_owd);
    CHECK(c->paths[1].delivered_ts == 0 && c->paths[1].last_rx_ns == 0); /* not echoed */

    /* A forged further echo (a path the connection lacks, a psn never sent)
     * drops the whole ACK: nothing of it is taken. */
    uint8_t forged[MRC_ACK_MAX_LEN];
    memcpy(forged, h[0], len[0]);
    struct mrc_ack_echo *fe = (struct mrc_ack_echo *)(forged + MRC_ACK_LEN);
    fe[1].path = 9;
    fe[1].ts = 500 * US;
    tx_on_ack_pt(c, &c->paths[0], (struct mrc_hdr *)forged,
                 (struct mrc_ack_ext *)(forged + sizeof(struct mrc_hdr)), now);
    CHECK(ep->st.drops[MRC_DROP_BAD_ACK] == 1);
    fe[1].path = 3;
    fe[1].psn = 100;
    tx_on_ack_pt(c, &c->paths[0], (struct mrc_hdr *)forged,
                 (struct mrc_ack_ext *)(forged + sizeof(struct mrc_hdr)), now);
    CHECK(ep->st.drops[MRC_DROP_BAD_ACK] == 2);
    CHECK(c->paths[3].delivered_ts == 4 * US);
    teardown_paths();
}

/* The ACK leaves on the mirror of one of the paths it answers, in turn, and
 * never on one this side knows is failed; past 1 + MRC_ACK_ECHO_MAX paths, a
 * second ACK answers the rest. */
static void test_ack_path_turns(void)
{
    setup_paths(12);
    c->rx_cum = 100;
    c->paths[1].state = MRC_PATH_FAILED;
    int socks_used[12] = {0};
    for (int round = 0; round < 6; round++) {
        for (int s = 0; s < ep->nsocks; s++)
            ep->socks[s]->batch.n = 0;
        arrive((const int[]){0, 1, 2}, 3);
        for (int s = 0; s < ep->nsocks; s++)
            socks_used[s] += ep->socks[s]->batch.n;
    }
    CHECK(socks_used[1] == 0);                 /* failed mirror: never */
    CHECK(socks_used[0] > 0 && socks_used[2] > 0); /* the others in turn */
    CHECK(socks_used[0] + socks_used[2] == 6);
    for (int s = 0; s < ep->nsocks; s++)
        ep->socks[s]->batch.n = 0;
    arrive((const int[]){0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, 11);
    const struct mrc_hdr *h[8];
    size_t len[8];
    CHECK(queued_acks(h, len, 8) == 2);
    unsigned echoes = 0;
    for (int k = 0; k < 2; k++) {
        CHECK(mrc_pkt_validate(h[k], len[k], 8192) == 0);
        echoes += 1 + h[k]->len / (unsigned)sizeof(struct mrc_ack_echo);
    }
    CHECK(echoes == 11);
    teardown_paths();
}

/* Echoed packets further apart than a SACK block spans go in separate ACKs,
 * each block holding its echoes: a packet echoed but never reported as
 * received would time out at the sender. */
static void test_far_echoes_split(void)
{
    setup_paths(3);
    c->rx_cum = 100; /* a hole at 100: nothing is cumulatively acked beyond it */
    const uint32_t psn[3] = {110, 700, 705};
    for (int k = 0; k < 3; k++)
        c->rx_bits[(psn[k] & c->wmask) >> 6] |= 1ull << (psn[k] & 63);
    arrive_psns((const int[]){0, 1, 2}, psn, 3);
    const struct mrc_hdr *h[8];
    size_t len[8];
    int n = queued_acks(h, len, 8);
    CHECK(n == 2);
    unsigned seen = 0;
    for (int k = 0; k < n; k++) {
        const struct mrc_ack_ext *a = (const struct mrc_ack_ext *)(h[k] + 1);
        const struct mrc_ack_echo *e = (const struct mrc_ack_echo *)(a + 1);
        unsigned ne = 1 + h[k]->len / (unsigned)sizeof(*e);
        for (unsigned j = 0; j < ne; j++) {
            uint32_t p = j ? e[j - 1].psn : a->echo_psn;
            uint32_t i = p - a->sack_base;
            CHECK(i < MRC_SACK_BITS && (a->sack[i >> 6] >> (i & 63) & 1));
            seen |= 1u << (j ? e[j - 1].path : h[k]->path);
        }
    }
    CHECK(seen == 7);
    teardown_paths();
}

/* The SACK block filled a word at a time equals the bit-by-bit definition:
 * bit i is psn base + i's window bit when 0 <= psn - rx_cum < window, for
 * windows smaller and larger than the block, bases on and off word
 * boundaries (and before the cumulative ack), and psns wrapping at 2^32. */
static void test_sack_fill_words(void)
{
    uint64_t rng = 12345;
    static const uint32_t windows[] = {64, 128, 256, 512, 1024, 4096};
    int checked = 0;
    for (unsigned w = 0; w < sizeof(windows) / sizeof(windows[0]); w++) {
        for (int round = 0; round < 200; round++) {
            mrc_conn cc = {0};
            cc.window = windows[w];
            cc.wmask = cc.window - 1;
            cc.rx_bits = calloc(cc.window / 64, sizeof(uint64_t));
            for (uint32_t k = 0; k < cc.window / 64; k++) {
                rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                cc.rx_bits[k] = rng ^ (rng >> 17);
            }
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            cc.rx_cum = (uint32_t)(rng >> 32) | (round & 1 ? 0xffffff00u : 0);
            uint32_t base = cc.rx_cum + (uint32_t)(rng % 700) - 100;
            uint64_t got[MRC_SACK_BITS / 64], want[MRC_SACK_BITS / 64] = {0};
            rx_sack_fill(&cc, base, got);
            for (uint32_t i = 0; i < MRC_SACK_BITS; i++) {
                uint32_t psn = base + i;
                int32_t o = psn_diff(psn, cc.rx_cum);
                uint32_t at = psn & cc.wmask;
                if (o >= 0 && o < (int32_t)cc.window && ((cc.rx_bits[at >> 6] >> (at & 63)) & 1))
                    want[i >> 6] |= 1ull << (i & 63);
            }
            checked += memcmp(got, want, sizeof(got)) == 0;
            free(cc.rx_bits);
        }
    }
    CHECK(checked == 6 * 200);
}

/* One echo as tx.c takes it: sent at ts, received at rx_ts (the receiver's
 * clock, offset by an unknown constant), its ACK back at now; then the
 * packet's bytes acknowledged. */
static void echo(struct path *p, uint64_t ts, uint64_t rx_ts, uint64_t now)
{
    path_on_rtt_pt(p, now - ts, now);
    path_on_owd_pt(p, (int64_t)(rx_ts - ts), now);
    path_on_acked_pt(p, 8192, now);
}

/* Congestion is queueing on the way out, not on the round trip: ACKs that
 * wait behind other flows' data leaving the receiver's host (a 6 ms round
 * trip with the data's own one-way delay at its floor) must not cut the
 * window, as they did on the 4-host ring; data that queues on the way out
 * (one-way delay 5 ms over its floor) must. Clocks 1000 s apart either way. */
static void test_congestion_is_one_way(void)
{
    static const int64_t offsets[] = {1000000 * (int64_t)MS, -1000000 * (int64_t)MS};
    for (int k = 0; k < 2; k++) {
        struct path *p = setup();
        uint64_t rx = (uint64_t)((int64_t)(2000000 * MS) + offsets[k]);
        echo(p, 1 * MS, rx + 1 * MS + 100 * US, 1 * MS + 200 * US); /* the floors */
        p->cwnd = p->ssthresh = 64 * 8192;                          /* additive phase */
        uint64_t before = p->cwnd;
        for (int i = 0; i < 10; i++) {
            uint64_t ts = 10 * MS + (uint64_t)i * MS;
            echo(p, ts, rx + ts + 150 * US, ts + 6 * MS);
        }
        CHECK(p->last_rtt == 6 * MS); /* 5.8 ms above the base RTT */
        CHECK(p->cwnd > before);      /* grew: nothing queued ahead of the data */
        before = p->cwnd;
        echo(p, 30 * MS, rx + 35 * MS, 35 * MS + 100 * US);
        CHECK(p->cwnd < before); /* cut: 4.9 ms of queue on the way out */
        CHECK(p->ssthresh == p->cwnd);
        teardown();
    }
}

/* New data goes to a path in bursts of c->burst packets, then to the next
 * path; a path with packets in flight starts a burst only once its window has
 * room for one (or for half the window, or for the rest of the message);
 * retransmissions never wait for that room (path_pick_pt). */
static void test_bursts_per_path(void)
{
    setup();
    uint64_t need = 8192 + MRC_PKT_OVERHEAD;
    c->npaths = 3;
    c->burst = 7;
    for (int i = 0; i < 3; i++) {
        path_init(&c->paths[i], c->mss);
        c->paths[i].id = i;
        c->paths[i].cwnd = 64 * need;
        c->path_index[i] = i;
    }
    uint64_t rest = 100 * 8192;
    for (int k = 0; k < 21; k++) { /* 7 to each path in turn */
        struct path *p = path_pick_pt(c, 8192, rest, -1);
        CHECK(p && p->id == k / 7);
        p->inflight += need;
        rest -= 8192;
    }
    /* A full window ends a burst early. */
    CHECK(path_pick_pt(c, 8192, rest, -1)->id == 0);
    c->paths[0].inflight += need;
    c->paths[0].cwnd = c->paths[0].inflight + need;
    CHECK(path_pick_pt(c, 8192, rest, -1)->id == 0);
    c->paths[0].inflight += need;
    CHECK(path_pick_pt(c, 8192, rest, -1)->id == 1);
    /* Room for 3 packets where a burst is 7 and half the window is 32:
     * every path waits, but for a retransmission or a 2-packet rest. */
    for (int i = 0; i < 3; i++) {
        c->paths[i].cwnd = 64 * need;
        c->paths[i].inflight = 61 * need;
    }
    c->burst_left = 0;
    CHECK(path_pick_pt(c, 8192, rest, -1) == NULL);
    CHECK(path_pick_pt(c, 8192, 0, -1) != NULL);
    CHECK(path_pick_pt(c, 8192, 2 * 8192, -1) != NULL);
    /* A small window starts a burst at half its size. */
    c->paths[2].cwnd = 8 * need;
    c->paths[2].inflight = 4 * need;
    c->burst_left = 0;
    CHECK(path_pick_pt(c, 8192, rest, -1)->id == 2);
    /* An idle path always takes data, whatever its window. */
    c->paths[1].inflight = 0;
    c->paths[1].cwnd = need / 2;
    c->burst_left = 0;
    CHECK(path_pick_pt(c, 8192, rest, -1)->id == 1);
    teardown();
}

/* A SEND of len bytes from payload (a region of its own), for the tx tests. */
static mrc_op *send_op(mrc_mr *mr, uint8_t *payload, uint64_t len)
{
    *mr = (mrc_mr){.addr = payload, .len = len};
    mrc_op *op = calloc(1, sizeof(*op));
    op->kind = MRC_OP_SEND;
    op->mr = mr;
    op->len = len;
    return op;
}

/* The tx ring starts small and doubles while packets in flight fill it, up
 * to the window; every packet in flight keeps its place (psn % tx_cap). */
static void test_tx_ring_grows_with_packets_in_flight(void)
{
    enum { NPKT = 200, NPATHS = 8 }; /* 25 per path: no socket batch fills */
    setup_paths(NPATHS);
    c->tx_cap = 16;
    c->tx_mask = 15;
    c->tx = calloc(c->tx_cap, sizeof(*c->tx));
    c->rtxq = calloc(c->tx_cap, sizeof(*c->rtxq));
    for (int i = 0; i < NPATHS; i++)
        c->paths[i].cwnd = 1ull << 30;
    static uint8_t payload[NPKT * 8192];
    mrc_mr mr;
    mrc_op *op = send_op(&mr, payload, sizeof(payload));
    c->una = c->next_psn = 0xfffffff0u; /* the PSN wraps on the way */
    tx_post_pt(c, op);
    CHECK(tx_run_pt(c));
    CHECK(c->next_psn - c->una == NPKT && c->tx_cap == 256 && c->tx_mask == 255);
    for (uint32_t k = 0; k < NPKT; k++) {
        const struct tx_pkt *t = &c->tx[(c->una + k) & c->tx_mask];
        CHECK(t->op == op && t->psn == c->una + k && t->off == k * 8192ull);
    }
    /* At the window it stops growing and sending. */
    c->window = 256;
    static uint8_t more[100 * 8192];
    mrc_mr mr2;
    mrc_op *op2 = send_op(&mr2, more, sizeof(more));
    tx_post_pt(c, op2);
    for (int s = 0; s < ep->nsocks; s++)
        ep->socks[s]->batch.n = 0;
    CHECK(tx_run_pt(c) && c->next_psn - c->una == 256 && c->tx_cap == 256);
    CHECK(!tx_run_pt(c) && c->next_psn - c->una == 256 && !op2->seg_done);
    for (int s = 0; s < ep->nsocks; s++)
        ep->socks[s]->batch.n = 0;
    free(c->tx);
    free(c->rtxq);
    free(op);
    free(op2);
    teardown_paths();
}

/* Round after round of refused probes: the probe is the oldest packet, sent
 * out of turn with its queue entry left behind, and its refusal queues it
 * again. With every packet in flight refused, the queue held as many
 * entries as its ring, and each round wrote one more over a waiting
 * packet's entry: that packet was never sent again and the connection
 * failed at its timeout once the receiver was ready (a 2 MiB SEND at
 * window 64, found by measuring the tables grown on demand). */
static void test_rnr_rounds_keep_every_packet_queued(void)
{
    enum { CAP = 16 };
    setup_paths(1);
    c->tx_cap = CAP;
    c->tx_mask = CAP - 1;
    c->tx = calloc(CAP, sizeof(*c->tx));
    c->rtxq = calloc(CAP, sizeof(*c->rtxq));
    static uint8_t payload[CAP * 8192];
    mrc_mr mr;
    mrc_op *op = send_op(&mr, payload, sizeof(payload));
    op->seg_off = op->len;
    op->seg_done = true;
    uint64_t t0 = now_ns();
    c->una = 0;
    c->next_psn = CAP;
    for (uint32_t psn = 0; psn < CAP; psn++)
        c->tx[psn] = (struct tx_pkt){
            .op = op, .psn = psn, .off = psn * 8192u, .len = 8192, .sent_ns = t0 - MS};
    c->paths[0].inflight = CAP * (8192 + MRC_PKT_OVERHEAD);
    struct mrc_hdr h = {.type = MRC_PKT_NAK, .path = 0};
    struct mrc_nak_ext n = {.msn = 0, .code = MRC_NAK_RNR};
    for (uint32_t psn = 0; psn < CAP; psn++) {
        h.psn = psn;
        tx_on_nak_pt(c, &c->paths[0], &h, &n);
    }
    CHECK(c->rtx_count == CAP);
    for (int round = 0; round < 3 * CAP; round++) {
        c->rnr_until = 0; /* the back-off is over: the oldest asks again */
        ep->socks[0]->batch.n = 0;
        CHECK(tx_run_pt(c) && !c->tx[0].lost);
        h.psn = 0;
        tx_on_nak_pt(c, &c->paths[0], &h, &n); /* refused again */
    }
    CHECK(c->rtx_count <= CAP);
    bool queued[CAP] = {false};
    for (uint32_t k = 0; k < c->rtx_count; k++)
        queued[c->rtxq[(c->rtx_head + k) & c->tx_mask] & c->tx_mask] = true;
    for (uint32_t psn = 0; psn < CAP; psn++)
        CHECK(queued[psn] && c->tx[psn].lost == 1);
    ep->socks[0]->batch.n = 0;
    free(c->tx);
    free(c->rtxq);
    free(op);
    teardown_paths();
}

/* Receiver not ready. A window refused together is one round: its NAKs set
 * the back-off once (1 ms), not once each (they took the first refusal
 * straight to 64 ms); a packet sent after that and refused again doubles it.
 * The receiver that refused owes the sender a READY when a RECV is posted,
 * and the READY ends the sender's wait at once. */
static void test_rnr_rounds_and_ready(void)
{
    setup_paths(1);
    c->tx = calloc(c->window, sizeof(*c->tx));
    c->rtxq = calloc(c->window, sizeof(*c->rtxq));
    static uint8_t payload[10 * 8192];
    mrc_mr mr;
    mrc_op *op = send_op(&mr, payload, sizeof(payload));
    op->seg_off = op->len; /* all of it sent */
    op->seg_done = true;
    uint64_t t0 = now_ns();
    c->una = 0;
    c->next_psn = 10;
    for (uint32_t psn = 0; psn < 10; psn++)
        c->tx[psn] = (struct tx_pkt){
            .op = op, .psn = psn, .off = psn * 8192u, .len = 8192, .sent_ns = t0 - MS};
    c->paths[0].inflight = 10 * (8192 + MRC_PKT_OVERHEAD);
    struct mrc_hdr h = {.type = MRC_PKT_NAK, .path = 0};
    struct mrc_nak_ext n = {.msn = 0, .code = MRC_NAK_RNR};
    for (uint32_t psn = 0; psn < 10; psn++) {
        h.psn = psn;
        tx_on_nak_pt(c, &c->paths[0], &h, &n);
    }
    CHECK(ep->st.rnr_naks == 10 && ep->st.drops[MRC_DROP_BAD_ACK] == 0);
    CHECK(c->rnr_backoff == MRC_RNR_MIN_NS); /* one round: not 2^9 ms */
    CHECK(c->rtx_count == 10);
    CHECK(c->rnr_until >= t0 + MRC_RNR_MIN_NS);
    /* Sent again after the back-off and refused again: the next round. */
    c->tx[0].sent_ns = now_ns();
    h.psn = 0;
    tx_on_nak_pt(c, &c->paths[0], &h, &n);
    CHECK(c->rnr_backoff == 2 * MRC_RNR_MIN_NS);
    /* The receiver's READY: send now, the back-off level kept. */
    struct mrc_nak_ext ready = {.msn = 0, .code = MRC_NAK_READY};
    h.psn = 0;
    tx_on_nak_pt(c, &c->paths[0], &h, &ready);
    CHECK(ep->st.rnr_ready == 1 && c->rnr_until == 0 && c->rnr_backoff == 2 * MRC_RNR_MIN_NS);
    /* Still backing off: one packet, the oldest, asks whether the receiver
     * takes data (not the window again); the next waits a round. */
    const struct mrc_hdr *q[4];
    size_t len[4];
    c->tx[0].lost = 0; /* psn 0 in flight: the oldest waiting is psn 1 */
    CHECK(tx_run_pt(c));
    CHECK(queued_acks(q, len, 4) == 1 && q[0]->type == MRC_PKT_SEND && q[0]->psn == 1);
    CHECK(c->rnr_until > now_ns() && !c->tx[1].lost && c->tx[2].lost);
    CHECK(!tx_run_pt(c) && queued_acks(q, len, 4) == 1);
    /* Its ACK (a packet sent since the first refusal) ends the back-off. */
    struct mrc_hdr ah = {.type = MRC_PKT_ACK, .path = 0, .psn = 0, .ts = q[0]->ts};
    struct mrc_ack_ext ae = {.sack_base = 0, .echo_psn = 1, .sack = {1ull << 1}};
    ep->socks[0]->batch.n = 0;
    tx_on_ack_pt(c, &c->paths[0], &ah, &ae, now_ns());
    CHECK(ep->st.drops[MRC_DROP_BAD_ACK] == 0 && c->tx[1].acked);
    CHECK(c->rnr_backoff == 0 && c->rnr_until == 0);
    /* The rest at once: 2..9, and 0, which the ACK of 1 (sent after it on
     * its path) showed lost (RACK). */
    CHECK(tx_run_pt(c) && c->paths[0].retx == 1 + 9 && c->rtx_count == 0);
    ep->socks[0]->batch.n = 0;
    free(c->tx);
    free(c->rtxq);
    free(op);

    /* The receiver's side: a refusal leaves a READY owed on the refused path,
     * sent when a RECV is posted, once. */
    c->rnr_owed = true;
    c->rnr_owed_path = 0;
    mrc_op *recv = calloc(1, sizeof(*recv));
    rx_post_recv_pt(c, recv);
    CHECK(queued_acks(q, len, 4) == 1);
    CHECK(len[0] == MRC_NAK_LEN && mrc_pkt_validate(q[0], len[0], 8192) == 0);
    const struct mrc_nak_ext *qn = (const struct mrc_nak_ext *)(q[0] + 1);
    CHECK(q[0]->type == MRC_PKT_NAK && qn->code == MRC_NAK_READY && !c->rnr_owed);
    mrc_op *recv2 = calloc(1, sizeof(*recv2));
    rx_post_recv_pt(c, recv2);
    CHECK(queued_acks(q, len, 4) == 1); /* nothing owed: nothing more sent */
    free(recv);
    free(recv2);
    teardown_paths();
}

int main(void)
{
    test_sack_fill_words();
    test_one_event_per_stall();
    test_three_events_fail();
    test_quick_rto_slack();
    test_spurious_timeout();
    test_real_timeout_kept();
    test_one_ack_echoes_every_path();
    test_ack_path_turns();
    test_far_echoes_split();
    test_congestion_is_one_way();
    test_bursts_per_path();
    test_rnr_rounds_and_ready();
    test_rnr_rounds_keep_every_packet_queued();
    test_tx_ring_grows_with_packets_in_flight();
    DONE("test_path");
    return 0;
}
