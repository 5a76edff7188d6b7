// The cuda_ipc backend's own tests (backends/cuda_ipc): its blobs (round trips, and refusal of
// truncated, foreign, other-version and other-node blobs), its options, the process checks and
// process_vm_writev path against a forked child (a second process whose memory we write and
// which compares the bytes), the transport over host memory (byte compare, dead target), and
// what it says about CUDA memory without a device. The [gpu] cases register cudaMalloc'ed
// memory and compare bytes after copying them back; without a usable device they print why and
// pass (WARN), never pretend: run them on a GPU machine (README.md of the backend says how).
#include <cuda_runtime_api.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "backends/cuda_ipc/cuda_ipc_cma.h"
#include "backends/cuda_ipc/cuda_ipc_cuda.h"
#include "backends/cuda_ipc/cuda_ipc_options.h"
#include "backends/cuda_ipc/cuda_ipc_wire.h"
#include "lib/base/crc32c.h"
#include "lib/core/manager_common.h"
#include "pdlib/spi/transport.h"
#include "test/support/write_completions.h"

namespace spi = pdlib::spi;
namespace ci = pdlib::cuda_ipc;
using pdlib::Status;
using pdlib::StatusCode;

namespace {

using Completions = pdlib::testing::WriteCompletions;

bool Contains(const Status& s, const std::string& text) {
  return s.ToString().find(text) != std::string::npos;
}

std::unique_ptr<spi::Transport> MakeTransport(std::map<std::string, std::string> options = {}) {
  spi::TransportOptions o;
  o.options = std::move(options);
  auto t = spi::CreateTransport("cuda_ipc", o);
  INFO(t.status().ToString());
  REQUIRE(t.ok());
  return std::move(*t);
}

// A child process that holds a copy of our memory (fork) and, once told through a pipe,
// compares `region` with `expected` and exits 0 when they match, 1 when not. While it waits,
// the parent writes into its copy of `region` with process_vm_writev.
class Child {
 public:
  Child(const uint8_t* region, const std::vector<uint8_t>& expected) {
    int fds[2];
    REQUIRE(pipe(fds) == 0);
    pid_ = fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      close(fds[1]);
      char go = 0;
      if (read(fds[0], &go, 1) != 1) _exit(2);
      _exit(std::memcmp(region, expected.data(), expected.size()) == 0 ? 0 : 1);
    }
    close(fds[0]);
    go_fd_ = fds[1];
  }
  ~Child() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (go_fd_ >= 0) close(go_fd_);
  }
  pid_t pid() const { return pid_; }
  // Tells the child to compare; returns its exit status.
  int Check() {
    char go = 1;
    REQUIRE(write(go_fd_, &go, 1) == 1);
    int status = 0;
    REQUIRE(waitpid(pid_, &status, 0) == pid_);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  void Kill() {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  int go_fd_ = -1;
};

std::vector<uint8_t> Pattern(size_t bytes, int salt) {
  std::vector<uint8_t> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<uint8_t>(i * 131 + salt + i / 251);
  return v;
}

}  // namespace

TEST_CASE("cuda_ipc endpoint blobs round-trip and refuse malformed ones") {
  ci::EndpointInfo info{42, {1234, 987654321}, std::string(ci::kBootIdBytes, 'b')};
  spi::Blob blob = ci::EncodeEndpoint(info);
  auto back = ci::DecodeEndpoint(blob);
  REQUIRE(back.ok());
  CHECK(back->target == 42);
  CHECK(back->process.pid == 1234);
  CHECK(back->process.start_time == 987654321);
  CHECK(back->boot_id == info.boot_id);

  for (size_t n = 0; n < blob.size(); ++n) {  // every truncation
    spi::Blob cut(blob.begin(), blob.begin() + n);
    auto r = ci::DecodeEndpoint(cut);
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
  }
  spi::Blob longer = blob;
  longer.push_back(0);
  CHECK(Contains(ci::DecodeEndpoint(longer).status(), "expected"));
  spi::Blob foreign = blob;
  foreign[0] ^= 0xff;
  CHECK(Contains(ci::DecodeEndpoint(foreign).status(), "another backend"));
  spi::Blob version = blob;
  version[4] = 9;
  CHECK(Contains(ci::DecodeEndpoint(version).status(), "version 9"));
  ci::EndpointInfo bad_pid = info;
  bad_pid.process.pid = 0;
  CHECK(Contains(ci::DecodeEndpoint(ci::EncodeEndpoint(bad_pid)).status(), "pid 0"));
}

TEST_CASE("cuda_ipc key blobs round-trip and refuse malformed ones") {
  ci::KeyInfo host;
  host.kind = ci::KeyKind::kHost;
  host.length = 4096;
  host.address = 0x7f0000001000;
  auto h = ci::DecodeKey(ci::EncodeKey(host));
  REQUIRE(h.ok());
  CHECK(h->kind == ci::KeyKind::kHost);
  CHECK(h->length == 4096);
  CHECK(h->address == host.address);

  ci::KeyInfo cuda;
  cuda.kind = ci::KeyKind::kCuda;
  cuda.length = 1 << 20;
  cuda.address = 0x7e0000000000;
  cuda.offset = 512;
  cuda.device = 3;
  std::iota(cuda.handle.begin(), cuda.handle.end(), 1);
  spi::Blob cblob = ci::EncodeKey(cuda);
  auto c = ci::DecodeKey(cblob);
  REQUIRE(c.ok());
  CHECK(c->kind == ci::KeyKind::kCuda);
  CHECK(c->offset == 512);
  CHECK(c->device == 3);
  CHECK(c->handle == cuda.handle);
  CHECK(c->address == cuda.address);

  for (size_t n = 0; n < cblob.size(); ++n) {
    spi::Blob cut(cblob.begin(), cblob.begin() + n);
    CHECK(ci::DecodeKey(cut).status().code() == StatusCode::kInvalidArgument);
  }
  spi::Blob unknown = cblob;
  unknown[8] = 7;  // the kind
  CHECK(Contains(ci::DecodeKey(unknown).status(), "unknown memory kind 7"));
  ci::KeyInfo empty = host;
  empty.length = 0;
  CHECK(Contains(ci::DecodeKey(ci::EncodeKey(empty)).status(), "empty"));
  ci::KeyInfo wraps = host;
  wraps.address = ~uint64_t{0} - 10;
  CHECK(Contains(ci::DecodeKey(ci::EncodeKey(wraps)).status(), "wraps"));
  // An endpoint blob is not a key, and the other way round.
  CHECK(Contains(ci::DecodeKey(ci::EncodeEndpoint({1, {1, 1}, "x"})).status(), "another backend"));
}

TEST_CASE("cuda_ipc options") {
  auto defaults = ci::ParseCudaIpcOptions({{"ucx.tls", "shm"}});  // others' keys are ignored
  REQUIRE(defaults.ok());
  CHECK(defaults->copy == ci::CopyMode::kKernel);
  CHECK(defaults->ptracer == ci::Ptracer::kAny);
  auto set = ci::ParseCudaIpcOptions(
      {{"cuda_ipc.copy", "memcpy"}, {"cuda_ipc.ptracer", "keep"}, {"cuda_ipc.busy_poll_us", "0"}});
  REQUIRE(set.ok());
  CHECK(set->copy == ci::CopyMode::kMemcpy);
  CHECK(set->ptracer == ci::Ptracer::kKeep);
  CHECK(set->busy_poll_us == 0);
  Status bad = ci::ParseCudaIpcOptions({{"cuda_ipc.copy", "dma"}}).status();
  CHECK(Contains(bad, "cuda_ipc.copy"));
  CHECK(Contains(bad, "'kernel'"));
  Status typo = ci::ParseCudaIpcOptions({{"cuda_ipc.cpy", "kernel"}}).status();
  CHECK(Contains(typo, "cuda_ipc.cpy"));
  CHECK(Contains(typo, "cuda_ipc.copy"));  // the known keys are listed
  // The factory refuses them too, naming the key.
  spi::TransportOptions o;
  o.options = {{"cuda_ipc.busy_poll_us", "-1"}};
  CHECK(Contains(spi::CreateTransport("cuda_ipc", o).status(), "cuda_ipc.busy_poll_us"));
}

TEST_CASE("cuda_ipc process identity tells a live process from a gone or reused pid") {
  auto self = ci::SelfProcessId();
  REQUIRE(self.ok());
  CHECK(self->pid == getpid());
  CHECK(ci::CheckProcessAlive(*self).ok());
  ci::ProcessId reused = *self;
  reused.start_time += 1;  // our pid, another start: a process that reused the pid
  CHECK(ci::CheckProcessAlive(reused).code() == StatusCode::kUnavailable);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) _exit(0);
  auto start = ci::ReadProcessStartTime(child);  // may already be a zombie: still readable
  REQUIRE(waitpid(child, nullptr, 0) == child);
  Status gone = ci::CheckProcessAlive({child, start.ok() ? *start : 1});
  CHECK(gone.code() == StatusCode::kUnavailable);
  CHECK(Contains(gone, std::to_string(child)));
  auto boot = ci::ReadBootId();
  REQUIRE(boot.ok());
  CHECK(boot->size() == ci::kBootIdBytes);
}

// The watch PostWrites asks before every batch: a pidfd where the kernel has pidfd_open, which
// also sees an exited child that nobody reaped yet (a zombie still has its /proc entry).
TEST_CASE("cuda_ipc process watch: a live target, an exited one (zombie or reaped), a reused pid") {
  auto self = ci::SelfProcessId();
  REQUIRE(self.ok());
  auto watch_self = ci::ProcessWatch::Open(*self);
  REQUIRE(watch_self.ok());
  CHECK((*watch_self)->Check().ok());
  ci::ProcessId reused = *self;
  reused.start_time += 1;
  CHECK(ci::ProcessWatch::Open(reused).status().code() == StatusCode::kUnavailable);

  int go[2];
  REQUIRE(pipe(go) == 0);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    close(go[1]);
    char c = 0;
    (void)!read(go[0], &c, 1);  // wait until the parent watches (its end closes), then exit
    _exit(0);
  }
  close(go[0]);
  auto start = ci::ReadProcessStartTime(child);
  REQUIRE(start.ok());
  auto watch = ci::ProcessWatch::Open({child, *start});
  REQUIRE(watch.ok());
  CHECK((*watch)->Check().ok());
  close(go[1]);  // the child exits; not reaped yet
  if ((*watch)->uses_pidfd()) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while ((*watch)->Check().ok() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    Status zombie = (*watch)->Check();
    CHECK(zombie.code() == StatusCode::kUnavailable);
    CHECK(Contains(zombie, std::to_string(child)));
  } else {
    WARN("no pidfd_open here: the watch reads /proc, which still lists a zombie");
  }
  REQUIRE(waitpid(child, nullptr, 0) == child);
  Status gone = (*watch)->Check();
  CHECK(gone.code() == StatusCode::kUnavailable);
  CHECK(Contains(gone, std::to_string(child)));
}

TEST_CASE("cuda_ipc process_vm_writev writes another process's memory, byte for byte") {
  // More pieces than IOV_MAX (1024), of odd sizes, scattered backwards over the region.
  constexpr size_t kPieces = 2500, kPiece = 37;
  std::vector<uint8_t> region(kPieces * kPiece, 0);
  const std::vector<uint8_t> src = Pattern(region.size(), 5);
  std::vector<uint8_t> expected(region.size());
  std::vector<ci::CmaWrite> writes;
  for (size_t i = 0; i < kPieces; ++i) {
    const size_t to = (kPieces - 1 - i) * kPiece;
    writes.push_back(
        {src.data() + i * kPiece, reinterpret_cast<uint64_t>(region.data() + to), kPiece});
    std::memcpy(expected.data() + to, src.data() + i * kPiece, kPiece);
  }
  Child child(region.data(), expected);
  REQUIRE(ci::WriteProcessMemory(child.pid(), writes).ok());
  CHECK(std::all_of(region.begin(), region.end(), [](uint8_t b) { return b == 0; }));  // not ours
  CHECK(child.Check() == 0);  // the child saw every byte

  // Negative control: the child compares against bytes we did not write.
  std::vector<uint8_t> wrong = expected;
  wrong[77] ^= 1;
  Child strict(region.data(), wrong);
  REQUIRE(ci::WriteProcessMemory(strict.pid(), writes).ok());
  CHECK(strict.Check() == 1);

  // A gone process and an unmapped destination are Unavailable, naming the pid.
  Child dead(region.data(), expected);
  const pid_t pid = dead.pid();
  dead.Kill();
  Status gone = ci::WriteProcessMemory(pid, writes);
  CHECK(gone.code() == StatusCode::kUnavailable);
  CHECK(Contains(gone, std::to_string(pid)));
  uint8_t byte = 1;
  ci::CmaWrite unmapped{&byte, 8, 1};  // address 8 is never mapped
  Status fault = ci::WriteProcessMemory(getpid(), std::span(&unmapped, 1));
  CHECK(fault.code() == StatusCode::kUnavailable);
  CHECK(Contains(fault, "not mapped"));
}

TEST_CASE("cuda_ipc transport writes a forked target's host memory and notices when it is gone") {
  auto t = MakeTransport();
  constexpr size_t kPage = 4096, kPages = 64;
  std::vector<uint8_t> src = Pattern(kPage * kPages, 9);
  std::vector<uint8_t> dst(kPage * kPages, 0);
  spi::Blob src_key, dst_key;
  auto sr = t->RegisterMemory({src.data(), src.size()}, &src_key);
  auto dr = t->RegisterMemory({dst.data(), dst.size()}, &dst_key);  // the child's copy is written
  REQUIRE(sr.ok());
  REQUIRE(dr.ok());
  // Page i goes to page (i * 7) % kPages: scattered, every page once.
  std::vector<spi::WriteOp> ops;
  std::vector<uint8_t> expected(dst.size());
  for (uint64_t i = 0; i < kPages; ++i) {
    const uint64_t to = (i * 7) % kPages;
    ops.push_back({*sr, i * kPage, 0, to * kPage, kPage});
    std::memcpy(expected.data() + to * kPage, src.data() + i * kPage, kPage);
  }
  Child child(dst.data(), expected);
  auto boot = ci::ReadBootId();
  auto start = ci::ReadProcessStartTime(child.pid());
  REQUIRE(boot.ok());
  REQUIRE(start.ok());
  // The endpoint the child would have sent (it has no transport of its own: forked, not exec'd).
  spi::Blob endpoint = ci::EncodeEndpoint({1, {child.pid(), *start}, *boot});
  auto conn = t->Connect(endpoint);
  REQUIRE(conn.ok());
  auto remote = t->ImportRemoteRegion(
      conn->peer, {reinterpret_cast<uint64_t>(dst.data()), dst.size(), dst_key});
  REQUIRE(remote.ok());
  Completions done;
  REQUIRE(t->PostWrites(conn->peer, ops, done.Callback()).ok());
  REQUIRE(done.Wait(1));
  CHECK(done.statuses()[0].ok());
  const pid_t pid = child.pid();
  CHECK(child.Check() == 0);  // compared every byte, then exited

  // The target is gone now: the next batch is refused with kUnavailable naming its pid.
  Status gone = t->PostWrites(conn->peer, ops, done.Callback());
  CHECK(gone.code() == StatusCode::kUnavailable);
  CHECK(Contains(gone, "process " + std::to_string(pid) + " exited"));
  // ... and the peer stays failed with that reason.
  CHECK(t->PostWrites(conn->peer, {}, done.Callback()).code() == StatusCode::kUnavailable);
  t->Disconnect(conn->peer);
}

TEST_CASE("cuda_ipc process_vm_readv reads another process's memory, byte for byte") {
  // More pieces than IOV_MAX, of odd sizes, gathered backwards from the child's copy.
  constexpr size_t kPieces = 2500, kPiece = 37;
  std::vector<uint8_t> region = Pattern(kPieces * kPiece, 3);
  const std::vector<uint8_t> theirs = region;
  Child child(region.data(), theirs);  // holds the pattern; we change ours afterwards
  std::fill(region.begin(), region.end(), 0);
  std::vector<uint8_t> got(region.size(), 0), expected(region.size());
  std::vector<ci::CmaRead> reads;
  for (size_t i = 0; i < kPieces; ++i) {
    const size_t from = (kPieces - 1 - i) * kPiece;
    reads.push_back(
        {reinterpret_cast<uint64_t>(region.data() + from), got.data() + i * kPiece, kPiece});
    std::memcpy(expected.data() + i * kPiece, theirs.data() + from, kPiece);
  }
  REQUIRE(ci::ReadProcessMemory(child.pid(), reads).ok());
  CHECK(got == expected);  // the child's bytes, not our (zeroed) copy's
  CHECK(child.Check() == 0);

  // A gone process and an unmapped source are Unavailable, naming the pid.
  Child dead(region.data(), region);
  const pid_t pid = dead.pid();
  dead.Kill();
  Status gone = ci::ReadProcessMemory(pid, reads);
  CHECK(gone.code() == StatusCode::kUnavailable);
  CHECK(Contains(gone, std::to_string(pid)));
  CHECK(Contains(gone, "process_vm_readv"));
  uint8_t byte = 0;
  ci::CmaRead unmapped{8, &byte, 1};  // address 8 is never mapped
  Status fault = ci::ReadProcessMemory(getpid(), std::span(&unmapped, 1));
  CHECK(fault.code() == StatusCode::kUnavailable);
  CHECK(Contains(fault, "source is not mapped"));
}

TEST_CASE("cuda_ipc transport reads a forked target's host memory and notices when it is gone") {
  auto t = MakeTransport();
  REQUIRE(t->capabilities().reads);
  constexpr size_t kPage = 4096, kPages = 64;
  // The target's region: the child's copy keeps the pattern, ours is zeroed after the fork.
  std::vector<uint8_t> theirs = Pattern(kPage * kPages, 11);
  std::vector<uint8_t> ours(kPage * kPages + kPage, 0);  // a page more: must stay untouched
  spi::Blob their_key, our_key;
  auto tr = t->RegisterMemory({theirs.data(), theirs.size()}, &their_key);
  auto orr = t->RegisterMemory({ours.data(), ours.size()}, &our_key);
  REQUIRE(tr.ok());
  REQUIRE(orr.ok());
  // Our page i from their page (i * 7) % kPages, except page 5, left out.
  std::vector<spi::ReadOp> ops;
  std::vector<uint8_t> expected(ours.size(), 0);
  for (uint64_t i = 0; i < kPages; ++i) {
    if (i == 5) continue;
    const uint64_t from = (i * 7) % kPages;
    ops.push_back({*orr, i * kPage, 0, from * kPage, kPage});
    std::memcpy(expected.data() + i * kPage, theirs.data() + from * kPage, kPage);
  }
  const std::vector<uint8_t> pattern = theirs;
  Child child(theirs.data(), pattern);
  std::fill(theirs.begin(), theirs.end(), 0);
  auto boot = ci::ReadBootId();
  auto start = ci::ReadProcessStartTime(child.pid());
  REQUIRE(boot.ok());
  REQUIRE(start.ok());
  spi::Blob endpoint = ci::EncodeEndpoint({1, {child.pid(), *start}, *boot});
  auto conn = t->Connect(endpoint);
  REQUIRE(conn.ok());
  auto remote = t->ImportRemoteRegion(
      conn->peer, {reinterpret_cast<uint64_t>(theirs.data()), theirs.size(), their_key});
  REQUIRE(remote.ok());
  for (auto& op : ops) op.remote_region = *remote;
  Completions done;
  REQUIRE(t->PostReads(conn->peer, ops, done.Callback()).ok());
  REQUIRE(done.Wait(1));
  CHECK(done.statuses()[0].ok());
  CHECK(ours == expected);  // every page read from the child, page 5 and the extra page zero

  // A read past the target's region is refused, naming the read.
  spi::ReadOp past{*orr, 0, *remote, theirs.size() - 8, 16};
  Status out = t->PostReads(conn->peer, std::span(&past, 1), done.Callback());
  CHECK(out.code() == StatusCode::kOutOfRange);
  CHECK(Contains(out, "read 0"));

  const pid_t pid = child.pid();
  CHECK(child.Check() == 0);  // exits
  Status gone = t->PostReads(conn->peer, ops, done.Callback());
  CHECK(gone.code() == StatusCode::kUnavailable);
  CHECK(Contains(gone, "process " + std::to_string(pid) + " exited"));
  CHECK(t->PostReads(conn->peer, {}, done.Callback()).code() == StatusCode::kUnavailable);
  t->Disconnect(conn->peer);
}

TEST_CASE("cuda_ipc Connect and ImportRemoteRegion refuse what cannot be written") {
  auto t = MakeTransport();
  auto boot = ci::ReadBootId();
  auto self = ci::SelfProcessId();
  REQUIRE(boot.ok());
  REQUIRE(self.ok());
  std::string other_boot = *boot;
  other_boot[0] = other_boot[0] == 'a' ? 'b' : 'a';
  Status other_node = t->Connect(ci::EncodeEndpoint({1, *self, other_boot})).status();
  CHECK(other_node.code() == StatusCode::kFailedPrecondition);
  CHECK(Contains(other_node, "another node"));
  CHECK(Contains(other_node, "one node"));
  CHECK(Contains(t->Connect(spi::Blob{1, 2, 3}).status(), "truncated"));
  ci::ProcessId reused = *self;
  reused.start_time += 5;
  CHECK(t->Connect(ci::EncodeEndpoint({1, reused, *boot})).status().code() ==
        StatusCode::kUnavailable);

  auto ep = t->CreateTargetEndpoint();
  REQUIRE(ep.ok());
  auto conn = t->Connect(ep->blob);
  REQUIRE(conn.ok());
  std::vector<uint8_t> buf(1024);
  spi::Blob key;
  REQUIRE(t->RegisterMemory({buf.data(), buf.size()}, &key).ok());
  const auto addr = reinterpret_cast<uint64_t>(buf.data());
  // A region larger than, or outside, the one its key describes.
  CHECK(Contains(t->ImportRemoteRegion(conn->peer, {addr, 2048, key}).status(), "not inside"));
  CHECK(Contains(t->ImportRemoteRegion(conn->peer, {addr - 16, 64, key}).status(), "not inside"));
  CHECK(t->ImportRemoteRegion(conn->peer, {addr + 512, 512, key}).ok());  // a part is fine
  // A CUDA key without a device here is refused with the reason.
  ci::DeviceProbe probe = ci::ProbeDevices();
  if (probe.count == 0) {
    ci::KeyInfo cuda;
    cuda.kind = ci::KeyKind::kCuda;
    cuda.length = 4096;
    cuda.address = 1 << 20;
    Status refused =
        t->ImportRemoteRegion(conn->peer, {1 << 20, 4096, ci::EncodeKey(cuda)}).status();
    CHECK(refused.code() == StatusCode::kFailedPrecondition);
    CHECK(Contains(refused, "cudaGetDeviceCount"));
  }
  t->Disconnect(conn->peer);
}

TEST_CASE("cuda_ipc without a CUDA device: host memory works, CUDA memory is refused with why") {
  ci::DeviceProbe probe = ci::ProbeDevices();
  auto t = MakeTransport();
  CHECK(t->capabilities().supports_cuda_memory == (probe.count > 0));
  CHECK(t->capabilities().digests_cuda_memory == (probe.count > 0));
  // DigestRanges reads GPU regions only: a host region, or memory not registered, is refused
  // before anything runs.
  std::vector<uint8_t> host(4096, 7);
  REQUIRE(t->RegisterMemory({host.data(), host.size()}, nullptr).ok());
  const std::vector<spi::DigestRange> ranges = {{reinterpret_cast<uint64_t>(host.data()), 1024, 0}};
  std::vector<uint32_t> crcs(1);
  Status digest = t->DigestRanges(ranges, crcs);
  CHECK(digest.code() == StatusCode::kInvalidArgument);
  CHECK(Contains(digest, "not inside a registered CUDA region"));
  CHECK_FALSE(t->capabilities().fences);
  CHECK(t->capabilities().moves_bytes);
  CHECK(t->FenceTarget(1).code() == StatusCode::kUnimplemented);
  if (probe.count > 0) {
    WARN("a CUDA device is present: the no-device refusal is not checked here");
    return;
  }
  std::vector<uint8_t> buf(4096);
  spi::MemoryRegion region{buf.data(), buf.size(), pdlib::MemoryKind::kCuda, 0};
  Status refused = t->RegisterMemory(region, nullptr).status();
  INFO(refused.ToString());
  CHECK(refused.code() == StatusCode::kFailedPrecondition);
  CHECK(Contains(refused, "cuda_ipc"));
  CHECK(Contains(refused, "cuda"));
  CHECK(Contains(refused, "cudaGetDeviceCount"));
  CHECK(Contains(refused, probe.why_none.ToString().substr(0, 20)));
}

// ---- GPU cases: cudaMalloc'ed regions, bytes compared after copying them back ----
namespace {

// Why the GPU cases cannot run here (empty: they can).
std::string WhyNoGpu() {
  ci::DeviceProbe probe = ci::ProbeDevices();
  return probe.count > 0 ? "" : probe.why_none.ToString();
}

constexpr uint64_t kGpuPage = 4096, kGpuPages = 64, kGpuBytes = kGpuPage * kGpuPages;
constexpr uint64_t kGpuOffset = 8192;  // the target region starts this far into its allocation

// The batch the GPU cases write (remote offsets within one region of kGpuBytes): whole pages
// scattered ((i * 7) % pages, the first half) and, for the second half, an NHD-like head slice
// of every page (8 pieces of 64 bytes at a stride of 512), which the copy plan coalesces.
std::vector<spi::WriteOp> GpuOps(spi::LocalRegionId local, spi::RemoteRegionId remote) {
  std::vector<spi::WriteOp> ops;
  for (uint64_t i = 0; i < kGpuPages / 2; ++i) {
    ops.push_back({local, i * kGpuPage, remote, ((i * 7) % (kGpuPages / 2)) * kGpuPage, kGpuPage});
  }
  for (uint64_t i = kGpuPages / 2; i < kGpuPages; ++i) {
    const uint64_t to = kGpuPages / 2 + (kGpuPages - 1 - i);
    for (uint64_t piece = 0; piece < 8; ++piece) {
      ops.push_back(
          {local, i * kGpuPage + piece * 512 + 128, remote, to * kGpuPage + piece * 512, 64});
    }
  }
  return ops;
}

// What the destination holds after GpuOps over `src`, starting from zeros.
std::vector<uint8_t> GpuExpected(const std::vector<uint8_t>& src) {
  std::vector<uint8_t> dst(kGpuBytes, 0);
  for (const spi::WriteOp& op : GpuOps(0, 0)) {
    std::memcpy(dst.data() + op.remote_offset, src.data() + op.local_offset, op.length);
  }
  return dst;
}

void* DeviceCopyOf(const std::vector<uint8_t>& host, uint64_t pad = 0) {
  void* p = nullptr;
  REQUIRE(cudaMalloc(&p, host.size() + pad) == cudaSuccess);
  REQUIRE(cudaMemset(p, 0, host.size() + pad) == cudaSuccess);
  REQUIRE(cudaMemcpy(static_cast<uint8_t*>(p) + pad, host.data(), host.size(),
                     cudaMemcpyHostToDevice) == cudaSuccess);
  // The transport copies on a non-blocking stream, which does not wait for these.
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  return p;
}

std::vector<uint8_t> HostCopyOf(const void* device, uint64_t bytes) {
  std::vector<uint8_t> host(bytes);
  REQUIRE(cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
  return host;
}

std::string Hex(const spi::Blob& blob) {
  std::string out;
  char buf[3];
  for (uint8_t b : blob) {
    std::snprintf(buf, sizeof(buf), "%02x", b);
    out += buf;
  }
  return out;
}

spi::Blob Unhex(const std::string& text) {
  spi::Blob out;
  for (size_t i = 0; i + 1 < text.size(); i += 2) {
    out.push_back(static_cast<uint8_t>(std::stoi(text.substr(i, 2), nullptr, 16)));
  }
  return out;
}

}  // namespace

TEST_CASE("cuda_ipc [gpu] DigestRanges: the KV digest of GPU regions equals the CPU's CRC32C") {
  if (const std::string why = WhyNoGpu(); !why.empty()) {
    WARN("SKIP cuda_ipc GPU case: no usable CUDA device (" << why << ")");
    return;
  }
  auto t = MakeTransport();
  REQUIRE(t->capabilities().digests_cuda_memory);
  const std::vector<uint8_t> bytes = Pattern(kGpuBytes, 5);
  void* dev = DeviceCopyOf(bytes);
  REQUIRE(t->RegisterMemory({dev, kGpuBytes, pdlib::MemoryKind::kCuda, 0}, nullptr).ok());
  const auto base = reinterpret_cast<uint64_t>(dev);
  // Whole pages, a head slice with the zeros after it, an odd range.
  const std::vector<spi::DigestRange> ranges = {
      {base, kGpuPage, 0}, {base + 5 * kGpuPage + 256, 512, kGpuPage - 768}, {base + 77, 999, 3}};
  std::vector<uint32_t> crcs(ranges.size());
  Status s = t->DigestRanges(ranges, crcs);
  INFO(s.ToString());
  REQUIRE(s.ok());
  for (size_t i = 0; i < ranges.size(); ++i) {
    const uint64_t off = ranges[i].addr - base;
    CHECK(crcs[i] == pdlib::Crc32cMulMod(pdlib::Crc32cRaw(0, bytes.data() + off, ranges[i].length),
                                         pdlib::Crc32cZerosFactor(ranges[i].zeros_after)));
  }
  // A range that runs past the region is refused.
  const std::vector<spi::DigestRange> past = {{base + kGpuBytes - 10, 20, 0}};
  CHECK(t->DigestRanges(past, crcs).code() == StatusCode::kInvalidArgument);
  t.reset();
  (void)cudaFree(dev);
}

TEST_CASE("cuda_ipc [gpu] in one process: device, host-to-device and device-to-host writes") {
  if (const std::string why = WhyNoGpu(); !why.empty()) {
    WARN("SKIP cuda_ipc GPU case: no usable CUDA device (" << why << ")");
    return;
  }
  const std::string copy = GENERATE(std::string("kernel"), std::string("memcpy"));
  INFO("cuda_ipc.copy=" << copy);
  auto initiator = MakeTransport({{"cuda_ipc.copy", copy}});
  auto target = MakeTransport();
  REQUIRE(initiator->capabilities().supports_cuda_memory);
  const std::vector<uint8_t> src = Pattern(kGpuBytes, 3);
  void* src_dev = DeviceCopyOf(src);
  void* dst_alloc = DeviceCopyOf(std::vector<uint8_t>(kGpuBytes, 0), kGpuOffset);
  void* dst_dev = static_cast<uint8_t*>(dst_alloc) + kGpuOffset;
  std::vector<uint8_t> host_dst(kGpuBytes, 0);  // a host region written from device memory
  std::vector<uint8_t> host_src = Pattern(kGpuBytes, 11);
  spi::Blob dst_key, host_key;
  auto sr = initiator->RegisterMemory({src_dev, kGpuBytes, pdlib::MemoryKind::kCuda, 0}, nullptr);
  auto hs = initiator->RegisterMemory({host_src.data(), kGpuBytes}, nullptr);
  auto dr = target->RegisterMemory({dst_dev, kGpuBytes, pdlib::MemoryKind::kCuda, 0}, &dst_key);
  auto hr = target->RegisterMemory({host_dst.data(), kGpuBytes}, &host_key);
  REQUIRE(sr.ok());
  REQUIRE(hs.ok());
  INFO(dr.status().ToString());
  REQUIRE(dr.ok());
  REQUIRE(hr.ok());
  auto ep = target->CreateTargetEndpoint();
  REQUIRE(ep.ok());
  auto conn = initiator->Connect(ep->blob);
  REQUIRE(conn.ok());
  auto remote = initiator->ImportRemoteRegion(
      conn->peer, {reinterpret_cast<uint64_t>(dst_dev), kGpuBytes, dst_key});
  auto remote_host = initiator->ImportRemoteRegion(
      conn->peer, {reinterpret_cast<uint64_t>(host_dst.data()), kGpuBytes, host_key});
  REQUIRE(remote.ok());
  REQUIRE(remote_host.ok());

  // Device -> device (gathered), and device -> host into the host region, in one batch.
  std::vector<spi::WriteOp> ops = GpuOps(*sr, *remote);
  ops.push_back({*sr, 0, *remote_host, kGpuPage, 3 * kGpuPage});
  Completions done;
  REQUIRE(initiator->PostWrites(conn->peer, ops, done.Callback()).ok());
  REQUIRE(done.Wait(1));
  INFO(done.statuses()[0].ToString());
  CHECK(done.statuses()[0].ok());
  CHECK(HostCopyOf(dst_dev, kGpuBytes) == GpuExpected(src));
  CHECK(std::equal(src.begin(), src.begin() + 3 * kGpuPage, host_dst.begin() + kGpuPage));
  CHECK(std::all_of(host_dst.begin(), host_dst.begin() + kGpuPage, [](uint8_t b) { return !b; }));

  // Host -> device: every page of the host source onto the device region in reverse.
  std::vector<spi::WriteOp> up;
  for (uint64_t i = 0; i < kGpuPages; ++i) {
    up.push_back({*hs, i * kGpuPage, *remote, (kGpuPages - 1 - i) * kGpuPage, kGpuPage});
  }
  REQUIRE(initiator->PostWrites(conn->peer, up, done.Callback()).ok());
  REQUIRE(done.Wait(2));
  CHECK(done.statuses()[1].ok());
  const std::vector<uint8_t> back = HostCopyOf(dst_dev, kGpuBytes);
  for (uint64_t i = 0; i < kGpuPages; ++i) {
    CHECK(std::equal(host_src.begin() + i * kGpuPage, host_src.begin() + (i + 1) * kGpuPage,
                     back.begin() + (kGpuPages - 1 - i) * kGpuPage));
  }
  // The bytes before the region in its allocation were never touched.
  CHECK(HostCopyOf(dst_alloc, kGpuOffset) == std::vector<uint8_t>(kGpuOffset, 0));
  initiator->Disconnect(conn->peer);
  initiator.reset();
  target.reset();
  cudaFree(src_dev);
  cudaFree(dst_alloc);
}

// The target half of the next case, run in a process of its own (this binary, exec'd with
// PDLIB_CUDA_IPC_GPU_TARGET=1): registers a cudaMalloc'ed region at an offset into its
// allocation, prints its endpoint and key, waits for "CHECK" and compares every byte.
TEST_CASE("cuda_ipc gpu target process", "[.cuda_ipc_gpu_target]") {
  if (std::getenv("PDLIB_CUDA_IPC_GPU_TARGET") == nullptr) return;
  auto target = MakeTransport();
  void* alloc = DeviceCopyOf(std::vector<uint8_t>(kGpuBytes, 0), kGpuOffset);
  void* region = static_cast<uint8_t*>(alloc) + kGpuOffset;
  spi::Blob key;
  auto reg = target->RegisterMemory({region, kGpuBytes, pdlib::MemoryKind::kCuda, 0}, &key);
  if (!reg.ok()) {
    std::printf("BLOB ERROR %s\n", reg.status().ToString().c_str());
    std::fflush(stdout);
    return;
  }
  auto ep = target->CreateTargetEndpoint();
  REQUIRE(ep.ok());
  std::printf("BLOB EP %s\nBLOB KEY %s\nBLOB ADDR %llu\n", Hex(ep->blob).c_str(), Hex(key).c_str(),
              static_cast<unsigned long long>(reinterpret_cast<uint64_t>(region)));
  std::fflush(stdout);
  char line[64] = {};
  if (std::fgets(line, sizeof(line), stdin) == nullptr) return;
  const std::vector<uint8_t> got = HostCopyOf(region, kGpuBytes);
  const std::vector<uint8_t> want = GpuExpected(Pattern(kGpuBytes, 3));
  size_t bad = 0;
  while (bad < got.size() && got[bad] == want[bad]) ++bad;
  if (bad == got.size()) {
    std::printf("BLOB RESULT OK\n");
  } else {
    std::printf("BLOB RESULT BAD at byte %zu\n", bad);
  }
  std::fflush(stdout);
  cudaFree(alloc);
}

TEST_CASE("cuda_ipc [gpu] across processes: writes through an opened IPC handle") {
  if (const std::string why = WhyNoGpu(); !why.empty()) {
    WARN("SKIP cuda_ipc GPU case: no usable CUDA device (" << why << ")");
    return;
  }
  const std::string copy = GENERATE(std::string("kernel"), std::string("memcpy"));
  INFO("cuda_ipc.copy=" << copy);
  int to_child[2], from_child[2];
  REQUIRE(pipe(to_child) == 0);
  REQUIRE(pipe(from_child) == 0);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    dup2(to_child[0], 0);
    dup2(from_child[1], 1);
    setenv("PDLIB_CUDA_IPC_GPU_TARGET", "1", 1);
    execl("/proc/self/exe", "cuda_ipc_transport_test", "[.cuda_ipc_gpu_target]", nullptr);
    _exit(127);
  }
  close(to_child[0]);
  close(from_child[1]);
  // Lines starting "BLOB " are the child's; Catch2's own output is skipped. The child's stdout is
  // one buffer (Catch's "Filters:" line and the blobs arrive in one read), so lines are split here
  // from what was read, and poll() waits only when no whole line is left.
  std::string pending;
  auto next_blob = [&]() -> std::string {
    while (true) {
      const size_t eol = pending.find('\n');
      if (eol != std::string::npos) {
        const std::string line = pending.substr(0, eol);
        pending.erase(0, eol + 1);
        if (line.rfind("BLOB ", 0) == 0) return line.substr(5);
        continue;
      }
      pollfd p{from_child[0], POLLIN, 0};
      if (poll(&p, 1, 60000) <= 0) return "TIMEOUT";
      char buf[8192];
      const ssize_t n = read(from_child[0], buf, sizeof(buf));
      if (n <= 0) return "EOF";
      pending.append(buf, static_cast<size_t>(n));
    }
  };
  std::string ep_line = next_blob();
  INFO("child said: " << ep_line);
  REQUIRE(ep_line.rfind("EP ", 0) == 0);
  const std::string key_line = next_blob();
  const std::string addr_line = next_blob();
  REQUIRE(key_line.rfind("KEY ", 0) == 0);
  REQUIRE(addr_line.rfind("ADDR ", 0) == 0);

  auto initiator = MakeTransport({{"cuda_ipc.copy", copy}});
  const std::vector<uint8_t> src = Pattern(kGpuBytes, 3);
  void* src_dev = DeviceCopyOf(src);
  auto sr = initiator->RegisterMemory({src_dev, kGpuBytes, pdlib::MemoryKind::kCuda, 0}, nullptr);
  REQUIRE(sr.ok());
  auto conn = initiator->Connect(Unhex(ep_line.substr(3)));
  REQUIRE(conn.ok());
  const uint64_t addr = std::stoull(addr_line.substr(5));
  auto remote =
      initiator->ImportRemoteRegion(conn->peer, {addr, kGpuBytes, Unhex(key_line.substr(4))});
  INFO(remote.status().ToString());
  REQUIRE(remote.ok());
  // The same allocation imported again (a second region of it) shares the opened handle.
  auto again = initiator->ImportRemoteRegion(
      conn->peer, {addr + kGpuPage, kGpuPage, Unhex(key_line.substr(4))});
  CHECK(again.ok());
  Completions done;
  REQUIRE(initiator->PostWrites(conn->peer, GpuOps(*sr, *remote), done.Callback()).ok());
  REQUIRE(done.Wait(1));
  INFO(done.statuses()[0].ToString());
  CHECK(done.statuses()[0].ok());
  REQUIRE(write(to_child[1], "CHECK\n", 6) == 6);
  CHECK(next_blob() == "RESULT OK");
  initiator->Disconnect(conn->peer);  // closes the IPC mapping
  int status = 0;
  waitpid(pid, &status, 0);
  close(from_child[0]);
  close(to_child[1]);
  initiator.reset();
  cudaFree(src_dev);
}

// Rails by topology for GPU pools (lib/rails): the core asks the CUDA driver this process loaded
// which GPU holds the KV pool, and passes its PCI address to the backends.
TEST_CASE("cuda_ipc [gpu] the core locates a GPU pool's PCI address through the loaded driver") {
  if (const std::string why = WhyNoGpu(); !why.empty()) {
    WARN("SKIP cuda_ipc GPU case: no usable CUDA device (" << why << ")");
    return;
  }
  int device = -1;
  REQUIRE(cudaGetDevice(&device) == cudaSuccess);
  char want[64] = {};
  REQUIRE(cudaDeviceGetPCIBusId(want, sizeof(want) - 1, device) == cudaSuccess);
  void* pool = nullptr;
  REQUIRE(cudaMalloc(&pool, 1 << 20) == cudaSuccess);
  pdlib::KVManagerOptions options;
  options.args.kv.ptrs = {reinterpret_cast<uint64_t>(pool) + 4096};
  options.args.kv.lens = {4096};
  options.args.kv.item_lens = {4096};
  options.args.memory_kind = pdlib::MemoryKind::kCuda;
  const std::string got = pdlib::TransportOptionsFor(options).memory_pci_address;
  INFO("cudaDeviceGetPCIBusId: " << want << ", the core: " << got);
  auto lower = [](std::string s) {
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
    return s;
  };
  CHECK(!got.empty());
  CHECK(lower(got) == lower(want));
  // Host memory is no GPU's.
  std::vector<uint8_t> host(4096);
  CHECK(pdlib::PciAddressOfCudaMemory(reinterpret_cast<uint64_t>(host.data())).empty());
  cudaFree(pool);
}
