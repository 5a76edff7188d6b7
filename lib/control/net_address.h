// Host/port helpers shared by the control plane's servers and clients.
#ifndef PDLIB_LIB_CONTROL_NET_ADDRESS_H_
#define PDLIB_LIB_CONTROL_NET_ADDRESS_H_

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

namespace pdlib {
inline namespace v1 {
namespace control {

// "127.0.0.1:8998", "[::1]:8998": the form gRPC targets and log lines use. An IPv6 literal is
// bracketed unless it already is.
std::string JoinHostPort(std::string_view host, int64_t port);

// What a TCP connect to host:port found. kRefused (every address refused the connection) means
// no process listens there: whoever listened before has closed its socket (shut down or exited).
// A frozen (SIGSTOPped) process still listening gives kListening: the kernel accepts for it.
enum class PortProbe { kListening, kRefused, kUnknown };
PortProbe ProbeTcpPort(const std::string& host, uint16_t port, std::chrono::milliseconds timeout);

}  // namespace control
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CONTROL_NET_ADDRESS_H_
