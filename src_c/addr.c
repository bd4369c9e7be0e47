/* addr.c - socket address helpers shared by set-up, sockets and telemetry. */
#include "internal.h"

#include <arpa/inet.h>
#include <stdio.h>
#include <string.h>

int addr_parse(const char *s, uint16_t port, struct sockaddr_storage *ss, socklen_t *len)
{
    memset(ss, 0, sizeof(*ss));
    struct sockaddr_in *in4 = (struct sockaddr_in *)ss;
    struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)ss;
    if (inet_pton(AF_INET, s, &in4->sin_addr) == 1) {
        in4->sin_family = AF_INET;
        in4->sin_port = htons(port);
        *len = sizeof(*in4);
        return 0;
    }
    if (inet_pton(AF_INET6, s, &in6->sin6_addr) == 1) {
        in6->sin6_family = AF_INET6;
        in6->sin6_port = htons(port);
        *len = sizeof(*in6);
        return 0;
    }
    return MRC_EUSAGE;
}

void addr_format(const struct sockaddr_storage *ss, char *buf, size_t len)
{
    const void *a = ss->ss_family == AF_INET
                        ? (const void *)&((const struct sockaddr_in *)ss)->sin_addr
                        : (const void *)&((const struct sockaddr_in6 *)ss)->sin6_addr;
    if (!inet_ntop(ss->ss_family, a, buf, (socklen_t)len))
        snprintf(buf, len, "?");
}

bool addr_same_host(const struct sockaddr_storage *a, const struct sockaddr_storage *b)
{
    if (a->ss_family != b->ss_family)
        return false;
    if (a->ss_family == AF_INET)
        return ((const struct sockaddr_in *)a)->sin_addr.s_addr ==
               ((const struct sockaddr_in *)b)->sin_addr.s_addr;
    return memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr,
                  &((const struct sockaddr_in6 *)b)->sin6_addr, 16) == 0;
}
