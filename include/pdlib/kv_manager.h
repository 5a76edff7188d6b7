// KVManager, KVSender and KVReceiver: the per-rank object and the per-request handles an engine
// drives (SPEC §1).
//
// Ownership: the engine owns the KVManager (created by KVManager::Create) and every handle it
// creates; handles must be destroyed before their manager. Destroying a handle that is not yet
// terminal aborts its request and releases everything held for it.
//
// Threads: every method may be called from any thread. Poll() is wait-free (one atomic load)
// so engines can call it every scheduler step. Background threads owned by the manager do all
// the network work; no call here blocks on the network.
#ifndef PDLIB_KV_MANAGER_H_
#define PDLIB_KV_MANAGER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "pdlib/export.h"
#include "pdlib/kv_args.h"
#include "pdlib/status.h"
#include "pdlib/types.h"

namespace pdlib {
inline namespace v1 {

// Anything whose transfer state can be polled; PollAndAllReduce takes these.
class PDLIB_EXPORT KVPollable {
 public:
  virtual ~KVPollable() = default;
  // Wait-free: the current state, never moving backwards (SPEC R2.2, R2.3).
  virtual KVPoll Poll() const = 0;
  // OK unless Poll() is kFailed; then the reason, e.g. DEADLINE_EXCEEDED: "room 7: no
  // TransferInfo from decode within 30000 ms (state Bootstrapping)".
  virtual Status FailureReason() const = 0;
  // The request's bootstrap_room.
  virtual uint64_t room() const = 0;
};

// Prefill side of one request.
class PDLIB_EXPORT KVSender : public KVPollable {
 public:
  // Announces how many KV pages the whole request will send and which metadata slot carries its
  // first output token. May be called in any non-terminal state.
  virtual Status Init(uint64_t num_kv_pages, std::optional<uint32_t> aux_index) = 0;
  // Queues one chunk of this request's KV pages (SPEC R5.2). Non-last chunks must hold only
  // whole pages; the last chunk's call also sends the aux slot and `state_indices`.
  // Requires the decode side's TransferInfo (Poll() >= kWaitingForInput).
  virtual Status Send(std::span<const int32_t> kv_page_indices, bool is_last_chunk,
                      std::span<const int32_t> state_indices = {}) = 0;
  // Fails the request with `reason` (code kAborted) and tells the decode side. Idempotent.
  virtual void Abort(std::string_view reason) = 0;
};

// Decode side of one request.
class PDLIB_EXPORT KVReceiver : public KVPollable {
 public:
  // Hands over the destination pages, the metadata slot and the state slots, and sends them to
  // every prefill rank that writes to this rank (SPEC R1.3). Call once. Poll() reaches
  // kWaitingForInput when the prefill rank is connected; Init() may also come earlier, while
  // Bootstrapping, and is then sent as soon as the connection is up.
  virtual Status Init(std::span<const int32_t> kv_page_indices, std::optional<uint32_t> aux_index,
                      std::span<const int32_t> state_indices = {}) = 0;
  // Fails the request with `reason` (code kAborted) and tells the prefill side. Idempotent.
  virtual void Abort(std::string_view reason) = 0;
};

// Where a request's prefill deployment can be found (from the router, SPEC R1.1).
struct BootstrapAddress {
  std::string host = "127.0.0.1";
  uint16_t port = 8998;
};

// Point-in-time counters of one manager (SPEC R10.1).
struct KVManagerMetrics {
  uint64_t live_rooms = 0;            // handles not yet destroyed
  uint64_t bootstrap_queue_size = 0;  // rooms in Bootstrapping
  uint64_t transfer_queue_size = 0;   // rooms in WaitingForInput or Transferring
  uint64_t rooms_succeeded = 0;
  uint64_t rooms_failed = 0;
  uint64_t bootstrap_failed_reqs = 0;  // failed before leaving Bootstrapping
  uint64_t transfer_failed_reqs = 0;   // failed afterwards
  uint64_t bytes_transferred = 0;      // bytes written to peers (prefill)
  uint64_t pages_transferred = 0;
  uint64_t write_batches = 0;
  uint64_t connections = 0;     // live peer connections
  uint64_t requests_total = 0;  // handles ever created
  // Failed rooms by the failure's status code name ("DEADLINE_EXCEEDED", "UNAVAILABLE", ...).
  std::map<std::string, uint64_t> failed_by_cause;
  // Time from a room's creation to Success, summed over succeeded rooms (mean = sum / count).
  uint64_t transfer_latency_us_sum = 0;
  uint64_t transfer_latency_count = 0;
};

// Renders `m` in the Prometheus text exposition format, every metric prefixed "pdlib_" and
// carrying `labels` (e.g. {{"role", "prefill"}, {"tp_rank", "0"}}).
PDLIB_EXPORT std::string RenderPrometheus(const KVManagerMetrics& m,
                                          const std::map<std::string, std::string>& labels = {});

// One per engine rank. Create it after the engine has allocated its KV pools.
class PDLIB_EXPORT KVManager {
 public:
  // Validates `options`, creates the named backend, registers every buffer of options.args
  // and starts the manager's background threads.
  static StatusOr<std::unique_ptr<KVManager>> Create(const KVManagerOptions& options);

  virtual ~KVManager() = default;

  virtual Mode mode() const = 0;
  // Prefill: "host:port" of this rank's control endpoint.
  virtual std::string endpoint() const = 0;

  // Prefill only. Fails with kAlreadyExists when `room` is live on this manager.
  virtual StatusOr<std::unique_ptr<KVSender>> CreateSender(uint64_t room) = 0;
  // Decode only. `prefill_dp_rank` overrides the default room % prefill_dp_size (SPEC R5.7).
  virtual StatusOr<std::unique_ptr<KVReceiver>> CreateReceiver(
      const BootstrapAddress& bootstrap, uint64_t room,
      std::optional<int32_t> prefill_dp_rank = std::nullopt) = 0;

  virtual KVManagerMetrics metrics() const = 0;
};

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_KV_MANAGER_H_
