// KV events (SPEC R10.2): what a PageAllocator tells the outside world about its pages.
//
//  - BlockStored: pages were handed to a request and will hold its KV.
//  - BlockRemoved: a request's pages went back to the free list.
//  - AllBlocksCleared: every page is free again (allocator reset).
//
// KVEventPublisher numbers events (seq 1, 2, 3, ...), keeps the most recent ones in a replay
// buffer and hands each new one to its subscribers, so a late subscriber first replays what it
// missed and then follows live. examples/kv_events serves a publisher over a gRPC server
// stream; pd-kv-events prints what it receives.
//
// Threads: KVEventReplayBuffer is a plain value (one thread at a time). KVEventPublisher is
// thread-safe: the scheduler thread publishes while gRPC threads subscribe and unsubscribe.
#ifndef PDLIB_EXAMPLES_SCHEDULER_KV_EVENTS_H_
#define PDLIB_EXAMPLES_SCHEDULER_KV_EVENTS_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace pdlib::sched {

enum class KVEventType : int32_t {
  kBlockStored = 0,
  kBlockRemoved = 1,
  kAllBlocksCleared = 2,
};
std::string_view KVEventTypeName(KVEventType type);

struct KVEvent {
  uint64_t seq = 0;          // assigned by the publisher: 1 for the first event
  int64_t timestamp_us = 0;  // assigned by the publisher: system clock, us since the epoch
  KVEventType type = KVEventType::kBlockStored;
  uint64_t room = 0;           // the request owning the pages (0 for AllBlocksCleared)
  std::vector<int32_t> pages;  // page indices (empty for AllBlocksCleared)
  int32_t page_size = 0;       // tokens per page

  friend bool operator==(const KVEvent&, const KVEvent&) = default;
};

// One line: "seq=3 BlockStored room=7 page_size=16 pages=[4,5,6]".
std::string FormatKVEvent(const KVEvent& event);

// Where a PageAllocator sends its events.
class KVEventSink {
 public:
  virtual ~KVEventSink() = default;
  // `event.seq` and `event.timestamp_us` are filled in by the sink.
  virtual void Publish(KVEvent event) = 0;
};

// The most recent `capacity` events, oldest first.
class KVEventReplayBuffer {
 public:
  explicit KVEventReplayBuffer(size_t capacity);

  // Appends an event whose seq is last_seq() + 1; drops the oldest when full.
  void Append(KVEvent event);
  // Held events with seq >= from_seq, oldest first (from_seq 0 means 1). *missed counts the
  // events with seq >= from_seq that were published but are no longer held.
  std::vector<KVEvent> Since(uint64_t from_seq, uint64_t* missed) const;

  size_t capacity() const { return capacity_; }
  size_t size() const { return events_.size(); }
  uint64_t last_seq() const { return last_seq_; }

 private:
  size_t capacity_;
  uint64_t last_seq_ = 0;
  std::deque<KVEvent> events_;
};

class KVEventPublisher final : public KVEventSink {
 public:
  // Called with each live event, in seq order, under the publisher's lock: it must be quick
  // and must not call back into the publisher.
  using Listener = std::function<void(const KVEvent&)>;

  struct Subscription {
    uint64_t id = 0;              // for Unsubscribe
    std::vector<KVEvent> replay;  // buffered events with seq >= from_seq, oldest first
    uint64_t missed = 0;          // events with seq >= from_seq already dropped from the buffer
  };

  // `replay_capacity`: events kept for late subscribers (at least 1).
  explicit KVEventPublisher(size_t replay_capacity = 1024);

  void Publish(KVEvent event) override;

  // Atomically takes the replay and registers `listener` for every later event, so that a
  // subscriber sees each event exactly once.
  Subscription Subscribe(uint64_t from_seq, Listener listener);
  // After it returns the listener is never called again. Unknown ids are ignored.
  void Unsubscribe(uint64_t id);

  uint64_t last_seq() const;
  size_t subscribers() const;
  size_t replay_capacity() const { return replay_capacity_; }

 private:
  const size_t replay_capacity_;
  mutable std::mutex mu_;
  KVEventReplayBuffer buffer_;              // guarded by mu_
  std::map<uint64_t, Listener> listeners_;  // guarded by mu_
  uint64_t next_id_ = 1;                    // guarded by mu_
};

}  // namespace pdlib::sched

#endif  // PDLIB_EXAMPLES_SCHEDULER_KV_EVENTS_H_
