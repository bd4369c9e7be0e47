# Mirrors src_c/include/mrc.h. C names appear nowhere else in the package.
from libc.stdint cimport int32_t, uint16_t, uint32_t, uint64_t


cdef extern from "mrc.h" nogil:
    enum:
        MRC_MAX_PLANES
        MRC_MAX_PATHS
        MRC_MAX_SEGS
        MRC_ADDR_STRLEN
        MRC_ACCESS_REMOTE_WRITE
        MRC_ACCESS_READONLY
        MRC_WRITE_IMM
        MRC_DROP_MAX
        MRC_EKEY
        MRC_EBOUNDS
        MRC_ETIMEOUT
        MRC_EPATHDOWN
        MRC_ECLOSED
        MRC_EPROTO
        MRC_ETRUNC
        MRC_EUNREACH
        MRC_EUSAGE
        MRC_EREMOTE
        MRC_ENOBUFS
        MRC_ENOTMRC
        MRC_EBUSY
        MRC_ERNR
        MRC_EABORT
        MRC_EMISMATCH
        MRC_EGONE
        MRC_ESTALLED
        MRC_OP_WRITE
        MRC_OP_SEND
        MRC_OP_RECV
    uint64_t MRC_TAG_ANY

    ctypedef struct mrc_ep:
        pass
    ctypedef struct mrc_conn:
        pass
    ctypedef struct mrc_mr:
        pass
    ctypedef struct mrc_op:
        pass
    ctypedef struct mrc_cq:
        pass

    const char *mrc_strerror(int rc)
    const char *mrc_drop_str(int reason)
    const char *mrc_path_state_str(int state)

    struct mrc_ep_config:
        int nplanes
        char planes[16][64]
        uint16_t udp_port
        uint32_t mss
        uint32_t timeout_ms
        uint32_t sockbuf
        uint32_t window
        uint64_t max_unexpected
        int32_t rnr_timeout_ms

    void mrc_ep_config_init(mrc_ep_config *cfg)
    int mrc_ep_create(const mrc_ep_config *cfg, mrc_ep **out)
    void mrc_ep_destroy(mrc_ep *ep)
    int mrc_ep_nplanes(const mrc_ep *ep)
    uint64_t mrc_ep_progress_cpu_ns(const mrc_ep *ep)
    int mrc_ep_srh_offload(const mrc_ep *ep)
    int mrc_ep_plane(const mrc_ep *ep, int plane, char *addr, size_t addrlen, uint16_t *port)
    int mrc_ep_inject(mrc_ep *ep, int plane, double tx_loss, int down)

    struct mrc_path_spec:
        int id
        int plane
        char dst[64]
        int nsegs
        char segs[8][64]

    int mrc_ep_listen(mrc_ep *ep, const char *addr, uint16_t port, uint16_t *bound_port)
    int mrc_ep_unlisten(mrc_ep *ep)
    int mrc_conn_create(mrc_ep *ep, const char *name, mrc_conn **out)
    int mrc_conn_add_path(mrc_conn *c, const mrc_path_spec *p)
    int mrc_conn_connect(mrc_conn *c, const char *addr, uint16_t port, int timeout_ms)
    int mrc_conn_connect_any(mrc_conn *c, const char *const *addrs, int naddrs, uint16_t port,
                             int timeout_ms, int *errs)
    int mrc_ep_accept(mrc_ep *ep, int timeout_ms, mrc_conn **out)
    int mrc_conn_set_name(mrc_conn *c, const char *name)
    int mrc_conn_establish(mrc_conn *c, int timeout_ms)
    const char *mrc_conn_peer_name(const mrc_conn *c)
    int mrc_conn_peer_plane(const mrc_conn *c, int plane, char *addr, size_t addrlen)
    int mrc_conn_npaths(const mrc_conn *c)
    void mrc_conn_destroy(mrc_conn *c)
    int mrc_conn_error(const mrc_conn *c)

    int mrc_mr_reg(mrc_ep *ep, void *addr, size_t len, int access, mrc_mr **out)
    uint64_t mrc_mr_key(const mrc_mr *mr)
    int mrc_mr_dereg(mrc_mr *mr)
    int mrc_mr_pending(const mrc_mr *mr)

    int mrc_post_write(mrc_conn *c, mrc_mr *lmr, uint64_t loff, uint64_t len, uint64_t rkey,
                       uint64_t roff, uint32_t imm, int flags, mrc_op **out)
    int mrc_post_send(mrc_conn *c, mrc_mr *lmr, uint64_t loff, uint64_t len, uint64_t tag,
                      mrc_op **out)
    int mrc_post_recv(mrc_conn *c, mrc_mr *lmr, uint64_t loff, uint64_t len, uint64_t tag,
                      mrc_op **out)
    int mrc_op_wait(mrc_op *op, int timeout_ms)
    int mrc_op_done(mrc_op *op)
    struct mrc_op_result:
        int status
        int kind
        uint64_t bytes
        uint64_t tag
    void mrc_op_get_result(mrc_op *op, mrc_op_result *res)
    void mrc_op_release(mrc_op *op)
    int mrc_conn_wait_imm(mrc_conn *c, int timeout_ms, uint32_t *imm, uint64_t *len)

    enum:
        MRC_WC_WRITE
        MRC_WC_SEND
        MRC_WC_RECV
        MRC_WC_IMM
    struct mrc_wc:
        uint64_t ctx
        int status
        int kind
        uint64_t bytes
        uint64_t tag
        uint32_t imm
        mrc_conn *conn
    int mrc_cq_create(mrc_ep *ep, mrc_cq **out)
    int mrc_cq_destroy(mrc_cq *cq)
    void mrc_cq_shutdown(mrc_cq *cq)
    int mrc_cq_fd(mrc_cq *cq)
    int mrc_cq_poll(mrc_cq *cq, mrc_wc *wc, int max)
    int mrc_cq_wait(mrc_cq *cq, mrc_wc *wc, int max, int timeout_ms)
    int mrc_conn_set_cq(mrc_conn *c, mrc_cq *cq, uint64_t ctx)
    struct mrc_wr:
        int kind
        int flags
        mrc_mr *mr
        uint64_t loff, len
        uint64_t rkey, roff
        uint32_t imm
        uint64_t tag
        mrc_cq *cq
        uint64_t ctx
    int mrc_post(mrc_conn *c, const mrc_wr *wr, mrc_op **out)

    struct mrc_path_stats:
        int conn_index
        uint32_t conn_id
        int id, plane, state
        char dst[64]
        int nsegs
        uint64_t tx_pkts, tx_bytes, rx_pkts, rx_bytes
        uint64_t retx, lost, injected, probes
        uint64_t srtt_ns, base_rtt_ns, cwnd_bytes, inflight_bytes
        uint64_t state_changes
        int conn_error
        char peer[64]

    struct mrc_ep_stats:
        uint64_t drops[MRC_DROP_MAX]
        uint64_t tx_pkts, rx_pkts, tx_bytes, rx_bytes, retx, acks_tx, acks_rx
        uint64_t acked_bytes, rnr_naks, rnr_ready, staged_bytes, staged_msgs
        uint64_t lost_rack, lost_rto, spurious_rto, lost_flush, probe_timeouts, link_events
        uint64_t seg6route_failures
        uint64_t loop_iters, rx_reads, rx_gro_reads, tx_sends, acks_carried, acks_no_room
        uint64_t busy_polls, caller_passes, conn_bytes
        int nconns
        int nmrs
        int npaths
        int nsocks
        int nsocks_seg6route

    int mrc_ep_get_stats(mrc_ep *ep, mrc_ep_stats *st, mrc_path_stats *paths, int max_paths)


cdef extern from "mrc_testing.h" nogil:
    int mrc_ep_rx_inject(mrc_ep *ep, int plane, const void *pkt, size_t len,
                         const char *src_addr, uint16_t src_port)
    uint32_t mrc_conn_id(const mrc_conn *c)
    uint32_t mrc_conn_peer_id(const mrc_conn *c)


# Collectives (reduce.c, coll.c)
cdef extern from "mrc.h" nogil:
    size_t mrc_dtype_size(int dtype)
    int mrc_reduce(void *acc, const void *src, size_t count, int dtype, int op)
    int mrc_reduce_finish(void *acc, size_t count, int dtype, int op, int n)

    struct mrc_coll_step:
        uint32_t kind
    struct mrc_coll_ref:
        uint32_t buf
    struct mrc_coll_plan:
        const mrc_coll_step *steps
        uint32_t nsteps
        uint32_t nrings
        const mrc_coll_ref *refs
        uint32_t nrefs
        const uint32_t *deps
        uint32_t ndeps
        uint64_t stage_bytes
    struct mrc_coll_args:
        void *send
        uint64_t send_len
        void *recv
        uint64_t recv_len
        int dtype, op
        uint32_t sig
        int timeout_ms
        int (*interrupted)(void *arg) noexcept nogil
        void *interrupt_arg
    struct mrc_coll_config:
        int rank, nranks
        mrc_conn **peers
        uint64_t chunk_bytes
        int slots
        int window
        uint32_t busy_poll_us
    ctypedef struct mrc_coll:
        pass
    int mrc_coll_create(mrc_ep *ep, const mrc_coll_config *cfg, mrc_coll **out)
    int mrc_coll_run(mrc_coll *c, const mrc_coll_plan *plan, const mrc_coll_args *a,
                     int *failed_peer)
    void mrc_coll_abort(mrc_coll *c)
    uint32_t mrc_coll_runs(const mrc_coll *c, int peer)
    int mrc_coll_peer_gone(mrc_coll *c, int peer, uint32_t runs)
    int mrc_coll_drain(mrc_coll *c, int timeout_ms)
    uint64_t mrc_coll_scratch_bytes(const mrc_coll *c)
    void mrc_coll_destroy(mrc_coll *c)
