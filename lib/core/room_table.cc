#include "lib/core/room_table.h"

#include <string>

namespace pdlib {
inline namespace v1 {
namespace {
int64_t NowNs() { return absl::ToUnixNanos(absl::Now()); }
}  // namespace

RoomState::RoomState(uint64_t room, KVPoll initial)
    : room_(room), created_ns_(NowNs()), state_(initial), state_since_ns_(created_ns_) {}

bool RoomState::Advance(KVPoll to) {
  if (to == KVPoll::kFailed) return false;
  KVPoll cur = state_.load(std::memory_order_acquire);
  while (!IsTerminal(cur) && static_cast<int>(cur) < static_cast<int>(to)) {
    // Release: publishes what this thread did before the transition (see Poll()).
    if (state_.compare_exchange_weak(cur, to, std::memory_order_release,
                                     std::memory_order_acquire)) {
      state_since_ns_.store(NowNs(), std::memory_order_relaxed);
      return true;
    }
  }
  return false;
}

bool RoomState::Fail(Status reason) {
  if (reason.ok()) reason = Status::Internal("room failed without a reason");
  MutexLock lock(&reason_mu_);
  KVPoll cur = state_.load(std::memory_order_acquire);
  while (!IsTerminal(cur)) {
    if (state_.compare_exchange_weak(cur, KVPoll::kFailed, std::memory_order_release,
                                     std::memory_order_acquire)) {
      failed_from_.store(cur, std::memory_order_release);
      reason_ = std::move(reason);
      state_since_ns_.store(NowNs(), std::memory_order_relaxed);
      return true;
    }
  }
  return false;
}

Status RoomState::FailureReason() const {
  MutexLock lock(&reason_mu_);
  return reason_;
}

StatusOr<std::shared_ptr<RoomState>> RoomTable::Insert(uint64_t room, KVPoll initial) {
  auto state = std::make_shared<RoomState>(room, initial);
  MutexLock lock(&mu_);
  auto [it, inserted] = rooms_.try_emplace(room, state);
  if (!inserted) {
    return Status::AlreadyExists("room " + std::to_string(room) +
                                 " is already live on this manager (state " +
                                 std::string(KVPollName(it->second->Poll())) + ")");
  }
  return state;
}

std::shared_ptr<RoomState> RoomTable::Find(uint64_t room) const {
  MutexLock lock(&mu_);
  auto it = rooms_.find(room);
  return it == rooms_.end() ? nullptr : it->second;
}

void RoomTable::Erase(uint64_t room, const RoomState* state) {
  MutexLock lock(&mu_);
  auto it = rooms_.find(room);
  if (it != rooms_.end() && it->second.get() == state) rooms_.erase(it);
}

size_t RoomTable::size() const {
  MutexLock lock(&mu_);
  return rooms_.size();
}

std::vector<std::shared_ptr<RoomState>> RoomTable::Snapshot() const {
  MutexLock lock(&mu_);
  std::vector<std::shared_ptr<RoomState>> out;
  out.reserve(rooms_.size());
  for (const auto& [room, state] : rooms_) out.push_back(state);
  return out;
}

}  // namespace v1
}  // namespace pdlib
