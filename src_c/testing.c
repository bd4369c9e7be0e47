/* testing.c - the hooks of mrc_testing.h. */
#include "internal.h"
#include "mrc_testing.h"

#include <string.h>

struct rx_inject {
    int plane;
    const void *pkt;
    size_t len;
    struct sockaddr_storage from;
};

void testing_rx_inject_pt(mrc_ep *ep, void *arg)
{
    struct rx_inject *r = arg;
    /* The receive path may write into its buffer (never does today), and
     * must see the same alignment as a real burst: copy into slot 0. */
    memcpy(ep->rxbuf, r->pkt, r->len);
    rx_packet_pt(ep, r->plane, &r->from, ep->rxbuf, r->len, now_ns());
    rx_flush_acks_pt(ep, now_ns());
}

int mrc_ep_rx_inject(mrc_ep *ep, int plane, const void *pkt, size_t len, const char *src_addr,
                     uint16_t src_port)
{
    if (plane < 0 || plane >= ep->nplanes || len > MRC_RX_SLOT)
        return MRC_EUSAGE;
    struct rx_inject r = {.plane = plane, .pkt = pkt, .len = len};
    socklen_t sl;
    if (addr_parse(src_addr, src_port, &r.from, &sl))
        return MRC_EUSAGE;
    struct ctl c = {.type = CTL_RX_INJECT, .arg = &r};
    return ep_ctl(ep, &c);
}

int mrc_ep_testing_tx_stall(mrc_ep *ep, int on)
{
    struct ctl c = {.type = CTL_TX_STALL, .iarg = on};
    return ep_ctl(ep, &c);
}

int mrc_ep_testing_no_ready(mrc_ep *ep, int on)
{
    ep->testing_no_ready = on != 0; /* read by connect on the caller's thread */
    return 0;
}

int mrc_ep_testing_late_ready(mrc_ep *ep, int on)
{
    ep->testing_late_ready = on != 0; /* read by connect on the caller's thread */
    return 0;
}

uint32_t mrc_conn_id(const mrc_conn *c) { return c->id; }
uint32_t mrc_conn_peer_id(const mrc_conn *c) { return c->peer_id; }
