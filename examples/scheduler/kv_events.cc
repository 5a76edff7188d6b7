#include "examples/scheduler/kv_events.h"

#include <algorithm>
#include <chrono>

namespace pdlib::sched {

std::string_view KVEventTypeName(KVEventType type) {
  switch (type) {
    case KVEventType::kBlockStored: return "BlockStored";
    case KVEventType::kBlockRemoved: return "BlockRemoved";
    case KVEventType::kAllBlocksCleared: return "AllBlocksCleared";
  }
  return "Unknown";
}

std::string FormatKVEvent(const KVEvent& event) {
  std::string out =
      "seq=" + std::to_string(event.seq) + " " + std::string(KVEventTypeName(event.type));
  if (event.type == KVEventType::kAllBlocksCleared) return out;
  out += " room=" + std::to_string(event.room) + " page_size=" + std::to_string(event.page_size) +
         " pages=[";
  for (size_t i = 0; i < event.pages.size(); ++i) {
    if (i > 0) out += ",";
    out += std::to_string(event.pages[i]);
  }
  return out + "]";
}

KVEventReplayBuffer::KVEventReplayBuffer(size_t capacity)
    : capacity_(std::max<size_t>(1, capacity)) {}

void KVEventReplayBuffer::Append(KVEvent event) {
  last_seq_ = event.seq;
  events_.push_back(std::move(event));
  if (events_.size() > capacity_) events_.pop_front();
}

std::vector<KVEvent> KVEventReplayBuffer::Since(uint64_t from_seq, uint64_t* missed) const {
  from_seq = std::max<uint64_t>(from_seq, 1);
  // Events are held for seqs [first_held, last_seq_]; everything older was dropped.
  const uint64_t first_held = last_seq_ + 1 - events_.size();
  *missed = from_seq < first_held ? first_held - from_seq : 0;
  std::vector<KVEvent> out;
  if (from_seq > last_seq_) return out;
  const uint64_t skip = from_seq > first_held ? from_seq - first_held : 0;
  out.assign(events_.begin() + static_cast<std::ptrdiff_t>(skip), events_.end());
  return out;
}

KVEventPublisher::KVEventPublisher(size_t replay_capacity)
    : replay_capacity_(std::max<size_t>(1, replay_capacity)), buffer_(replay_capacity_) {}

void KVEventPublisher::Publish(KVEvent event) {
  event.timestamp_us = std::chrono::duration_cast<std::chrono::microseconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count();
  std::lock_guard<std::mutex> lock(mu_);
  event.seq = buffer_.last_seq() + 1;
  for (auto& [id, listener] : listeners_) listener(event);
  buffer_.Append(std::move(event));
}

KVEventPublisher::Subscription KVEventPublisher::Subscribe(uint64_t from_seq, Listener listener) {
  std::lock_guard<std::mutex> lock(mu_);
  Subscription sub;
  sub.id = next_id_++;
  sub.replay = buffer_.Since(from_seq, &sub.missed);
  listeners_.emplace(sub.id, std::move(listener));
  return sub;
}

void KVEventPublisher::Unsubscribe(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  listeners_.erase(id);
}

uint64_t KVEventPublisher::last_seq() const {
  std::lock_guard<std::mutex> lock(mu_);
  return buffer_.last_seq();
}

size_t KVEventPublisher::subscribers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return listeners_.size();
}

}  // namespace pdlib::sched
