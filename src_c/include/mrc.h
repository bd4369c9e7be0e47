/*
 * mrc.h - public C API of the mrc datapath.
 *
 * A multipath, RDMA-style reliable transport over UDP: every connection sprays
 * its packets over all healthy paths (NIC planes x source routes), tracks each
 * path's delay and loss, retransmits lost packets on another path, and places
 * data straight into registered memory on arrival.
 *
 * Threading: every endpoint runs one progress thread that owns all datapath
 * state. The functions below may be called from any thread; they post work to
 * the progress thread and never touch packets themselves. No function here
 * calls back into the caller.
 *
 * Errors: functions return 0 or a negative code: -errno for system errors, or
 * one of MRC_E* below. mrc_strerror() names either kind.
 */
#ifndef MRC_H
#define MRC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MRC_VERSION_MAJOR 0
#define MRC_VERSION_MINOR 1

#define MRC_MAX_PLANES 16   /* local NIC planes per endpoint */
#define MRC_MAX_PATHS 64    /* paths per connection */
#define MRC_MAX_SEGS 8      /* SRv6 segments per path */
#define MRC_ADDR_STRLEN 64

/* mrc's own error codes (negative; -errno values are below 4096). */
enum mrc_err {
    MRC_EKEY = -5001,      /* remote refused a WRITE: unknown key */
    MRC_EBOUNDS = -5002,   /* remote refused a WRITE: outside the region */
    MRC_ETIMEOUT = -5003,  /* no progress on any path within the timeout */
    MRC_EPATHDOWN = -5004, /* every path to the peer has failed */
    MRC_ECLOSED = -5005,   /* connection closed (locally or by the peer) */
    MRC_EPROTO = -5006,    /* peer speaks another protocol version / bad hello */
    MRC_ETRUNC = -5007,    /* SEND larger than the matching RECV buffer */
    MRC_EUNREACH = -5008,  /* could not reach the peer to connect */
    MRC_EUSAGE = -5009,    /* invalid argument for this call */
    MRC_EREMOTE = -5010,   /* connection failed after a remote access error */
    MRC_ENOBUFS = -5011,   /* a fixed-size table is full */
    MRC_EBUSY = -5012,     /* object still in use by pending operations */
    MRC_ERNR = -5013,      /* receiver not ready: the peer posted no RECV within the RNR limit */
    MRC_EABORT = -5014,    /* aborted by the caller (collectives: mrc_coll_abort) */
    MRC_EMISMATCH = -5015, /* collectives: ranks called with different arguments */
    MRC_ENOTMRC = -5016,   /* connect: the port answered in another protocol */
    MRC_EGONE = -5017,     /* collectives: the peer closed without making this call */
    MRC_ESTALLED = -5018,  /* collectives: nothing completed within the run's timeout */
};

const char *mrc_strerror(int rc);

typedef struct mrc_ep mrc_ep;
typedef struct mrc_conn mrc_conn;
typedef struct mrc_mr mrc_mr;
typedef struct mrc_op mrc_op;

/* ---- endpoint ------------------------------------------------------------ */

struct mrc_ep_config {
    int nplanes;                            /* 1..MRC_MAX_PLANES */
    char planes[MRC_MAX_PLANES][MRC_ADDR_STRLEN]; /* local addresses, v4 or v6 */
    uint16_t udp_port;     /* 0: an ephemeral port per plane */
    uint32_t mss;          /* payload bytes per packet; 0: 8192 */
    uint32_t timeout_ms;   /* connection fails after this long without progress; 0: 5000 */
    uint32_t sockbuf;      /* SO_RCVBUF/SO_SNDBUF bytes; 0: 8 MiB */
    uint32_t window;       /* packets in flight per connection (power of 2); 0: 4096 */
    uint64_t max_unexpected; /* SEND bytes held per connection for RECVs not yet
                              * posted; beyond it the sender is told to back off
                              * (receiver not ready); 0: 64 MiB. Messages that
                              * overtook a lost one may take as much again.
                              * Each staged message also counts 256 bytes, so
                              * empty SENDs are bounded in number too. */
    int32_t rnr_timeout_ms;  /* how long a sender retries a peer that keeps
                              * answering receiver-not-ready before the
                              * connection fails with MRC_ERNR; 0: timeout_ms;
                              * < 0: for ever (verbs' rnr_retry = 7) */
};

void mrc_ep_config_init(struct mrc_ep_config *cfg);
int mrc_ep_create(const struct mrc_ep_config *cfg, mrc_ep **out);
/* Stops the progress thread; every pending operation fails with MRC_ECLOSED,
 * and so does an mrc_ep_accept blocked in another thread (waited for here).
 * Connections and regions not yet destroyed are freed with it (their handles
 * must not be used again, and no call on them may run concurrently with this
 * one). Operations stay the caller's: mrc_op_wait, mrc_op_done,
 * mrc_op_get_result and mrc_op_release remain valid on them afterwards (each
 * op keeps the endpoint's small core alive until it is released). */
void mrc_ep_destroy(mrc_ep *ep);
int mrc_ep_nplanes(const mrc_ep *ep);
/* 1 when this endpoint's SRv6 route sockets take their header from kernel
 * seg6 routes, so UDP GSO batches cross the fabric whole; 0 when they would
 * carry it as the socket's sticky header, which cuts every batch into
 * datagrams at the sender (MRC_SRH=socket, planes on `lo`, no CAP_NET_ADMIN,
 * or a kernel without SRv6 lightweight tunnels). Asks the kernel (a route
 * out of the first plane whose link is up, added to a table no rule names,
 * and removed). */
int mrc_ep_srh_offload(const mrc_ep *ep);
/* The plane's bound address and UDP port. */
int mrc_ep_plane(const mrc_ep *ep, int plane, char *addr, size_t addrlen, uint16_t *port);
/* CPU time the endpoint's progress thread has used, in nanoseconds; 0 when the
 * kernel cannot say. Any thread may ask, while the endpoint exists: a planner
 * learns from it whether the datapath, not the wire, set an operation's pace. */
uint64_t mrc_ep_progress_cpu_ns(const mrc_ep *ep);

/* Fault injection on a local plane, for tests and tools: each packet sent on
 * the plane is dropped with probability tx_loss; a plane marked down drops
 * everything it sends and receives, as a dead cable would. */
int mrc_ep_inject(mrc_ep *ep, int plane, double tx_loss, int down);

/* ---- connection set-up (out-of-band TCP exchange on any plane) ----------- */

/* A path: local plane, destination, optional SRv6 segment list (travel order,
 * the last segment is the destination). Paths are numbered by the caller;
 * path k must be the mirror of the peer's path k (same plane, same spine). */
struct mrc_path_spec {
    int id;              /* 0..MRC_MAX_PATHS-1 */
    int plane;           /* local plane index */
    char dst[MRC_ADDR_STRLEN];
    int nsegs;           /* 0: plain IP */
    char segs[MRC_MAX_SEGS][MRC_ADDR_STRLEN];
};

/* Listens on TCP `port` (0: an ephemeral one) of addr, or with addr NULL or ""
 * of every plane's address (one port for all), so clients reach the endpoint
 * over any plane that is up. Listening again replaces the listeners. */
int mrc_ep_listen(mrc_ep *ep, const char *addr, uint16_t port, uint16_t *bound_port);
/* Stops listening, and every set-up: an mrc_ep_accept or mrc_conn_connect
 * blocked in another thread returns MRC_ECLOSED within 50 ms (so that thread
 * can leave before mrc_ep_destroy); later accepts find no listener and later
 * connects MRC_ECLOSED. For the endpoint's closing. */
int mrc_ep_unlisten(mrc_ep *ep);
/* A connection under construction: add paths, then connect or establish. */
int mrc_conn_create(mrc_ep *ep, const char *name, mrc_conn **out);
/* With no paths added, the connection uses plane k -> peer plane k. */
int mrc_conn_add_path(mrc_conn *c, const struct mrc_path_spec *p);
/* port must be 1..65535; addr an IPv4 or IPv6 literal (no name resolution). */
int mrc_conn_connect(mrc_conn *c, const char *addr, uint16_t port, int timeout_ms);
/* Races a TCP connect to every address (the server's planes, 1..MRC_MAX_PLANES)
 * and sets the connection up over the first that answers; a set-up that
 * stalls (its plane went down) or fails for want of a route is tried again,
 * over the other addresses first, until timeout_ms. MRC_EUNREACH when no
 * address answers; errs (NULL, or naddrs entries) then holds each address's
 * last reason (a -errno). MRC_ENOTMRC: the port answered in another protocol;
 * MRC_ETIMEOUT: it accepted but sent no hello in time; MRC_ECLOSED: the peer
 * hung up every time. */
int mrc_conn_connect_any(mrc_conn *c, const char *const *addrs, int naddrs, uint16_t port,
                         int timeout_ms, int *errs);
/* Server side: waits up to timeout_ms for a complete hello; then the caller
 * may add paths (it knows the peer's name) and must call mrc_conn_establish().
 * A client that sends nothing, sends slowly or hangs up does not hold up other
 * clients or fail the call; its socket waits (for the endpoint's timeout) into
 * later calls. MRC_EUSAGE before mrc_ep_listen. */
int mrc_ep_accept(mrc_ep *ep, int timeout_ms, mrc_conn **out);
/* Server side, before mrc_conn_establish: this end's name, which the hello it
 * sends gives the peer (an accepted connection starts without one).
 * MRC_EUSAGE once established. */
int mrc_conn_set_name(mrc_conn *c, const char *name);
int mrc_conn_establish(mrc_conn *c, int timeout_ms);
const char *mrc_conn_peer_name(const mrc_conn *c);
int mrc_conn_peer_plane(const mrc_conn *c, int plane, char *addr, size_t addrlen);
int mrc_conn_npaths(const mrc_conn *c);
/* Closes the connection: pending operations fail with MRC_ECLOSED. Frees it.
 * SENDs the peer holds unmatched (completed at the sender, staged at the
 * peer) are discarded there: the peer's later RECVs fail with MRC_ECLOSED. */
void mrc_conn_destroy(mrc_conn *c);
/* 0 while usable, else the error that failed it. */
int mrc_conn_error(const mrc_conn *c);

/* ---- memory -------------------------------------------------------------- */

#define MRC_ACCESS_REMOTE_WRITE 0x1 /* peers may WRITE into it */
#define MRC_ACCESS_READONLY 0x2     /* read-only memory: a source of SEND and WRITE
                                     * only (RECVs into it are refused, and so is
                                     * MRC_ACCESS_REMOTE_WRITE with it) */

int mrc_mr_reg(mrc_ep *ep, void *addr, size_t len, int access, mrc_mr **out);
uint64_t mrc_mr_key(const mrc_mr *mr);
/* Deregisters and frees the region, as verbs does: MRC_EBUSY (and nothing
 * changes) while operations posted with it have not completed; the caller
 * waits for them, or destroys their connection, and tries again. On 0 the
 * progress thread no longer reads or places data in the region and the
 * handle is gone. Posts racing this call either count (then it is busy) or
 * are refused with MRC_EUSAGE. */
int mrc_mr_dereg(mrc_mr *mr);
/* Operations posted with the region and not yet completed (why dereg is busy). */
int mrc_mr_pending(const mrc_mr *mr);

/* ---- operations ---------------------------------------------------------- */

enum mrc_op_kind { MRC_OP_WRITE = 1, MRC_OP_SEND = 2, MRC_OP_RECV = 3 };

/* RDMA WRITE of [loff, loff+len) of the local region to remote region rkey at
 * roff. With MRC_WRITE_IMM the peer is told `imm` once every byte is placed
 * (and every earlier operation is complete). */
#define MRC_WRITE_IMM 0x1
int mrc_post_write(mrc_conn *c, mrc_mr *lmr, uint64_t loff, uint64_t len, uint64_t rkey,
                   uint64_t roff, uint32_t imm, int flags, mrc_op **out);
int mrc_post_send(mrc_conn *c, mrc_mr *lmr, uint64_t loff, uint64_t len, uint64_t tag,
                  mrc_op **out);
/* A RECV with this tag matches a message of any tag. */
#define MRC_TAG_ANY UINT64_MAX
int mrc_post_recv(mrc_conn *c, mrc_mr *lmr, uint64_t loff, uint64_t len, uint64_t tag,
                  mrc_op **out);

/* 0 once the op completed (its status tells how), -ETIMEDOUT if not yet.
 * timeout_ms < 0 waits forever. */
int mrc_op_wait(mrc_op *op, int timeout_ms);
int mrc_op_done(mrc_op *op);
struct mrc_op_result {
    int status;      /* 0 or a negative code */
    int kind;        /* enum mrc_op_kind */
    uint64_t bytes;  /* bytes transferred (RECV: message length) */
    uint64_t tag;    /* RECV: tag of the matched message */
};
void mrc_op_get_result(mrc_op *op, struct mrc_op_result *res);
/* Drops the caller's reference; the op may still be in flight. */
void mrc_op_release(mrc_op *op);

/* Immediate values of WRITE-with-immediate received on the connection, in
 * order: 0 and the value, or -ETIMEDOUT. */
int mrc_conn_wait_imm(mrc_conn *c, int timeout_ms, uint32_t *imm, uint64_t *len);

/* ---- completion queues --------------------------------------------------
 * (src_c/cq.c) A CQ belongs to one endpoint. Operations posted with mrc_post()
 * and a cq complete there, in completion order, with the post's 64-bit ctx;
 * immediates of a connection bound with mrc_conn_set_cq() arrive there as
 * MRC_WC_IMM entries instead of on mrc_conn_wait_imm(). Only waiters of this
 * CQ are woken by its completions. mrc_cq_fd() is readable (an eventfd) while
 * completions wait, so a CQ can join epoll/selectors/asyncio; do not read it
 * yourself: the poll that empties the CQ resets it. The queue needs no memory
 * of its own (an op's entry lives in the op) and never drops a completion. */
typedef struct mrc_cq mrc_cq;

enum mrc_wc_kind { MRC_WC_WRITE = 1, MRC_WC_SEND = 2, MRC_WC_RECV = 3, MRC_WC_IMM = 4 };

struct mrc_wc {
    uint64_t ctx;    /* the post's ctx; MRC_WC_IMM: the connection's ctx (mrc_conn_set_cq) */
    int status;      /* 0 or a negative code */
    int kind;        /* enum mrc_wc_kind */
    uint64_t bytes;  /* bytes transferred (RECV: message length; IMM: write length) */
    uint64_t tag;    /* RECV: tag of the matched message */
    uint32_t imm;    /* MRC_WC_IMM: the immediate value */
    mrc_conn *conn;  /* the connection it happened on */
};

int mrc_cq_create(mrc_ep *ep, mrc_cq **out);
/* MRC_EBUSY while operations posted to it are pending, connections bound to it
 * live or a thread waits in mrc_cq_wait; entries not yet polled are dropped.
 * mrc_ep_destroy frees CQs left open, after the endpoint's pending ops have
 * completed into them with MRC_ECLOSED and threads in mrc_cq_wait returned. */
int mrc_cq_destroy(mrc_cq *cq);
/* Shuts the CQ down without freeing it: threads in mrc_cq_wait return, and
 * from now on mrc_cq_wait returns MRC_ECLOSED once it is empty and mrc_post to
 * it fails with MRC_ECLOSED (ops already posted still complete into it).
 * Bindings call it before freeing the endpoint, so that no thread is left
 * about to wait on a CQ that goes. */
void mrc_cq_shutdown(mrc_cq *cq);
/* The eventfd is written only once it has been asked for: a CQ that is only
 * polled and waited on costs no write/read pair per completion batch. */
int mrc_cq_fd(mrc_cq *cq);
/* Up to max completions, never blocks: returns how many (>= 0) or a negative code. */
int mrc_cq_poll(mrc_cq *cq, struct mrc_wc *wc, int max);
/* Like poll, but blocks until at least one (returns n > 0) or -ETIMEDOUT;
 * timeout_ms < 0 waits forever. MRC_ECLOSED once the endpoint is being destroyed. */
int mrc_cq_wait(mrc_cq *cq, struct mrc_wc *wc, int max, int timeout_ms);
/* Like wait, but sleeps until at least min completions wait (fewer only on
 * timeout, or when shut down): a caller that can do nothing with fewer is not
 * woken once per completion. min <= 1 is mrc_cq_wait. */
int mrc_cq_wait_min(mrc_cq *cq, struct mrc_wc *wc, int max, int min, int timeout_ms);
/* cq NULL unbinds. Immediates already waiting for mrc_conn_wait_imm move to cq. */
int mrc_conn_set_cq(mrc_conn *c, mrc_cq *cq, uint64_t ctx);

/* One work request: the general form of mrc_post_write/send/recv. */
struct mrc_wr {
    int kind;                  /* MRC_OP_WRITE, MRC_OP_SEND, MRC_OP_RECV */
    int flags;                 /* MRC_WRITE_IMM, MRC_POST_MORE, MRC_POST_LAZY_ACK */
    mrc_mr *mr;                /* local region */
    uint64_t loff, len;
    uint64_t rkey, roff;       /* WRITE */
    uint32_t imm;              /* WRITE with MRC_WRITE_IMM */
    uint64_t tag;              /* SEND, RECV (MRC_TAG_ANY) */
    mrc_cq *cq;                /* NULL: complete only on the op handle */
    uint64_t ctx;              /* returned in the mrc_wc */
};
/* out may be NULL when wr->cq is set: the completion is then seen only on the CQ
 * and the op is freed once polled. mrc_post_write/send/recv are this with no CQ
 * (their out must not be NULL). */
int mrc_post(mrc_conn *c, const struct mrc_wr *wr, mrc_op **out);
/* MRC_POST_MORE: more posts follow at once, so a sleeping progress thread is
 * not woken for this one (sendmmsg's MSG_MORE idea: one wake-up, one drain for
 * a batch); a later post without it, or mrc_ep_kick(), wakes it. */
#define MRC_POST_MORE 0x100
/* MRC_POST_LAZY_ACK (WRITE, SEND): nothing waits on this operation's completion
 * soon (it only frees a buffer that is not needed again at once), so the
 * receiver may hold its ACKs a moment for data going back to carry them: one
 * datagram instead of two per message each way for small back-to-back
 * exchanges. The completion may come up to 0.5 ms later. */
#define MRC_POST_LAZY_ACK 0x200
void mrc_ep_kick(mrc_ep *ep);
/* Until `us` microseconds from now, each time the progress thread would
 * sleep it polls its sockets instead, yielding the CPU between looks (a thread
 * already asleep starts at its next wake-up: a post wakes it). A later call
 * may extend the deadline, never shorten it. For a caller about to post a
 * short exchange: the thread needs no wake-up for its posts or the answers. */
void mrc_ep_busy_poll(mrc_ep *ep, uint32_t us);
/* Caller-driven progress (libfabric's manual progress, for a thread about to
 * wait on a CQ for a short exchange): a thread holding the endpoint's
 * progress runs the progress thread's passes itself (mrc_ep_progress: takes
 * posts, receives, acknowledges, runs timers, transmits, publishes
 * completions, without sleeping), so neither its posts nor the answers wait
 * for a hand-over between threads; the progress thread waits meanwhile.
 * begin: 1 held; 0 the progress thread is in a pass (try again); MRC_ECLOSED
 * the endpoint is stopping; MRC_EUSAGE this thread already holds one.
 * mrc_ep_progress: 1 it did something, 0 nothing to do, MRC_ECLOSED stopping
 * (end now). While a thread holds it, requests that the progress thread
 * would run (regions, connections, stats) run on that thread; the holder
 * should end within a millisecond or so: other threads' posts wait for its
 * passes, and mrc_ep_destroy on the holder ends it first.
 * end's quiet_us: for that long the progress thread leaves the sockets to
 * the next holder (it wakes for posts, netlink and delayed ACKs, not for
 * arrivals or its timer scan), so that a loop of short exchanges costs it no
 * wake-up; 0: it takes over at once (the caller is about to sleep on a CQ).
 * A post by a thread not holding the progress ends the quiet (that work is
 * the thread's); an arrival for an operation posted before it waits for the
 * next holder or the end of the quiet. */
int mrc_ep_progress_begin(mrc_ep *ep);
int mrc_ep_progress(mrc_ep *ep);
void mrc_ep_progress_end(mrc_ep *ep, uint32_t quiet_us);

/* ---- collectives: reductions (reduce.c) ----------------------------------
 * acc[i] = acc[i] op src[i]. float16/bfloat16 (IEEE binary16 / the top half
 * of a float32, as uint16 bit patterns) are widened to float32, combined and
 * rounded to nearest-even at every call, so a fixed order of calls gives the
 * same bits everywhere. Integers wrap. AVG combines as SUM; after the last
 * source, mrc_reduce_finish() divides by n once (integers truncate toward 0). */
enum mrc_dtype {
    MRC_INT8 = 0, MRC_UINT8, MRC_INT32, MRC_INT64,
    MRC_FLOAT16, MRC_BFLOAT16, MRC_FLOAT32, MRC_FLOAT64,
    MRC_NDTYPES
};
enum mrc_redop { MRC_SUM = 0, MRC_PROD, MRC_MIN, MRC_MAX, MRC_AVG, MRC_NREDOPS };

size_t mrc_dtype_size(int dtype);     /* 0: unknown dtype */
const char *mrc_dtype_str(int dtype);
const char *mrc_redop_str(int op);
/* acc and src must not overlap. */
int mrc_reduce(void *acc, const void *src, size_t count, int dtype, int op);
int mrc_reduce_finish(void *acc, size_t count, int dtype, int op, int n);

/* ---- collectives: the schedule executor (coll.c) --------------------------
 * A schedule is one rank's list of steps; the planner (mrc/collectives/
 * schedule.py) builds it, this executor runs any schedule. Each step covers a
 * whole byte range; the executor cuts it into chunks of chunk_bytes and
 * pipelines them: chunk i of a step waits for chunk i of each step it depends
 * on (or for the whole step, when the two have different chunk counts).
 *
 * Buffers: MRC_BUF_SEND and MRC_BUF_RECV are the caller's (they may be the
 * same memory: in place); MRC_BUF_SCRATCH refs name a ring (ref.off = ring
 * index) of `slots` chunk-sized slots owned by the executor: chunk i of a
 * step lives in slot i % slots, and the ring's producer waits for chunk
 * i - slots to be consumed by every step reading it. So extra memory is
 * nrings * slots * chunk_bytes, whatever the message size. MRC_BUF_STAGE
 * refs are byte offsets into a contiguous area of plan.stage_bytes, also the
 * executor's (a small call's gathered inputs: the tree all_reduce); its
 * SENDs are never early.
 *
 * Messages: the SEND/RECV steps between two ranks are matched in one order
 * per direction: chunk i of a step is message i + lag, ties by pair_seq
 * (0, 1, ... numbered in plan order), so a later phase interleaves with an
 * earlier one; chunk_bytes must be the same on every rank; each message's tag
 * carries the call's signature, the pair's sequence number of collectives,
 * pair_seq and the chunk, and every received tag and length is checked:
 * ranks called with different arguments fail with MRC_EMISMATCH. */
enum mrc_step_kind {
    MRC_STEP_SEND = 1,   /* src ref -> peer */
    MRC_STEP_RECV = 2,   /* peer -> dst ref */
    MRC_STEP_REDUCE = 3, /* dst = srcs[0] op srcs[1] op ... (this order, always) */
    MRC_STEP_COPY = 4,   /* dst = srcs[0] */
};
enum mrc_buf { MRC_BUF_SEND = 0, MRC_BUF_RECV = 1, MRC_BUF_SCRATCH = 2, MRC_BUF_STAGE = 3 };

struct mrc_coll_ref {
    uint32_t buf;        /* enum mrc_buf */
    uint32_t pad;
    uint64_t off;        /* byte offset (SEND, RECV, STAGE); MRC_BUF_SCRATCH: ring index */
};

struct mrc_coll_step {
    uint32_t kind;       /* enum mrc_step_kind */
    int32_t peer;        /* SEND/RECV: rank */
    uint32_t pair_seq;   /* SEND/RECV: order among this pair's steps, per direction */
    uint32_t flags;      /* MRC_STEP_FINISH: REDUCE ends with mrc_reduce_finish */
    uint64_t len;        /* bytes (a multiple of the element size) */
    uint32_t src, nsrc;  /* refs[src .. src+nsrc): SEND 1, COPY 1, REDUCE >= 1 */
    uint32_t dst;        /* refs[dst]: RECV, REDUCE, COPY */
    uint32_t dep, ndeps; /* deps[dep .. dep+ndeps): indices of earlier steps */
    uint32_t lag;        /* SEND/RECV: chunk i is the pair's message i + lag (see below) */
};
#define MRC_STEP_FINISH 0x1

struct mrc_coll_plan {
    const struct mrc_coll_step *steps;
    uint32_t nsteps;
    uint32_t nrings;
    const struct mrc_coll_ref *refs;
    uint32_t nrefs;
    const uint32_t *deps;
    uint32_t ndeps;
    uint64_t stage_bytes; /* the MRC_BUF_STAGE area */
};

struct mrc_coll_args {
    void *send;          /* may equal recv; NULL when empty */
    uint64_t send_len;
    void *recv;
    uint64_t recv_len;
    int dtype, op;       /* enum mrc_dtype, mrc_redop (op: REDUCE steps only) */
    uint32_t sig;        /* signature of the call: equal on every rank (19 bits used) */
    int timeout_ms;      /* fail with MRC_ESTALLED after this long without progress (a
                          * connection's own timeout fails it sooner: MRC_ETIMEOUT) */
    /* Optional: asked at most every 100 ms while the run waits without progress;
     * nonzero ends it as mrc_coll_abort would (MRC_EABORT) for this run only.
     * A binding answers whether the user interrupted the wait (Ctrl-C). */
    int (*interrupted)(void *arg);
    void *interrupt_arg;
};

struct mrc_coll_config {
    int rank, nranks;
    mrc_conn *const *peers; /* nranks entries, NULL at rank */
    uint64_t chunk_bytes;   /* 0: 256 KiB; a multiple of 8 */
    int slots;              /* scratch slots per ring; 0: 4 */
    int window;             /* chunks in flight per peer and direction; 0: slots */
    uint32_t busy_poll_us;  /* runs small enough for the bounce slots: the progress
                             * thread polls for this long from their start
                             * (mrc_ep_busy_poll), or, up to 4 KiB, the calling
                             * thread runs the progress itself that long and leaves
                             * the sockets to the next call as long after
                             * (mrc_ep_progress); 0: neither */
};

typedef struct mrc_coll mrc_coll;
int mrc_coll_create(mrc_ep *ep, const struct mrc_coll_config *cfg, mrc_coll **out);
/* Runs the plan to completion on the calling thread. 0, or a negative code;
 * *failed_peer names the rank involved (-1: none). After a failure,
 * operations may still be pending: close the connections (their operations
 * then fail) and call mrc_coll_drain() before touching the buffers. */
int mrc_coll_run(mrc_coll *c, const struct mrc_coll_plan *plan, const struct mrc_coll_args *a,
                 int *failed_peer);
/* Any thread: the running (and every later) mrc_coll_run returns MRC_EABORT. */
void mrc_coll_abort(mrc_coll *c);
/* Waits until no operation of a failed run is pending (0), or -ETIMEDOUT. */
int mrc_coll_drain(mrc_coll *c, int timeout_ms);
/* Completed runs that sent to `peer` (between runs, not while one is under way). */
uint32_t mrc_coll_runs(const mrc_coll *c, int peer);
/* Any thread: `peer` closed after `runs` runs that sent to this rank. A run
 * (this or a later one) that waits on it without progress although this rank
 * has received in `runs` runs already, i.e. one the peer never made, returns
 * MRC_EGONE within a wait slice instead of waiting out its timeout. */
int mrc_coll_peer_gone(mrc_coll *c, int peer, uint32_t runs);
/* Scratch bytes currently held (for memory accounting). */
uint64_t mrc_coll_scratch_bytes(const mrc_coll *c);
void mrc_coll_destroy(mrc_coll *c);

/* ---- telemetry ----------------------------------------------------------- */

enum mrc_path_state { MRC_PATH_GOOD = 0, MRC_PATH_SUSPECT, MRC_PATH_FAILED, MRC_PATH_PROBING };
const char *mrc_path_state_str(int state);

/* Drop reasons on the receive path; each has a counter (NONE: not a drop). */
#define MRC_DROP_REASONS(X) \
    X(NONE, "none")                 \
    X(TRUNCATED, "truncated")       \
    X(BAD_MAGIC, "bad_magic")       \
    X(BAD_VERSION, "bad_version")   \
    X(BAD_TYPE, "bad_type")         \
    X(BAD_LENGTH, "bad_length")     \
    X(UNKNOWN_CONN, "unknown_conn") \
    X(BAD_PEER, "bad_peer")         \
    X(PSN_WINDOW, "psn_window")     \
    X(DUPLICATE, "duplicate")       \
    X(BAD_KEY, "bad_key")           \
    X(BAD_BOUNDS, "bad_bounds")     \
    X(BAD_ACK, "bad_ack")           \
    X(BAD_PATH, "bad_path")         \
    X(BAD_MSG, "bad_msg")           \
    X(NO_BUFFER, "no_buffer")       \
    X(INJECTED, "injected")         \
    X(CLOSED_CONN, "closed_conn")

enum mrc_drop {
#define MRC_X_ENUM(name, str) MRC_DROP_##name,
    MRC_DROP_REASONS(MRC_X_ENUM)
#undef MRC_X_ENUM
    MRC_DROP_MAX
};
const char *mrc_drop_str(int reason);

struct mrc_path_stats {
    int conn_index;        /* which connection (order of creation among live ones) */
    uint32_t conn_id;
    int id, plane, state;
    char dst[MRC_ADDR_STRLEN];
    int nsegs;
    uint64_t tx_pkts, tx_bytes, rx_pkts, rx_bytes;
    uint64_t retx;           /* packets retransmitted that were first sent here */
    uint64_t lost;           /* packets declared lost on this path */
    uint64_t injected;       /* packets dropped by fault injection */
    uint64_t probes;
    uint64_t srtt_ns, base_rtt_ns, cwnd_bytes, inflight_bytes;
    uint64_t state_changes;
    int conn_error;        /* 0 while the connection is up; else the MRC_E* that ended
                              it: its paths' states then stay as they were (no more
                              probes), so observers should not read them as current */
    char peer[64];         /* the peer's connection name (its hello), "" if none */
};

struct mrc_ep_stats {
    uint64_t drops[MRC_DROP_MAX];
    uint64_t tx_pkts, rx_pkts, tx_bytes, rx_bytes, retx, acks_tx, acks_rx;
    uint64_t acked_bytes;    /* payload bytes newly acknowledged: goodput */
    uint64_t rnr_naks;       /* receiver-not-ready answers received (sender backed off) */
    uint64_t rnr_ready;      /* receiver-ready notices received: a back-off cut short */
    uint64_t staged_bytes;   /* SEND bytes held here waiting for a RECV, all connections */
    uint64_t staged_msgs;    /* SENDs that went through staging (one extra copy each) */
    uint64_t lost_rack;      /* declared lost: a later packet on its path arrived */
    uint64_t lost_rto;       /* declared lost: retransmission timeout */
    uint64_t spurious_rto;   /* timeouts found spurious: the path delivered after it */
    uint64_t lost_flush;     /* declared lost: its path failed or timed out */
    uint64_t probe_timeouts;
    uint64_t link_events;    /* local interface carrier changes seen */
    uint64_t seg6route_failures; /* kernel seg6 routes not put back after a link came up */
    uint64_t loop_iters;
    uint64_t rx_reads;       /* datagrams read from sockets (a UDP GRO read counts once) */
    uint64_t rx_gro_reads;   /* reads that held several packets, coalesced by UDP GRO */
    uint64_t tx_sends;       /* datagrams handed to the kernel (a UDP GSO batch counts once) */
    uint64_t acks_carried;   /* ACKs that went in DATA packets (MRC_POST_LAZY_ACK); acks_tx
                              * counts those that went alone */
    uint64_t acks_no_room;   /* held ACKs sent alone at once: the DATA going back that was
                              * to carry them was a full datagram */
    uint64_t busy_polls;     /* looks at the sockets instead of a sleep (mrc_ep_busy_poll) */
    uint64_t caller_passes;  /* progress passes run by a caller holding the progress
                              * (mrc_ep_progress) */
    uint64_t conn_bytes;     /* memory the connections' own state takes (the connection,
                              * its paths, tx ring, retransmit queue, receive window and
                              * message table: the tables grow as traffic needs them) */
    int nconns;
    int nmrs;       /* memory regions registered (collectives keep their users' a while) */
    int npaths;     /* entries filled in paths[] */
    int nsocks;     /* UDP sockets: one per plane + one per (plane, SRv6 route to a spine) */
    int nsocks_seg6route; /* route sockets whose SRH a kernel seg6 route inserts (GSO kept) */
};

/* Snapshot taken by the progress thread. paths may be NULL. */
int mrc_ep_get_stats(mrc_ep *ep, struct mrc_ep_stats *st, struct mrc_path_stats *paths,
                 int max_paths);

#ifdef __cplusplus
}
#endif
#endif /* MRC_H */
