/*
 * link.c - local link state from netlink: a plane whose interface loses its
 * carrier fails all its paths at once, without waiting for a timeout.
 *
 * The kernel announces RTM_NEWLINK on every flag change; IFF_RUNNING follows
 * the carrier (a veth whose peer went down loses it too). A plane comes back
 * only through probes: link up says nothing about the path beyond it.
 */
#include "internal.h"

#include <errno.h>
#include <ifaddrs.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <net/if.h>
#include <string.h>
#include <sys/epoll.h>
#include <unistd.h>

/* The interface that holds each plane's address (0: none found, e.g. a
 * loopback alias, which never goes down). */
static void link_map_planes(mrc_ep *ep)
{
    struct ifaddrs *ifs;
    if (getifaddrs(&ifs) < 0)
        return;
    for (int i = 0; i < ep->nplanes; i++) {
        struct sockaddr_storage *pa = &ep->planes[i].addr;
        for (struct ifaddrs *a = ifs; a; a = a->ifa_next) {
            if (!a->ifa_addr || a->ifa_addr->sa_family != pa->ss_family)
                continue;
            struct sockaddr_storage s;
            memset(&s, 0, sizeof(s));
            memcpy(&s, a->ifa_addr, pa->ss_family == AF_INET ? sizeof(struct sockaddr_in)
                                                           : sizeof(struct sockaddr_in6));
            if (addr_same_host(&s, pa)) {
                ep->planes[i].ifindex = (int)if_nametoindex(a->ifa_name);
                ep->planes[i].loopback = (a->ifa_flags & IFF_LOOPBACK) != 0;
                break;
            }
        }
    }
    freeifaddrs(ifs);
}

int link_open(mrc_ep *ep)
{
    link_map_planes(ep);
    int fd = socket(AF_NETLINK, SOCK_RAW | SOCK_NONBLOCK | SOCK_CLOEXEC, NETLINK_ROUTE);
    if (fd < 0)
        return 0; /* no netlink (unusual sandbox): timeouts still find failures */
    struct sockaddr_nl sa = {.nl_family = AF_NETLINK, .nl_groups = RTMGRP_LINK};
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        close(fd);
        return 0;
    }
    /* In the epoll set: an idle loop sleeps without a timer, and a carrier
     * change must still wake it (UINT32_MAX - 1 names this fd). */
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = UINT32_MAX - 1};
    if (epoll_ctl(ep->epfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
        close(fd);
        return 0;
    }
    ep->nl_fd = fd;
    return 0;
}

static void link_plane_event_pt(mrc_ep *ep, int plane, bool up)
{
    struct plane *pl = &ep->planes[plane];
    if (pl->link_down == !up)
        return;
    pl->link_down = !up;
    ep->st.link_events++;
    if (up) {
        /* Setting an interface down deletes the routes through it, the seg6
         * routes of this plane's route sockets too: put them back. */
        sock_seg6route_restore_pt(ep, plane);
        /* The carrier says nothing beyond it, but it is the time to look. */
        for (mrc_conn *c = ep->active; c; c = c->next_active)
            for (int i = 0; i < c->npaths; i++)
                if (c->paths[i].plane == plane)
                    path_probe_soon_pt(c, &c->paths[i]);
        return;
    }
    uint64_t now = now_ns();
    for (mrc_conn *c = ep->active; c; c = c->next_active)
        for (int i = 0; i < c->npaths; i++)
            if (c->paths[i].plane == plane)
                path_set_state_pt(c, &c->paths[i], MRC_PATH_FAILED, now);
}

/* Reads pending link notifications (bounded: one buffer per call). */
void link_poll_pt(mrc_ep *ep)
{
    if (ep->nl_fd < 0)
        return;
    _Alignas(struct nlmsghdr) char buf[8192];
    for (int round = 0; round < 4; round++) {
        ssize_t n = recv(ep->nl_fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (n <= 0)
            return;
        for (struct nlmsghdr *h = (struct nlmsghdr *)buf; NLMSG_OK(h, (size_t)n);
             h = NLMSG_NEXT(h, n)) {
            if (h->nlmsg_type != RTM_NEWLINK && h->nlmsg_type != RTM_DELLINK)
                continue;
            if (h->nlmsg_len < NLMSG_LENGTH(sizeof(struct ifinfomsg)))
                continue;
            const struct ifinfomsg *ifi = NLMSG_DATA(h);
            bool up = h->nlmsg_type == RTM_NEWLINK && (ifi->ifi_flags & IFF_UP) &&
                      (ifi->ifi_flags & IFF_RUNNING);
            for (int i = 0; i < ep->nplanes; i++)
                if (ep->planes[i].ifindex && ep->planes[i].ifindex == ifi->ifi_index)
                    link_plane_event_pt(ep, i, up);
        }
    }
}
