/* fd_budget: accepting a connection never fails with EMFILE, and the last
 * --fd-reserve descriptors stay free for everything that is not a
 * connection (weights files, uploads, the probes' sockets).
 *
 * Why here: gRPC core 1.51's posix TCP server drops its listener for good
 * when accept4 fails with anything but EAGAIN or EINTR (on_read in
 * tcp_server_posix.cc), so idle connections that use up the descriptors
 * lock every later client out while the process looks healthy. gRPC core
 * has no connection cap to set. moed therefore defines accept4 itself: the
 * executable comes first in symbol lookup, so libgrpc's and libuv's calls
 * land here. A connection whose descriptor would fall into the reserve is
 * closed at once; EMFILE/ENFILE (the reserve used up by other descriptors)
 * closes a spare descriptor to take the pending connection and close it,
 * as libuv does for its own listeners. Either way the caller sees the next
 * connection or EAGAIN, which rearms gRPC's listener. The HTTP port may
 * use the first half of the reserve, so that its probes and /metrics still
 * answer while gRPC connections fill everything up to the reserve. */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "moed.h"

static _Atomic int ceiling = INT32_MAX; /* an accepted descriptor >= this is refused */
static _Atomic int side_fd = -1;        /* the HTTP port's listener: half the reserve is its too */
static _Atomic int side_ceiling = INT32_MAX;
static _Atomic int spare = -1; /* closed to make room when accept fails with EMFILE */
static _Atomic uint64_t refused_reserve, refused_exhausted;

static int sys_accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags) {
  return (int)syscall(SYS_accept4, fd, addr, len, flags);
}

static void spare_refill(void) {
  int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  int none = -1;
  if (fd >= 0 && !atomic_compare_exchange_strong(&spare, &none, fd)) close(fd);
}

/* accept4 failed with EMFILE/ENFILE: takes one pending connection with the
 * spare's slot and closes it. false: no spare, or nothing was pending. */
static bool refuse_one(int listener) {
  int fd = atomic_exchange(&spare, -1);
  if (fd < 0) return false;
  close(fd);
  int c = sys_accept4(listener, NULL, NULL, SOCK_CLOEXEC);
  if (c >= 0) {
    atomic_fetch_add(&refused_exhausted, 1); /* before the close a probe may see */
    close(c);
  }
  spare_refill();
  return c >= 0;
}

/* glibc declares accept4 with a transparent union for addr; this definition
 * is one of its members. */
int accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags) {
  const socklen_t room = len ? *len : 0;
  const int top = fd == atomic_load(&side_fd) ? atomic_load(&side_ceiling) : atomic_load(&ceiling);
  for (;;) {
    int c = sys_accept4(fd, addr, len, flags);
    if (c >= 0) {
      if (c < top) return c;
      atomic_fetch_add(&refused_reserve, 1); /* into the reserve: refused (counted before a probe sees it) */
      close(c);                              /* the next pending one may still fit */
      if (len) *len = room;
      continue;
    }
    if (errno != EMFILE && errno != ENFILE) return -1;
    if (!refuse_one(fd)) {
      errno = EAGAIN; /* the listener waits for the next connection instead of dying */
      return -1;
    }
    if (len) *len = room;
  }
}

void moed_fd_budget_init(int reserve) {
  struct rlimit fds;
  if (getrlimit(RLIMIT_NOFILE, &fds) != 0) return;
  if (fds.rlim_cur < fds.rlim_max) {
    fds.rlim_cur = fds.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &fds) != 0) {
      moed_log(MOED_LOG_WARN, "fd_limit", "could not raise the open-file limit: %s", strerror(errno));
      getrlimit(RLIMIT_NOFILE, &fds);
    }
  }
  rlim_t limit = fds.rlim_cur == RLIM_INFINITY || fds.rlim_cur > INT32_MAX ? INT32_MAX : fds.rlim_cur;
  if ((rlim_t)reserve > limit / 4) {
    moed_log(MOED_LOG_WARN, "fd_limit",
             "--fd-reserve %d is over a quarter of the open-file limit %llu: using %llu", reserve,
             (unsigned long long)limit, (unsigned long long)(limit / 4));
    reserve = (int)(limit / 4);
  }
  atomic_store(&ceiling, (int)(limit - (rlim_t)reserve));
  atomic_store(&side_ceiling, (int)(limit - (rlim_t)reserve / 2));
  spare_refill();
  /* a build that linked accept4 elsewhere would leave gRPC's listener unguarded */
  if (dlsym(RTLD_DEFAULT, "accept4") != (void *)accept4)
    moed_log(MOED_LOG_WARN, "fd_limit", "accept4 is not moed's own: gRPC's listener is not guarded");
  moed_log(MOED_LOG_DEBUG, "fd_limit", "open-file limit %llu, connections refused from descriptor %d",
           (unsigned long long)limit, atomic_load(&ceiling));
}

void moed_fd_budget_side_listener(int fd) { atomic_store(&side_fd, fd); }

void moed_fd_budget_refused(uint64_t *reserve, uint64_t *exhausted) {
  *reserve = atomic_load(&refused_reserve);
  *exhausted = atomic_load(&refused_exhausted);
}
