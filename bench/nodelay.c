/*
 * nodelay.so: sets TCP_NODELAY on every socket a server accepts, for servers
 * that do not set it themselves (loaded with LD_PRELOAD by bench/run.sh).
 *
 * Why: with Nagle's algorithm on, a server that writes a small piece (an SSE
 * event) while its previous piece is not yet acknowledged holds it until the
 * ACK comes, and the client delays that ACK up to 40 ms. A streamed reply
 * then stalls ~40 ms after its first event. The benchmark's first report
 * found exactly that in Arbor and in arbor-mock; both set the option
 * themselves since. The runner still loads this into the mock, so that the
 * baseline stays a non-stalling provider when an older build is measured.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

static void set_nodelay(int fd) {
    if (fd >= 0) {
        int one = 1;
        /* Fails harmlessly (and is ignored) on a non-TCP socket. */
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
}

int accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags) {
    static int (*real_accept4)(int, struct sockaddr *, socklen_t *, int);
    if (!real_accept4) real_accept4 = (int (*)(int, struct sockaddr *, socklen_t *, int))dlsym(RTLD_NEXT, "accept4");
    int accepted = real_accept4(fd, addr, len, flags);
    set_nodelay(accepted);
    return accepted;
}

int accept(int fd, struct sockaddr *addr, socklen_t *len) {
    static int (*real_accept)(int, struct sockaddr *, socklen_t *);
    if (!real_accept) real_accept = (int (*)(int, struct sockaddr *, socklen_t *))dlsym(RTLD_NEXT, "accept");
    int accepted = real_accept(fd, addr, len);
    set_nodelay(accepted);
    return accepted;
}
