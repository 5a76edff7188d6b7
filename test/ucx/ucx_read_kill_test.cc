// A reader killed mid-read must not take the target down (issue #29). This process is the target
// (prefill in pull): it serves "am" reads over tcp on lo to two reader processes forked before it
// touches UCX. The first reads in a loop until it is frozen (SIGSTOP) with requests and replies in
// flight (a fence on it then reports, after a bounded wait, that replies sent from the region are
// still queued) and then killed; the target keeps running (UCX's emulated gets aborted it here,
// "ucp_get_req_handler ... Endpoint timeout") and then serves the second reader byte for byte.
// Its own binary: the readers are forked before any UCX state exists in the process.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "pdlib/spi/transport.h"
#include "test/support/pipe_io.h"
#include "test/support/write_completions.h"

namespace spi = pdlib::spi;
using pdlib::Status;

namespace {

constexpr size_t kBytes = size_t{32} << 20;
constexpr uint64_t kPage = 32768;

uint8_t Pattern(size_t i) { return static_cast<uint8_t>((i * 131) ^ (i >> 13)); }

spi::TransportOptions Tcp(pdlib::TransferDirection direction, bool deep = false) {
  spi::TransportOptions options;
  options.options = {{"ucx.tls", "tcp"}, {"ucx.net_devices", "lo"}};
  // A read window deeper than the sockets' buffers (a few MiB on lo): a reader frozen mid-read
  // then always leaves replies queued at the target, not only in the kernel.
  if (deep) options.options["ucx.max_inflight_read_bytes"] = std::to_string(size_t{256} << 20);
  options.direction = direction;
  return options;
}

using pdlib::testing::ReadAll;
using pdlib::testing::ReceiveBlob;
using pdlib::testing::SendBlob;
using pdlib::testing::WaitExit;
using pdlib::testing::WriteAll;

// The reader (decode in pull), in a child process: connects with the blobs it is sent, then
// reads the whole region in pages, once (`loop` false: checks every byte, exit 0 when exact) or
// forever (in its second round, with 128 MiB requested, reporting 'R' on `status` and
// stopping itself with SIGSTOP).
int Reader(int in, int status, bool loop) {
  spi::Blob endpoint, key;
  uint64_t addr = 0;
  if (!ReceiveBlob(in, &endpoint) || !ReceiveBlob(in, &key) || !ReadAll(in, &addr, sizeof(addr))) {
    return 10;
  }
  auto transport = spi::CreateTransport("ucx", Tcp(pdlib::TransferDirection::kPull, loop));
  if (!transport.ok()) return 11;
  spi::Transport& t = **transport;
  auto conn = t.Connect(endpoint);
  if (!conn.ok()) return 12;
  auto remote = t.ImportRemoteRegion(conn->peer, {addr, kBytes, key});
  if (!remote.ok()) return 13;
  std::vector<uint8_t> dst(kBytes, 0);
  auto local = t.RegisterMemory({dst.data(), dst.size()}, nullptr);
  if (!local.ok()) return 14;
  std::vector<spi::ReadOp> ops;
  for (uint64_t off = 0; off < kBytes; off += kPage)
    ops.push_back({*local, off, *remote, off, kPage});
  for (int round = 0;; ++round) {
    pdlib::testing::WriteCompletions done;
    for (int i = 0; i < 4; ++i) {
      if (!t.PostReads(conn->peer, ops, done.Callback()).ok()) return 15;
    }
    if (loop && round == 1) {
      // 128 MiB requested (the deep window sends every request at once), a few MiB of it
      // answered: freeze here, so that the target holds replies it cannot send, whatever the
      // machine's speed (a stop timed from outside sometimes fell between two rounds).
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      WriteAll(status, "R", 1);
      raise(SIGSTOP);
    }
    if (!done.Wait(4, std::chrono::seconds(60))) return 16;
    for (const Status& s : done.statuses()) {
      if (!s.ok()) return 17;
    }
    if (!loop) break;
  }
  for (size_t i = 0; i < kBytes; ++i) {
    if (dst[i] != Pattern(i)) return 18;
  }
  return 0;
}

pid_t ForkReader(int* to_child, int* from_child, bool loop) {
  int down[2], up[2];
  REQUIRE(pipe(down) == 0);
  REQUIRE(pipe(up) == 0);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    close(down[1]);
    close(up[0]);
    _exit(Reader(down[0], up[1], loop));
  }
  close(down[0]);
  close(up[1]);
  *to_child = down[1];
  *from_child = up[0];
  return pid;
}

}  // namespace

TEST_CASE("ucx am reads over tcp: a reader frozen and killed mid-read leaves the target serving") {
  int to_victim = -1, from_victim = -1, to_reader = -1, from_reader = -1;
  const pid_t victim = ForkReader(&to_victim, &from_victim, /*loop=*/true);
  const pid_t reader = ForkReader(&to_reader, &from_reader, /*loop=*/false);

  std::vector<uint8_t> memory(kBytes);
  for (size_t i = 0; i < kBytes; ++i) memory[i] = Pattern(i);
  auto target = spi::CreateTransport("ucx", Tcp(pdlib::TransferDirection::kPull));
  REQUIRE(target.ok());
  CHECK((*target)->capabilities().fences);
  spi::Blob key;
  REQUIRE((*target)->RegisterMemory({memory.data(), kBytes}, &key).ok());
  const uint64_t addr = reinterpret_cast<uint64_t>(memory.data());
  auto serve = [&](int fd) {
    auto ep = (*target)->CreateTargetEndpoint();
    REQUIRE(ep.ok());
    SendBlob(fd, ep->blob);
    SendBlob(fd, key);
    WriteAll(fd, &addr, sizeof(addr));
    return ep->id;
  };

  const spi::TargetId victim_target = serve(to_victim);
  char ready = 0;
  REQUIRE(ReadAll(from_victim, &ready, 1));  // it has read the region once and stops itself
  int stopped = 0;
  REQUIRE(waitpid(victim, &stopped, WUNTRACED) == victim);
  REQUIRE(WIFSTOPPED(stopped));  // requests and replies in flight, replies piling up
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  {
    // Replies go out of the region itself (no copy): a fence holds only once those sent before
    // it have ended, and the frozen reader takes none, so the fence says that it does not hold
    // yet, after waiting a bounded time, instead of claiming a cut that UCX could still cross.
    const auto start = std::chrono::steady_clock::now();
    Status fenced = (*target)->FenceTarget(victim_target);
    const auto waited = std::chrono::steady_clock::now() - start;
    INFO(fenced.ToString());
    CHECK(fenced.code() == pdlib::StatusCode::kUnavailable);
    CHECK(fenced.message().find("still queued") != std::string::npos);
    CHECK(waited >= std::chrono::milliseconds(400));
    CHECK(waited < std::chrono::seconds(10));
  }
  kill(victim, SIGKILL);
  int status = 0;
  REQUIRE(waitpid(victim, &status, 0) == victim);
  CHECK(WIFSIGNALED(status));
  // The target's progress thread meets the dead reader's endpoint (its replies fail) meanwhile.
  std::this_thread::sleep_for(std::chrono::seconds(2));

  const spi::TargetId reader_target = serve(to_reader);
  CHECK(WaitExit(reader, std::chrono::seconds(120)) == 0);
  // A reader that took all its replies: the fence holds at once.
  CHECK((*target)->FenceTarget(reader_target).ok());
  target->reset();
  for (int fd : {to_victim, from_victim, to_reader, from_reader}) close(fd);
}
