// The fake backend (SPEC R8.1): implements the whole transport SPI but moves no bytes. Every
// batch is validated exactly like a real backend would (regions exist, ops stay inside them)
// and completes as soon as its progress thread sees it.
//
// Options (KVManagerOptions::backend_options):
//   fake.copy=true     move the bytes after all, by memcpy, when the batch completes: for peers
//                      that share this process (the in-process control plane), whose region
//                      addresses are this process's. Off by default.
//   fake.corrupt=K:P,...  with fake.copy, corrupt a completed batch with probability P (0..1)
//                      per kind K: `byte` flips one byte of one op, `page` overwrites one op's
//                      bytes, `misplace` lands one op one op-length further on in its region
//                      (the intended bytes stay as they were). At most one per batch; each is
//                      logged and counted (FakeCorruptionsInjected), for KV integrity tests.
//   fake.digests_sends=false  do not offer PostWritesDigested (on with fake.copy: the source
//                      bytes of each op are digested as they are copied, before any fault of
//                      fake.corrupt), so that the core digests the source itself.
//   fake.digests_cuda=false  do not offer DigestRanges for kCuda regions (on by default: the
//                      "GPU" memory of a fake is host memory, digested by the CPU and counted,
//                      FakeDeviceRangesDigested), to test the refusal of checksums.
// Used for warm-up, control-plane tests and benchmarks of everything except the wire. Its API side
// is the transport toolkit's (backends/common/tables.h): the same region and peer tables and the
// same checks of every op as ucx and verbs; it has no wire, so it keeps a plain condition-variable
// thread of its own.
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "backends/common/tables.h"
#include "backends/fake/fake_faults.h"
#include "lib/base/crc32c.h"
#include "lib/base/log_internal.h"
#include "lib/registry/builtin_registration.h"
#include "pdlib/spi/transport.h"

namespace pdlib {
inline namespace v1 {
namespace {

using spi::Blob;

// Endpoint blobs carry a magic and an id, so a blob from another backend is refused cleanly.
constexpr uint32_t kEndpointMagic = 0x46414b45;  // "FAKE"

Blob EncodeU64Pair(uint32_t magic, uint64_t value) {
  Blob blob(12);
  std::memcpy(blob.data(), &magic, 4);
  std::memcpy(blob.data() + 4, &value, 8);
  return blob;
}

bool DecodeU64Pair(const Blob& blob, uint32_t magic, uint64_t* value) {
  uint32_t got = 0;
  if (blob.size() != 12) return false;
  std::memcpy(&got, blob.data(), 4);
  if (got != magic) return false;
  std::memcpy(value, blob.data() + 4, 8);
  return true;
}

// Target ids are unique in the process and fences are kept process-wide, so that a fence by one
// fake transport (decode's) stops the batches another one (prefill's, in-process) posts to it.
struct FenceRegistry {
  std::mutex mu;
  std::unordered_set<spi::TargetId> fenced;
  std::atomic<spi::TargetId> next_target{1};
};
FenceRegistry& Fences() {
  static auto* registry = new FenceRegistry();
  return *registry;
}
bool IsFenced(spi::TargetId target) {
  std::lock_guard lock(Fences().mu);
  return Fences().fenced.contains(target);
}

std::atomic<uint64_t>& CorruptionCounter() {
  static auto* n = new std::atomic<uint64_t>(0);
  return *n;
}

std::atomic<uint64_t>& DeviceDigestCounter() {
  static auto* n = new std::atomic<uint64_t>(0);
  return *n;
}

enum class Fault { kByte = 0, kPage = 1, kMisplace = 2 };
constexpr const char* kFaultNames[] = {"byte", "page", "misplace"};

struct FakeOptions {
  bool copy = false;
  bool digests_cuda = true;
  bool digests_sends = true;
  double prob[3] = {0, 0, 0};
};

StatusOr<FakeOptions> ParseFakeOptions(const spi::TransportOptions& o) {
  FakeOptions f;
  for (const auto& [key, value] : o.options) {
    if (key == "fake.copy" || key == "fake.digests_cuda" || key == "fake.digests_sends") {
      bool* flag = key == "fake.copy"           ? &f.copy
                   : key == "fake.digests_cuda" ? &f.digests_cuda
                                                : &f.digests_sends;
      if (value == "1" || value == "true") {
        *flag = true;
      } else if (value == "0" || value == "false") {
        *flag = false;
      } else {
        return Status::InvalidArgument(key + "=" + value + ": true or false");
      }
    } else if (key == "fake.corrupt") {
      for (absl::string_view item : absl::StrSplit(value, ',', absl::SkipEmpty())) {
        std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(item, ':');
        int kind = -1;
        for (int k = 0; k < 3; ++k) kind = kv.first == kFaultNames[k] ? k : kind;
        double p = 0;
        if (kind < 0 || !absl::SimpleAtod(kv.second, &p) || p < 0 || p > 1) {
          return Status::InvalidArgument("fake.corrupt=" + value +
                                         ": kind:probability,... with kinds byte, page, misplace "
                                         "and probabilities in [0, 1]");
        }
        f.prob[kind] = p;
      }
    } else if (key.rfind("fake.", 0) == 0) {
      return Status::InvalidArgument("unknown fake backend option " + key +
                                     " (known: fake.copy, fake.corrupt, fake.digests_cuda, "
                                     "fake.digests_sends)");
    }
  }
  if (!f.copy && (f.prob[0] > 0 || f.prob[1] > 0 || f.prob[2] > 0)) {
    return Status::InvalidArgument("fake.corrupt needs fake.copy=true (no bytes move otherwise)");
  }
  return f;
}

class FakeTransport final : public spi::Transport {
 public:
  explicit FakeTransport(FakeOptions options)
      : options_(options), rng_(std::random_device{}()), progress_([this] { ProgressLoop(); }) {}

  ~FakeTransport() override {
    std::deque<Pending> left;
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
      left.swap(queue_);
    }
    cv_.notify_all();
    progress_.join();
    for (auto& p : left) p.done(Status::Cancelled("fake transport destroyed"));
  }

  std::string_view name() const override { return "fake"; }

  spi::TransportCapabilities capabilities() const override {
    spi::TransportCapabilities caps;
    caps.moves_bytes = options_.copy;
    caps.supports_cuda_memory = true;  // nothing is touched, so any address is fine
    caps.fences = true;                // a fenced target's batches fail; nothing ever lands
    caps.reads = true;                 // validated like writes; no byte moves either way
    caps.digests_cuda_memory = options_.digests_cuda;  // "GPU" regions are host memory here
    caps.digests_sends = options_.copy && options_.digests_sends;  // as MoveBytes copies
    return caps;
  }

  // As a GPU backend would: only ranges inside kCuda regions, each counted
  // (FakeDeviceRangesDigested), so that tests see the core hand GPU pools to the transport.
  Status DigestRanges(std::span<const spi::DigestRange> ranges, std::span<uint32_t> crcs) override {
    if (crcs.size() < ranges.size()) {
      return Status::InvalidArgument("fake: DigestRanges with fewer CRCs than ranges");
    }
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < ranges.size(); ++i) {
      const spi::DigestRange& r = ranges[i];
      const LocalRegion* region = local_regions_.Holding(r.addr, r.length);
      if (region == nullptr || !region->cuda) {
        return Status::InvalidArgument(
            absl::StrFormat("fake: DigestRanges: [%#x, +%d) is not inside a registered CUDA region",
                            r.addr, r.length));
      }
      const uint32_t raw =
          Crc32cRaw(0, reinterpret_cast<const void*>(static_cast<uintptr_t>(r.addr)), r.length);
      crcs[i] = Crc32cAppendZeros(raw, r.zeros_after);
    }
    DeviceDigestCounter() += ranges.size();
    return Status::OK();
  }

  StatusOr<spi::LocalRegionId> RegisterMemory(const spi::MemoryRegion& region,
                                              Blob* key_blob) override {
    if (region.addr == nullptr || region.length == 0) {
      return Status::InvalidArgument("fake: cannot register an empty region");
    }
    std::lock_guard lock(mu_);
    spi::LocalRegionId id = local_regions_.Add(LocalRegion{
        region.length, reinterpret_cast<uint64_t>(region.addr), region.kind == MemoryKind::kCuda});
    if (key_blob) *key_blob = EncodeU64Pair(kEndpointMagic + 1, id);
    return id;
  }

  Status DeregisterMemory(spi::LocalRegionId region) override {
    std::lock_guard lock(mu_);
    return local_regions_.Remove(region).status();
  }

  StatusOr<spi::TargetEndpoint> CreateTargetEndpoint() override {
    std::lock_guard lock(mu_);
    spi::TargetId id = Fences().next_target.fetch_add(1);
    targets_.insert(id);
    return spi::TargetEndpoint{id, EncodeU64Pair(kEndpointMagic, id)};
  }

  void CloseTargetEndpoint(spi::TargetId target) override {
    {
      std::lock_guard lock(mu_);
      if (targets_.erase(target) == 0) return;
    }
    std::lock_guard lock(Fences().mu);
    Fences().fenced.erase(target);
  }

  Status FenceTarget(spi::TargetId target) override {
    {
      std::lock_guard lock(mu_);
      if (!targets_.contains(target)) {
        return Status::NotFound("fake: unknown target " + std::to_string(target));
      }
    }
    std::lock_guard lock(Fences().mu);
    Fences().fenced.insert(target);
    return Status::OK();
  }

  StatusOr<spi::Connection> Connect(const Blob& target_endpoint) override {
    uint64_t target = 0;
    if (!DecodeU64Pair(target_endpoint, kEndpointMagic, &target)) {
      return Status::InvalidArgument("fake: endpoint blob of " +
                                     std::to_string(target_endpoint.size()) +
                                     " bytes is not a fake endpoint");
    }
    std::lock_guard lock(mu_);
    spi::PeerId id = peers_.NextId();
    peers_.Add(id, PeerEntry{{}, Status(), target});
    return spi::Connection{id, {}};
  }

  StatusOr<spi::RemoteRegionId> ImportRemoteRegion(spi::PeerId peer,
                                                   const spi::RemoteRegion& region) override {
    uint64_t key = 0;
    if (!DecodeU64Pair(region.key, kEndpointMagic + 1, &key)) {
      return Status::InvalidArgument("fake: remote key blob is not a fake key");
    }
    if (Status s = toolkit::CheckRemoteRegion("fake", region); !s.ok()) return s;
    std::lock_guard lock(mu_);
    auto entry = peers_.ForImport(peer);
    if (!entry.ok()) return entry.status();
    (*entry)->regions.push_back(RemoteRegion{region.length, region.addr});
    return static_cast<spi::RemoteRegionId>((*entry)->regions.size() - 1);
  }

  Status PostWrites(spi::PeerId peer, std::span<const spi::WriteOp> ops,
                    spi::WriteCallback done) override {
    return Post(peer, ops, std::move(done), toolkit::OpKind::kWrite);
  }

  // The source of each op digested as MoveBytes copies it, before any fault of fake.corrupt.
  Status PostWritesDigested(spi::PeerId peer, std::span<const spi::WriteOp> ops,
                            std::span<uint32_t> crcs, spi::WriteCallback done) override {
    if (!capabilities().digests_sends)
      return spi::Transport::PostWritesDigested(peer, ops, crcs, done);
    if (crcs.size() != ops.size()) {
      return Status::InvalidArgument("fake: PostWritesDigested with a CRC count unlike the ops'");
    }
    return Post(peer, ops, std::move(done), toolkit::OpKind::kWrite, crcs);
  }

  Status PostReads(spi::PeerId peer, std::span<const spi::ReadOp> ops,
                   spi::ReadCallback done) override {
    return Post(peer, ops, std::move(done), toolkit::OpKind::kRead);
  }

  Status PeerStatus(spi::PeerId peer) override {
    std::lock_guard lock(mu_);
    return peers_.Health(peer);
  }

  void Disconnect(spi::PeerId peer) override {
    std::lock_guard lock(mu_);
    peers_.Erase(peer);
    // Batches already queued complete normally: the fake has nothing in flight to cancel.
  }

 private:
  // A batch of writes or reads: checked the same way, completed the same way.
  Status Post(spi::PeerId peer, std::span<const spi::WriteOp> ops, spi::WriteCallback done,
              toolkit::OpKind kind, std::span<uint32_t> crcs = {}) {
    std::unique_lock lock(mu_);
    if (stopping_) return Status::Cancelled("fake: transport is shutting down");
    auto entry = peers_.ForWrites(peer);
    if (!entry.ok()) return entry.status();
    std::vector<Copy> copies;
    for (size_t i = 0; i < ops.size(); ++i) {
      auto resolved = peers_.ResolveWrite(peer, **entry, local_regions_, i, ops[i], kind);
      if (!resolved.ok()) return resolved.status();
      if (!crcs.empty() && resolved->first->cuda) {
        return Status::InvalidArgument("fake: PostWritesDigested: write " + std::to_string(i) +
                                       " reads a CUDA region");
      }
      if (options_.copy) {
        const auto [local, remote] = *resolved;
        uint64_t from = local->addr + ops[i].local_offset, to = remote->addr + ops[i].remote_offset;
        uint64_t to_base = remote->addr, to_len = remote->length, to_off = ops[i].remote_offset;
        if (kind == toolkit::OpKind::kRead) {
          std::swap(from, to);
          to_base = local->addr;
          to_len = local->length;
          to_off = ops[i].local_offset;
        }
        copies.push_back(
            {from, to, ops[i].length, to_base, to_len, to_off, crcs.empty() ? nullptr : &crcs[i]});
      }
    }
    queue_.push_back(Pending{std::move(done), (*entry)->target, std::move(copies)});
    lock.unlock();
    cv_.notify_one();
    return Status::OK();
  }

  struct LocalRegion {
    uint64_t length = 0;
    uint64_t addr = 0;
    bool cuda = false;  // registered as kCuda (host memory standing in for a GPU's)
  };
  struct RemoteRegion {
    uint64_t length = 0;
    uint64_t addr = 0;  // the peer's address: this process's only when it shares it (fake.copy)
  };
  // fake.copy: one op's bytes, moved when its batch completes; the destination region, for a
  // misplaced landing.
  struct Copy {
    uint64_t from = 0, to = 0, length = 0;
    uint64_t region = 0, region_length = 0, offset = 0;
    uint32_t* crc = nullptr;  // PostWritesDigested: the raw CRC of the source, set as it is copied
  };
  struct PeerEntry {
    std::vector<RemoteRegion> regions;
    Status failure;            // never set: nothing fails on a fake wire
    spi::TargetId target = 0;  // the endpoint it connected to
  };
  struct Pending {
    spi::WriteCallback done;
    spi::TargetId target = 0;  // the endpoint the batch's peer connected to
    std::vector<Copy> copies;
  };

  // Moves a batch's bytes (fake.copy), with at most one of the faults of fake.corrupt.
  void MoveBytes(const std::vector<Copy>& copies) {
    int fault = -1;
    size_t victim = 0;
    if (!copies.empty()) {
      std::uniform_real_distribution<double> coin(0, 1);
      for (int k = 0; k < 3 && fault < 0; ++k) {
        if (options_.prob[k] > 0 && coin(rng_) < options_.prob[k]) fault = k;
      }
      victim = std::uniform_int_distribution<size_t>(0, copies.size() - 1)(rng_);
    }
    for (size_t i = 0; i < copies.size(); ++i) {
      const Copy& c = copies[i];
      auto* to = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(c.to));
      const auto* from = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(c.from));
      if (c.crc != nullptr) *c.crc = Crc32cRaw(0, from, c.length);
      if (i != victim || fault < 0 || c.length == 0) {
        std::memmove(to, from, c.length);
        continue;
      }
      switch (static_cast<Fault>(fault)) {
        case Fault::kByte: {
          std::memmove(to, from, c.length);
          to[std::uniform_int_distribution<uint64_t>(0, c.length - 1)(rng_)] ^= 0x5A;
          break;
        }
        case Fault::kPage: std::memset(to, 0xA5, c.length); break;
        case Fault::kMisplace: {
          // One op-length further on, wrapping inside the region (a different place whenever
          // the region holds two such ops).
          uint64_t at = c.offset + c.length;
          if (at + c.length > c.region_length) at = 0;
          if (at == c.offset) {
            std::memmove(to, from, c.length);
            to[0] ^= 0x5A;  // nowhere else to land: a flipped byte instead
          } else {
            std::memmove(reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(c.region + at)), from,
                         c.length);
          }
          break;
        }
      }
      CorruptionCounter().fetch_add(1);
      PDLIB_LOG(kWarning, "fake: corrupted a batch on purpose (fake.corrupt %s, %d bytes)",
                kFaultNames[fault], c.length);
    }
  }

  void ProgressLoop() {
    std::unique_lock lock(mu_);
    while (true) {
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      std::deque<Pending> batch;
      batch.swap(queue_);
      lock.unlock();
      std::vector<bool> fenced;
      for (const auto& p : batch) fenced.push_back(IsFenced(p.target));
      for (size_t i = 0; i < batch.size(); ++i) {
        if (!fenced[i]) MoveBytes(batch[i].copies);
        batch[i].done(fenced[i] ? Status::Unavailable("fake: the target fenced this peer off")
                                : Status::OK());
      }
      lock.lock();
    }
  }

  const FakeOptions options_;
  std::mt19937_64 rng_;  // the progress thread's
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::deque<Pending> queue_;
  toolkit::LocalRegions<LocalRegion> local_regions_{"fake"};
  toolkit::PeerTable<PeerEntry> peers_{"fake"};
  std::unordered_set<spi::TargetId> targets_;
  std::thread progress_;  // last: starts after every member above is constructed
};

}  // namespace

void RegisterFakeBackend() {
  internal::RegisterBuiltinTransport(
      "fake",
      [](const spi::TransportOptions& o) -> StatusOr<std::unique_ptr<spi::Transport>> {
        auto options = ParseFakeOptions(o);
        if (!options.ok()) return options.status();
        return std::unique_ptr<spi::Transport>(std::make_unique<FakeTransport>(*options));
      })
      .IgnoreError();  // only fails if "fake" is registered twice, which the call_once prevents
}

uint64_t FakeCorruptionsInjected() { return CorruptionCounter().load(); }
uint64_t FakeDeviceRangesDigested() { return DeviceDigestCounter().load(); }

}  // namespace v1
}  // namespace pdlib
