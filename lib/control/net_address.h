// Host/port helpers shared by the control plane's servers and clients.
#ifndef PDLIB_LIB_CONTROL_NET_ADDRESS_H_
#define PDLIB_LIB_CONTROL_NET_ADDRESS_H_

#include <cstdint>
#include <string>
#include <string_view>

namespace pdlib {
inline namespace v1 {
namespace control {

// "127.0.0.1:8998", "[::1]:8998": the form gRPC targets and log lines use. An IPv6 literal is
// bracketed unless it already is.
std::string JoinHostPort(std::string_view host, int64_t port);

}  // namespace control
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CONTROL_NET_ADDRESS_H_
