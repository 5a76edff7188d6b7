// Helpers of the hostile-peer tests (hostile_peer_test.cc: a lying decode against a prefill
// manager; hostile_prefill_test.cc: a lying prefill against a decode manager): one rank's
// buffers and options over the gRPC control plane with the fake backend, and an honest transfer
// that shows a manager still works after the lies.
#ifndef PDLIB_TEST_CONTROL_HOSTILE_PEER_UTIL_H_
#define PDLIB_TEST_CONTROL_HOSTILE_PEER_UTIL_H_

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <string_view>
#include <thread>
#include <vector>

#include "pdlib/pdlib.h"

namespace pdlib_hostile {

using namespace std::chrono_literals;
using pdlib::KVPoll;

inline constexpr uint64_t kPages = 64, kPageBytes = 256, kAuxSlots = 8, kAuxBytes = 64;
inline const pdlib::ModelFingerprint kFingerprint{2, 8, 128, 2, 1, "test-model"};

template <typename Pred>
inline bool WaitFor(Pred pred, std::chrono::milliseconds limit = 10000ms) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

inline bool Contains(std::string_view text, std::string_view part) {
  return text.find(part) != std::string_view::npos;
}

// One rank's memory: two KV buffers (K, V: opaque pages) and one aux buffer.
struct Buffers {
  std::vector<uint8_t> k = std::vector<uint8_t>(kPages * kPageBytes);
  std::vector<uint8_t> v = std::vector<uint8_t>(kPages * kPageBytes);
  std::vector<uint8_t> aux = std::vector<uint8_t>(kAuxSlots * kAuxBytes);
  static uint64_t Addr(const std::vector<uint8_t>& b) {
    return reinterpret_cast<uint64_t>(b.data());
  }
};

inline pdlib::KVManagerOptions Options(pdlib::Mode mode, uint16_t bootstrap_port, Buffers& b) {
  pdlib::KVManagerOptions o;
  o.mode = mode;
  o.control_plane = pdlib::ControlPlane::kGrpc;
  o.start_bootstrap_server = mode == pdlib::Mode::kPrefill;
  o.bootstrap_port = bootstrap_port;
  o.liveness_timeout = 1000ms;
  o.connect_timeout = 2000ms;
  o.args.kv = {
      {Buffers::Addr(b.k), Buffers::Addr(b.v)}, {b.k.size(), b.v.size()}, {kPageBytes, kPageBytes}};
  o.args.aux = {{Buffers::Addr(b.aux)}, {b.aux.size()}, {kAuxBytes}};
  o.args.page_size = 16;
  o.args.fingerprint = kFingerprint;
  return o;
}

// A port nobody listens on right now (the kernel's choice for an ephemeral bind).
inline uint16_t FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  REQUIRE(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  close(fd);
  return ntohs(a.sin_port);
}

// One honest transfer through `prefill` from a fresh decode manager: the manager still works.
inline void ExpectHealthy(pdlib::KVManager& prefill, uint16_t bootstrap_port, uint64_t room) {
  Buffers dbuf;
  auto decode = pdlib::KVManager::Create(Options(pdlib::Mode::kDecode, bootstrap_port, dbuf));
  REQUIRE(decode.ok());
  auto sender = prefill.CreateSender(room);
  REQUIRE(sender.ok());
  auto receiver = (*decode)->CreateReceiver({"127.0.0.1", bootstrap_port}, room);
  REQUIRE(receiver.ok());
  std::vector<int32_t> dst = {5, 6, 7}, src = {1, 2, 3};
  REQUIRE((*receiver)->Init(dst, 1).ok());
  REQUIRE(WaitFor([&] { return (*sender)->Poll() == KVPoll::kWaitingForInput; }));
  REQUIRE((*sender)->Init(src.size(), 2).ok());
  REQUIRE((*sender)->Send(src, true).ok());
  REQUIRE(WaitFor([&] {
    return (*sender)->Poll() == KVPoll::kSuccess && (*receiver)->Poll() == KVPoll::kSuccess;
  }));
}

}  // namespace pdlib_hostile

#endif  // PDLIB_TEST_CONTROL_HOSTILE_PEER_UTIL_H_
