#include "lib/control/net_address.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_format.h"

namespace pdlib {
inline namespace v1 {
namespace control {

std::string JoinHostPort(std::string_view host, int64_t port) {
  const bool ipv6_literal = host.find(':') != std::string_view::npos && !host.starts_with('[');
  if (ipv6_literal) return absl::StrFormat("[%s]:%d", host, port);
  return absl::StrFormat("%s:%d", host, port);
}

namespace {

PortProbe ProbeOne(const addrinfo& ai, std::chrono::milliseconds timeout) {
  const int fd =
      ::socket(ai.ai_family, ai.ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai.ai_protocol);
  if (fd < 0) return PortProbe::kUnknown;
  PortProbe result = PortProbe::kUnknown;
  if (::connect(fd, ai.ai_addr, ai.ai_addrlen) == 0) {
    result = PortProbe::kListening;
  } else if (errno == ECONNREFUSED) {
    result = PortProbe::kRefused;
  } else if (errno == EINPROGRESS) {
    pollfd pfd{fd, POLLOUT, 0};
    if (::poll(&pfd, 1, static_cast<int>(timeout.count())) == 1) {
      int err = 0;
      socklen_t len = sizeof(err);
      if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0) {
        result = err == 0              ? PortProbe::kListening
                 : err == ECONNREFUSED ? PortProbe::kRefused
                                       : PortProbe::kUnknown;
      }
    }
  }
  ::close(fd);
  return result;
}

}  // namespace

PortProbe ProbeTcpPort(const std::string& host, uint16_t port, std::chrono::milliseconds timeout) {
  std::string bare = host;
  if (bare.size() > 2 && bare.front() == '[' && bare.back() == ']') {
    bare = bare.substr(1, bare.size() - 2);
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* list = nullptr;
  if (::getaddrinfo(bare.c_str(), std::to_string(port).c_str(), &hints, &list) != 0) {
    return PortProbe::kUnknown;
  }
  bool any = false, all_refused = true;
  for (addrinfo* ai = list; ai != nullptr; ai = ai->ai_next) {
    any = true;
    const PortProbe p = ProbeOne(*ai, timeout);
    if (p == PortProbe::kListening) {
      ::freeaddrinfo(list);
      return p;
    }
    all_refused &= p == PortProbe::kRefused;
  }
  ::freeaddrinfo(list);
  return any && all_refused ? PortProbe::kRefused : PortProbe::kUnknown;
}

}  // namespace control
}  // namespace v1
}  // namespace pdlib
