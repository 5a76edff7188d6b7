// The API side's tables, the same for every backend: registered local regions, connected peers
// (initiator side) and open target endpoints, and the checks PostWrites makes against them.
// Each table is guarded by the backend's own lock (none here), so that one lock covers a
// PostWrites' look-ups and its hand-over to the progress thread.
//
// A peer's states, as PostWrites sees them:
//   connected -> failed   (the wire reported the peer dead, or the backend gave up on it: new
//                          batches are refused with that reason, the first one recorded)
//             -> gone     (Disconnect: "unknown peer N (never connected, or disconnected)"; the
//                          progress thread drains what was posted before, the peer's draining
//                          state lives there)
// A target endpoint's states: open -> fenced (the backend makes sure nothing more from its
// initiator lands; what a fenced endpoint still allows is the backend's) -> closed (gone).
#ifndef PDLIB_BACKENDS_COMMON_TABLES_H_
#define PDLIB_BACKENDS_COMMON_TABLES_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "pdlib/spi/transport.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace toolkit {

// What a batch does: reads (PostReads) are checked exactly like writes, only named so.
enum class OpKind { kWrite, kRead };

// Checks write (or read) `index` of a batch to `peer` against its regions' lengths;
// `local_length` and `remote_length` are nullopt when the region is unknown. The errors name the
// op, the region and the bytes: InvalidArgument for an unknown region, OutOfRange for an op that
// leaves one.
Status CheckWrite(std::string_view backend, size_t index, const spi::WriteOp& op, spi::PeerId peer,
                  std::optional<uint64_t> local_length, std::optional<uint64_t> remote_length,
                  OpKind kind = OpKind::kWrite);

// Checks a remote region as ImportRemoteRegion receives it: not empty, not wrapping around.
Status CheckRemoteRegion(std::string_view backend, const spi::RemoteRegion& region);

// Registered local regions by id; ids start at 1 and are never reused. Entry needs `length`.
template <typename Entry>
class LocalRegions {
 public:
  explicit LocalRegions(std::string backend) : backend_(std::move(backend)) {
    regions_.emplace_back();  // id 0 is never valid
  }
  spi::LocalRegionId Add(Entry entry) {
    regions_.push_back(std::move(entry));
    return static_cast<spi::LocalRegionId>(regions_.size() - 1);
  }
  // The entry, or null when `id` was never registered or was deregistered.
  const Entry* Find(spi::LocalRegionId id) const {
    return id < regions_.size() && regions_[id] ? &*regions_[id] : nullptr;
  }
  // Takes the entry out; NotFound when there is none.
  StatusOr<Entry> Remove(spi::LocalRegionId id) {
    if (Find(id) == nullptr) {
      return Status::NotFound(backend_ + ": local region " + std::to_string(id) +
                              " not registered");
    }
    Entry entry = std::move(*regions_[id]);
    regions_[id].reset();
    return entry;
  }
  void Clear() { regions_.clear(); }
  // The entry whose [addr, addr + length) holds [addr, addr + n), or null (for an Entry with
  // `addr` and `length`).
  const Entry* Holding(uint64_t addr, uint64_t n) const {
    for (const std::optional<Entry>& e : regions_) {
      if (e && addr >= e->addr && n <= e->length && addr - e->addr <= e->length - n) return &*e;
    }
    return nullptr;
  }

 private:
  std::string backend_;
  std::vector<std::optional<Entry>> regions_;
};

// Connected peers by id, as PostWrites validates against them. Entry holds the peer's imported
// `regions` (each with `length`) and whatever else the backend resolves a write with.
template <typename Entry>
class PeerTable {
 public:
  explicit PeerTable(std::string backend) : backend_(std::move(backend)) {}

  spi::PeerId NextId() { return next_id_++; }
  Entry& Add(spi::PeerId id, Entry entry) {
    return peers_.insert_or_assign(id, std::move(entry)).first->second;
  }
  // Disconnect: true when the peer was there.
  bool Erase(spi::PeerId id) { return peers_.erase(id) > 0; }
  Entry* Find(spi::PeerId id) {
    auto it = peers_.find(id);
    return it == peers_.end() ? nullptr : &it->second;
  }
  // The peer's failure from now on (the first reason wins); no-op for a peer already gone.
  void MarkFailed(spi::PeerId id, const Status& failure) {
    auto it = peers_.find(id);
    if (it != peers_.end() && it->second.failure.ok()) it->second.failure = failure;
  }
  // The peer a batch may be posted to: NotFound when gone, its failure when failed.
  StatusOr<Entry*> ForWrites(spi::PeerId id) {
    Entry* entry = Find(id);
    if (entry == nullptr) {
      return Status::NotFound(backend_ + ": unknown peer " + std::to_string(id) +
                              " (never connected, or disconnected)");
    }
    if (!entry->failure.ok()) return entry->failure;
    return entry;
  }
  // Transport::PeerStatus: NotFound when gone, its failure when failed, else OK.
  Status Health(spi::PeerId id) {
    auto found = ForWrites(id);
    return found.ok() ? Status::OK() : found.status();
  }
  // The peer a region may be imported for: NotFound when gone, its failure when failed.
  StatusOr<Entry*> ForImport(spi::PeerId id) {
    Entry* entry = Find(id);
    if (entry == nullptr)
      return Status::NotFound(backend_ + ": unknown peer " + std::to_string(id));
    if (!entry->failure.ok()) return entry->failure;
    return entry;
  }
  // Resolves write (or read) `index` of a batch to `id`: its local and remote entries after
  // CheckWrite.
  template <typename Local>
  StatusOr<std::pair<const Local*, const typename decltype(Entry::regions)::value_type*>>
  ResolveWrite(spi::PeerId id, const Entry& peer, const LocalRegions<Local>& locals, size_t index,
               const spi::WriteOp& op, OpKind kind = OpKind::kWrite) const {
    const Local* local = locals.Find(op.local_region);
    const auto* remote =
        op.remote_region < peer.regions.size() ? &peer.regions[op.remote_region] : nullptr;
    Status s = CheckWrite(backend_, index, op, id,
                          local ? std::optional<uint64_t>(local->length) : std::nullopt,
                          remote ? std::optional<uint64_t>(remote->length) : std::nullopt, kind);
    if (!s.ok()) return s;
    return std::make_pair(local, remote);
  }
  void Clear() { peers_.clear(); }

 private:
  std::string backend_;
  std::unordered_map<spi::PeerId, Entry> peers_;
  spi::PeerId next_id_ = 1;
};

// Open target endpoints by id (ids start at 1). Entry needs `bool fenced`.
template <typename Entry>
class TargetTable {
 public:
  explicit TargetTable(std::string backend) : backend_(std::move(backend)) {}

  spi::TargetId Add(Entry entry) {
    const spi::TargetId id = next_id_++;
    targets_.emplace(id, std::move(entry));
    return id;
  }
  // The open endpoint, or NotFound naming it.
  StatusOr<Entry*> Find(spi::TargetId id) {
    auto it = targets_.find(id);
    if (it == targets_.end()) {
      return Status::NotFound(backend_ + ": unknown target endpoint " + std::to_string(id) +
                              " (never created, or closed)");
    }
    return &it->second;
  }
  // The open endpoint unless fenced (FailedPrecondition then): what may still be connected.
  StatusOr<Entry*> FindUnfenced(spi::TargetId id) {
    auto entry = Find(id);
    if (entry.ok() && (*entry)->fenced) {
      return Status::FailedPrecondition(backend_ + ": target endpoint " + std::to_string(id) +
                                        " was fenced");
    }
    return entry;
  }
  // CloseTargetEndpoint: the entry, to be destroyed outside the lock; nullopt when not open.
  std::optional<Entry> Take(spi::TargetId id) {
    auto it = targets_.find(id);
    if (it == targets_.end()) return std::nullopt;
    std::optional<Entry> taken(std::move(it->second));
    targets_.erase(it);
    return taken;
  }
  void Clear() { targets_.clear(); }

 private:
  std::string backend_;
  std::unordered_map<spi::TargetId, Entry> targets_;
  spi::TargetId next_id_ = 1;
};

}  // namespace toolkit
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_COMMON_TABLES_H_
