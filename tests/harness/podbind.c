/* The ground's pods share this machine's network namespace, each with its own loopback
 * address (its podIP). On GKE each pod has its own network namespace, so two replicas can
 * both listen on 0.0.0.0:8080. Here a bind() of a fixed port on every IPv4 address
 * (INADDR_ANY) binds the pod's own address instead (GROUND_POD_IP), so the same holds.
 * Loaded into a pod's processes with LD_PRELOAD by the node agent (podbind.py). A bind of
 * port 0 (an ephemeral port) or of any named address is left as it is. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static int (*real_bind)(int, const struct sockaddr *, socklen_t);
    if (!real_bind)
        real_bind = (int (*)(int, const struct sockaddr *, socklen_t))dlsym(RTLD_NEXT, "bind");
    const char *pod_ip = getenv("GROUND_POD_IP");
    if (pod_ip && addr && addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in own = *(const struct sockaddr_in *)addr;
        if (own.sin_addr.s_addr == htonl(INADDR_ANY) && own.sin_port != 0 &&
            inet_pton(AF_INET, pod_ip, &own.sin_addr) == 1)
            return real_bind(fd, (const struct sockaddr *)&own, sizeof own);
    }
    return real_bind(fd, addr, len);
}
