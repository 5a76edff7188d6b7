// A peer killed in the middle of a shared-memory send must cost only its own connection. UCX's
// shm transports give a worker one receive FIFO that every sender writes into (a slot claimed,
// then filled); a sender killed in between leaves a slot that never fills, and a worker shared by
// all connections then received nothing more from anyone: with UCX 1.13, about one kill in eight
// left a decode that never completed another read (pdlib-chaos over ucx shm, pull). The ucx
// backend gives every connection a worker of its own (ucx_transport.h), so that:
// - push: this process is the target (decode); a writer child is killed mid-write, then a fresh
//   writer's batch lands here byte for byte;
// - pull: this process reads; a target child (prefill) is killed while it sends replies, then a
//   read from a fresh target completes byte for byte.
// Each case kills kRounds peers (a kill lands inside a send about one time in eight). Its own
// binary: the children are forked before any UCX state exists in the process.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "pdlib/spi/transport.h"
#include "test/support/pipe_io.h"
#include "test/support/write_completions.h"

namespace spi = pdlib::spi;
using pdlib::Status;

namespace {

constexpr int kRounds = 16;
constexpr size_t kBytes = size_t{1} << 20;
constexpr uint64_t kPage = 32768;

uint8_t Pattern(size_t i, int seed) {
  return static_cast<uint8_t>((i * 131 + seed * 7) ^ (i >> 9));
}

spi::TransportOptions Shm(pdlib::TransferDirection direction) {
  spi::TransportOptions options;
  options.options = {{"ucx.tls", "shm"}};
  options.direction = direction;
  return options;
}

using pdlib::testing::ReadAll;
using pdlib::testing::ReceiveBlob;
using pdlib::testing::SendBlob;
using pdlib::testing::WaitExit;
using pdlib::testing::WriteAll;

// Where a peer's bytes go or come from: an endpoint blob, a key blob and the region's address.
struct Exposure {
  spi::Blob endpoint, key;
  uint64_t addr = 0;
};

void SendExposure(int fd, const Exposure& e) {
  SendBlob(fd, e.endpoint);
  SendBlob(fd, e.key);
  WriteAll(fd, &e.addr, sizeof(e.addr));
}

bool ReceiveExposure(int fd, Exposure* e) {
  return ReceiveBlob(fd, &e->endpoint) && ReceiveBlob(fd, &e->key) &&
         ReadAll(fd, &e->addr, sizeof(e->addr));
}

std::vector<spi::WriteOp> Pages(spi::LocalRegionId local, spi::RemoteRegionId remote) {
  std::vector<spi::WriteOp> ops;
  for (uint64_t off = 0; off < kBytes; off += kPage)
    ops.push_back({local, off, remote, off, kPage});
  return ops;
}

// A writer (prefill in push), in a child: writes its pattern into the region it is told about,
// once (exit 0 when the batch succeeded) or forever (`loop`, after saying 'S' once the first
// batch is in), until it is killed.
int Writer(int in, int out, int seed, bool loop) {
  Exposure there;
  if (!ReceiveExposure(in, &there)) return 10;
  auto transport = spi::CreateTransport("ucx", Shm(pdlib::TransferDirection::kPush));
  if (!transport.ok()) return 11;
  spi::Transport& t = **transport;
  auto conn = t.Connect(there.endpoint);
  if (!conn.ok()) return 12;
  auto remote = t.ImportRemoteRegion(conn->peer, {there.addr, kBytes, there.key});
  if (!remote.ok()) return 13;
  std::vector<uint8_t> src(kBytes);
  for (size_t i = 0; i < kBytes; ++i) src[i] = Pattern(i, seed);
  auto local = t.RegisterMemory({src.data(), src.size()}, nullptr);
  if (!local.ok()) return 14;
  const std::vector<spi::WriteOp> ops = Pages(*local, *remote);
  for (int round = 0;; ++round) {
    pdlib::testing::WriteCompletions done;
    for (int i = 0; i < 4; ++i) {
      if (!t.PostWrites(conn->peer, ops, done.Callback()).ok()) return 15;
    }
    if (!done.Wait(4, std::chrono::seconds(30))) return 16;
    for (const Status& s : done.statuses()) {
      if (!s.ok()) return 17;
    }
    if (!loop) return 0;
    if (round == 0) WriteAll(out, "S", 1);
  }
}

// A target (prefill in pull), in a child: exposes its pattern for reads and serves them until
// it is killed (or its pipe closes).
int Target(int in, int out, int seed) {
  auto transport = spi::CreateTransport("ucx", Shm(pdlib::TransferDirection::kPull));
  if (!transport.ok()) return 11;
  spi::Transport& t = **transport;
  std::vector<uint8_t> memory(kBytes);
  for (size_t i = 0; i < kBytes; ++i) memory[i] = Pattern(i, seed);
  Exposure here;
  if (!t.RegisterMemory({memory.data(), kBytes}, &here.key).ok()) return 12;
  auto ep = t.CreateTargetEndpoint();
  if (!ep.ok()) return 13;
  here.endpoint = ep->blob;
  here.addr = reinterpret_cast<uint64_t>(memory.data());
  SendExposure(out, here);
  char c = 0;
  (void)ReadAll(in, &c, 1);  // the parent closes the pipe when done
  return 0;
}

struct Child {
  pid_t pid = -1;
  int to = -1, from = -1;
};

enum class Role { kWriterLoop, kWriterOnce, kTarget };

Child Fork(Role role, int seed) {
  int down[2], up[2];
  REQUIRE(pipe(down) == 0);
  REQUIRE(pipe(up) == 0);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    close(down[1]);
    close(up[0]);
    _exit(role == Role::kTarget ? Target(down[0], up[1], seed)
                                : Writer(down[0], up[1], seed, role == Role::kWriterLoop));
  }
  close(down[0]);
  close(up[1]);
  return Child{pid, down[1], up[0]};
}

void Kill(const Child& c) {
  kill(c.pid, SIGKILL);
  int status = 0;
  waitpid(c.pid, &status, 0);
  close(c.to);
  close(c.from);
}

// Somewhere inside the victim's stream of sends.
std::chrono::microseconds KillDelay(std::mt19937& rng) {
  return std::chrono::microseconds(std::uniform_int_distribution<int>(1000, 60000)(rng));
}

}  // namespace

TEST_CASE("ucx shm push: writers killed mid-write leave the target receiving from the next") {
  std::vector<Child> victims, probes;
  for (int r = 0; r < kRounds; ++r) {
    victims.push_back(Fork(Role::kWriterLoop, 2 * r));
    probes.push_back(Fork(Role::kWriterOnce, 2 * r + 1));
  }
  auto target = spi::CreateTransport("ucx", Shm(pdlib::TransferDirection::kPush));
  REQUIRE(target.ok());
  std::vector<std::vector<uint8_t>> regions(2 * kRounds, std::vector<uint8_t>(kBytes, 0));
  std::vector<spi::Blob> keys(regions.size());
  for (size_t i = 0; i < regions.size(); ++i) {
    REQUIRE((*target)->RegisterMemory({regions[i].data(), kBytes}, &keys[i]).ok());
  }
  auto expose = [&](const Child& c, size_t region) {
    auto ep = (*target)->CreateTargetEndpoint();
    REQUIRE(ep.ok());
    SendExposure(c.to,
                 {ep->blob, keys[region], reinterpret_cast<uint64_t>(regions[region].data())});
    return ep->id;
  };
  std::mt19937 rng(7);
  for (int r = 0; r < kRounds; ++r) {
    INFO("round " << r);
    const spi::TargetId victim_target = expose(victims[r], 2 * r);
    char started = 0;
    REQUIRE(ReadAll(victims[r].from, &started, 1));
    std::this_thread::sleep_for(KillDelay(rng));
    Kill(victims[r]);
    (*target)->CloseTargetEndpoint(victim_target);  // as decode does once the prefill is gone

    const spi::TargetId probe_target = expose(probes[r], 2 * r + 1);
    REQUIRE(WaitExit(probes[r].pid, std::chrono::seconds(30)) == 0);
    const std::vector<uint8_t>& got = regions[2 * r + 1];
    size_t first_bad = kBytes;
    for (size_t i = 0; i < kBytes && first_bad == kBytes; ++i) {
      if (got[i] != Pattern(i, 2 * r + 1)) first_bad = i;
    }
    CHECK(first_bad == kBytes);
    (*target)->CloseTargetEndpoint(probe_target);
    close(probes[r].to);
    close(probes[r].from);
  }
  target->reset();
}

TEST_CASE("ucx shm pull: targets killed mid-reply leave the reader reading from the next") {
  std::vector<Child> victims, probes;
  for (int r = 0; r < kRounds; ++r) {
    victims.push_back(Fork(Role::kTarget, 2 * r));
    probes.push_back(Fork(Role::kTarget, 2 * r + 1));
  }
  auto reader = spi::CreateTransport("ucx", Shm(pdlib::TransferDirection::kPull));
  REQUIRE(reader.ok());
  spi::Transport& t = **reader;
  std::vector<uint8_t> dst(kBytes, 0);
  auto local = t.RegisterMemory({dst.data(), dst.size()}, nullptr);
  REQUIRE(local.ok());
  auto connect = [&](const Child& c) {
    Exposure there;
    REQUIRE(ReceiveExposure(c.from, &there));
    auto conn = t.Connect(there.endpoint);
    REQUIRE(conn.ok());
    auto remote = t.ImportRemoteRegion(conn->peer, {there.addr, kBytes, there.key});
    REQUIRE(remote.ok());
    return std::make_pair(conn->peer, *remote);
  };
  std::mt19937 rng(11);
  for (int r = 0; r < kRounds; ++r) {
    INFO("round " << r);
    {
      // Reads in flight (16 MiB requested, answered in replies), then the target dies.
      auto [peer, remote] = connect(victims[r]);
      pdlib::testing::WriteCompletions done;
      const std::vector<spi::WriteOp> ops = Pages(*local, remote);
      for (int i = 0; i < 16; ++i) REQUIRE(t.PostReads(peer, ops, done.Callback()).ok());
      std::this_thread::sleep_for(KillDelay(rng));
      Kill(victims[r]);
      t.Disconnect(peer);  // as decode does once the prefill is gone: every batch ends
      CHECK(done.Wait(16, std::chrono::seconds(10)));
    }
    std::fill(dst.begin(), dst.end(), 0);
    auto [peer, remote] = connect(probes[r]);
    pdlib::testing::WriteCompletions done;
    REQUIRE(t.PostReads(peer, Pages(*local, remote), done.Callback()).ok());
    REQUIRE(done.Wait(1, std::chrono::seconds(10)));
    CHECK(done.statuses()[0].ok());
    size_t first_bad = kBytes;
    for (size_t i = 0; i < kBytes && first_bad == kBytes; ++i) {
      if (dst[i] != Pattern(i, 2 * r + 1)) first_bad = i;
    }
    CHECK(first_bad == kBytes);
    t.Disconnect(peer);
    Kill(probes[r]);
  }
  reader->reset();
}
