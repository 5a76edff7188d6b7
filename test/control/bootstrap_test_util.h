// Helpers shared by the bootstrap tests.
#ifndef PDLIB_TEST_CONTROL_BOOTSTRAP_TEST_UTIL_H_
#define PDLIB_TEST_CONTROL_BOOTSTRAP_TEST_UTIL_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <string>

#include "lib/control/bootstrap_types.h"

namespace pdlib {
inline namespace v1 {
namespace control {
namespace testing {

inline ModelFingerprint TestFingerprint() {
  ModelFingerprint fp;
  fp.num_layers = 32;
  fp.num_kv_heads = 8;
  fp.head_dim = 128;
  fp.dtype_bytes = 2;
  fp.layout_version = 1;
  fp.model_name = "test-model";
  return fp;
}

// Rank (dp, tp, pp) of a deployment with the given sizes, listening on 127.0.0.1:port.
inline RankRegistration TestRank(int32_t dp, int32_t tp, int32_t pp, int32_t dp_size = 1,
                                 int32_t tp_size = 2, int32_t pp_size = 1, uint32_t port = 7000) {
  RankRegistration reg;
  reg.parallel.dp_rank = dp;
  reg.parallel.tp_rank = tp;
  reg.parallel.pp_rank = pp;
  reg.parallel.dp_size = dp_size;
  reg.parallel.tp_size = tp_size;
  reg.parallel.pp_size = pp_size;
  reg.host = "127.0.0.1";
  reg.port = port;
  reg.page_size = 16;
  reg.fingerprint = TestFingerprint();
  return reg;
}

// A port on 127.0.0.1 that nothing listens on right now (bound to 0, then closed). Connecting
// to it is refused until someone else takes it, which is unlikely within a test.
inline int32_t UnusedLocalPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int32_t port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

}  // namespace testing
}  // namespace control
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_TEST_CONTROL_BOOTSTRAP_TEST_UTIL_H_
