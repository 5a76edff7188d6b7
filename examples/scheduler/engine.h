// What a scheduler needs from its host, behind small interfaces so that tests inject fakes and
// hosts write thin adapters:
//
//  - ModelRunner: forward passes over the paged KV cache (kernels_runner.h adapts
//    pdlib::kernels::Model), and, for decode retraction, copying a request's KV to host memory
//    and back.
//  - SenderFactory / ReceiverFactory: one pdlib KVSender (prefill) or KVReceiver (decode) per
//    request; KVManagerTransport adapts a pdlib::KVManager.
//
// Also the request a scheduler takes and the result it returns.
#ifndef PDLIB_EXAMPLES_SCHEDULER_ENGINE_H_
#define PDLIB_EXAMPLES_SCHEDULER_ENGINE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "pdlib/kv_manager.h"
#include "pdlib/status.h"

namespace pdlib::sched {

// One generation request as the router sends it to both sides (SPEC R1.1).
struct Request {
  uint64_t room = 0;                       // bootstrap_room: unique per request
  std::vector<int32_t> prompt;             // token ids
  int32_t max_new_tokens = 16;             // prefill generates only the first token
  BootstrapAddress bootstrap;              // decode: where the request's prefill deployment is
  std::optional<int32_t> prefill_dp_rank;  // decode: default room % prefill DP size
};

// A request the scheduler is done with.
struct FinishedRequest {
  uint64_t room = 0;
  Status status;                    // OK, or why the request failed
  std::vector<int32_t> output_ids;  // prefill: the first token; decode: every generated token
  // When things happened, on the scheduler's clock (options.now_us); 0 when the request never
  // got there. Hosts turn them into per-request latencies.
  int64_t first_token_us = 0;     // prefill: the last chunk's forward ended; decode: the first
                                  // token arrived with the KV
  int64_t transfer_start_us = 0;  // prefill: the first chunk was sent; decode: KVReceiver::Init
  int64_t transfer_end_us = 0;    // the transfer ended with Success (decode: the KV arrived)
  // KV bytes of the pages this rank sent (prefill) or received (decode): pages x
  // kv_bytes_per_page. A TP or PP prefill rank counts only its own share.
  uint64_t kv_bytes = 0;
};

// One request's share of a forward pass: tokens at positions [start_pos, start_pos + n),
// attending to the first start_pos tokens already in its pages.
struct ForwardChunk {
  uint64_t room = 0;
  std::span<const int32_t> tokens;
  int32_t start_pos = 0;
  std::span<const int32_t> page_table;
  int32_t state_slot = -1;  // hybrid models; -1 without recurrent state
};

// The greedy token after a chunk's last token.
struct ForwardOutput {
  int32_t token = -1;
  float logprob = 0;
  std::vector<int32_t> top_ids;  // best first; at most 128 are carried to decode
  std::vector<float> top_logprobs;
};

// A request's KV (and state) copied to host memory by a retraction. Opaque to the scheduler.
struct HostKV {
  int64_t num_tokens = 0;
  std::vector<std::byte> bytes;
};

// Not thread-safe: the scheduler thread calls it.
class ModelRunner {
 public:
  virtual ~ModelRunner() = default;
  // One result per chunk, in order. On error the scheduler fails every request of the batch.
  virtual Status Forward(std::span<const ForwardChunk> batch,
                         std::vector<ForwardOutput>* results) = 0;
  // Forward that reports, as it runs, how many of this rank's KV layers (pdlib's, KVArgs::kv
  // order) hold every chunk's K/V (layer-wise streaming): `kv_layers_done` is called with a
  // growing count, at most once per layer; every call returns before this does (a GPU runner
  // may call it from a host-callback thread). The default reports nothing: the scheduler then
  // sends each chunk after its forward, as without streaming.
  virtual Status ForwardStreaming(std::span<const ForwardChunk> batch,
                                  const std::function<void(int32_t)>& kv_layers_done,
                                  std::vector<ForwardOutput>* results) {
    (void)kv_layers_done;
    return Forward(batch, results);
  }
  // Copies the KV of the first `num_tokens` tokens in `page_table` (and the state slot) to host
  // memory. The default refuses, and the decode scheduler then cannot retract.
  virtual StatusOr<HostKV> OffloadKV(std::span<const int32_t> page_table, int64_t num_tokens,
                                     int32_t state_slot) {
    return Status::Unimplemented("this model runner cannot offload KV to host memory");
  }
  // Writes `kv` back into (new) pages and state slot.
  virtual Status RestoreKV(const HostKV& kv, std::span<const int32_t> page_table,
                           int32_t state_slot) {
    return Status::Unimplemented("this model runner cannot restore KV from host memory");
  }
};

class SenderFactory {
 public:
  virtual ~SenderFactory() = default;
  virtual StatusOr<std::unique_ptr<KVSender>> CreateSender(uint64_t room) = 0;
};

class ReceiverFactory {
 public:
  virtual ~ReceiverFactory() = default;
  virtual StatusOr<std::unique_ptr<KVReceiver>> CreateReceiver(
      const BootstrapAddress& bootstrap, uint64_t room, std::optional<int32_t> prefill_dp_rank) = 0;
};

// Both factories over one pdlib KVManager (which must outlive this object).
class KVManagerTransport final : public SenderFactory, public ReceiverFactory {
 public:
  explicit KVManagerTransport(KVManager* manager) : manager_(manager) {}
  StatusOr<std::unique_ptr<KVSender>> CreateSender(uint64_t room) override {
    return manager_->CreateSender(room);
  }
  StatusOr<std::unique_ptr<KVReceiver>> CreateReceiver(
      const BootstrapAddress& bootstrap, uint64_t room,
      std::optional<int32_t> prefill_dp_rank) override {
    return manager_->CreateReceiver(bootstrap, room, prefill_dp_rank);
  }

 private:
  KVManager* manager_;
};

}  // namespace pdlib::sched

#endif  // PDLIB_EXAMPLES_SCHEDULER_ENGINE_H_
