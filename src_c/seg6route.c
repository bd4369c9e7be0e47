/*
 * seg6route.c - kernel seg6 routes for SRv6 route sockets, so that a UDP GSO
 * batch keeps its segment routing header and stays one buffer.
 *
 * Why: a sticky IPV6_RTHDR makes the kernel build every datagram with the
 * routing header as an IPv6 extension header of the socket, and a GSO batch
 * of such a socket is cut into single datagrams at the sender (measured on
 * veth: 7 x 8000 B batches left as 7 skbs each; without the SRH as one). Every
 * datagram then costs its own trip through the forwarding namespaces, which
 * bounded a four-flow ring at 0.58 of line while plain IP paths reached 0.88.
 * A seg6 lightweight tunnel route in inline mode inserts the same SRH after
 * segmentation offload has been decided: the batch crosses veth links and
 * seg6local End hops whole and arrives whole at a UDP_GRO socket.
 *
 * How: one policy-routing table per (plane interface, segments before the
 * destination), chosen by a firewall mark that the route socket carries
 * (SO_MARK):
 *
 *   ip -6 rule add pref 9000 fwmark M lookup M
 *   ip -6 route add default encap seg6 mode inline segs S1,...,Sk dev IF table M
 *   ip -6 route add throw S1/128 table M      (the SID itself: main table)
 *
 * Inline mode writes the packet's destination into segments[0] and sends it
 * to the first SID, exactly what the sticky header does, so one table serves
 * every peer behind the same spines. M is a hash of what the table holds; the
 * entries are identical for every endpoint on the host that needs the same
 * route, so adding them is idempotent (EEXIST is success) and they are left
 * in place when the endpoint closes (another endpoint may use them; see
 * docs/routing.md for listing and removing them). Before a socket uses M the
 * kernel is asked which route a marked packet takes; if that is not ours (a
 * hash collision, or someone else's rule) the next M is tried. Setting the
 * plane's interface down deletes the route (not the rule or the throw); the
 * endpoint puts it back when the link comes up (link.c).
 *
 * Without CAP_NET_ADMIN, or on a kernel without seg6 lwtunnels, this fails
 * and the caller falls back to the sticky header (correct, only slower).
 */
#include "internal.h"

#include <errno.h>
#include <linux/fib_rules.h>
#include <linux/lwtunnel.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <linux/seg6.h>
#include <linux/seg6_iptunnel.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define SEG6ROUTE_PREF 9000u
#define SEG6ROUTE_BASE 0x6d720000u /* "mr": marks and tables 0x6d720000-0x6d72ffff */
#define SEG6ROUTE_PROBES 16

/* A request: the header and its attributes in one buffer (nl_put appends). */
struct nlreq {
    _Alignas(struct nlmsghdr) char raw[1040];
};
#define NH(r) ((struct nlmsghdr *)(void *)(r)->raw)

static void *nl_tail(struct nlmsghdr *nh)
{
    return (char *)nh + NLMSG_ALIGN(nh->nlmsg_len);
}

static struct rtattr *nl_put(struct nlmsghdr *nh, unsigned short type, const void *data,
                             size_t len)
{
    struct rtattr *a = nl_tail(nh);
    a->rta_type = type;
    a->rta_len = (unsigned short)RTA_LENGTH(len);
    if (len)
        memcpy(RTA_DATA(a), data, len);
    nh->nlmsg_len = NLMSG_ALIGN(nh->nlmsg_len) + RTA_ALIGN(a->rta_len);
    return a;
}

static void nl_put_u32(struct nlmsghdr *nh, unsigned short type, uint32_t v)
{
    nl_put(nh, type, &v, sizeof(v));
}

/* Sends one request and waits for its answer. With `reply`, the first
 * message that is not an ack is copied there (RTM_GETROUTE). Returns 0 or a
 * negative errno from the kernel's ack. */
static int nl_talk(int fd, struct nlmsghdr *nh, void *reply, size_t reply_len)
{
    static uint32_t seq;
    nh->nlmsg_seq = __atomic_add_fetch(&seq, 1, __ATOMIC_RELAXED);
    nh->nlmsg_flags |= NLM_F_REQUEST | NLM_F_ACK;
    struct sockaddr_nl sa = {.nl_family = AF_NETLINK};
    if (sendto(fd, nh, nh->nlmsg_len, 0, (struct sockaddr *)&sa, sizeof(sa)) < 0)
        return -errno;
    char buf[8192] __attribute__((aligned(NLMSG_ALIGNTO)));
    bool got = reply == NULL;
    for (;;) {
        ssize_t n = recv(fd, buf, sizeof(buf), 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        for (struct nlmsghdr *m = (struct nlmsghdr *)buf; NLMSG_OK(m, (size_t)n);
             m = NLMSG_NEXT(m, n)) {
            if (m->nlmsg_seq != nh->nlmsg_seq)
                continue;
            if (m->nlmsg_type == NLMSG_ERROR) {
                const struct nlmsgerr *e = NLMSG_DATA(m);
                if (e->error || got)
                    return e->error;
                continue;
            }
            if (!got && m->nlmsg_len <= reply_len) {
                memcpy(reply, m, m->nlmsg_len);
                got = true;
            }
        }
    }
}

static uint32_t seg6route_hash(int ifindex, int nsegs, const struct in6_addr *segs)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    const uint8_t *p = (const uint8_t *)segs;
    for (size_t i = 0; i < 16 * (size_t)(nsegs - 1); i++)
        h = (h ^ p[i]) * 1099511628211ull;
    h = (h ^ (uint64_t)(uint32_t)ifindex) * 1099511628211ull;
    return (uint32_t)(h ^ (h >> 32)) & 0xffffu;
}

static int rule_add(int fd, uint32_t mark)
{
    struct nlreq r;
    memset(&r, 0, sizeof(r));
    NH(&r)->nlmsg_len = NLMSG_LENGTH(sizeof(struct fib_rule_hdr));
    NH(&r)->nlmsg_type = RTM_NEWRULE;
    NH(&r)->nlmsg_flags = NLM_F_CREATE | NLM_F_EXCL;
    struct fib_rule_hdr *f = NLMSG_DATA(NH(&r));
    f->family = AF_INET6;
    f->action = FR_ACT_TO_TBL;
    nl_put_u32(NH(&r), FRA_PRIORITY, SEG6ROUTE_PREF);
    nl_put_u32(NH(&r), FRA_FWMARK, mark);
    nl_put_u32(NH(&r), FRA_FWMASK, 0xffffffffu);
    nl_put_u32(NH(&r), FRA_TABLE, mark);
    int rc = nl_talk(fd, NH(&r), NULL, 0);
    return rc == -EEXIST ? 0 : rc;
}

static struct rtmsg *route_msg(struct nlreq *r, uint16_t type, uint16_t flags, uint32_t table)
{
    memset(r, 0, sizeof(*r));
    NH(r)->nlmsg_len = NLMSG_LENGTH(sizeof(struct rtmsg));
    NH(r)->nlmsg_type = type;
    NH(r)->nlmsg_flags = flags;
    struct rtmsg *m = NLMSG_DATA(NH(r));
    m->rtm_family = AF_INET6;
    m->rtm_table = RT_TABLE_UNSPEC; /* the table is in RTA_TABLE: 32 bits */
    m->rtm_protocol = RTPROT_STATIC;
    m->rtm_scope = RT_SCOPE_UNIVERSE;
    m->rtm_type = RTN_UNICAST;
    if (table)
        nl_put_u32(NH(r), RTA_TABLE, table);
    return m;
}

static int route_add(int fd, uint32_t table, int ifindex, const uint8_t *srh, size_t srhlen)
{
    struct nlreq r;
    route_msg(&r, RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, table);
    nl_put_u32(NH(&r), RTA_OIF, (uint32_t)ifindex);
    uint16_t et = LWTUNNEL_ENCAP_SEG6;
    nl_put(NH(&r), RTA_ENCAP_TYPE, &et, sizeof(et));
    struct rtattr *nest = nl_put(NH(&r), RTA_ENCAP | NLA_F_NESTED, NULL, 0);
    uint8_t tun[sizeof(int) + MRC_SRH_MAX];
    int mode = SEG6_IPTUN_MODE_INLINE;
    memcpy(tun, &mode, sizeof(mode));
    memcpy(tun + sizeof(mode), srh, srhlen);
    nl_put(NH(&r), SEG6_IPTUNNEL_SRH, tun, sizeof(mode) + srhlen);
    nest->rta_len = (unsigned short)((char *)nl_tail(NH(&r)) - (char *)nest);
    int rc = nl_talk(fd, NH(&r), NULL, 0);
    return rc == -EEXIST ? 0 : rc;
}

static int throw_add(int fd, uint32_t table, const struct in6_addr *sid)
{
    struct nlreq r;
    struct rtmsg *m = route_msg(&r, RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, table);
    m->rtm_type = RTN_THROW;
    m->rtm_dst_len = 128;
    nl_put(NH(&r), RTA_DST, sid, sizeof(*sid));
    int rc = nl_talk(fd, NH(&r), NULL, 0);
    return rc == -EEXIST ? 0 : rc;
}

/* Does a packet to `dst` carrying `mark` take our route: table `mark`, out of
 * `ifindex`, with our segments (all but the placeholder)? */
static bool route_is_ours(int fd, uint32_t mark, int ifindex, const struct in6_addr *dst,
                          const uint8_t *srh, size_t srhlen)
{
    struct nlreq r;
    struct rtmsg *m = route_msg(&r, RTM_GETROUTE, 0, 0);
    m->rtm_flags = RTM_F_FIB_MATCH; /* the route entry itself, with its encap */
    m->rtm_dst_len = 128;
    nl_put(NH(&r), RTA_DST, dst, sizeof(*dst));
    nl_put_u32(NH(&r), RTA_MARK, mark);
    union {
        struct nlmsghdr nh;
        char buf[4096];
    } rep;
    if (nl_talk(fd, NH(&r), &rep, sizeof(rep)) < 0 || rep.nh.nlmsg_type != RTM_NEWROUTE)
        return false;
    struct rtmsg *rm = NLMSG_DATA(&rep.nh);
    int len = (int)RTM_PAYLOAD(&rep.nh);
    uint32_t table = rm->rtm_table, oif = 0;
    bool seg6 = false, same = false;
    for (struct rtattr *a = RTM_RTA(rm); RTA_OK(a, len); a = RTA_NEXT(a, len)) {
        if (a->rta_type == RTA_TABLE && RTA_PAYLOAD(a) == 4)
            memcpy(&table, RTA_DATA(a), 4);
        else if (a->rta_type == RTA_OIF && RTA_PAYLOAD(a) == 4)
            memcpy(&oif, RTA_DATA(a), 4);
        else if (a->rta_type == RTA_ENCAP_TYPE && RTA_PAYLOAD(a) == 2)
            seg6 = *(uint16_t *)RTA_DATA(a) == LWTUNNEL_ENCAP_SEG6;
        else if ((a->rta_type & NLA_TYPE_MASK) == RTA_ENCAP) {
            int nlen = (int)RTA_PAYLOAD(a);
            for (struct rtattr *t = RTA_DATA(a); RTA_OK(t, nlen); t = RTA_NEXT(t, nlen)) {
                if (t->rta_type != SEG6_IPTUNNEL_SRH || RTA_PAYLOAD(t) != sizeof(int) + srhlen)
                    continue;
                const uint8_t *got = (const uint8_t *)RTA_DATA(t);
                int mode;
                memcpy(&mode, got, sizeof(mode));
                got += sizeof(int);
                /* bytes 1-4: length, type, segments left, last entry; then
                 * segments[1..] (segments[0] is the placeholder). */
                same = mode == SEG6_IPTUN_MODE_INLINE && memcmp(got + 1, srh + 1, 4) == 0 &&
                       memcmp(got + 8 + 16, srh + 8 + 16, srhlen - 8 - 16) == 0;
            }
        }
    }
    return table == mark && oif == (uint32_t)ifindex && seg6 && same;
}

static int nl_open(void)
{
    int fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
    if (fd < 0)
        return -errno;
    struct timeval tv = {.tv_sec = 2};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    return fd;
}

/* Adds route, throw and rule of table m (each may exist already): 0 when a
 * packet with mark m then takes our route, 1 when it takes another (m is
 * someone else's), else the kernel's error (EPERM, EOPNOTSUPP, ENETDOWN).
 * The route first: a kernel without seg6 lwtunnels refuses it, and then
 * nothing is left behind (a rule and throw were, when they came first). */
static int install(int fd, uint32_t m, int ifindex, int nsegs, const struct in6_addr *segs)
{
    uint8_t srh[MRC_SRH_MAX];
    size_t srhlen = sock_srh_build(srh, nsegs, segs); /* the sticky header's bytes */
    int r = route_add(fd, m, ifindex, srh, srhlen);
    if (r == 0)
        r = throw_add(fd, m, &segs[0]);
    if (r == 0)
        r = rule_add(fd, m);
    if (r < 0)
        return r;
    return route_is_ours(fd, m, ifindex, &segs[nsegs - 1], srh, srhlen) ? 0 : 1;
}

int seg6route_mark(int ifindex, int nsegs, const struct in6_addr *segs, uint32_t *mark)
{
    if (ifindex <= 0 || nsegs < 2 || nsegs > MRC_MAX_SEGS)
        return MRC_EUSAGE;
    int fd = nl_open();
    if (fd < 0)
        return fd;
    uint32_t h = seg6route_hash(ifindex, nsegs, segs);
    int rc = -EADDRINUSE;
    for (int probe = 0; probe < SEG6ROUTE_PROBES; probe++) {
        uint32_t m = SEG6ROUTE_BASE | ((h + (uint32_t)probe) & 0xffffu);
        int r = install(fd, m, ifindex, nsegs, segs);
        if (r <= 0) {
            rc = r; /* 0: ours; < 0: no kernel route here */
            if (r == 0)
                *mark = m;
            break;
        }
    }
    close(fd);
    return rc;
}

/* The table a probe's route goes into: inside the range `mrc-route kernel`
 * lists (a probe killed between add and delete leaves a route there to find),
 * and harmless if install() ever hashes to it: no rule leads there, and a
 * route that is not ours makes install() take the next table. */
#define SEG6ROUTE_PROBE_TABLE (SEG6ROUTE_BASE | 0xffffu)

static int route_del(int fd, uint32_t table, int ifindex)
{
    struct nlreq r;
    route_msg(&r, RTM_DELROUTE, 0, table);
    nl_put_u32(NH(&r), RTA_OIF, (uint32_t)ifindex);
    return nl_talk(fd, NH(&r), NULL, 0);
}

int seg6route_probe(int ifindex)
{
    if (ifindex <= 0)
        return MRC_EUSAGE;
    int fd = nl_open();
    if (fd < 0)
        return fd;
    /* Any two segments: the route is never used (no rule names its table). */
    struct in6_addr segs[2] = {{.s6_addr = {0xfd, [15] = 1}}, {.s6_addr = {0xfd, [15] = 2}}};
    uint8_t srh[MRC_SRH_MAX];
    size_t srhlen = sock_srh_build(srh, 2, segs);
    int rc = route_add(fd, SEG6ROUTE_PROBE_TABLE, ifindex, srh, srhlen);
    if (rc == 0)
        route_del(fd, SEG6ROUTE_PROBE_TABLE, ifindex);
    close(fd);
    return rc;
}

int seg6route_restore(uint32_t mark, int ifindex, int nsegs, const struct in6_addr *segs)
{
    int fd = nl_open();
    if (fd < 0)
        return fd;
    int rc = install(fd, mark, ifindex, nsegs, segs);
    close(fd);
    return rc;
}
