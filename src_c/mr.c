/* mr.c - memory regions: registration (pages faulted in, a random key), the
 * count of operations that use a region, deregistration. */
#include "internal.h"

#include <errno.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older glibc headers lack it */
#endif

int mrc_mr_reg(mrc_ep *ep, void *addr, size_t len, int access, mrc_mr **out)
{
    if ((!addr && len) || (access & ~(MRC_ACCESS_REMOTE_WRITE | MRC_ACCESS_READONLY)) ||
        ((access & MRC_ACCESS_REMOTE_WRITE) && (access & MRC_ACCESS_READONLY)))
        return MRC_EUSAGE;
    mrc_mr *mr = calloc(1, sizeof(*mr));
    if (!mr)
        return -ENOMEM;
    pthread_mutex_lock(&ep->lock);
    if (!ep->nmr_free) {
        pthread_mutex_unlock(&ep->lock);
        free(mr);
        return MRC_ENOBUFS;
    }
    uint32_t slot = ep->mr_free[--ep->nmr_free];
    pthread_mutex_unlock(&ep->lock);
    /* Fault the pages in now, as RDMA registration pins them: a first-touch
     * page fault inside the progress thread stalls every connection for
     * milliseconds. Best effort (MADV_POPULATE_WRITE: Linux 5.14+). */
    if (len && (access & MRC_ACCESS_REMOTE_WRITE)) {
        uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
        uintptr_t lo = (uintptr_t)addr & ~(pg - 1);
        uintptr_t hi = ((uintptr_t)addr + len + pg - 1) & ~(pg - 1);
        madvise((void *)lo, hi - lo, MADV_POPULATE_WRITE);
    }
    mr->ep = ep;
    mr->addr = addr;
    mr->len = len;
    mr->access = access;
    /* 48 random bits above the slot: a peer that guesses keys has to hit
     * both the slot and 2^48 choices. */
    mr->key = (rand_u64() << 16) | slot;
    struct ctl c = {.type = CTL_MR_ADD, .arg = mr};
    int rc = ep_ctl(ep, &c);
    pthread_mutex_lock(&ep->lock);
    if (rc) {
        ep->mr_free[ep->nmr_free++] = slot;
    } else {
        DL_APPEND(ep->own_mrs, ep->own_mrs_tail, mr, own_prev, own_next);
    }
    pthread_mutex_unlock(&ep->lock);
    if (rc) {
        free(mr);
        return rc;
    }
    *out = mr;
    return 0;
}

uint64_t mrc_mr_key(const mrc_mr *mr) { return mr->key; }

int mrc_mr_pending(const mrc_mr *mr)
{
    mrc_ep *ep = mr->ep;
    pthread_mutex_lock(&ep->lock);
    int n = mr->ops;
    pthread_mutex_unlock(&ep->lock);
    return n;
}

int mrc_mr_dereg(mrc_mr *mr)
{
    if (!mr)
        return 0;
    mrc_ep *ep = mr->ep;
    /* As verbs (EBUSY from ibv_dereg_mr while bound): the progress thread
     * reads the region for every (re)transmission and writes it for every
     * RECV until the op completes, so freeing it earlier is a use after
     * free. Ops hold a count until their completion is published, which is
     * only once no socket batch holds their packets (ep_hold_pt). */
    pthread_mutex_lock(&ep->lock);
    if (mr->ops) {
        pthread_mutex_unlock(&ep->lock);
        return MRC_EBUSY;
    }
    mr->dereg = true; /* op_post refuses it from here on */
    pthread_mutex_unlock(&ep->lock);
    struct ctl c = {.type = CTL_MR_DEL, .arg = mr};
    ep_ctl(ep, &c); /* fails only if the engine stopped, which also unmaps it */
    mr_free(mr);
    return 0;
}

void mr_free(mrc_mr *mr)
{
    mrc_ep *ep = mr->ep;
    pthread_mutex_lock(&ep->lock);
    ep->mr_free[ep->nmr_free++] = (uint32_t)(mr->key & 0xffff);
    DL_UNLINK(ep->own_mrs, ep->own_mrs_tail, mr, own_prev, own_next);
    pthread_mutex_unlock(&ep->lock);
    free(mr);
}
