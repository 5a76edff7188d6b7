#include "lib/control/net_address.h"

#include "absl/strings/str_format.h"

namespace pdlib {
inline namespace v1 {
namespace control {

std::string JoinHostPort(std::string_view host, int64_t port) {
  const bool ipv6_literal = host.find(':') != std::string_view::npos && !host.starts_with('[');
  if (ipv6_literal) return absl::StrFormat("[%s]:%d", host, port);
  return absl::StrFormat("%s:%d", host, port);
}

}  // namespace control
}  // namespace v1
}  // namespace pdlib
