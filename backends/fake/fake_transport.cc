// The fake backend (SPEC R8.1): implements the whole transport SPI but moves no bytes. Every
// batch is validated exactly like a real backend would (regions exist, ops stay inside them)
// and completes as soon as its progress thread sees it. Used for warm-up, control-plane tests
// and benchmarks of everything except the wire.
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

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

class FakeTransport final : public spi::Transport {
 public:
  FakeTransport() : progress_([this] { ProgressLoop(); }) {}

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
    caps.moves_bytes = false;
    caps.supports_cuda_memory = true;  // nothing is touched, so any address is fine
    caps.fences = true;                // a fenced target's batches fail; nothing ever lands
    return caps;
  }

  StatusOr<spi::LocalRegionId> RegisterMemory(const spi::MemoryRegion& region,
                                              Blob* key_blob) override {
    if (region.addr == nullptr || region.length == 0) {
      return Status::InvalidArgument("fake: cannot register an empty region");
    }
    std::lock_guard lock(mu_);
    spi::LocalRegionId id = next_region_++;
    local_regions_[id] = region.length;
    if (key_blob) *key_blob = EncodeU64Pair(kEndpointMagic + 1, id);
    return id;
  }

  Status DeregisterMemory(spi::LocalRegionId region) override {
    std::lock_guard lock(mu_);
    if (local_regions_.erase(region) == 0) {
      return Status::NotFound("fake: local region " + std::to_string(region) + " not registered");
    }
    return Status::OK();
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
    spi::PeerId id = next_peer_++;
    peers_[id];
    peer_target_[id] = target;
    return spi::Connection{id, {}};
  }

  StatusOr<spi::RemoteRegionId> ImportRemoteRegion(spi::PeerId peer,
                                                   const spi::RemoteRegion& region) override {
    uint64_t key = 0;
    if (!DecodeU64Pair(region.key, kEndpointMagic + 1, &key)) {
      return Status::InvalidArgument("fake: remote key blob is not a fake key");
    }
    if (region.length == 0) return Status::InvalidArgument("fake: empty remote region");
    std::lock_guard lock(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end()) return Status::NotFound("fake: unknown peer " + std::to_string(peer));
    it->second.push_back(region.length);
    return static_cast<spi::RemoteRegionId>(it->second.size() - 1);
  }

  Status PostWrites(spi::PeerId peer, std::span<const spi::WriteOp> ops,
                    spi::WriteCallback done) override {
    std::unique_lock lock(mu_);
    if (stopping_) return Status::Cancelled("fake: transport is shutting down");
    auto it = peers_.find(peer);
    if (it == peers_.end()) return Status::NotFound("fake: unknown peer " + std::to_string(peer));
    const std::vector<uint64_t>& remote = it->second;
    for (size_t i = 0; i < ops.size(); ++i) {
      const spi::WriteOp& op = ops[i];
      auto local = local_regions_.find(op.local_region);
      if (local == local_regions_.end()) {
        return Status::InvalidArgument("fake: write " + std::to_string(i) +
                                       " names unregistered local region " +
                                       std::to_string(op.local_region));
      }
      if (op.remote_region >= remote.size()) {
        return Status::InvalidArgument("fake: write " + std::to_string(i) +
                                       " names unknown remote region " +
                                       std::to_string(op.remote_region));
      }
      if (op.length > local->second || op.local_offset > local->second - op.length ||
          op.length > remote[op.remote_region] ||
          op.remote_offset > remote[op.remote_region] - op.length) {
        return Status::OutOfRange("fake: write " + std::to_string(i) + " of " +
                                  std::to_string(op.length) + " bytes leaves its region");
      }
    }
    queue_.push_back(Pending{std::move(done), peer_target_[peer]});
    lock.unlock();
    cv_.notify_one();
    return Status::OK();
  }

  void Disconnect(spi::PeerId peer) override {
    std::lock_guard lock(mu_);
    peers_.erase(peer);
    peer_target_.erase(peer);
    // Batches already queued complete normally: the fake has nothing in flight to cancel.
  }

 private:
  struct Pending {
    spi::WriteCallback done;
    spi::TargetId target = 0;  // the endpoint the batch's peer connected to
  };

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
        batch[i].done(fenced[i] ? Status::Unavailable("fake: the target fenced this peer off")
                                : Status::OK());
      }
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::deque<Pending> queue_;
  spi::LocalRegionId next_region_ = 1;
  spi::PeerId next_peer_ = 1;
  std::unordered_map<spi::LocalRegionId, uint64_t> local_regions_;
  std::unordered_map<spi::PeerId, std::vector<uint64_t>> peers_;  // peer -> remote region lengths
  std::unordered_set<spi::TargetId> targets_;
  std::unordered_map<spi::PeerId, spi::TargetId> peer_target_;  // what each peer connected to
  std::thread progress_;  // last: starts after every member above is constructed
};

}  // namespace

void RegisterFakeBackend() {
  internal::RegisterBuiltinTransport(
      "fake",
      [](const spi::TransportOptions&) -> StatusOr<std::unique_ptr<spi::Transport>> {
        return std::unique_ptr<spi::Transport>(std::make_unique<FakeTransport>());
      })
      .IgnoreError();  // only fails if "fake" is registered twice, which the call_once prevents
}

}  // namespace v1
}  // namespace pdlib
