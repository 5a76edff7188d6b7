// Decode's bootstrap lookups after the bootstrap server restarts (lib/control/discovery.cc,
// FreshBootstrapClient; issue #18). A gRPC channel whose server went away fails every later call
// at once with the remembered error, and its own reconnection completes only when some thread
// polls the channel, which in a process with no call waiting is gRPC's backup poller, every
// 5 s: a decode process kept failing its lookups "connection refused" 5-8 s after the server
// was back (found by pdlib-chaos's bootstrap_restart fault). Now a failed call drops its channel
// and the next one connects afresh.
//
// The lookups run in a child process, as in a decode process: in this one the server's own
// threads poll gRPC and would hide the delay. The child is forked before this process uses gRPC
// (this binary holds this one case; ctest runs it alone) and reports each lookup on a pipe.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <memory>
#include <thread>

#include "lib/control/bootstrap_server.h"
#include "lib/control/discovery.h"
#include "test/control/bootstrap_test_util.h"

namespace pdlib::control {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// The child: a decode directory's GetParallelInfo every 50 ms, one byte per answer on `out`
// ('y': the server answered, NOT_FOUND included; 'n': it did not), until the pipe breaks.
[[noreturn]] void LookUpForever(int32_t port, int out) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  KVManagerOptions o;
  o.mode = Mode::kDecode;
  o.connect_timeout = milliseconds(2000);
  auto discovery = DiscoveryBackend::Create(o);
  if (!discovery.ok()) ::_exit(2);
  auto directory = (*discovery)->Open("127.0.0.1", static_cast<uint16_t>(port));
  if (!directory.ok()) ::_exit(3);
  while (true) {
    auto info = (*directory)->GetParallelInfo();
    const char answer = info.ok() || info.status().code() == StatusCode::kNotFound ? 'y' : 'n';
    if (::write(out, &answer, 1) != 1) ::_exit(0);
    std::this_thread::sleep_for(milliseconds(50));
  }
}

TEST_CASE("a decode process's lookups succeed soon after its bootstrap server restarts") {
  const int32_t port = testing::UnusedLocalPort();
  REQUIRE(port > 0);
  int pipe_fds[2];
  REQUIRE(::pipe(pipe_fds) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(pipe_fds[0]);
    LookUpForever(port, pipe_fds[1]);
  }
  ::close(pipe_fds[1]);
  const int in = pipe_fds[0];
  // The next answer of kind `want` ('y' or 'n') within `limit`; how long it took, or -1.
  auto next = [&](char want, milliseconds limit) -> int64_t {
    const auto start = Clock::now();
    char c = 0;
    while (Clock::now() - start < limit) {
      if (::read(in, &c, 1) != 1) return -1;
      if (c == want) {
        return std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
      }
    }
    return -1;
  };
  BootstrapServerOptions so;
  so.host = "127.0.0.1";
  so.port = port;
  auto start_server = [&] {
    const auto deadline = Clock::now() + milliseconds(10000);
    while (true) {
      auto server = BootstrapServer::Start(so);
      if (server.ok()) return std::move(server).value();
      REQUIRE(Clock::now() < deadline);  // the old socket's port is let go within that
      std::this_thread::sleep_for(milliseconds(20));
    }
  };
  auto server = start_server();
  REQUIRE(next('y', milliseconds(10000)) >= 0);
  for (int round = 0; round < 4; ++round) {
    INFO("restart " << round);
    server.reset();
    // The child has seen the server gone (its channel remembers the failure) ...
    REQUIRE(next('n', milliseconds(10000)) >= 0);
    REQUIRE(next('n', milliseconds(10000)) >= 0);
    std::this_thread::sleep_for(milliseconds(500 + 300 * round));
    server = start_server();
    // ... and answers from the new server within a few lookups, not after gRPC's 5 s backup
    // poll (before the fix: 6-8 s). Buffered 'n's of the outage are read on the way.
    const int64_t took = next('y', milliseconds(15000));
    CHECK(took >= 0);
    CHECK(took < 1500);
  }
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  ::close(in);
}

}  // namespace
}  // namespace pdlib::control
