// KVEventServer: serves a KVEventPublisher (examples/scheduler/kv_events.h) over gRPC
// (service KVEvents in kv_events.proto): each subscriber gets the replay buffer from its
// from_seq, then every new event, batched while a write is in flight.
//
// KVEventClient: the subscriber side (pd-kv-events, tests).
//
// Ownership: the host owns the server; the publisher must outlive it. A subscriber that falls
// more than `max_pending_events` behind is disconnected with RESOURCE_EXHAUSTED (it may resubscribe
// from its last seq), so a slow reader never grows the server's memory without bound.
// Threads: all methods are thread-safe. Including this header pulls in no gRPC header.
#ifndef PDLIB_EXAMPLES_KV_EVENTS_KV_EVENT_SERVER_H_
#define PDLIB_EXAMPLES_KV_EVENTS_KV_EVENT_SERVER_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "examples/scheduler/kv_events.h"
#include "pdlib/status.h"

namespace pdlib::sched {

struct KVEventServerOptions {
  std::string host = "127.0.0.1";     // address to bind
  int32_t port = 0;                   // 0 picks a free port; port() tells which
  size_t max_pending_events = 65536;  // per subscriber, see the file comment
};

class KVEventServer {
 public:
  static StatusOr<std::unique_ptr<KVEventServer>> Start(const KVEventServerOptions& options,
                                                        KVEventPublisher* publisher);
  ~KVEventServer();  // Shutdown()
  KVEventServer(const KVEventServer&) = delete;
  KVEventServer& operator=(const KVEventServer&) = delete;

  // Ends every subscription and stops serving. Idempotent.
  void Shutdown();
  int32_t port() const;
  std::string address() const;  // "host:port"

 private:
  struct Rep;
  explicit KVEventServer(std::unique_ptr<Rep> rep);
  std::unique_ptr<Rep> rep_;
};

struct KVEventSubscribeOptions {
  std::string target = "127.0.0.1:5557";  // the server's host:port
  uint64_t from_seq = 0;                  // see SubscribeRequest in kv_events.proto
  // Give up when nothing arrives for this long (0: wait forever).
  std::chrono::milliseconds idle_timeout{0};
};

// Subscribes and calls `on_event` for each event until it returns false (OK), the server ends the
// stream, or the idle timeout passes (DEADLINE_EXCEEDED). `on_missed` (may be null) is called
// once with the first batch's missed count. Blocks the calling thread.
Status SubscribeKVEvents(const KVEventSubscribeOptions& options,
                         const std::function<bool(const KVEvent&)>& on_event,
                         const std::function<void(uint64_t)>& on_missed = nullptr);

}  // namespace pdlib::sched

#endif  // PDLIB_EXAMPLES_KV_EVENTS_KV_EVENT_SERVER_H_
