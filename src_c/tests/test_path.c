/*
 * test_path.c - the path state machine and timeouts (path.c), driven
 * directly on the progress-thread functions with a bare endpoint whose only
 * plane is down, so probes go nowhere and nothing runs concurrently.
 */
#include <stdint.h>
#include <stdlib.h>

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

int main(void)
{
    test_one_event_per_stall();
    test_three_events_fail();
    test_quick_rto_slack();
    test_spurious_timeout();
    test_real_timeout_kept();
    DONE("test_path");
    return 0;
}
