#include "fuzz/checked_transport.h"

#include <cstdio>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "pdlib/spi/transport.h"

namespace pdlib {
inline namespace v1 {
namespace fuzzing {
namespace {

[[noreturn]] void Violation(const char* what, const spi::WriteOp& op, uint64_t local_len,
                            uint64_t remote_len) {
  std::fprintf(
      stderr,
      "control_fuzz: write outside the registered regions: %s\n"
      "  local region %u offset %llu, remote region %u offset %llu, length %llu\n"
      "  local region length %llu, remote region length (as decode declared) %llu\n",
      what, op.local_region, static_cast<unsigned long long>(op.local_offset), op.remote_region,
      static_cast<unsigned long long>(op.remote_offset), static_cast<unsigned long long>(op.length),
      static_cast<unsigned long long>(local_len), static_cast<unsigned long long>(remote_len));
  __builtin_trap();
}

// [offset, offset + length) inside [0, region), without overflow.
bool Inside(uint64_t offset, uint64_t length, uint64_t region) {
  return length <= region && offset <= region - length;
}

class CheckedTransport final : public spi::Transport {
 public:
  explicit CheckedTransport(bool fail_every_other) : fail_every_other_(fail_every_other) {}

  std::string_view name() const override { return kCheckedTransportName; }

  spi::TransportCapabilities capabilities() const override {
    spi::TransportCapabilities caps;
    caps.moves_bytes = false;
    return caps;
  }

  StatusOr<spi::LocalRegionId> RegisterMemory(const spi::MemoryRegion& region,
                                              spi::Blob* key_blob) override {
    if (region.addr == nullptr || region.length == 0) {
      return Status::InvalidArgument("fuzz-checked: empty region");
    }
    std::lock_guard lock(mu_);
    const spi::LocalRegionId id = next_local_++;
    local_[id] = region.length;
    if (key_blob != nullptr) *key_blob = {1, 2, 3, 4};
    return id;
  }

  Status DeregisterMemory(spi::LocalRegionId region) override {
    std::lock_guard lock(mu_);
    if (local_.erase(region) == 0) {
      std::fprintf(stderr, "control_fuzz: deregistering unknown local region %u\n", region);
      __builtin_trap();
    }
    return Status::OK();
  }

  StatusOr<spi::TargetEndpoint> CreateTargetEndpoint() override {
    std::lock_guard lock(mu_);
    return spi::TargetEndpoint{next_target_++, {5, 6, 7}};
  }

  void CloseTargetEndpoint(spi::TargetId) override {}

  StatusOr<spi::Connection> Connect(const spi::Blob& target_endpoint) override {
    if (!target_endpoint.empty() && target_endpoint[0] == kRefusedBlobMarker) {
      return Status::InvalidArgument("fuzz-checked: endpoint blob refused");
    }
    std::lock_guard lock(mu_);
    const spi::PeerId id = next_peer_++;
    peers_[id];
    return spi::Connection{id, {}};
  }

  StatusOr<spi::RemoteRegionId> ImportRemoteRegion(spi::PeerId peer,
                                                   const spi::RemoteRegion& region) override {
    if (!region.key.empty() && region.key[0] == kRefusedBlobMarker) {
      return Status::InvalidArgument("fuzz-checked: remote key refused");
    }
    std::lock_guard lock(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end()) {
      std::fprintf(stderr, "control_fuzz: importing a region for unknown peer %llu\n",
                   static_cast<unsigned long long>(peer));
      __builtin_trap();
    }
    it->second.push_back(region.length);
    return static_cast<spi::RemoteRegionId>(it->second.size() - 1);
  }

  Status PostWrites(spi::PeerId peer, std::span<const spi::WriteOp> ops,
                    spi::WriteCallback done) override {
    bool fail = false;
    uint64_t bytes = 0;
    {
      std::lock_guard lock(mu_);
      auto it = peers_.find(peer);
      // A peer replaced by a reconnect may still have rooms in flight: a clean error, as a real
      // backend would give.
      if (it == peers_.end()) return Status::Unavailable("fuzz-checked: peer disconnected");
      const std::vector<uint64_t>& remote = it->second;
      for (const spi::WriteOp& op : ops) {
        auto local = local_.find(op.local_region);
        const uint64_t local_len = local == local_.end() ? 0 : local->second;
        const uint64_t remote_len = op.remote_region < remote.size() ? remote[op.remote_region] : 0;
        if (local == local_.end()) Violation("unknown local region", op, local_len, remote_len);
        if (op.remote_region >= remote.size()) {
          Violation("unknown remote region", op, local_len, remote_len);
        }
        if (!Inside(op.local_offset, op.length, local_len)) {
          Violation("past the end of the local region", op, local_len, remote_len);
        }
        if (!Inside(op.remote_offset, op.length, remote_len)) {
          Violation("past the end of the remote region", op, local_len, remote_len);
        }
        bytes += op.length;
      }
      fail = fail_every_other_ && (batches_++ % 2 == 1);
    }
    CheckedTransportStats& stats = GlobalCheckedTransportStats();
    stats.batches.fetch_add(1, std::memory_order_relaxed);
    stats.writes.fetch_add(ops.size(), std::memory_order_relaxed);
    stats.bytes.fetch_add(bytes, std::memory_order_relaxed);
    // Inline completion: allowed by the SPI (the core holds no lock while posting) and keeps
    // the fuzzer's runs as deterministic as the core's worker threads allow.
    done(fail ? Status::Unavailable("fuzz-checked: injected dead peer") : Status::OK());
    return Status::OK();
  }

  void Disconnect(spi::PeerId peer) override {
    std::lock_guard lock(mu_);
    peers_.erase(peer);
  }

 private:
  const bool fail_every_other_;
  std::mutex mu_;
  std::unordered_map<spi::LocalRegionId, uint64_t> local_;
  std::unordered_map<spi::PeerId, std::vector<uint64_t>> peers_;  // remote region lengths
  spi::LocalRegionId next_local_ = 1;
  spi::TargetId next_target_ = 1;
  spi::PeerId next_peer_ = 1;
  uint64_t batches_ = 0;
};

}  // namespace

CheckedTransportStats& GlobalCheckedTransportStats() {
  static CheckedTransportStats* stats = new CheckedTransportStats();
  return *stats;
}

Status RegisterCheckedTransport() {
  static const Status registered = spi::RegisterTransport(
      kCheckedTransportName,
      [](const spi::TransportOptions& options) -> StatusOr<std::unique_ptr<spi::Transport>> {
        auto it = options.options.find(kFailEveryOtherOption);
        const bool fail = it != options.options.end() && it->second == "1";
        return std::unique_ptr<spi::Transport>(new CheckedTransport(fail));
      });
  return registered;
}

}  // namespace fuzzing
}  // namespace v1
}  // namespace pdlib
