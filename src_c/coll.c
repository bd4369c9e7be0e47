/*
 * coll.c - the one collective executor: runs any rank's schedule (mrc.h,
 * "collectives: the schedule executor") to completion on the caller's thread.
 *
 * Every step covers a byte range and is cut into chunks of chunk_bytes; a
 * chunk runs once the same chunk of each step it depends on is done (or the
 * whole dependency, when chunk counts differ), so receiving chunk i+1 overlaps
 * reducing chunk i and forwarding chunk i-1. Transfers go through the public
 * API only: mrc_post() onto the executor's own completion queue, whose ctx is
 * (step << 32 | chunk). REDUCE and COPY chunks run here, between waits, in the
 * schedule's source order: the result never depends on arrival order.
 *
 * Matching: the messages of one direction of a pair are posted in one order
 * on both sides (chunks by chunk index + step lag, then pair_seq), and received with
 * MRC_TAG_ANY, so the n-th RECV takes the n-th SEND whatever its tag; the
 * tag then says whether the sender ran the same call (signature), the same
 * collective (the pair's sequence number) and the same step and chunk. A
 * difference, or a length that differs, is MRC_EMISMATCH, not a hang.
 *
 * Scratch rings: slot i % slots of a ring holds chunk i of its producer; the
 * producer's chunk i waits until every step reading the ring is done with
 * chunk i - slots. Extra memory: nrings * slots * chunk_bytes.
 */
#include <errno.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mrc.h"

#define DEFAULT_CHUNK (256u << 10)
#define DEFAULT_SLOTS 4
#define WAIT_SLICE_MS 10 /* how often a waiting run looks at the abort flag */
#define INTERRUPT_ASK_MS 100 /* and at most how often it asks a->interrupted */
#define WC_BATCH 64
/* Calls whose buffers fit go through a region registered once: registering
 * the caller's buffers costs four round trips to the progress thread, which
 * is most of a small collective's latency. */
#define BOUNCE_BYTES (256u << 10)
/* Regions of larger user buffers stay registered for the next calls (a
 * training loop all-reduces the same gradient buckets every step): a
 * registration and a deregistration are two round trips to the progress
 * thread, ~50 us per buffer and call on a busy 2-core host. Safe to keep
 * after the buffer is freed: they are registered without remote access, so
 * only operations this executor posts, during a call that passes that exact
 * range again, ever touch their memory. */
#define MR_CACHE 8
/* The bounce region has two slots of BOUNCE_BYTES. A bounced call (send and
 * recv copies apart in the slot) does not wait for the acknowledgement of a
 * SEND whose bytes nothing in the call writes once it is posted (no step
 * writes them but the SEND's own dependencies, chunk for chunk): it is
 * marked done when posted and completes in the background ("early" sends,
 * ctx bit 63, slot in bit 62); the next call uses the other slot, and a slot
 * is reused only once its early sends completed. A small all_reduce so waits
 * only for its RECVs (its all-gather's SENDs of the reduced shares too): the
 * acknowledgements' round trip and wake-up leave its critical path. */
/* Tiny calls (send and recv up to HOLD_BYTES, bounced) do not hand their
 * posts and completions across threads at all: for busy_poll_us the calling
 * thread holds the endpoint's progress and runs its passes itself
 * (mrc_ep_progress), then leaves the sockets to the next call for as long
 * (the progress thread stays asleep: no wake-up per arrival in a loop of
 * them). Shaped fabric, 8 B and 4 KiB all_reduce: 2 ranks (one spinning
 * thread per rank, two cores) 14-21 us against 25-33 us with the progress
 * thread's busy poll; 4 ranks (four spinning threads on two cores) 0-20%
 * faster, within the noise in some rounds. Not above: holding calls up to
 * 64 KiB made 8-32 KiB 2.8-6.7x slower at 2 ranks (8 KiB 285 against 49 us)
 * and 1.0-1.26x at 4. */
#define HOLD_BYTES 4096u
#define CTX_EARLY (1ull << 63)
#define CTX_SLOT (1ull << 62)

struct mrc_coll {
    mrc_ep *ep;
    mrc_cq *cq;
    mrc_cq *bg;             /* early sends' completions: they never end a wait for cq's */
    int rank, nranks;
    mrc_conn **peers;
    /* runs that sent to (2 * peer) and received from (2 * peer + 1) each peer: the
     * tag's sequence field. Per direction, so that the k-th run that sends to a
     * peer pairs with the peer's k-th run that receives from this rank: a p2p
     * send and a recv with one peer are two streams, not one (an exchange of
     * isend + irecv on both ranks matched send with send). */
    uint32_t *seq;
    /* per peer: -1, or the runs it had made with us when it closed
     * (mrc_coll_peer_gone, from another thread) */
    _Atomic int64_t *gone_after;
    uint64_t chunk;
    int slots, window;
    uint32_t busy_poll_us;  /* small (bounced) runs: this long of mrc_ep_busy_poll, or
                             * up to HOLD_BYTES of progress run here (mrc_ep_progress) */
    atomic_int aborted;
    uint8_t *scratch;       /* rings, registered as scratch_mr */
    uint64_t scratch_len;
    mrc_mr *scratch_mr;
    uint8_t *tmp;           /* one chunk: REDUCE whose destination is also a source */
    /* left by a failed run until mrc_coll_drain */
    int pending;            /* posted operations not yet completed */
    mrc_mr *user_mr[2];     /* regions of the send and recv buffers */
    struct {
        mrc_mr *mr;
        const void *addr;
        uint64_t len, used;
    } mrs[MR_CACHE];        /* user regions kept registered, least recently used goes */
    uint64_t mr_clock;
    uint64_t mr_base[2];    /* where each buffer starts in its region */
    bool bounced;           /* this run's buffers are copies in bounce */
    uint8_t *bounce;        /* 2 slots of BOUNCE_BYTES, registered as bounce_mr */
    mrc_mr *bounce_mr;
    int slot;               /* the bounce slot of the last bounced run */
    int lingering;          /* early sends not yet completed (also in pending) */
    int slot_pending[2];    /* of them, per slot */
    int late_rc, late_peer; /* the first early send that failed, for the next run */
};

/* Per run: state of each step. */
struct step_rt {
    uint32_t nchunks, next, ndone, inflight;
    uint8_t *done;          /* per chunk */
    int ring;               /* scratch ring this step produces, or -1 */
    bool settled;           /* SEND: nothing writes its bytes once posted (early_sends) */
};

struct ring_rt {
    int producer;
    uint32_t nconsumers;
    uint32_t *consumers;
};

struct run {
    mrc_coll *c;
    const struct mrc_coll_plan *p;
    const struct mrc_coll_args *a;
    uint64_t asked_ms; /* when a->interrupted was last asked */
    struct step_rt *st;
    struct ring_rt *rings;
    uint32_t *consumer_pool;
    uint8_t *done_pool;
    /* per peer and direction (0 send, 1 recv): its steps in pair_seq order */
    uint32_t **list;
    uint32_t *nlist, *inflight;
    uint8_t *bufs[2];
    uint64_t buf_len[2];
    uint64_t stage_at;      /* where MRC_BUF_STAGE starts in scratch: after the rings */
    size_t esize;
    uint32_t steps_done;
    int rc, failed_peer;
    bool early;             /* settled SENDs are early (bounced apart: see BOUNCE_BYTES) */
    uint64_t hold_until;    /* tiny calls: this thread drives the progress until then (us) */
    bool held;              /* it holds the endpoint's progress now */
};

static uint64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static uint64_t now_ms(void) { return now_us() / 1000u; }

/* Bit 63 stays clear, so no tag is MRC_TAG_ANY. */
static uint64_t make_tag(uint32_t sig, uint32_t seq, uint32_t pair_seq, uint32_t chunk)
{
    return ((uint64_t)(sig & 0x7ffffu) << 44) | ((uint64_t)(seq & 0xfffu) << 32) |
           ((uint64_t)(pair_seq & 0xffu) << 24) | (chunk & 0xffffffu);
}

/* ---- life cycle ---------------------------------------------------------- */

int mrc_coll_create(mrc_ep *ep, const struct mrc_coll_config *cfg, mrc_coll **out)
{
    if (!ep || !cfg || !out || cfg->nranks < 1 || cfg->rank < 0 || cfg->rank >= cfg->nranks ||
        (cfg->nranks > 1 && !cfg->peers) || cfg->chunk_bytes % 8 || cfg->slots < 0 ||
        cfg->window < 0)
        return MRC_EUSAGE;
    for (int r = 0; r < cfg->nranks && cfg->nranks > 1; r++)
        if ((r == cfg->rank) != (cfg->peers[r] == NULL))
            return MRC_EUSAGE;
    mrc_coll *c = calloc(1, sizeof(*c));
    if (!c)
        return -ENOMEM;
    c->ep = ep;
    c->rank = cfg->rank;
    c->nranks = cfg->nranks;
    c->chunk = cfg->chunk_bytes ? cfg->chunk_bytes : DEFAULT_CHUNK;
    c->slots = cfg->slots ? cfg->slots : DEFAULT_SLOTS;
    c->window = cfg->window ? cfg->window : c->slots;
    c->busy_poll_us = cfg->busy_poll_us;
    atomic_init(&c->aborted, 0);
    c->peers = calloc((size_t)c->nranks, sizeof(*c->peers));
    c->seq = calloc(2 * (size_t)c->nranks, sizeof(*c->seq));
    c->gone_after = calloc((size_t)c->nranks, sizeof(*c->gone_after));
    c->tmp = malloc(c->chunk);
    int rc = -ENOMEM;
    if (!c->peers || !c->seq || !c->gone_after || !c->tmp)
        goto free_c;
    for (int i = 0; i < c->nranks; i++)
        atomic_init(&c->gone_after[i], -1);
    if (cfg->nranks > 1)
        memcpy(c->peers, cfg->peers, (size_t)c->nranks * sizeof(*c->peers));
    rc = mrc_cq_create(ep, &c->cq);
    if (rc)
        goto free_c;
    rc = mrc_cq_create(ep, &c->bg);
    if (rc) {
        mrc_cq_destroy(c->cq);
        goto free_c;
    }
    *out = c;
    return 0;
free_c:
    free(c->tmp);
    free(c->gone_after);
    free(c->seq);
    free(c->peers);
    free(c);
    return rc;
}

void mrc_coll_abort(mrc_coll *c) { atomic_store(&c->aborted, 1); }

uint32_t mrc_coll_runs(const mrc_coll *c, int peer)
{
    return c && peer >= 0 && peer < c->nranks ? c->seq[2 * peer] : 0;
}

int mrc_coll_peer_gone(mrc_coll *c, int peer, uint32_t runs)
{
    if (!c || peer < 0 || peer >= c->nranks || peer == c->rank)
        return MRC_EUSAGE;
    atomic_store(&c->gone_after[peer], (int64_t)runs);
    return 0;
}


uint64_t mrc_coll_scratch_bytes(const mrc_coll *c) { return c->scratch_len; }

/* A region for exactly [addr, addr + len): the cached one, or a new one that
 * takes the least recently used entry's place. */
static int user_mr_get(mrc_coll *c, void *addr, uint64_t len, mrc_mr **out)
{
    int victim = 0;
    for (int i = 0; i < MR_CACHE; i++) {
        if (c->mrs[i].mr && c->mrs[i].addr == addr && c->mrs[i].len == len) {
            c->mrs[i].used = ++c->mr_clock;
            *out = c->mrs[i].mr;
            return 0;
        }
        if (c->mrs[i].used < c->mrs[victim].used)
            victim = i;
    }
    if (c->mrs[victim].mr) {
        /* Not the other buffer of this run: it was just stamped newest. No
         * operation holds an older run's region (a run starts only once
         * every earlier operation completed, early sends use bounce). */
        int rc = mrc_mr_dereg(c->mrs[victim].mr);
        if (rc)
            return rc;
        c->mrs[victim].mr = NULL;
        c->mrs[victim].used = 0;
    }
    int rc = mrc_mr_reg(c->ep, addr, len, 0, &c->mrs[victim].mr);
    if (rc)
        return rc;
    c->mrs[victim].addr = addr;
    c->mrs[victim].len = len;
    c->mrs[victim].used = ++c->mr_clock;
    *out = c->mrs[victim].mr;
    return 0;
}

static void user_mrs_free(mrc_coll *c)
{
    for (int i = 0; i < MR_CACHE; i++)
        if (c->mrs[i].mr)
            mrc_mr_dereg(c->mrs[i].mr);
}

void mrc_coll_destroy(mrc_coll *c)
{
    if (!c)
        return;
    /* Early sends of the last runs: their acknowledgements are on the way
     * (every peer that finished its call has the data). */
    if (c->pending && c->pending == c->lingering)
        mrc_coll_drain(c, 1000);
    /* Operations still pending (a failed run nobody drained) reference the
     * regions: leave them to mrc_ep_destroy rather than free them under it. */
    if (!c->pending) {
        user_mrs_free(c);
        if (c->scratch_mr)
            mrc_mr_dereg(c->scratch_mr);
        free(c->scratch);
        if (c->bounce_mr)
            mrc_mr_dereg(c->bounce_mr);
        free(c->bounce);
        mrc_cq_destroy(c->cq);
        mrc_cq_destroy(c->bg);
    }
    free(c->tmp);
    free(c->gone_after);
    free(c->seq);
    free(c->peers);
    free(c);
}

/* Grows the scratch rings to `len` bytes (never shrinks: the next call of the
 * same size reuses them without registering again). */
static int scratch_reserve(mrc_coll *c, uint64_t len)
{
    if (len <= c->scratch_len)
        return 0;
    if (c->scratch_mr)
        mrc_mr_dereg(c->scratch_mr);
    free(c->scratch);
    c->scratch_mr = NULL;
    c->scratch_len = 0;
    c->scratch = aligned_alloc(64, (len + 63) & ~(uint64_t)63);
    if (!c->scratch)
        return -ENOMEM;
    int rc = mrc_mr_reg(c->ep, c->scratch, len, 0, &c->scratch_mr);
    if (rc) {
        free(c->scratch);
        c->scratch = NULL;
        return rc;
    }
    c->scratch_len = len;
    return 0;
}

/* ---- plan checks --------------------------------------------------------- */

static uint32_t nchunks_of(const mrc_coll *c, uint64_t len)
{
    return len ? (uint32_t)((len + c->chunk - 1) / c->chunk) : 1; /* empty: one 0-byte message */
}

static int check_ref(const struct run *r, uint32_t i, uint64_t len)
{
    if (i >= r->p->nrefs)
        return MRC_EUSAGE;
    const struct mrc_coll_ref *f = &r->p->refs[i];
    if (f->buf == MRC_BUF_SCRATCH)
        return f->off < r->p->nrings ? 0 : MRC_EUSAGE;
    if (f->buf > MRC_BUF_STAGE)
        return MRC_EUSAGE;
    uint64_t blen = f->buf == MRC_BUF_STAGE ? r->p->stage_bytes : r->buf_len[f->buf];
    return f->off <= blen && len <= blen - f->off ? 0 : MRC_EUSAGE;
}

/* Everything the run relies on: refs inside their buffers, dependencies on
 * earlier steps, one producer per ring whose readers depend on it with the
 * same chunking, pair_seq 0, 1, ... per peer and direction. */
static int check_plan(struct run *r)
{
    const struct mrc_coll_plan *p = r->p;
    mrc_coll *c = r->c;
    for (uint32_t s = 0; s < p->nsteps; s++) {
        const struct mrc_coll_step *t = &p->steps[s];
        if (t->len % r->esize || t->dep > p->ndeps || t->ndeps > p->ndeps - t->dep)
            return MRC_EUSAGE;
        for (uint32_t d = 0; d < t->ndeps; d++)
            if (p->deps[t->dep + d] >= s)
                return MRC_EUSAGE;
        bool xfer = t->kind == MRC_STEP_SEND || t->kind == MRC_STEP_RECV;
        if (xfer && (t->peer < 0 || t->peer >= c->nranks || t->peer == c->rank))
            return MRC_EUSAGE;
        switch (t->kind) {
        case MRC_STEP_SEND:
            if (t->nsrc != 1 || check_ref(r, t->src, t->len))
                return MRC_EUSAGE;
            break;
        case MRC_STEP_RECV:
            if (check_ref(r, t->dst, t->len))
                return MRC_EUSAGE;
            break;
        case MRC_STEP_REDUCE:
        case MRC_STEP_COPY:
            if (t->nsrc < 1 || (t->kind == MRC_STEP_COPY && t->nsrc != 1) ||
                t->src > p->nrefs || t->nsrc > p->nrefs - t->src || check_ref(r, t->dst, t->len))
                return MRC_EUSAGE;
            for (uint32_t k = 0; k < t->nsrc; k++)
                if (check_ref(r, t->src + k, t->len))
                    return MRC_EUSAGE;
            break;
        default:
            return MRC_EUSAGE;
        }
        if (t->kind != MRC_STEP_SEND && p->refs[t->dst].buf == MRC_BUF_SCRATCH) {
            uint32_t k = (uint32_t)p->refs[t->dst].off;
            if (r->rings[k].producer >= 0)
                return MRC_EUSAGE;
            r->rings[k].producer = (int)s;
            r->st[s].ring = (int)k;
        }
    }
    return 0;
}

/* Whether a step writes bytes of the SEND s reads, other than as one of its
 * dependencies that writes the same bytes in the same chunks (so chunk i of
 * s, posted after that dependency's chunk i, is never written again) or
 * before s starts at all (another chunk count: s waits for all of it). */
static bool written_under(const struct run *r, uint32_t s, uint32_t w)
{
    const struct mrc_coll_plan *p = r->p;
    const struct mrc_coll_step *t = &p->steps[s], *u = &p->steps[w];
    const struct mrc_coll_ref *src = &p->refs[t->src], *dst = &p->refs[u->dst];
    if (w == s || u->kind == MRC_STEP_SEND || dst->buf != src->buf)
        return false;
    if (!(dst->off < src->off + t->len && src->off < dst->off + u->len) || !t->len || !u->len)
        return false;
    for (uint32_t d = 0; d < t->ndeps; d++)
        if (p->deps[t->dep + d] == w)
            return r->st[w].nchunks == r->st[s].nchunks && dst->off != src->off;
    return true;
}

/* The SENDs from the call's buffers that may be early (BOUNCE_BYTES). */
static void early_sends(struct run *r)
{
    const struct mrc_coll_plan *p = r->p;
    for (uint32_t s = 0; s < p->nsteps; s++) {
        const struct mrc_coll_step *t = &p->steps[s];
        if (t->kind != MRC_STEP_SEND || p->refs[t->src].buf > MRC_BUF_RECV)
            continue; /* scratch and stage are the next call's too */
        bool settled = true;
        for (uint32_t w = 0; w < p->nsteps && settled; w++)
            settled = !written_under(r, s, w);
        r->st[s].settled = settled;
    }
}

/* Consumers of each ring; each must depend on the producer, chunk for chunk. */
static int link_rings(struct run *r)
{
    const struct mrc_coll_plan *p = r->p;
    uint32_t total = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (uint32_t s = 0; s < p->nsteps; s++) {
            const struct mrc_coll_step *t = &p->steps[s];
            if (t->kind == MRC_STEP_RECV)
                continue;
            for (uint32_t k = 0; k < t->nsrc; k++) {
                const struct mrc_coll_ref *f = &p->refs[t->src + k];
                if (f->buf != MRC_BUF_SCRATCH)
                    continue;
                struct ring_rt *g = &r->rings[f->off];
                if (pass == 0) {
                    total++;
                    continue;
                }
                if (g->producer < 0 || r->st[g->producer].nchunks != r->st[s].nchunks)
                    return MRC_EUSAGE;
                bool dep = false;
                for (uint32_t d = 0; d < t->ndeps; d++)
                    dep |= p->deps[t->dep + d] == (uint32_t)g->producer;
                if (!dep)
                    return MRC_EUSAGE;
                g->consumers[g->nconsumers++] = s;
            }
        }
        if (pass == 0) {
            r->consumer_pool = calloc(total ? total : 1, sizeof(uint32_t));
            if (!r->consumer_pool)
                return -ENOMEM;
            /* Slice the pool: count per ring first. */
            uint32_t *cnt = calloc(p->nrings ? p->nrings : 1, sizeof(uint32_t));
            if (!cnt)
                return -ENOMEM;
            for (uint32_t s = 0; s < p->nsteps; s++) {
                const struct mrc_coll_step *t = &p->steps[s];
                if (t->kind == MRC_STEP_RECV)
                    continue;
                for (uint32_t k = 0; k < t->nsrc; k++)
                    if (p->refs[t->src + k].buf == MRC_BUF_SCRATCH)
                        cnt[p->refs[t->src + k].off]++;
            }
            uint32_t at = 0;
            for (uint32_t g = 0; g < p->nrings; g++) {
                r->rings[g].consumers = r->consumer_pool + at;
                at += cnt[g];
            }
            free(cnt);
        }
    }
    return 0;
}

/* Per peer and direction, the transfer steps in plan order, which must be
 * pair_seq order. */
static int build_lists(struct run *r)
{
    const struct mrc_coll_plan *p = r->p;
    for (uint32_t s = 0; s < p->nsteps; s++) {
        const struct mrc_coll_step *t = &p->steps[s];
        if (t->kind != MRC_STEP_SEND && t->kind != MRC_STEP_RECV)
            continue;
        int q = t->peer * 2 + (t->kind == MRC_STEP_RECV);
        if (t->pair_seq != r->nlist[q])
            return MRC_EUSAGE;
        r->list[q][r->nlist[q]++] = s;
    }
    return 0;
}

/* ---- chunk addressing ---------------------------------------------------- */

static uint64_t chunk_len(const struct run *r, const struct mrc_coll_step *t, uint32_t i)
{
    uint64_t off = (uint64_t)i * r->c->chunk;
    uint64_t left = t->len - (off < t->len ? off : t->len);
    return left < r->c->chunk ? left : r->c->chunk;
}

/* Address, region and region offset of chunk i of a step through ref f. */
static uint8_t *ref_chunk(const struct run *r, const struct mrc_coll_ref *f, uint32_t i,
                          mrc_mr **mr, uint64_t *loff)
{
    mrc_coll *c = r->c;
    uint64_t off;
    if (f->buf == MRC_BUF_SCRATCH) {
        off = (f->off * (uint64_t)c->slots + i % (uint32_t)c->slots) * c->chunk;
        if (mr)
            *mr = c->scratch_mr, *loff = off;
        return c->scratch + off;
    }
    off = f->off + (uint64_t)i * c->chunk;
    if (f->buf == MRC_BUF_STAGE) {
        off += r->stage_at;
        if (mr)
            *mr = c->scratch_mr, *loff = off;
        return c->scratch + off;
    }
    if (mr)
        *mr = c->user_mr[f->buf], *loff = c->mr_base[f->buf] + off;
    return r->bufs[f->buf] ? r->bufs[f->buf] + off : NULL;
}

/* ---- readiness ----------------------------------------------------------- */

static bool dep_done(const struct run *r, uint32_t d, uint32_t s, uint32_t i)
{
    const struct step_rt *sd = &r->st[d];
    if (sd->nchunks == r->st[s].nchunks)
        return sd->done[i];
    return sd->ndone == sd->nchunks;
}

static bool ready(const struct run *r, uint32_t s, uint32_t i)
{
    const struct mrc_coll_step *t = &r->p->steps[s];
    for (uint32_t d = 0; d < t->ndeps; d++)
        if (!dep_done(r, r->p->deps[t->dep + d], s, i))
            return false;
    int g = r->st[s].ring;
    if (g >= 0 && i >= (uint32_t)r->c->slots) {
        const struct ring_rt *ring = &r->rings[g];
        for (uint32_t k = 0; k < ring->nconsumers; k++)
            if (!r->st[ring->consumers[k]].done[i - (uint32_t)r->c->slots])
                return false;
    }
    return true;
}

static void mark_done(struct run *r, uint32_t s, uint32_t i)
{
    struct step_rt *st = &r->st[s];
    st->done[i] = 1;
    if (++st->ndone == st->nchunks)
        r->steps_done++;
}

/* ---- local steps ------------------------------------------------------------ */

static bool overlaps(const uint8_t *a, const uint8_t *b, uint64_t n)
{
    return n && a < b + n && b < a + n;
}

/* dst = srcs[0] op srcs[1] op ... in that order, then AVG's division. When the
 * destination is also a later source (in place, owner > 0), the sum is built
 * in tmp first so that no source is overwritten before it is read. */
static int run_reduce(struct run *r, const struct mrc_coll_step *t, uint32_t i)
{
    uint64_t len = chunk_len(r, t, i);
    if (!len)
        return 0;
    size_t count = len / r->esize;
    uint8_t *dst = ref_chunk(r, &r->p->refs[t->dst], i, NULL, NULL);
    const uint8_t *s0 = ref_chunk(r, &r->p->refs[t->src], i, NULL, NULL);
    bool alias = dst != s0 && overlaps(dst, s0, len);
    for (uint32_t k = 1; k < t->nsrc && !alias; k++)
        alias = overlaps(dst, ref_chunk(r, &r->p->refs[t->src + k], i, NULL, NULL), len);
    uint8_t *acc = alias ? r->c->tmp : dst;
    if (acc != s0)
        memcpy(acc, s0, len);
    int rc = 0;
    for (uint32_t k = 1; k < t->nsrc && !rc; k++)
        rc = mrc_reduce(acc, ref_chunk(r, &r->p->refs[t->src + k], i, NULL, NULL), count,
                        r->a->dtype, r->a->op);
    if (!rc && (t->flags & MRC_STEP_FINISH))
        rc = mrc_reduce_finish(acc, count, r->a->dtype, r->a->op, r->c->nranks);
    if (alias)
        memcpy(dst, acc, len);
    return rc;
}

static int run_local(struct run *r, uint32_t s, uint32_t i)
{
    const struct mrc_coll_step *t = &r->p->steps[s];
    if (t->kind == MRC_STEP_REDUCE)
        return run_reduce(r, t, i);
    uint64_t len = chunk_len(r, t, i);
    uint8_t *dst = ref_chunk(r, &r->p->refs[t->dst], i, NULL, NULL);
    const uint8_t *src = ref_chunk(r, &r->p->refs[t->src], i, NULL, NULL);
    if (len && dst != src)
        memmove(dst, src, len);
    return 0;
}

/* ---- posting ------------------------------------------------------------- */

static int post_chunk(struct run *r, uint32_t s, uint32_t i)
{
    const struct mrc_coll_step *t = &r->p->steps[s];
    mrc_coll *c = r->c;
    /* MRC_POST_MORE: the progress thread is woken once for the whole batch
     * (main_loop kicks it after issue()). */
    struct mrc_wr wr = {.cq = c->cq,
                        .flags = MRC_POST_MORE,
                        .ctx = ((uint64_t)s << 32) | i,
                        .len = chunk_len(r, t, i)};
    if (t->kind == MRC_STEP_SEND) {
        wr.kind = MRC_OP_SEND;
        ref_chunk(r, &r->p->refs[t->src], i, &wr.mr, &wr.loff);
        wr.tag = make_tag(r->a->sig, c->seq[2 * t->peer], t->pair_seq, i);
    } else {
        wr.kind = MRC_OP_RECV;
        ref_chunk(r, &r->p->refs[t->dst], i, &wr.mr, &wr.loff);
        wr.tag = MRC_TAG_ANY;
    }
    if (!wr.len)
        wr.loff = 0; /* an empty chunk may sit at the end of its buffer */
    bool early = r->early && t->kind == MRC_STEP_SEND && r->st[s].settled;
    if (early) {
        wr.ctx |= CTX_EARLY | (c->slot ? CTX_SLOT : 0);
        wr.cq = c->bg;
        wr.flags |= MRC_POST_LAZY_ACK; /* their ACKs may ride on the peers' next data */
    }
    int rc = mrc_post(c->peers[t->peer], &wr, NULL);
    if (rc)
        return rc;
    c->pending++;
    if (early) {
        c->lingering++;
        c->slot_pending[c->slot]++;
        return 1;
    }
    return 0;
}

/* The step whose next chunk is the next message of queue q (a peer and
 * direction): chunk i of a step is message key i + lag, ties to the lower
 * pair_seq; both ends compute the same order from the same steps. Lag lets a
 * later phase interleave with an earlier one (all-gather chunk i after
 * reduce-scatter chunk i + lag) instead of waiting for all of it, so its
 * RECVs are posted before its data arrives and nothing is staged. Every
 * message depends only on messages of lower keys, so the order cannot
 * deadlock. */
static int next_message(const struct run *r, int q)
{
    int best = -1;
    uint64_t best_key = UINT64_MAX;
    for (uint32_t k = 0; k < r->nlist[q]; k++) {
        uint32_t s = r->list[q][k];
        const struct step_rt *st = &r->st[s];
        if (st->next >= st->nchunks)
            continue;
        uint64_t key = (uint64_t)st->next + r->p->steps[s].lag;
        if (key < best_key) {
            best_key = key;
            best = (int)s;
        }
    }
    return best;
}

/* Starts every chunk that can start: local steps run now, transfers are
 * posted in pair order up to the window. Returns how many started, or an
 * error (r->rc set). */
static int issue(struct run *r)
{
    const struct mrc_coll_plan *p = r->p;
    int started = 0;
    for (uint32_t s = 0; s < p->nsteps; s++) {
        const struct mrc_coll_step *t = &p->steps[s];
        struct step_rt *st = &r->st[s];
        if (t->kind != MRC_STEP_REDUCE && t->kind != MRC_STEP_COPY)
            continue;
        while (st->next < st->nchunks && ready(r, s, st->next)) {
            int rc = run_local(r, s, st->next);
            if (rc) {
                r->rc = rc;
                return rc;
            }
            mark_done(r, s, st->next++);
            started++;
        }
    }
    for (int q = 0; q < 2 * r->c->nranks; q++) {
        while ((int)r->inflight[q] < r->c->window) {
            int sn = next_message(r, q);
            if (sn < 0)
                break;
            uint32_t s = (uint32_t)sn;
            struct step_rt *st = &r->st[s];
            if (!ready(r, s, st->next))
                break;
            int rc = post_chunk(r, s, st->next);
            if (rc < 0) {
                r->rc = rc;
                r->failed_peer = q / 2;
                return rc;
            }
            if (rc == 1) {
                mark_done(r, s, st->next++); /* early: its completion comes later */
            } else {
                st->next++;
                st->inflight++;
                r->inflight[q]++;
            }
            started++;
        }
    }
    return started;
}

/* ---- completions --------------------------------------------------------- */

static void complete(struct run *r, const struct mrc_wc *wc)
{
    mrc_coll *c = r->c;
    c->pending--;
    if (wc->ctx & CTX_EARLY) {
        c->lingering--;
        c->slot_pending[(wc->ctx & CTX_SLOT) ? 1 : 0]--;
        if (wc->status && !c->late_rc) {
            c->late_rc = wc->status;
            c->late_peer = -1;
            for (int p = 0; p < c->nranks; p++)
                if (c->peers[p] && c->peers[p] == wc->conn)
                    c->late_peer = p;
        }
        return;
    }
    uint32_t s = (uint32_t)((wc->ctx & ~(CTX_EARLY | CTX_SLOT)) >> 32), i = (uint32_t)wc->ctx;
    if (!r->p || s >= r->p->nsteps)
        return; /* draining after a failure: only the count matters */
    const struct mrc_coll_step *t = &r->p->steps[s];
    int q = t->peer * 2 + (t->kind == MRC_STEP_RECV);
    r->inflight[q]--;
    r->st[s].inflight--;
    if (r->rc)
        return;
    int rc = wc->status;
    if (rc == MRC_ETRUNC)
        rc = MRC_EMISMATCH; /* the peer sent more than this rank expects */
    if (!rc && t->kind == MRC_STEP_RECV &&
        (wc->tag != make_tag(r->a->sig, c->seq[2 * t->peer + 1], t->pair_seq, i) ||
         wc->bytes != chunk_len(r, t, i)))
        rc = MRC_EMISMATCH;
    if (rc) {
        r->rc = rc;
        r->failed_peer = t->peer;
        return;
    }
    mark_done(r, s, i);
}

/* The peer to blame when nothing moved for the timeout: one that has not
 * acknowledged this rank's data (a live peer acknowledges even what it is not
 * ready for), else one whose posted RECVs got nothing (a full scratch ring
 * posts none, so a peer merely slowed by another one is not named), else the
 * first one this rank still expects a message from. */
static int waited_peer(const struct run *r)
{
    static const uint32_t order[3] = {MRC_STEP_SEND, MRC_STEP_RECV, 0};
    for (int pass = 0; pass < 3; pass++)
        for (uint32_t s = 0; s < r->p->nsteps; s++) {
            const struct mrc_coll_step *t = &r->p->steps[s];
            if (pass < 2 && t->kind == order[pass] && r->st[s].inflight)
                return t->peer;
            if (pass == 2 && t->kind == MRC_STEP_RECV && r->st[s].ndone < r->st[s].nchunks)
                return t->peer;
        }
    return -1;
}

/* The peer this run waits on closed before making it: every run in which it
 * sent to this rank (gone_after) this rank has received in (seq), so what it
 * waits for can never come. */
static bool waits_on_gone(const struct run *r, int *peer)
{
    int w = waited_peer(r);
    if (w < 0)
        return false;
    int64_t after = atomic_load(&r->c->gone_after[w]);
    if (after < 0 || (int64_t)r->c->seq[2 * w + 1] < after)
        return false;
    *peer = w;
    return true;
}

/* How many completions to sleep for: once every transfer of the run is
 * posted nothing new can be posted, so one wake-up for all of them (what is
 * left to do, the local steps, runs right after) instead of one per
 * completion; before that, any completion may let a chunk start. */
static int wake_count(const struct run *r)
{
    if (!r->p)
        return 1;
    for (uint32_t s = 0; s < r->p->nsteps; s++) {
        const struct mrc_coll_step *t = &r->p->steps[s];
        if ((t->kind == MRC_STEP_SEND || t->kind == MRC_STEP_RECV) &&
            r->st[s].next < r->st[s].nchunks)
            return 1;
    }
    uint32_t n = 0;
    for (int q = 0; q < 2 * r->c->nranks; q++)
        n += r->inflight[q];
    return n > WC_BATCH ? WC_BATCH : n ? (int)n : 1;
}

/* Waits up to ms for completions on q (for min of them) and handles them:
 * >0 handled, 0 none. */
static int reap_q(struct run *r, mrc_cq *q, int ms, int min)
{
    struct mrc_wc wc[WC_BATCH];
    int n = mrc_cq_poll(q, wc, WC_BATCH);
    if (n == 0 && ms)
        n = mrc_cq_wait_min(q, wc, WC_BATCH, min, ms);
    if (n == -ETIMEDOUT)
        return 0;
    if (n < 0) {
        if (!r->rc)
            r->rc = n;
        return n;
    }
    for (int k = 0; k < n; k++)
        complete(r, &wc[k]);
    return n;
}

/* The early sends that completed, then up to ms for the run's own. */
static int reap(struct run *r, int ms)
{
    if (r->c->lingering) {
        int n = reap_q(r, r->c->bg, 0, 1);
        if (n < 0)
            return n;
    }
    return reap_q(r, r->c->cq, ms, wake_count(r));
}

/* Tiny calls (see HOLD_BYTES): takes the endpoint's progress if the call's
 * window is still open and the progress thread is not in a pass. */
static void hold_try(struct run *r)
{
    if (r->held || !r->hold_until)
        return;
    int h = mrc_ep_progress_begin(r->c->ep);
    r->held = h == 1;
    if (h < 0)
        r->hold_until = 0; /* stopping */
}

/* Gives the progress back: quiet for busy_poll_us if the call ended (the next
 * tiny call of a loop finds its arrivals waiting), else at once (this thread
 * now sleeps on its CQ and the progress thread must read the sockets). */
static void hold_end(struct run *r, bool ended)
{
    if (!r->held)
        return;
    mrc_ep_progress_end(r->c->ep, ended ? r->c->busy_poll_us : 0);
    r->held = false;
}

/* One progress pass on this thread, then the completions it published;
 * yields the CPU when neither did anything (the peers' ranks may share it). */
static int reap_held(struct run *r)
{
    int rc = mrc_ep_progress(r->c->ep);
    if (rc < 0) {
        hold_end(r, false); /* stopping: the thread fails the operations */
        r->hold_until = 0;
    }
    int got = reap(r, 0);
    if (rc == 0 && got == 0)
        sched_yield();
    return got;
}

static int main_loop(struct run *r)
{
    mrc_coll *c = r->c;
    uint64_t last = now_ms();
    hold_try(r); /* before the posts: then they wake no one */
    while (!r->rc && r->steps_done < r->p->nsteps) {
        if (atomic_load(&c->aborted)) {
            r->rc = MRC_EABORT;
            break;
        }
        int started;
        while ((started = issue(r)) > 0)
            last = now_ms();
        if (!r->held)
            mrc_ep_kick(c->ep); /* the posts above (if any) did not wake the progress thread */
        if (started < 0 || r->steps_done == r->p->nsteps)
            break;
        int got;
        if (r->hold_until && now_us() < r->hold_until) {
            hold_try(r);
            if (r->held) {
                got = reap_held(r);
            } else {
                got = reap(r, 0); /* the thread is in a pass: look again after it */
                if (!got)
                    sched_yield();
            }
        } else {
            hold_end(r, false); /* the window closed: sleep, the thread takes over */
            r->hold_until = 0;
            got = reap(r, WAIT_SLICE_MS);
        }
        if (got < 0)
            break;
        if (got > 0) {
            last = now_ms();
        } else if (r->a->timeout_ms >= 0 && now_ms() - last > (uint64_t)r->a->timeout_ms) {
            r->rc = MRC_ESTALLED; /* not ETIMEOUT: that is a connection's own */
            r->failed_peer = waited_peer(r);
        } else if (waits_on_gone(r, &r->failed_peer)) {
            r->rc = MRC_EGONE;
        } else if (r->a->interrupted && now_ms() - r->asked_ms >= INTERRUPT_ASK_MS) {
            r->asked_ms = now_ms();
            if (r->a->interrupted(r->a->interrupt_arg))
                r->rc = MRC_EABORT;
        }
    }
    hold_end(r, true);
    return r->rc;
}

/* After a mismatch, let this rank's own SENDs reach their peers (bounded by
 * the timeout), so that every rank sees the mismatch itself rather than a
 * connection closed under it. Early ones too: their acknowledgement says the
 * peer holds the data that shows it the mismatch, before this rank returns
 * and perhaps exits (which its peers hear of from the rendezvous). */
static void flush_sends(struct run *r)
{
    uint64_t until = now_ms() + (uint64_t)(r->a->timeout_ms > 0 ? r->a->timeout_ms : 1000);
    for (;;) {
        bool sending = false;
        for (int q = 0; q < 2 * r->c->nranks; q += 2)
            sending |= r->inflight[q] > 0;
        if ((!sending && !r->c->lingering) || now_ms() > until || atomic_load(&r->c->aborted))
            return;
        int n = sending ? reap(r, WAIT_SLICE_MS) : reap_q(r, r->c->bg, WAIT_SLICE_MS, 1);
        if (n < 0)
            return;
    }
}

/* ---- the run ------------------------------------------------------------- */

static int run_alloc(struct run *r)
{
    const struct mrc_coll_plan *p = r->p;
    int nq = 2 * r->c->nranks;
    r->st = calloc(p->nsteps ? p->nsteps : 1, sizeof(*r->st));
    r->rings = calloc(p->nrings ? p->nrings : 1, sizeof(*r->rings));
    r->list = calloc((size_t)nq, sizeof(*r->list));
    r->nlist = calloc((size_t)nq, sizeof(uint32_t));
    r->inflight = calloc((size_t)nq, sizeof(uint32_t));
    if (!r->st || !r->rings || !r->list || !r->nlist || !r->inflight)
        return -ENOMEM;
    for (int q = 0; q < nq; q++)
        if (!(r->list[q] = calloc(p->nsteps ? p->nsteps : 1, sizeof(uint32_t))))
            return -ENOMEM;
    for (uint32_t g = 0; g < p->nrings; g++)
        r->rings[g].producer = -1;
    uint64_t total = 0;
    for (uint32_t s = 0; s < p->nsteps; s++) {
        r->st[s].nchunks = nchunks_of(r->c, p->steps[s].len);
        r->st[s].ring = -1;
        total += r->st[s].nchunks;
    }
    r->done_pool = calloc(total ? total : 1, 1);
    if (!r->done_pool)
        return -ENOMEM;
    uint64_t at = 0;
    for (uint32_t s = 0; s < p->nsteps; s++) {
        r->st[s].done = r->done_pool + at;
        at += r->st[s].nchunks;
    }
    return 0;
}

static void run_free(struct run *r)
{
    if (r->list)
        for (int q = 0; q < 2 * r->c->nranks; q++)
            free(r->list[q]);
    free(r->list);
    free(r->nlist);
    free(r->inflight);
    free(r->st);
    free(r->rings);
    free(r->consumer_pool);
    free(r->done_pool);
}

/* Waits until bounce slot k has no early sends left (their peer's
 * acknowledgement is one round trip away), up to the call's timeout. */
static int slot_wait(mrc_coll *c, int k, int timeout_ms)
{
    struct run idle = {.c = c};
    uint64_t until = now_ms() + (uint64_t)(timeout_ms < 0 ? 0 : timeout_ms);
    while (c->slot_pending[k]) {
        if (atomic_load(&c->aborted))
            return MRC_EABORT;
        if (timeout_ms >= 0 && now_ms() > until)
            return MRC_ESTALLED;
        int n = reap_q(&idle, c->bg, WAIT_SLICE_MS, 1);
        if (n < 0)
            return n;
    }
    return 0;
}

/* Small calls: copies of the buffers in a bounce slot (recv too, so that
 * bytes the schedule does not write come back unchanged). The send copy gets
 * its own place even in place when both fit, so that its sends can be early. */
static int bounce_in(mrc_coll *c, struct run *r, const struct mrc_coll_args *a)
{
    bool same = a->recv == a->send && a->recv_len == a->send_len;
    uint64_t roff = (a->send_len + 63) & ~(uint64_t)63;
    bool split = roff + a->recv_len <= BOUNCE_BYTES;
    if (same && !split)
        roff = 0; /* in place, too big for two copies: one, no early sends */
    else if (!split)
        return 1;
    if (roff + a->recv_len > BOUNCE_BYTES)
        return 1;
    if (!c->bounce) {
        c->bounce = aligned_alloc(64, 2 * BOUNCE_BYTES);
        if (!c->bounce)
            return -ENOMEM;
        int rc = mrc_mr_reg(c->ep, c->bounce, 2 * BOUNCE_BYTES, 0, &c->bounce_mr);
        if (rc) {
            free(c->bounce);
            c->bounce = NULL;
            return rc;
        }
    }
    /* The other slot than last time, once its early sends are done. */
    int k = c->slot ^ 1;
    if (c->slot_pending[k] && !c->slot_pending[c->slot])
        k = c->slot;
    int rc = slot_wait(c, k, a->timeout_ms);
    if (rc)
        return rc;
    c->slot = k;
    uint8_t *base = c->bounce + (uint64_t)k * BOUNCE_BYTES;
    if (a->send_len)
        memcpy(base, a->send, a->send_len);
    if (roff && a->recv_len)
        memcpy(base + roff, a->recv, a->recv_len);
    r->bufs[0] = base;
    r->bufs[1] = base + roff;
    c->user_mr[0] = c->user_mr[1] = c->bounce_mr;
    c->mr_base[0] = (uint64_t)k * BOUNCE_BYTES;
    c->mr_base[1] = c->mr_base[0] + roff;
    c->bounced = true;
    /* A small call is a short exchange: its time is the hand-overs between
     * threads, not bytes. A tiny one runs the progress itself (HOLD_BYTES);
     * for a larger one the progress thread polls instead of sleeping through
     * it and into the gap before the next one, so neither the posts nor the
     * answers wait for a wake-up (mrc_ep_busy_poll). */
    if (c->busy_poll_us && a->send_len <= HOLD_BYTES && a->recv_len <= HOLD_BYTES)
        r->hold_until = now_us() + c->busy_poll_us; /* main_loop: this thread drives */
    else
        mrc_ep_busy_poll(c->ep, c->busy_poll_us);
    r->early = roff != 0;
    if (r->early)
        early_sends(r);
    return 0;
}

static int register_user(mrc_coll *c, struct run *r, const struct mrc_coll_args *a)
{
    int rc = bounce_in(c, r, a);
    if (rc <= 0)
        return rc;
    c->mr_base[0] = c->mr_base[1] = 0;
    rc = user_mr_get(c, a->send, a->send_len, &c->user_mr[0]);
    if (!rc)
        rc = user_mr_get(c, a->recv, a->recv_len, &c->user_mr[1]);
    if (rc)
        c->user_mr[0] = c->user_mr[1] = NULL;
    return rc;
}

int mrc_coll_run(mrc_coll *c, const struct mrc_coll_plan *p, const struct mrc_coll_args *a,
                 int *failed_peer)
{
    int dummy;
    failed_peer = failed_peer ? failed_peer : &dummy;
    *failed_peer = -1;
    if (!c || !p || !a || (p->nsteps && !p->steps) || (p->nrefs && !p->refs) ||
        (p->ndeps && !p->deps) || (a->send_len && !a->send) || (a->recv_len && !a->recv))
        return MRC_EUSAGE;
    if (c->pending > c->lingering)
        return MRC_EBUSY; /* a failed run was not drained */
    if (atomic_load(&c->aborted))
        return MRC_EABORT;
    if (c->lingering) {
        struct run idle = {.c = c};
        reap(&idle, 0); /* completions of earlier runs' early sends */
    }
    if (c->late_rc) {
        /* An earlier call's early send failed after that call returned. */
        int late = c->late_rc;
        *failed_peer = c->late_peer;
        c->late_rc = 0;
        return late;
    }
    struct run r = {.c = c, .p = p, .a = a, .failed_peer = -1, .asked_ms = now_ms()};
    r.esize = mrc_dtype_size(a->dtype);
    if (!r.esize || a->op < 0 || a->op >= MRC_NREDOPS)
        return MRC_EUSAGE;
    r.bufs[0] = a->send;
    r.bufs[1] = a->recv;
    r.buf_len[0] = a->send_len;
    r.buf_len[1] = a->recv_len;
    int rc = run_alloc(&r);
    if (!rc)
        rc = check_plan(&r);
    if (!rc)
        rc = link_rings(&r);
    if (!rc)
        rc = build_lists(&r);
    r.stage_at = (uint64_t)p->nrings * (uint64_t)c->slots * c->chunk;
    if (!rc && p->stage_bytes > UINT64_MAX - 64 - r.stage_at)
        rc = MRC_EUSAGE;
    if (!rc)
        rc = scratch_reserve(c, r.stage_at + p->stage_bytes);
    if (!rc)
        rc = register_user(c, &r, a);
    if (rc) {
        run_free(&r);
        return rc;
    }
    rc = main_loop(&r);
    if (rc == MRC_EMISMATCH)
        flush_sends(&r);
    *failed_peer = r.failed_peer;
    if (!rc && c->bounced && a->recv_len)
        memcpy(a->recv, r.bufs[1], a->recv_len);
    if (!rc) {
        for (int peer = 0; peer < c->nranks; peer++)
            for (int dir = 0; dir < 2; dir++)
                if (r.nlist[2 * peer + dir])
                    c->seq[2 * peer + dir]++;
    }
    run_free(&r);
    /* The regions stay in the cache (mrs), the bounce slot with its early
     * sends; operations a failed run left hold their regions themselves. */
    c->bounced = false;
    c->user_mr[0] = c->user_mr[1] = NULL;
    return rc;
}

int mrc_coll_drain(mrc_coll *c, int timeout_ms)
{
    struct run r = {.c = c};
    uint64_t until = now_ms() + (uint64_t)(timeout_ms < 0 ? 0 : timeout_ms);
    while (c->pending) {
        if (timeout_ms >= 0 && now_ms() > until)
            return -ETIMEDOUT;
        int n = c->pending > c->lingering ? reap(&r, WAIT_SLICE_MS)
                                          : reap_q(&r, c->bg, WAIT_SLICE_MS, 1);
        if (n < 0 && n != MRC_ECLOSED)
            return n;
        if (n == MRC_ECLOSED)
            break; /* the endpoint is going: it completes and frees them itself */
    }
    return c->pending ? MRC_EBUSY : 0;
}
