// DecodeCore: page reuse. A failed room whose pages went out stays quarantined until every
// prefill connection they went to is drained, fenced or gone (kv_manager.h, "Page reuse").
#include <algorithm>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_format.h"
#include "lib/base/log_internal.h"
#include "lib/core/decode_core.h"
#include "lib/core/decode_types.h"

namespace pdlib {
inline namespace v1 {

void DecodeCore::EnterQuarantine(const std::shared_ptr<Room>& room) {
  MutexLock lock(&room->mu);
  // Pull: our own read batches still in flight hold the pages like an open exposure.
  const bool open =
      room->reads_outstanding > 0 || std::any_of(room->exposed.begin(), room->exposed.end(),
                                                 [](const Exposure& e) { return e.open; });
  if (!open) {
    // Its pages never went out, or every rank they went to is drained, fenced or gone. Failed
    // was visible before this: an engine may have destroyed the receiver in between, and
    // ReleaseRoom then found the pages not reusable yet; TakeReusableRooms reports it now.
    room->state->MarkReusable();
    if (room->released) released_.Add(room->state->room());
    return;
  }
  room->quarantined = true;
  room->quarantined_at = absl::Now();
  room->next_warning = room->quarantined_at + absl::FromChrono(options_.quarantine_warn_after);
  room->held_pages = room->info.dst_kv_pages.size() + (room->info.aux_index ? 1 : 0) +
                     room->info.dst_state_indices.size();
  MutexLock conn_lock(&mu_);
  quarantine_[room.get()] = room;
}

void DecodeCore::ClearExposures(const std::function<bool(uint64_t, const Exposure&)>& match,
                                Release why) {
  std::vector<std::shared_ptr<Room>> rooms;
  {
    MutexLock lock(&mu_);
    rooms.reserve(room_data_.size() + quarantine_.size());
    for (auto& [id, room] : room_data_) rooms.push_back(room);
    for (auto& [ptr, room] : quarantine_) {
      if (!room_data_.contains(room->state->room()) ||
          room_data_.at(room->state->room()).get() != ptr) {
        rooms.push_back(room);  // its receiver is gone: only the quarantine holds it
      }
    }
  }
  std::vector<std::shared_ptr<Room>> candidates;  // quarantined, every exposure closed now
  for (auto& room : rooms) {
    const uint64_t id = room->state->room();
    MutexLock lock(&room->mu);
    bool open = false;
    for (Exposure& e : room->exposed) {
      if (e.open && match(id, e)) e.open = false;
      open |= e.open;
    }
    if (room->quarantined && !open && room->reads_outstanding == 0) candidates.push_back(room);
  }
  if (candidates.empty()) return;
  // A drained or dead prefill posts nothing more, but what it already sent may still wait in
  // this process's own queues (UCX's emulated puts): applied before the pages are given back. A
  // fenced connection's writes are dropped instead.
  if (why != Release::kFenced) {
    MutexLock lock(&transport_mu_);
    if (!transport_) return;
    transport_->SettleIncoming();
  }
  const absl::Time now = absl::Now();
  std::vector<std::shared_ptr<Room>> ended;
  uint64_t longest = 0;
  for (auto& room : candidates) {
    MutexLock lock(&room->mu);
    if (!room->quarantined) continue;  // another caller ended it meanwhile
    room->quarantined = false;
    const uint64_t held_ms = absl::ToInt64Milliseconds(now - room->quarantined_at);
    longest = std::max(longest, held_ms);
    ended.push_back(room);
    PDLIB_LOG(kInfo, "decode: room %d: %d pages reusable after %d ms of quarantine (%s)",
              room->state->room(), room->held_pages, held_ms,
              why == Release::kDrained  ? "prefill drained it"
              : why == Release::kFenced ? "prefill fenced off"
                                        : "prefill gone");
  }
  if (ended.empty()) return;
  {
    // Counted before the pages are reusable, so that metrics never lag what a handle says.
    MutexLock lock(&mu_);
    for (auto& room : ended) quarantine_.erase(room.get());
    released_by_[static_cast<int>(why)] += ended.size();
    max_hold_ms_ = std::max(max_hold_ms_, longest);
  }
  for (auto& room : ended) {
    MutexLock lock(&room->mu);
    room->state->MarkReusable();
    if (room->released) released_.Add(room->state->room());  // see ReleaseRoom
  }
}

void DecodeCore::ResendAborts(const std::string& key, uint64_t instance) {
  // Quarantined rooms still waiting on this same instance: the old stream may have lost their
  // TransferInfo or Abort, in which case the instance knows nothing to report. Telling it again
  // is harmless: a room it never saw, or that is over, is reported drained at once.
  std::vector<std::shared_ptr<Room>> rooms;
  std::shared_ptr<PrefillLink> link;
  std::vector<std::pair<uint64_t, std::string>> owed;
  {
    MutexLock lock(&mu_);
    auto it = connections_.find(key);
    if (it == connections_.end()) return;
    link = it->second.link;
    for (auto& [ptr, room] : quarantine_) rooms.push_back(room);
    if (auto o = owed_aborts_.find(key); o != owed_aborts_.end()) {
      owed = std::move(o->second);
      owed_aborts_.erase(o);
    }
  }
  // Rooms that failed when the last connection ended, whatever instance answers now: one that
  // never saw them reports them drained.
  for (const auto& [room, why] : owed) {
    link->SendAbort(room, session_, "failed on decode when its connection ended: " + why);
  }
  for (auto& room : rooms) {
    bool waiting = false;
    {
      MutexLock lock(&room->mu);
      for (const Exposure& e : room->exposed) {
        waiting |= e.open && e.key == key && e.instance == instance;
      }
    }
    if (waiting) {
      link->SendAbort(room->state->room(), session_,
                      "failed on decode while the connection was down: " +
                          room->state->FailureReason().ToString());
    }
  }
}

void DecodeCore::OnDrained(const std::string& key, const RoomsDrainedMsg& msg) {
  absl::flat_hash_set<uint64_t> rooms(msg.rooms.begin(), msg.rooms.end());
  ClearExposures(
      [&](uint64_t room, const Exposure& e) {
        return e.key == key && e.instance == msg.instance && rooms.contains(room);
      },
      Release::kDrained);
}

void DecodeCore::OnPrefillExited(const std::string& key, std::optional<uint64_t> instance) {
  uint64_t live_gen = 0;
  {
    MutexLock lock(&mu_);
    if (auto it = connections_.find(key); it != connections_.end()) live_gen = it->second.gen;
  }
  ClearExposures(
      [&](uint64_t, const Exposure& e) {
        if (e.key != key) return false;
        return instance ? e.instance == *instance : e.gen != live_gen;
      },
      Release::kGone);
}

std::vector<std::string> DecodeCore::KeysAwaitingPrefill() const {
  std::vector<std::shared_ptr<Room>> rooms;
  {
    MutexLock lock(&mu_);
    for (auto& [ptr, room] : quarantine_) rooms.push_back(room);
  }
  absl::flat_hash_set<std::string> keys;
  for (auto& room : rooms) {
    MutexLock lock(&room->mu);
    for (const Exposure& e : room->exposed) {
      if (e.open) keys.insert(e.key);
    }
  }
  std::vector<std::string> out;
  MutexLock lock(&mu_);
  for (const auto& key : keys) {
    if (!connections_.contains(key)) out.push_back(key);
  }
  return out;
}

void DecodeCore::WarnLongQuarantines(absl::Time now) {
  std::vector<std::shared_ptr<Room>> rooms;
  {
    MutexLock lock(&mu_);
    for (auto& [ptr, room] : quarantine_) rooms.push_back(room);
  }
  for (auto& room : rooms) {
    MutexLock lock(&room->mu);
    if (!room->quarantined || now < room->next_warning) continue;
    room->next_warning = now + absl::FromChrono(options_.quarantine_warn_after);
    std::string waiting;
    for (const Exposure& e : room->exposed) {
      if (e.open) absl::StrAppendFormat(&waiting, " %s (instance %016x)", e.key, e.instance);
    }
    PDLIB_LOG(kError,
              "decode: room %d: %d pages quarantined for %d ms: prefill%s has neither reported "
              "the room drained nor been seen gone, so a late write may still come; they stay "
              "out of use",
              room->state->room(), room->held_pages,
              absl::ToInt64Milliseconds(now - room->quarantined_at), waiting);
  }
}

}  // namespace v1
}  // namespace pdlib
