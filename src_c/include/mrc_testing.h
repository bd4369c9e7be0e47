/*
 * mrc_testing.h - hooks for fuzzers and hostile-input tests. Not for
 * applications: they bypass the sockets, not the checks.
 */
#ifndef MRC_TESTING_H
#define MRC_TESTING_H

#include <stddef.h>
#include <stdint.h>

#include "mrc.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Runs one datagram through the endpoint's receive path on its progress
 * thread, as if it had arrived on `plane` from src_addr:src_port, and waits
 * until it has been handled. Everything the packet causes (placement, ACKs,
 * drops) happens exactly as for a packet from the wire. */
int mrc_ep_rx_inject(mrc_ep *ep, int plane, const void *pkt, size_t len, const char *src_addr,
                     uint16_t src_port);

/* While on, every send of the endpoint behaves as if the kernel answered
 * EAGAIN: packets stay queued in their batches (a socket that stays full). */
int mrc_ep_testing_tx_stall(mrc_ep *ep, int on);

/* While on, the endpoint's connects never send `ready` after the hellos (a
 * TCP exchange that dies once the hellos are through): the server must see
 * the client live on the datapath instead. Set before connecting. */
int mrc_ep_testing_no_ready(mrc_ep *ep, int on);

/* While on, the endpoint's connects send `ready` only once the attempt's
 * deadline has passed (an activation that a busy progress thread finished
 * late): the set-up must still succeed, once. Set before connecting. */
int mrc_ep_testing_late_ready(mrc_ep *ep, int on);

/* This endpoint's id for the connection (what a peer puts in `conn`). */
uint32_t mrc_conn_id(const mrc_conn *c);
/* The peer's id for it (what we put in `conn`). */
uint32_t mrc_conn_peer_id(const mrc_conn *c);

/* How many mrc_ep_accept calls are under way on the endpoint (a test waits
 * for its accepting thread to be inside before it destroys the endpoint). */
int mrc_ep_accepts_active(mrc_ep *ep);

#ifdef __cplusplus
}
#endif
#endif
