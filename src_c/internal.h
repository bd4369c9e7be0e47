/*
 * internal.h - datapath state shared by the src_c files. Not installed.
 *
 * Ownership: everything reachable from struct mrc_ep is owned by the progress
 * thread, except the fields marked [lock], which are guarded by ep->lock, and
 * [const], which are set before the progress thread first sees the object.
 * Functions that may only run on the progress thread end in _pt.
 */
#ifndef MRC_INTERNAL_H
#define MRC_INTERNAL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <time.h>

#include "mrc.h"
#include "wire.h"

#define likely(x) __builtin_expect(!!(x), 1)
#define unlikely(x) __builtin_expect(!!(x), 0)

#define MRC_SLOTS 65536u        /* connection and region ids: (random << 16) | slot */
#define MRC_BATCH 64            /* packets per sendmmsg/recvmmsg */
#define MRC_MSGW 1024u          /* messages in flight per connection */
#define MRC_TX_CAP0 256u        /* a connection's first tx ring (packets), then doubled */
#define MRC_MSGS_CAP0 16u       /* its first message table, then doubled */
#define MRC_RX_SLOT 65536u     /* bytes per receive slot: a whole UDP GRO read */
/* Plane sockets plus route sockets, one per (plane, segments before the
 * destination): 256 spine routes are more than any fabric in routing/ has. */
#define MRC_MAX_SOCKS (MRC_MAX_PLANES + 256)
#define MRC_DEFAULT_MSS 8192u
#define MRC_MAX_MSS 65000u
/* What one staged SEND costs beyond its payload (allocator headers, the
 * staged_msg, the rx_msg slot): charged against max_unexpected so that empty
 * and tiny SENDs are bounded in number too, not only in bytes. */
#define MRC_STAGE_MSG_COST 256u
/* Immediates delivered and not yet taken by the application, per
 * connection; past it the last packet of a WRITE-with-immediate is refused
 * as receiver-not-ready and the sender backs off. */
#define MRC_IMM_MAX 4096u

/* Timing policy (ns). */
#define MRC_TIMER_NS 250000ull          /* timer scan period while packets are in flight */
#define MRC_MIN_RTO_NS 5000000ull       /* floor of a path's retransmit timeout */
#define MRC_MIN_QUICK_RTO_NS 1000000ull /* floor while other paths deliver */
/* How long an ACK owed only for LAZY packets may wait for data going back to
 * carry it (wire.h, MRC_F_LAZY): about one small collective on a loaded host,
 * so that the next one's data carries it, and half the retransmission floor
 * above, so a held ACK never looks like a loss. More than MRC_ACK_LAZY_PKTS
 * such packets (a bulk transfer), a hole or a duplicate: the ACK goes now. */
#define MRC_ACK_DELAY_NS 500000ull
#define MRC_ACK_LAZY_PKTS 4u
/* A failed path is probed MRC_PROBE_INTERVAL_NS after it failed, then twice
 * as long after each unanswered probe, up to MRC_PROBE_GAP_MAX_NS. Not at a
 * fixed 5 ms: a host whose plane is down has that path failed to every peer,
 * and 1000 peers probed every 5 ms are 200k packets a second, for as long as
 * the cable is out; at the cap they are 5k. A heal is still seen at once
 * where it can be: the side whose link comes back (netlink) and a side that
 * gets a probe on the failed path restart at the shortest gap. */
#define MRC_PROBE_INTERVAL_NS 5000000ull
#define MRC_PROBE_GAP_MAX_NS 200000000ull
/* A busy connection's idle paths, one path per turn: a waiting connection's
 * keepalives exist to find a dead peer, well inside any operation timeout. */
#define MRC_KEEPALIVE_NS 100000000ull
#define MRC_PROBES_TO_GOOD 3            /* consecutive probe answers that heal a path */
#define MRC_LOSSES_TO_FAIL 3            /* consecutive loss events that fail a path */

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Doubly linked lists with head and tail, through the fields named prev and
 * next of each element. */
#define DL_APPEND(head, tail, x, prev, next)                                     \
    do {                                                                          \
        (x)->prev = (tail);                                                       \
        (x)->next = NULL;                                                         \
        if (tail)                                                                 \
            (tail)->next = (x);                                                   \
        else                                                                      \
            (head) = (x);                                                         \
        (tail) = (x);                                                             \
    } while (0)
#define DL_UNLINK(head, tail, x, prev, next)                                     \
    do {                                                                          \
        if ((x)->prev)                                                            \
            (x)->prev->next = (x)->next;                                          \
        else                                                                      \
            (head) = (x)->next;                                                   \
        if ((x)->next)                                                            \
            (x)->next->prev = (x)->prev;                                          \
        else                                                                      \
            (tail) = (x)->prev;                                                   \
        (x)->prev = (x)->next = NULL;                                             \
    } while (0)

/* xorshift64*: fault injection and path tie-breaks, never keys. */
static inline uint64_t rng_next(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1Dull;
}

#define MRC_OP_CVS 16

/* ---- objects ------------------------------------------------------------- */

struct mrc_mr {
    mrc_ep *ep;        /* [const] */
    int ops;           /* [lock] operations posted with it and not yet completed */
    bool dereg;        /* [lock] being deregistered: no new posts */
    struct mrc_mr *own_prev, *own_next; /* [lock] ep->own_mrs: freed by mrc_ep_destroy */
    uint8_t *addr;     /* [const] */
    uint64_t len;      /* [const] */
    uint64_t key;      /* [const] */
    int access;        /* [const] */
};

/* A completion waiting on a CQ: embedded in its op, or allocated for an
 * immediate (op NULL). */
struct cq_ent {
    struct cq_ent *next;
    mrc_op *op;         /* holds one reference until polled; NULL: immediate */
    struct mrc_wc wc;
};

struct mrc_cq {
    mrc_ep *ep;                         /* [const] */
    struct mrc_cq *own_prev, *own_next; /* [lock] ep->own_cqs: freed by mrc_ep_destroy */
    int fd;                             /* [const] eventfd, readable while head != NULL */
    pthread_cond_t cv;                  /* waiters of this CQ only */
    /* [lock] */
    struct cq_ent *head, *tail;
    bool fd_set;        /* the eventfd counter is non-zero */
    bool fd_used;       /* mrc_cq_fd was called: keep the eventfd up to date */
    uint32_t len;       /* entries in the queue */
    int want;           /* a lone waiter's threshold (mrc_cq_wait_min) */
    int waiters;        /* threads inside mrc_cq_wait */
    uint64_t npending;  /* ops posted to it and not yet completed */
    int nbound;         /* connections bound with mrc_conn_set_cq */
    bool shut;          /* mrc_cq_shutdown */
};

struct mrc_op {
    atomic_int refs;    /* the caller's (if out), the progress thread's, the CQ's (if cq) */
    int kind;           /* [const] enum mrc_op_kind */
    int flags;          /* [const] MRC_WRITE_IMM */
    mrc_ep *ep;         /* [const] outlives the connection */
    mrc_conn *conn;     /* [const] only the progress thread follows it */
    mrc_mr *mr;         /* [const] local region */
    uint64_t loff, len; /* [const] */
    uint64_t rkey, roff, tag; /* [const] */
    uint32_t imm;       /* [const] */
    mrc_cq *cq;         /* [const] NULL: completes on the handle only */
    uint64_t ctx;       /* [const] returned in the CQ entry */
    struct cq_ent cqe;  /* [lock] its entry on cq once complete */
    /* progress thread */
    uint32_t msn;
    uint64_t seg_off;   /* next byte to put in a packet */
    uint32_t outstanding; /* packets sent and not yet acknowledged */
    bool seg_done;      /* every packet of the op has been sent once */
    int pt_status;      /* status decided by the progress thread */
    uint64_t res_bytes, res_tag;
    struct mrc_op *prev, *next; /* conn's txops / recvq list */
    struct mrc_op *qnext;       /* submission or completion list */
    bool mr_counted;            /* [lock] counted in mr->ops until published */
    /* [lock] */
    int done, status;
    int waiters;        /* threads in mrc_op_wait: publish wakes ep->cv only for them */
};

/* One transmitted (or pending) packet, indexed by psn % window. */
struct tx_pkt {
    mrc_op *op;       /* NULL: slot free */
    uint64_t off;     /* offset in the op */
    uint64_t sent_ns;
    uint32_t len;
    uint32_t psn;
    uint8_t path;
    uint8_t flags;    /* wire flags */
    uint8_t acked;
    uint8_t lost;     /* queued for retransmission */
    uint16_t ntx;
};

struct path {
    int id, plane, sock;   /* sock: index in ep->socks */
    struct sockaddr_storage dst;
    socklen_t dstlen;
    int nsegs;
    struct in6_addr segs[MRC_MAX_SEGS];
    char dst_str[MRC_ADDR_STRLEN];
    int state;             /* enum mrc_path_state */
    uint64_t state_since;
    /* delay and congestion */
    uint64_t srtt, rttvar, last_rtt, base_rtt, base_rtt_until;
    /* One-way delay, data out to its arrival, in the receiver's clock minus
     * ours: the offset between the clocks is unknown but constant, so only
     * last_owd - base_owd (the queueing on the way out) means anything.
     * base_owd INT64_MAX: no sample yet. */
    int64_t last_owd, base_owd;
    uint64_t base_owd_until;
    uint64_t cwnd, inflight, ssthresh, last_cut_ns;
    uint64_t delivered_ts;  /* send time of the latest packet acked on this path */
    /* failure detection */
    int consec_loss, probe_ok;
    uint64_t loss_event_ns; /* when the last loss that counted was detected */
    /* The last timeout that counted: when, and the send time of the packet
     * that timed out (path_on_delivered_pt: was it spurious?). 0: none open. */
    uint64_t rto_loss_ns, rto_loss_sent_ns;
    uint32_t probe_seq;
    uint64_t probe_sent_ns, last_tx_ns, last_rx_ns;
    uint64_t probe_gap_ns; /* failed: the next probe this long after the last */
    bool probe_out;
    /* counters */
    uint64_t tx_pkts, tx_bytes, rx_pkts, rx_bytes, retx, lost, injected, probes, changes;
};

/* Receive state of one message (indexed by msn % MRC_MSGW). */
struct rx_msg {
    uint32_t msn;
    bool used, have_last;
    uint8_t type, flags;
    uint32_t last_psn, imm;
    uint32_t ref_psn;    /* the first accepted packet's PSN and offset: every */
    uint64_t ref_off;    /* later SEND packet's offset follows from its PSN */
    uint64_t key, msg_len, got;
    mrc_op *recv;        /* SEND bound to a posted RECV on arrival */
    uint8_t *stage;      /* SEND staged until a RECV matches */
};

struct staged_msg {      /* a complete SEND no RECV has matched yet */
    uint64_t tag, len;
    uint8_t *data;
    struct staged_msg *next;
};

struct imm_ev {
    uint32_t imm;
    uint64_t len;
    struct imm_ev *next;
};

/* A RECV completion (or an immediate) waiting behind a copy out of staging:
 * copies run in MRC_COPY_BUDGET slices between receive bursts, and what
 * completes after them on the connection waits its turn (rx_copy_run_pt). */
struct copy_job {
    mrc_op *r;          /* RECV to complete, or NULL */
    uint8_t *data;      /* staged message to copy into r (owned), or NULL */
    uint64_t len, tag, off;
    bool imm;           /* an immediate (immv, len) to hand to the application */
    uint32_t immv;
    struct copy_job *next;
};

/* Bytes copied out of staging per progress-loop pass: a multi-MiB memcpy in
 * one go kept ACKs from leaving for milliseconds, past the peers' 1 ms
 * quick-RTO floor (measured: 10x the spurious RTO losses and 4x the path state
 * changes of pre-posted RECVs under a SEND-heavy load). */
#define MRC_COPY_BUDGET (256u << 10)

enum conn_state { CONN_NEW = 0, CONN_ACTIVE, CONN_FAILED, CONN_CLOSED };

struct mrc_conn {
    mrc_ep *ep;
    struct mrc_conn *own_prev, *own_next; /* [lock] ep->own_conns: freed by mrc_ep_destroy */
    uint32_t id, peer_id;
    uint32_t slot;
    char name[64], peer_name[64];
    int state;          /* [lock] for the API, written by the progress thread */
    int error;          /* [lock] */
    int hs_fd;          /* handshake TCP socket while connecting */
    /* The datapath took a packet from the peer: it is live (it sends only once
     * it has our hello), `ready` or not (mrc_conn_establish). */
    atomic_bool rx_seen;
    int npeer_planes;
    struct sockaddr_storage peer_planes[MRC_MAX_PLANES];
    uint32_t mss, window, wmask;
    int npaths;
    int ka_path;   /* [pt] the path whose turn it is for the next keepalive probe */
    uint64_t ka_sent_ns; /* [pt] when the last keepalive probe left, any path */
    /* Only as many as the connection has (mrc_conn_add_path grows it while
     * the connection is new): 64 inline were 39 KiB of every connection. */
    struct path *paths;
    int paths_cap;
    int path_index[MRC_MAX_PATHS]; /* wire path id -> index in paths[], -1 none */
    bool active_listed, in_ackq, closing_sent;
    struct mrc_conn *next_active, *next_ack;
    struct mrc_conn *pt_prev, *pt_next; /* ep->pt_conns: every connection in ep->conns[] */
    bool timed;                  /* on ep->timed: has timers to run (engine_timers) */
    struct mrc_conn *next_timed;

    /* transmit. The tx ring and the retransmit queue hold tx_cap entries, a
     * power of two that starts small and doubles (tx_grow_pt) while packets
     * in flight fill it, up to the window: a connection costs what it uses,
     * not 176 KiB for a window of 4096 whether it sends or not. */
    struct tx_pkt *tx;
    uint32_t tx_cap, tx_mask;
    uint32_t una, next_psn, highest_acked;
    uint32_t next_msn;
    mrc_op *txops_head, *txops_tail; /* posted WRITE/SEND, msn order */
    mrc_op *seg_op;                  /* first op with bytes not yet sent */
    uint32_t *rtxq;                  /* psns to retransmit, ring of tx_cap */
    uint32_t rtx_head, rtx_count;
    int rr;
    /* New data goes to a path in bursts of up to `burst` packets (what one
     * GSO datagram carries), not one packet per path in turn (path_pick_pt). */
    int burst, burst_path, burst_left;
    uint64_t last_progress_ns;
    uint64_t last_acked_ns;    /* when some packet was last newly acknowledged */
    uint64_t rnr_until, rnr_backoff; /* receiver not ready: no sending before rnr_until */
    uint64_t rnr_since;        /* first refusal of the current back-off */
    uint64_t rnr_raised_ns;    /* when the back-off last doubled: refusals of
                                * packets sent before then are the same round */
    uint64_t rnr_last_ns;      /* the latest refusal (RNR NAK) received */
    uint64_t all_failed_since; /* 0 while some path is not failed */

    /* receive */
    uint32_t rx_cum;          /* every psn below is received */
    uint64_t *rx_bits;        /* window bits, psn % window */
    uint32_t rx_deliver_msn;
    struct rx_msg *msgs;      /* msgs_cap (<= MRC_MSGW), grown as messages arrive */
    uint32_t msgs_cap;
    mrc_op *recvq_head, *recvq_tail;     /* posted RECVs */
    struct staged_msg *unexp_head, *unexp_tail;
    uint64_t staged_bytes;    /* all staged SEND bytes */
    uint64_t undelivered_bytes; /* of which, messages not yet delivered */
    int staging;              /* staged messages not yet delivered */
    /* A SEND refused for want of a RECV and staging room: the next RECV
     * posted tells the sender on this path (MRC_NAK_READY). */
    bool rnr_owed;
    uint8_t rnr_owed_path;
    uint64_t ack_need;        /* bit per path id */
    uint64_t ack_since;       /* when ack_need last became non-zero */
    uint32_t ack_lazy;        /* packets owed an ACK, all LAZY (ack_now clear) */
    bool ack_now;             /* the ACK owed may not wait (MRC_ACK_DELAY_NS) */
    unsigned ack_turn;        /* which delivering path's mirror the next ACK takes */
    uint32_t ack_echo_psn[MRC_MAX_PATHS];
    uint64_t ack_echo_ts[MRC_MAX_PATHS];
    uint64_t ack_echo_rx_ts[MRC_MAX_PATHS]; /* when each echoed packet arrived */

    /* [lock] immediates delivered to the user: on imm_head, or on cq when bound */
    struct imm_ev *imm_head, *imm_tail;
    mrc_cq *cq;
    uint64_t cq_ctx;
    /* Immediates queued = imm_queued (progress thread) - imm_taken (API). */
    uint32_t imm_queued;      /* delivered or admitted (last packet accepted) */
    atomic_uint imm_taken;
    uint32_t staged_count;    /* staged messages, delivered or not */
    struct copy_job *copy_head, *copy_tail; /* completions behind a copy-out */
    bool in_copyq;            /* on ep->copyq */
    struct mrc_conn *next_copy;
};

/* A socket: one per plane (receives everything for the plane, sends plain
 * IP paths) plus one per distinct SRv6 route (send only, sticky SRH). */
struct txbatch {
    int n, sent;
    uint64_t retired;  /* packets that left the batch (sent or given up) before
                        * the current n: retired + sent only grows */
    struct mmsghdr msg[MRC_BATCH];
    struct iovec iov[MRC_BATCH][2];     /* header, payload: contiguous, so a run of
                                         * packets is one iovec array (UDP GSO) */
    struct sockaddr_in6 dst[MRC_BATCH]; /* copies: a path may go before its packet */
    _Alignas(8) uint8_t hdr[MRC_BATCH][MRC_DATA_ACKS_MAX_LEN]; /* the longest header */
    /* What one sendmmsg passes: runs of equal-sized packets to one address
     * merged into one UDP GSO datagram each (sock_flush_pt). */
    struct mmsghdr gmsg[MRC_BATCH];
    int gcount[MRC_BATCH];
    union {
        char buf[CMSG_SPACE(sizeof(uint16_t))];
        struct cmsghdr align;
    } gctl[MRC_BATCH];
};
static_assert(MRC_ACK_LEN >= MRC_DATA_HDR_LEN, "hdr slots fit every header");

struct msock {
    int fd, plane, nsegs;
    bool no_gso;        /* the kernel refused UDP GSO here: one datagram per packet */
    bool gro;           /* plane socket with UDP GRO: a read may hold many packets */
    uint32_t mark;      /* SO_MARK of a route socket whose SRH a kernel seg6 route
                         * (table `mark`) inserts; 0: sticky IPV6_RTHDR or none */
    struct in6_addr segs[MRC_MAX_SEGS];
    struct txbatch batch;
};

enum ctl_type { CTL_CONN_ADD = 1, CTL_CONN_DEL, CTL_MR_ADD, CTL_MR_DEL, CTL_STATS, CTL_INJECT,
                CTL_RX_INJECT, CTL_TX_STALL };

struct ctl {
    int type;
    void *arg;
    void *arg2;
    int iarg;
    int rc;
    bool done;
    struct ctl *next;
};

struct plane {
    char addr_str[MRC_ADDR_STRLEN];
    struct sockaddr_storage addr;
    socklen_t addrlen;
    uint16_t port;
    double tx_loss;
    bool down;       /* fault injection */
    bool link_down;  /* netlink: the interface lost its carrier */
    int ifindex;     /* interface holding the address, 0 if unknown */
    bool loopback;   /* that interface is `lo`: no kernel seg6 routes installed there */
};

struct mrc_ep {
    /* [const] */
    struct mrc_ep_config cfg;
    /* The caller's reference plus one per operation not yet freed: an op may
     * be waited on or released after mrc_ep_destroy, so the struct (its lock
     * and condition) lives until the last op goes (ep_unref). */
    atomic_int refs;
    _Atomic uint64_t poll_until_ns; /* mrc_ep_busy_poll: the loop polls until then */
    _Atomic uint64_t quiet_until_ns; /* mrc_ep_progress_end: sockets left to callers */
    int nplanes;
    struct plane planes[MRC_MAX_PLANES];
    int epfd, evfd, nl_fd;
    pthread_t thread;
    clockid_t pt_clock; /* the progress thread's CPU clock, if pt_clock_ok */
    bool pt_clock_ok;

    /* [lock] */
    pthread_mutex_t lock;
    pthread_cond_t cv;                  /* control requests, immediates, connection state */
    pthread_cond_t op_cv[MRC_OP_CVS];   /* op waiters, by op_cv_index: a batch wakes only
                                         * the buckets of its ops that someone waits on */
    bool stopping, sleeping;
    bool progress_held; /* a caller holds the progress (mrc_ep_progress_begin) */
    uint64_t sleep_due; /* while sleeping: when the progress thread wakes by itself */
    bool sleep_quiet;   /* ... and it leaves the sockets to callers (quiet_until_ns) */
    bool wake_deferred; /* an MRC_POST_MORE post found the thread asleep */
    bool stopped;      /* the progress thread has returned: nothing touches objects now */
    mrc_op *subq_head, *subq_tail;
    struct ctl *ctlq_head, *ctlq_tail;
    uint32_t conn_free[MRC_SLOTS], nconn_free; /* free slot stack */
    uint32_t mr_free[MRC_SLOTS], nmr_free;
    mrc_conn *own_conns, *own_conns_tail; /* connections and regions not yet destroyed */
    mrc_mr *own_mrs, *own_mrs_tail;
    mrc_cq *own_cqs, *own_cqs_tail;
    struct hs_state *hs; /* [lock] listeners and pending hellos (handshake.c) */
    /* mrc_ep_unlisten: the endpoint is closing, so set-ups under way (connect,
     * accept, the hello) end with MRC_ECLOSED within a slice instead of waiting
     * out their timeout with close() waiting on them. */
    atomic_bool setup_closing;

    /* progress thread, or a caller holding the progress: under turn_lock */
    pthread_mutex_t turn_lock;
    bool pt_exited;          /* the progress thread failed everything and left */
    int nsocks;
    struct msock *socks[MRC_MAX_SOCKS];
    mrc_conn *conns[MRC_SLOTS];
    mrc_mr *mrs[MRC_SLOTS];
    mrc_conn *active;        /* connections in the datapath */
    mrc_conn *pt_conns, *pt_conns_tail; /* every connection in conns[], in order of adding */
    mrc_conn *timed;         /* active connections with timers to run; none: no tick */
    mrc_conn *ackq;          /* connections owing ACKs */
    uint64_t ack_due_ns;     /* the first ACK held in ackq falls due; UINT64_MAX: none */
    mrc_op *done_head;       /* completions to publish, newest first */
    /* Completions held back because a socket batch still holds packets that
     * may read their buffers (sendmmsg said EAGAIN): `held` is published once
     * every socket has sent what it held when `held` was closed
     * (held_need[s]); `next` collects completions meanwhile (ep_hold_pt). */
    mrc_op *held, *next_held; /* newest first, as done_head */
    mrc_conn *copyq;         /* connections with copies out of staging queued */
    uint64_t held_need[MRC_MAX_PLANES + MRC_MAX_PATHS * 4];
    uint64_t rng;
    uint64_t next_timer_ns;  /* UINT64_MAX: no timer exists, sleep until woken */
    bool nl_ready;           /* the netlink socket woke the loop */
    uint8_t *rxbuf;          /* MRC_BATCH + 1 slots of MRC_RX_SLOT bytes (sock_recv_pt) */
    struct mrc_ep_stats st;
    bool work;               /* this loop iteration did something */
    bool tx_stall;           /* testing: every sendmmsg 'fails' with EAGAIN */
    bool testing_no_ready;   /* [const after set] testing: connect() never sends `ready` */
    bool testing_late_ready; /* [const after set] testing: `ready` only after the attempt's deadline */
};

static inline unsigned op_cv_index(const void *op)
{
    uintptr_t a = (uintptr_t)op;
    return (unsigned)((a >> 6) ^ (a >> 12)) % MRC_OP_CVS; /* ops are >= 64-byte allocations */
}

/* conn.c */
void conn_new_id(mrc_conn *c);
void conn_add_pt(mrc_ep *ep, struct ctl *x);
void conn_del_pt(mrc_ep *ep, mrc_conn *c);

/* mr.c */
void mr_free(mrc_mr *mr);

/* ep.c */
bool ep_wait_locked(mrc_ep *ep, pthread_cond_t *cv, int timeout_ms,
                    bool (*ready)(const void *), const void *arg);
int ep_ctl(mrc_ep *ep, struct ctl *c);
void ep_wake(mrc_ep *ep);
void op_complete_pt(mrc_ep *ep, mrc_op *op, int status);
void ep_publish_pt(mrc_ep *ep);
void conn_fail_pt(mrc_conn *c, int err, int op_err);
void ep_unref(mrc_ep *ep);
void op_unref(mrc_op *op);
void ep_hold_pt(mrc_ep *ep, bool force);
void conn_free(mrc_conn *c);
uint64_t conn_bytes(const mrc_conn *c);
/* handshake.c */
void hs_free(mrc_ep *ep);
void ep_ctl_run_pt(mrc_ep *ep, struct ctl *c);
int addr_parse(const char *s, uint16_t port, struct sockaddr_storage *ss, socklen_t *len);
void addr_format(const struct sockaddr_storage *ss, char *buf, size_t len);
bool addr_same_host(const struct sockaddr_storage *a, const struct sockaddr_storage *b);
uint64_t rand_u64(void);

/* cq.c */
void cq_push_locked(mrc_cq *cq, struct cq_ent *e);
void cq_conn_unbind_locked(mrc_conn *c);
void cq_free_all(mrc_ep *ep);
void cq_stop_waiters(mrc_ep *ep);
int conn_imm_pt(mrc_conn *c, uint32_t imm, uint64_t len);

/* sock.c */
int sock_open_plane(mrc_ep *ep, int plane);
int sock_path_pt(mrc_ep *ep, int plane, int nsegs, const struct in6_addr *segs);
/* The type-4 routing header of a path's segments (a route socket's sticky
 * header, or what its seg6 route inserts); returns its length. */
#define MRC_SRH_MAX (8 + 16 * MRC_MAX_SEGS)
/* A UDP GSO datagram's IPv6 payload (UDP header, routing header, segments)
 * must fit in 64 KiB. */
#define MRC_GSO_MAX_BYTES (65535 - 8 - MRC_SRH_MAX)
size_t sock_srh_build(uint8_t *srh, int nsegs, const struct in6_addr *segs);
uint8_t *sock_tx_slot_pt(mrc_ep *ep, struct path *p, size_t hdrlen, const void *payload,
                         uint32_t len);
int sock_flush_pt(mrc_ep *ep, struct msock *s);
void sock_flush_all_pt(mrc_ep *ep);
bool sock_batch_full_pt(mrc_ep *ep, int sock);
int sock_recv_pt(mrc_ep *ep, int sock);

/* tx.c */
void tx_post_pt(mrc_conn *c, mrc_op *op);
bool tx_run_pt(mrc_conn *c);
void tx_on_ack_pt(mrc_conn *c, struct path *p, const struct mrc_hdr *h,
                  const struct mrc_ack_ext *a, uint64_t now);
void tx_on_nak_pt(mrc_conn *c, struct path *p, const struct mrc_hdr *h,
                  const struct mrc_nak_ext *n);
void tx_on_close_cum_pt(mrc_conn *c, uint32_t cum, uint64_t now);
void tx_lose_pt(mrc_conn *c, struct tx_pkt *t);
int tx_alloc(mrc_conn *c);
void tx_timers_pt(mrc_conn *c, uint64_t now);
void tx_flush_path_pt(mrc_conn *c, struct path *p);
void tx_release_pt(mrc_conn *c, int err);

/* rx.c */
int rx_alloc(mrc_conn *c);
void rx_packet_pt(mrc_ep *ep, int plane, const struct sockaddr_storage *from, uint8_t *buf,
                  size_t len, uint64_t now);
void rx_flush_acks_pt(mrc_ep *ep, uint64_t now);
/* The ACK c owes, written to out (MRC_ACK_MAX_LEN bytes) for a DATA packet to
 * carry when one ACK says all of it; its length, or 0 (then it waits). */
size_t rx_ack_carry_pt(mrc_conn *c, uint8_t *out);
void rx_sack_fill(const mrc_conn *c, uint32_t base, uint64_t sack[MRC_SACK_BITS / 64]);
void rx_post_recv_pt(mrc_conn *c, mrc_op *op);
void rx_release_pt(mrc_conn *c, int err);
void rx_copy_run_pt(mrc_ep *ep);

/* path.c */
struct path *path_pick_pt(mrc_conn *c, uint32_t len, uint64_t rest, int avoid);
struct path *path_for_ack_pt(mrc_conn *c, int id);
void path_set_state_pt(mrc_conn *c, struct path *p, int state, uint64_t now);
void path_on_rtt_pt(struct path *p, uint64_t rtt, uint64_t now);
void path_on_owd_pt(struct path *p, int64_t owd, uint64_t now);
void path_on_acked_pt(struct path *p, uint64_t bytes, uint64_t now);
void path_on_loss_pt(mrc_conn *c, struct path *p, bool timeout, uint64_t sent_ns, uint64_t now);
void path_on_probe_ack_pt(mrc_conn *c, struct path *p, uint64_t ts, uint64_t now);
void path_timers_pt(mrc_conn *c, uint64_t now, bool busy);
uint64_t path_rto(const struct path *p);
uint64_t path_quick_rto(const struct path *p);
void path_on_delivered_pt(mrc_conn *c, struct path *p, uint64_t ts, uint64_t now);
int path_send_ctrl_pt(mrc_conn *c, struct path *p, int id, int type, int flags, uint32_t psn,
                      uint64_t ts);
void path_init(struct path *p, uint32_t mss);

/* testing.c */
void testing_rx_inject_pt(mrc_ep *ep, void *arg);

/* link.c */
int link_open(mrc_ep *ep);

/* seg6route.c: the firewall mark under which the kernel inserts this
 * route's SRH (installing the rule and table once per host); <0: none. */
int seg6route_mark(int ifindex, int nsegs, const struct in6_addr *segs, uint32_t *mark);
/* 0 when the kernel takes a seg6 route out of `ifindex` here (SRv6
 * lightweight tunnels built in, CAP_NET_ADMIN), else its error. */
int seg6route_probe(int ifindex);
/* Puts table `mark` back as seg6route_mark made it (after a link down). */
int seg6route_restore(uint32_t mark, int ifindex, int nsegs, const struct in6_addr *segs);
/* sock.c: whether route sockets on this plane try kernel seg6 routes (not
 * with MRC_SRH=socket, nor on `lo`, where a test's endpoints would leave
 * rules in the host's own namespace). */
bool sock_seg6route_wanted(const struct plane *pl);
/* sock.c: restores the seg6 routes of plane's route sockets. */
void sock_seg6route_restore_pt(mrc_ep *ep, int plane);
void link_poll_pt(mrc_ep *ep);

/* engine.c */
void *engine_main(void *arg);
bool ep_progress_held_here(const mrc_ep *ep);
/* ep_ctl on a thread holding the progress: runs the request there. */
int ep_ctl_here(mrc_ep *ep, struct ctl *x);
void conn_arm_timer_pt(mrc_conn *c);
void path_probe_soon_pt(mrc_conn *c, struct path *p);

#define MRC_RNR_MIN_NS 1000000ull    /* first back-off after a receiver-not-ready */
#define MRC_RNR_MAX_NS 64000000ull   /* back-off doubles up to this */
#define MRC_PKT_OVERHEAD 64         /* bytes a packet costs in a window beyond payload */

static inline struct path *conn_path(mrc_conn *c, unsigned id)
{
    if (id >= MRC_MAX_PATHS || c->path_index[id] < 0)
        return NULL;
    return &c->paths[c->path_index[id]];
}

/* Fault injection: true if the packet about to leave on p is to be lost. */
static inline bool inject_drop(mrc_ep *ep, const struct path *p)
{
    const struct plane *pl = &ep->planes[p->plane];
    if (pl->down)
        return true;
    return pl->tx_loss > 0 &&
           (double)(rng_next(&ep->rng) >> 11) * (1.0 / 9007199254740992.0) < pl->tx_loss;
}

#define DROP(ep, reason) ((ep)->st.drops[MRC_DROP_##reason]++)

#endif /* MRC_INTERNAL_H */
