// RoomState and RoomTable: per-request transfer state (SPEC §2).
//
// A handle holds a shared_ptr<RoomState>, so KVSender::Poll() is exactly one acquire-load and
// never touches the table. Only pdlib's background threads (and Abort) write states, through
// compare-and-swap transitions that refuse to move backwards or out of a terminal state.
//
// Threads: everything here is thread-safe.
#ifndef PDLIB_LIB_CORE_ROOM_TABLE_H_
#define PDLIB_LIB_CORE_ROOM_TABLE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "lib/base/mutex.h"
#include "pdlib/status.h"
#include "pdlib/types.h"

namespace pdlib {
inline namespace v1 {

class RoomState {
 public:
  explicit RoomState(uint64_t room, KVPoll initial = KVPoll::kBootstrapping);
  RoomState(const RoomState&) = delete;
  RoomState& operator=(const RoomState&) = delete;

  uint64_t room() const { return room_; }

  // Acquire pairs with the release in Advance/Fail: whoever sees a state also sees every write
  // the advancing thread made before it (e.g. received bytes, the failure reason).
  KVPoll Poll() const { return state_.load(std::memory_order_acquire); }

  // Moves forward to `to` (not kFailed: use Fail). Returns false, changing nothing, when the
  // room is terminal or already at or past `to`.
  bool Advance(KVPoll to);

  // Moves any non-terminal state to kFailed with `reason` (must not be OK). Returns true for
  // the one call that failed the room; later calls keep the first reason.
  bool Fail(Status reason);

  // OK unless failed.
  Status FailureReason() const;
  // The state the room was in when it failed (kFailed while not failed).
  KVPoll failed_from() const { return failed_from_.load(std::memory_order_acquire); }

  // Page reuse (kv_manager.h): set once no peer can touch the room's pages any more. Release
  // pairs with the acquire in PagesReusable().
  bool PagesReusable() const { return reusable_.load(std::memory_order_acquire); }
  void MarkReusable() { reusable_.store(true, std::memory_order_release); }

  // Whether the room's per-room info lines are logged (RoomLogSampler), set when it is created.
  bool logged() const { return logged_.load(std::memory_order_relaxed); }
  void set_logged(bool logged) { logged_.store(logged, std::memory_order_relaxed); }

  // When the room was created (for latency metrics).
  absl::Time created() const { return absl::FromUnixNanos(created_ns_); }
  // When the room entered its current state (for timeouts).
  absl::Time state_since() const {
    return absl::FromUnixNanos(state_since_ns_.load(std::memory_order_relaxed));
  }

  // The progress clock of a transfer (CheckRoomDeadline): the side that moves the bytes notes
  // each step that shows the transfer alive (prefill: a chunk handed over, a write batch done;
  // decode in pull: reads posted, a read batch done). Until the first note the room is waiting
  // for the transfer to start, which is not a transfer.
  void NoteProgress() { progress_ns_.store(NowNanos(), std::memory_order_relaxed); }
  bool transfer_started() const { return progress_ns_.load(std::memory_order_relaxed) != 0; }
  absl::Time last_progress() const {
    return absl::FromUnixNanos(progress_ns_.load(std::memory_order_relaxed));
  }

 private:
  const uint64_t room_;
  const int64_t created_ns_;
  std::atomic<KVPoll> state_;
  std::atomic<KVPoll> failed_from_{KVPoll::kFailed};
  std::atomic<bool> reusable_{false};
  std::atomic<bool> logged_{false};
  static int64_t NowNanos() { return absl::ToUnixNanos(absl::Now()); }

  // Relaxed: only read by the timeout scanner, which tolerates a slightly stale value.
  std::atomic<int64_t> state_since_ns_;
  std::atomic<int64_t> progress_ns_{0};
  // Fail() writes the reason and the state under this lock, so FailureReason() (which takes it)
  // never sees Failed without its reason.
  mutable Mutex reason_mu_;
  Status reason_ ABSL_GUARDED_BY(reason_mu_);
};

// The live rooms of one manager, keyed by bootstrap_room.
class RoomTable {
 public:
  // kAlreadyExists when `room` is live (SPEC: a second live room with one id is rejected).
  StatusOr<std::shared_ptr<RoomState>> Insert(uint64_t room,
                                              KVPoll initial = KVPoll::kBootstrapping);
  std::shared_ptr<RoomState> Find(uint64_t room) const;
  // Removes `room` if it still maps to `state` (a newer room with the same id stays).
  void Erase(uint64_t room, const RoomState* state);
  size_t size() const;
  // A snapshot, so callers can act (fail, time out) without holding the table's lock.
  std::vector<std::shared_ptr<RoomState>> Snapshot() const;

 private:
  mutable Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<RoomState>> rooms_ ABSL_GUARDED_BY(mu_);
};

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CORE_ROOM_TABLE_H_
