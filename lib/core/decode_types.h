// The state DecodeCore keeps per room, shared by the files that implement it: decode_core.cc
// and decode_quarantine.cc.
#ifndef PDLIB_LIB_CORE_DECODE_TYPES_H_
#define PDLIB_LIB_CORE_DECODE_TYPES_H_

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lib/core/decode_core.h"

namespace pdlib {
inline namespace v1 {

// A prefill connection this room's pages were sent to (in a TransferInfo): until it is closed
// (drained, fenced, gone) a write for the room may still come from there.
struct DecodeCore::Exposure {
  std::string key;
  uint64_t gen = 0;
  uint64_t instance = 0;
  bool open = true;
};

struct DecodeCore::Room {
  explicit Room(std::shared_ptr<RoomState> s) : state(std::move(s)) {}
  const std::shared_ptr<RoomState> state;
  mutable Mutex mu;
  std::vector<BoundPrefill> prefills ABSL_GUARDED_BY(mu);  // ranks this room talks to
  size_t expected ABSL_GUARDED_BY(mu) = 0;  // of them, those that write (not dummies)
  std::optional<uint32_t> aux_index ABSL_GUARDED_BY(mu);
  std::vector<planner::RankId> statuses_ok ABSL_GUARDED_BY(mu);  // writers that succeeded
  bool initialized ABSL_GUARDED_BY(mu) = false;
  TransferInfoMsg info ABSL_GUARDED_BY(mu);  // what Init() asked for
  std::vector<Exposure> exposed ABSL_GUARDED_BY(mu);
  bool quarantined ABSL_GUARDED_BY(mu) = false;  // failed, some exposure still open
  bool released ABSL_GUARDED_BY(mu) = false;     // the receiver was destroyed meanwhile
  absl::Time quarantined_at ABSL_GUARDED_BY(mu);
  absl::Time next_warning ABSL_GUARDED_BY(mu);
  uint64_t held_pages ABSL_GUARDED_BY(mu) = 0;  // KV pages + aux slot + state slots
  // Pull: per entry of `prefills`, this room's reads from that rank; in total, read batches
  // posted and not complete (while any is, the pages are held whatever the room's state); per
  // page of info.dst_kv_pages, the layers read into it so far, summed over the prefill ranks,
  // and what a page needs to hold every byte (the readers' layers added up).
  struct PullProgress {
    bool published = false;   // a ReadReady came from that rank
    bool final_seen = false;  // its last chunk's last layers (with aux and state) were posted
    int outstanding = 0;
    bool failed = false;     // one of its batches failed
    bool done_sent = false;  // ReadsDone went back to it
  };
  std::vector<PullProgress> pull ABSL_GUARDED_BY(mu);
  int reads_outstanding ABSL_GUARDED_BY(mu) = 0;
  std::vector<uint32_t> page_layers ABSL_GUARDED_BY(mu);
  uint32_t layers_expected ABSL_GUARDED_BY(mu) = 0;
  // KV integrity: whether the room is digested (KVManagerOptions::checksum), the XOR of what
  // its writers said they moved (set at Init), and the pages a mismatch showed bad.
  bool digested = false;
  std::atomic<bool> corrupted{false};  // failure injection `corrupt` struck it (once a room)
  std::optional<KvDigest> digest_expected ABSL_GUARDED_BY(mu);
  // The transport's landing watch on the room's cells (Transport::WatchLandings), from Init until
  // CheckDigest takes it or the room fails or goes away.
  std::optional<uint64_t> landing_watch ABSL_GUARDED_BY(mu);
  std::vector<int32_t> corrupt_pages ABSL_GUARDED_BY(mu);
};

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CORE_DECODE_TYPES_H_
