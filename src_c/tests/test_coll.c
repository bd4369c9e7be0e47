/*
 * test_coll.c - the executor with 3 ranks in one process (an endpoint each on
 * loopback planes, every pair connected, one thread per rank): a direct
 * all_reduce schedule (owner reduces raw contributions in rank order, then
 * all-gather) built here by hand, out of place and in place, with tiny chunks
 * and 2-slot rings so every mechanism runs; results checked against a
 * reference summed in rank order; a signature mismatch gives MRC_EMISMATCH
 * on every rank; abort ends a run that waits for a peer that never comes.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "connect.h"
#include "mrc.h"

#define NR 3
#define NPL 2

static mrc_ep *eps[NR];
static mrc_conn *conns[NR][NR];
static mrc_coll *colls[NR];

/* ---- a plan builder (the real one is mrc/collectives/schedule.py) -------- */

struct plan {
    struct mrc_coll_step steps[64];
    struct mrc_coll_ref refs[128];
    uint32_t deps[128];
    struct mrc_coll_plan p;
};

static uint32_t ref(struct plan *pl, uint32_t buf, uint64_t off)
{
    pl->refs[pl->p.nrefs] = (struct mrc_coll_ref){.buf = buf, .off = off};
    return pl->p.nrefs++;
}

static uint32_t step(struct plan *pl, uint32_t kind, int peer, uint32_t pair_seq, uint64_t len)
{
    struct mrc_coll_step *t = &pl->steps[pl->p.nsteps];
    memset(t, 0, sizeof(*t));
    t->kind = kind, t->peer = peer, t->pair_seq = pair_seq, t->len = len;
    t->dep = pl->p.ndeps;
    return pl->p.nsteps++;
}

static void dep(struct plan *pl, uint32_t s, uint32_t on)
{
    pl->deps[pl->p.ndeps++] = on;
    pl->steps[s].ndeps++;
}

/* Direct all_reduce of `count` int32/float32 for rank r: equal shares. */
static void plan_all_reduce(struct plan *pl, int r, uint64_t count, int avg)
{
    memset(pl, 0, sizeof(*pl));
    uint64_t b[NR + 1];
    for (int k = 0; k <= NR; k++)
        b[k] = count * (uint64_t)k / NR * 4;
    uint32_t recv_from[NR] = {0}, rs_send[NR] = {0};
    int ring = 0, rings[NR];
    for (int j = 0; j < NR; j++) {
        if (j == r)
            continue;
        uint32_t s = step(pl, MRC_STEP_SEND, j, 0, b[j + 1] - b[j]);
        pl->steps[s].src = ref(pl, MRC_BUF_SEND, b[j]), pl->steps[s].nsrc = 1;
        rs_send[j] = s;
        rings[j] = ring++;
        s = step(pl, MRC_STEP_RECV, j, 0, b[r + 1] - b[r]);
        pl->steps[s].dst = ref(pl, MRC_BUF_SCRATCH, (uint64_t)rings[j]);
        recv_from[j] = s;
    }
    pl->p.nrings = (uint32_t)ring;
    uint32_t red = step(pl, MRC_STEP_REDUCE, -1, 0, b[r + 1] - b[r]);
    pl->steps[red].flags = avg ? MRC_STEP_FINISH : 0;
    pl->steps[red].dst = ref(pl, MRC_BUF_RECV, b[r]);
    pl->steps[red].src = pl->p.nrefs;
    pl->steps[red].nsrc = NR;
    for (int i = 0; i < NR; i++)
        if (i == r)
            ref(pl, MRC_BUF_SEND, b[r]);
        else
            ref(pl, MRC_BUF_SCRATCH, (uint64_t)rings[i]);
    for (int j = 0; j < NR; j++)
        if (j != r)
            dep(pl, red, recv_from[j]);
    for (int j = 0; j < NR; j++) {
        if (j == r)
            continue;
        uint32_t s = step(pl, MRC_STEP_SEND, j, 1, b[r + 1] - b[r]);
        pl->steps[s].src = ref(pl, MRC_BUF_RECV, b[r]), pl->steps[s].nsrc = 1;
        pl->steps[s].lag = 2;
        dep(pl, s, red);
        s = step(pl, MRC_STEP_RECV, j, 1, b[j + 1] - b[j]);
        pl->steps[s].lag = 2;
        pl->steps[s].dst = ref(pl, MRC_BUF_RECV, b[j]);
        dep(pl, s, rs_send[j]); /* in place: that range is still being sent to j */
    }
    pl->p.steps = pl->steps, pl->p.refs = pl->refs, pl->p.deps = pl->deps;
}

/* ---- ranks as threads ---------------------------------------------------- */

struct job {
    int rank;
    struct plan plan;
    struct mrc_coll_args args;
    int rc, failed;
};

static void *rank_main(void *arg)
{
    struct job *j = arg;
    j->rc = mrc_coll_run(colls[j->rank], &j->plan.p, &j->args, &j->failed);
    return NULL;
}

static void run_all(struct job *jobs)
{
    pthread_t t[NR];
    for (int r = 0; r < NR; r++)
        CHECK(pthread_create(&t[r], NULL, rank_main, &jobs[r]) == 0);
    for (int r = 0; r < NR; r++)
        pthread_join(t[r], NULL);
}

static void setup(uint64_t chunk, int slots)
{
    for (int r = 0; r < NR; r++) {
        struct mrc_ep_config cfg;
        mrc_ep_config_init(&cfg);
        cfg.nplanes = NPL;
        for (int i = 0; i < NPL; i++)
            snprintf(cfg.planes[i], sizeof(cfg.planes[i]), "127.0.%d.%d", 20 + r, i + 1);
        cfg.timeout_ms = 3000;
        CHECK_RC(mrc_ep_create(&cfg, &eps[r]));
    }
    for (int a = 0; a < NR; a++)
        for (int b = a + 1; b < NR; b++) {
            uint16_t port;
            char addr[32];
            snprintf(addr, sizeof(addr), "127.0.%d.1", 20 + b);
            CHECK_RC(mrc_ep_listen(eps[b], addr, 0, &port));
            CHECK_RC(connect_pair(eps[a], eps[b], addr, port, "r", &conns[a][b], &conns[b][a]));
        }
    for (int r = 0; r < NR; r++) {
        struct mrc_coll_config cc = {.rank = r, .nranks = NR, .peers = conns[r],
                                     .chunk_bytes = chunk, .slots = slots};
        CHECK_RC(mrc_coll_create(eps[r], &cc, &colls[r]));
    }
}

static void teardown(void)
{
    for (int r = 0; r < NR; r++)
        mrc_coll_destroy(colls[r]);
    for (int a = 0; a < NR; a++)
        for (int b = 0; b < NR; b++)
            if (conns[a][b])
                mrc_conn_destroy(conns[a][b]);
    memset(conns, 0, sizeof(conns));
    for (int r = 0; r < NR; r++)
        mrc_ep_destroy(eps[r]);
}

static void test_all_reduce(uint64_t count, int in_place, int dtype, int op)
{
    static struct job jobs[NR];
    float *in[NR], *out[NR];
    for (int r = 0; r < NR; r++) {
        in[r] = malloc(count * 4 + 4);
        out[r] = malloc(count * 4 + 4);
        for (uint64_t i = 0; i < count; i++) {
            if (dtype == MRC_FLOAT32)
                in[r][i] = (float)(i % 1000) * 0.1f + (float)r * 1e-3f + 1.0f / (float)(r + 3);
            else
                ((int32_t *)in[r])[i] = (int32_t)(i * 2654435761u) + r;
        }
    }
    /* reference: rank order, the same kernel (its own correctness is test_reduce's) */
    uint8_t *ref_out = malloc(count * 4 + 4);
    memcpy(ref_out, in[0], count * 4);
    for (int r = 1; r < NR; r++)
        CHECK_RC(mrc_reduce(ref_out, in[r], count, dtype, op));
    CHECK_RC(mrc_reduce_finish(ref_out, count, dtype, op, NR));
    for (int r = 0; r < NR; r++) {
        plan_all_reduce(&jobs[r].plan, r, count, op == MRC_AVG);
        jobs[r].rank = r;
        void *dst = in_place ? (void *)in[r] : (void *)out[r];
        jobs[r].args = (struct mrc_coll_args){.send = in[r], .send_len = count * 4, .recv = dst,
                                              .recv_len = count * 4, .dtype = dtype, .op = op,
                                              .sig = 0x1234, .timeout_ms = 5000};
    }
    run_all(jobs);
    for (int r = 0; r < NR; r++) {
        CHECK_RC(jobs[r].rc);
        CHECK(memcmp(jobs[r].args.recv, ref_out, count * 4) == 0);
    }
    for (int r = 0; r < NR; r++)
        free(in[r]), free(out[r]);
    free(ref_out);
}

static int nmrs(mrc_ep *ep)
{
    struct mrc_ep_stats st;
    CHECK_RC(mrc_ep_get_stats(ep, &st, NULL, 0));
    return st.nmrs;
}

/* Buffers above the bounce size keep their regions for the next calls: the
 * same buffers again register nothing; freed buffers (their addresses reused
 * by the next allocation), and more buffers in turn than the cache holds,
 * still give exact results, with a bounded number of regions. */
static void test_mr_cache(void)
{
    uint64_t count = 300000; /* 1.2 MB: registered, not bounced */
    int n0 = nmrs(eps[0]);
    test_all_reduce(count, 0, MRC_FLOAT32, MRC_SUM);
    CHECK(nmrs(eps[0]) > n0); /* the call's regions stayed */
    for (int i = 0; i < 3; i++)
        test_all_reduce(count, 0, MRC_FLOAT32, MRC_SUM); /* malloc'd afresh each time */
    CHECK(nmrs(eps[0]) <= n0 + 8); /* at most 8 kept */
    /* 12 buffer pairs in turn, each used twice: the cache (8) turns over. */
    static struct job jobs[NR];
    enum { NB = 12 };
    float *bufs[NB][NR];
    for (int b = 0; b < NB; b++)
        for (int r = 0; r < NR; r++) {
            bufs[b][r] = malloc(count * 4);
            for (uint64_t i = 0; i < count; i++)
                bufs[b][r][i] = (float)((i + (uint64_t)b) % 97) + (float)r * 0.25f;
        }
    float *out[NR];
    for (int r = 0; r < NR; r++)
        out[r] = malloc(count * 4);
    for (int round = 0; round < 2; round++)
        for (int b = 0; b < NB; b++) {
            for (int r = 0; r < NR; r++) {
                plan_all_reduce(&jobs[r].plan, r, count, 0);
                jobs[r].rank = r;
                jobs[r].args = (struct mrc_coll_args){
                    .send = bufs[b][r], .send_len = count * 4, .recv = out[r],
                    .recv_len = count * 4, .dtype = MRC_FLOAT32, .op = MRC_SUM,
                    .sig = 0x1234, .timeout_ms = 5000};
            }
            run_all(jobs);
            for (int r = 0; r < NR; r++) {
                CHECK_RC(jobs[r].rc);
                float want = 0;
                for (int q = 0; q < NR; q++)
                    want += bufs[b][q][count - 1];
                CHECK(out[r][count - 1] == want);
                CHECK(out[r][0] == (float)(b % 97) * 3 + 0.75f);
            }
        }
    CHECK(nmrs(eps[0]) <= n0 + 8);
    for (int b = 0; b < NB; b++)
        for (int r = 0; r < NR; r++)
            free(bufs[b][r]);
    for (int r = 0; r < NR; r++)
        free(out[r]);
}

static void test_mismatch(void)
{
    static struct job jobs[NR];
    int32_t buf[NR][100];
    for (int r = 0; r < NR; r++) {
        plan_all_reduce(&jobs[r].plan, r, 100, 0);
        jobs[r].rank = r;
        jobs[r].args = (struct mrc_coll_args){.send = buf[r], .send_len = 400, .recv = buf[r],
                                              .recv_len = 400, .dtype = MRC_INT32,
                                              .op = MRC_SUM, .sig = r == 1 ? 77 : 78,
                                              .timeout_ms = 3000};
    }
    /* The endpoints' counters are cumulative: this test's own share is what
     * moved during it (a retransmission in an earlier test, spurious on a
     * stalled machine, made tx_bytes count some bytes twice: seen once under
     * ASan in make test). */
    struct mrc_ep_stats before[NR];
    for (int r = 0; r < NR; r++)
        CHECK_RC(mrc_ep_get_stats(eps[r], &before[r], NULL, 0));
    run_all(jobs);
    for (int r = 0; r < NR; r++) {
        CHECK(jobs[r].rc == MRC_EMISMATCH);
        CHECK(jobs[r].failed >= 0 && jobs[r].failed != r);
        /* A rank returns from a mismatch only once what it sent is acknowledged
         * (early sends too, whose ACKs a peer holds a while): its peers have
         * the data that shows them the mismatch even if this rank exits now.
         * A retransmission (each at most one 400-byte message here) counts
         * its bytes in tx_bytes again; ACKs of an earlier test's bytes may
         * land in this one's acked share (more acked is never the fault). */
        struct mrc_ep_stats st;
        CHECK_RC(mrc_ep_get_stats(eps[r], &st, NULL, 0));
        uint64_t tx = st.tx_bytes - before[r].tx_bytes;
        uint64_t acked = st.acked_bytes - before[r].acked_bytes;
        uint64_t retx = st.retx - before[r].retx;
        CHECK(tx <= acked + retx * 400);
    }
    /* ops still pending (each rank waits for chunks that differ): close, drain */
    for (int a = 0; a < NR; a++)
        for (int b = 0; b < NR; b++)
            if (conns[a][b]) {
                mrc_conn_destroy(conns[a][b]);
                conns[a][b] = NULL;
            }
    for (int r = 0; r < NR; r++)
        CHECK_RC(mrc_coll_drain(colls[r], 5000));
}

static void *abort_later(void *arg)
{
    struct timespec ts = {0, 50 * 1000 * 1000};
    nanosleep(&ts, NULL); /* the run must be waiting when the flag is set */
    mrc_coll_abort(arg);
    return NULL;
}

/* Rank 0 alone runs a collective: it waits for peers that never send. */
static void test_abort(void)
{
    static struct job j;
    int32_t buf[64];
    plan_all_reduce(&j.plan, 0, 64, 0);
    j.args = (struct mrc_coll_args){.send = buf, .send_len = sizeof(buf), .recv = buf,
                                    .recv_len = sizeof(buf), .dtype = MRC_INT32,
                                    .op = MRC_SUM, .sig = 1, .timeout_ms = -1};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, abort_later, colls[0]) == 0);
    int failed;
    CHECK(mrc_coll_run(colls[0], &j.plan.p, &j.args, &failed) == MRC_EABORT);
    pthread_join(t, NULL);
    CHECK(mrc_coll_run(colls[0], &j.plan.p, &j.args, &failed) == MRC_EBUSY);
    for (int b = 1; b < NR; b++) {
        mrc_conn_destroy(conns[0][b]);
        conns[0][b] = NULL;
    }
    CHECK_RC(mrc_coll_drain(colls[0], 5000));
    CHECK(mrc_coll_run(colls[0], &j.plan.p, &j.args, &failed) == MRC_EABORT);
}

/* Loss on every plane of every rank (0: none). */
static void inject_all(double loss)
{
    for (int r = 0; r < NR; r++)
        for (int pl = 0; pl < NPL; pl++)
            CHECK_RC(mrc_ep_inject(eps[r], pl, loss, 0));
}

/* A bounced call returns without waiting for a SEND's acknowledgement only if
 * nothing in the call writes its bytes after it is posted (coll.c, "early"
 * sends). Here each rank copies its input into recv, SENDs that to the next
 * rank, then RECVs the previous rank's into the same bytes, after the SEND
 * (write after read): under loss a SEND that did not wait would be
 * retransmitted from bytes the RECV had overwritten, and the next rank would
 * get the wrong data. The chain's first SEND and the ring's result say it
 * did wait. */
static void test_write_after_send(void)
{
    enum { LEN = 40000, ROUNDS = 20 };
    static struct job jobs[NR];
    static uint8_t in[NR][LEN], out[NR][LEN];
    inject_all(0.3);
    for (int round = 0; round < ROUNDS; round++) {
        for (int r = 0; r < NR; r++) {
            for (int i = 0; i < LEN; i++)
                in[r][i] = (uint8_t)(i * 7 + r * 31 + round);
            struct plan *pl = &jobs[r].plan;
            memset(pl, 0, sizeof(*pl));
            uint32_t cp = step(pl, MRC_STEP_COPY, -1, 0, LEN);
            pl->steps[cp].src = ref(pl, MRC_BUF_SEND, 0), pl->steps[cp].nsrc = 1;
            pl->steps[cp].dst = ref(pl, MRC_BUF_RECV, 0);
            uint32_t sd = step(pl, MRC_STEP_SEND, (r + 1) % NR, 0, LEN);
            pl->steps[sd].src = ref(pl, MRC_BUF_RECV, 0), pl->steps[sd].nsrc = 1;
            dep(pl, sd, cp);
            uint32_t rv = step(pl, MRC_STEP_RECV, (r + NR - 1) % NR, 0, LEN);
            pl->steps[rv].dst = ref(pl, MRC_BUF_RECV, 0);
            dep(pl, rv, sd);
            pl->p.steps = pl->steps, pl->p.refs = pl->refs, pl->p.deps = pl->deps;
            jobs[r].rank = r;
            jobs[r].args = (struct mrc_coll_args){.send = in[r], .send_len = LEN, .recv = out[r],
                                                  .recv_len = LEN, .dtype = MRC_UINT8,
                                                  .op = MRC_SUM, .sig = 0x77,
                                                  .timeout_ms = 10000};
        }
        run_all(jobs);
        for (int r = 0; r < NR; r++) {
            CHECK_RC(jobs[r].rc);
            CHECK(memcmp(out[r], in[(r + NR - 1) % NR], LEN) == 0);
        }
    }
    inject_all(0);
}

/* MRC_BUF_STAGE: the executor's contiguous area, SEND source and RECV
 * destination at byte offsets. Each rank copies its input into the stage's
 * second half, sends it from there to the next rank, receives the previous
 * rank's into the first half and copies that out: chunks of 64 bytes, 20%
 * loss, so stage bytes are retransmitted and land out of order. */
static void test_stage(void)
{
    enum { LEN = 3000 };
    static struct job jobs[NR];
    static uint8_t in[NR][LEN], out[NR][LEN];
    inject_all(0.2);
    for (int r = 0; r < NR; r++) {
        for (int i = 0; i < LEN; i++)
            in[r][i] = (uint8_t)(i * 13 + r * 7);
        struct plan *pl = &jobs[r].plan;
        memset(pl, 0, sizeof(*pl));
        uint32_t cp = step(pl, MRC_STEP_COPY, -1, 0, LEN);
        pl->steps[cp].src = ref(pl, MRC_BUF_SEND, 0), pl->steps[cp].nsrc = 1;
        pl->steps[cp].dst = ref(pl, MRC_BUF_STAGE, LEN);
        uint32_t sd = step(pl, MRC_STEP_SEND, (r + 1) % NR, 0, LEN);
        pl->steps[sd].src = ref(pl, MRC_BUF_STAGE, LEN), pl->steps[sd].nsrc = 1;
        dep(pl, sd, cp);
        uint32_t rv = step(pl, MRC_STEP_RECV, (r + NR - 1) % NR, 0, LEN);
        pl->steps[rv].dst = ref(pl, MRC_BUF_STAGE, 0);
        uint32_t out_cp = step(pl, MRC_STEP_COPY, -1, 0, LEN);
        pl->steps[out_cp].src = ref(pl, MRC_BUF_STAGE, 0), pl->steps[out_cp].nsrc = 1;
        pl->steps[out_cp].dst = ref(pl, MRC_BUF_RECV, 0);
        dep(pl, out_cp, rv);
        pl->p.steps = pl->steps, pl->p.refs = pl->refs, pl->p.deps = pl->deps;
        pl->p.stage_bytes = 2 * LEN;
        jobs[r].rank = r;
        jobs[r].args = (struct mrc_coll_args){.send = in[r], .send_len = LEN, .recv = out[r],
                                              .recv_len = LEN, .dtype = MRC_UINT8,
                                              .op = MRC_SUM, .sig = 0x78, .timeout_ms = 10000};
    }
    run_all(jobs);
    for (int r = 0; r < NR; r++) {
        CHECK_RC(jobs[r].rc);
        CHECK(memcmp(out[r], in[(r + NR - 1) % NR], LEN) == 0);
    }
    inject_all(0);
}

/* A plan that breaks the rules is refused before anything is posted. */
static void test_bad_plan(void)
{
    struct plan pl;
    int32_t buf[30];
    plan_all_reduce(&pl, 0, 30, 0);
    struct mrc_coll_args a = {.send = buf, .send_len = sizeof(buf), .recv = buf,
                              .recv_len = sizeof(buf), .dtype = MRC_INT32, .sig = 1,
                              .timeout_ms = 100};
    pl.refs[0].off = 1000; /* outside the buffer */
    CHECK(mrc_coll_run(colls[0], &pl.p, &a, NULL) == MRC_EUSAGE);
    plan_all_reduce(&pl, 0, 30, 0);
    pl.deps[0] = 50; /* not an earlier step */
    CHECK(mrc_coll_run(colls[0], &pl.p, &a, NULL) == MRC_EUSAGE);
    plan_all_reduce(&pl, 0, 30, 0);
    a.dtype = MRC_NDTYPES;
    CHECK(mrc_coll_run(colls[0], &pl.p, &a, NULL) == MRC_EUSAGE);
    a.dtype = MRC_INT32;
    plan_all_reduce(&pl, 0, 30, 0);
    pl.refs[0].buf = MRC_BUF_STAGE; /* a stage of 0 bytes */
    CHECK(mrc_coll_run(colls[0], &pl.p, &a, NULL) == MRC_EUSAGE);
    pl.p.stage_bytes = 8; /* smaller than the step */
    CHECK(mrc_coll_run(colls[0], &pl.p, &a, NULL) == MRC_EUSAGE);
    plan_all_reduce(&pl, 0, 30, 0);
    pl.refs[0].buf = MRC_BUF_STAGE + 1; /* no such buffer */
    CHECK(mrc_coll_run(colls[0], &pl.p, &a, NULL) == MRC_EUSAGE);
    plan_all_reduce(&pl, 0, 30, 0);
    pl.p.stage_bytes = UINT64_MAX; /* too big to reserve */
    CHECK(mrc_coll_run(colls[0], &pl.p, &a, NULL) == MRC_EUSAGE);
}

int main(void)
{
    setup(64, 2); /* 16-element chunks, 2-slot rings: rings wrap many times */
    test_all_reduce(1000, 0, MRC_FLOAT32, MRC_SUM);
    test_all_reduce(1000, 1, MRC_FLOAT32, MRC_SUM);
    test_all_reduce(1001, 1, MRC_INT32, MRC_AVG);
    test_all_reduce(2, 0, MRC_INT32, MRC_SUM);  /* rank 0 owns nothing */
    test_all_reduce(0, 0, MRC_INT32, MRC_SUM);  /* empty: 0-byte messages */
    test_stage();
    test_bad_plan();
    test_mismatch();
    teardown();
    setup(0, 0); /* defaults */
    test_all_reduce(300000, 1, MRC_FLOAT32, MRC_MAX);
    test_mr_cache();
    test_write_after_send();
    test_abort();
    teardown();
    DONE("test_coll");
    return 0;
}
