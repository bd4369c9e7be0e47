/*
 * connect.h - connects two endpoints of one process for tests and the
 * fuzzer: b (already listening on port) accepts on a thread while a
 * connects. Header-only, like check.h.
 */
#ifndef MRC_TESTS_CONNECT_H
#define MRC_TESTS_CONNECT_H
#include <errno.h>
#include <pthread.h>
#include <stdint.h>

#include "mrc.h"

struct accept_job {
    mrc_ep *b;
    mrc_conn *cb;
    int rc;
};

static void *accept_thread(void *arg)
{
    struct accept_job *j = arg;
    j->rc = mrc_ep_accept(j->b, 5000, &j->cb);
    if (!j->rc)
        j->rc = mrc_conn_establish(j->cb, 5000);
    return NULL;
}

/* 0, or the first error of either side. */
static int connect_pair(mrc_ep *a, mrc_ep *b, const char *b_addr, uint16_t port,
                        const char *name, mrc_conn **ca, mrc_conn **cb)
{
    struct accept_job j = {.b = b};
    pthread_t t;
    if (pthread_create(&t, NULL, accept_thread, &j))
        return -EAGAIN;
    int rc = mrc_conn_create(a, name, ca);
    if (!rc)
        rc = mrc_conn_connect(*ca, b_addr, port, 5000);
    pthread_join(t, NULL);
    *cb = j.cb;
    return rc ? rc : j.rc;
}
#endif
