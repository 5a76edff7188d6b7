#include "backends/common/progress_thread.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace pdlib {
inline namespace v1 {
namespace toolkit {

WakeSet::~WakeSet() {
  for (int fd : {wake_fd_, epoll_fd_}) {
    if (fd >= 0) close(fd);
  }
}

Status WakeSet::Open(const std::string& backend, std::span<const int> fds) {
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (wake_fd_ < 0 || epoll_fd_ < 0) {
    return Status::Internal(backend +
                            ": cannot create the progress thread's fds: " + std::strerror(errno));
  }
  auto add = [&](int fd) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    return epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) == 0;
  };
  if (!add(wake_fd_)) {
    return Status::Internal(backend + ": epoll_ctl failed: " + std::strerror(errno));
  }
  for (int fd : fds) {
    if (!add(fd)) return Status::Internal(backend + ": epoll_ctl failed: " + std::strerror(errno));
  }
  return Status::OK();
}

Status WakeSet::Watch(const std::string& backend, int fd) {
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = fd;
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    return Status::Internal(backend + ": epoll_ctl failed: " + std::strerror(errno));
  }
  return Status::OK();
}

void WakeSet::Unwatch(int fd) {
  // Fails only for an fd the set does not hold: nothing to undo then.
  (void)epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
}

void WakeSet::Wake() const {
  uint64_t one = 1;
  // Fails only when the counter would overflow, in which case the thread is awake anyway.
  ssize_t n = write(wake_fd_, &one, sizeof(one));
  (void)n;
}

int WakeSet::Wait(std::span<epoll_event> events, int timeout_ms) const {
  // The caller's loop re-checks everything: EINTR and timeouts need no handling.
  const int n = epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()), timeout_ms);
  uint64_t drained = 0;
  ssize_t r = read(wake_fd_, &drained, sizeof(drained));  // non-blocking: EAGAIN when not woken
  (void)r;
  return n;
}

}  // namespace toolkit
}  // namespace v1
}  // namespace pdlib
