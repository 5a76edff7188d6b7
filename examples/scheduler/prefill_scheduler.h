// PrefillScheduler: the prefill side's event loop (SPEC R9.1), as SGLang's disaggregated prefill
// runs it, over pdlib senders.
//
//   AddRequest -> bootstrap queue: a KVSender per request; waits for decode's TransferInfo
//                                  (in pull it does not: see PrefillSchedulerOptions::direction)
//              -> waiting queue:   a metadata slot; prefilled in chunks under a token budget
//                                  (chunked prefill), forward with max_new_tokens = 1
//              -> inflight queue:  KV sent chunk by chunk (whole pages until the last chunk),
//                                  then the first token in the metadata slot; polled until the
//                                  transfer ends, then pages and slots are freed
//
// A host loop:
//
//   auto sched = PrefillScheduler::Create(options, {&pages, metadata, &transport, &runner});
//   while (serving) {
//     for (Request& r : NewRequestsFromRouter()) Report(r.room, sched->AddRequest(r));
//     if (Status s = sched->Step(); !s.ok()) Die(s);   // only host-level faults end up here
//     for (FinishedRequest& f : sched->TakeFinished()) Reply(f);
//   }
//
// Step() polls every sender once through one PollAndAllReduce, so every TP rank that runs the
// same scheduler on the same requests makes the same decisions. Pages are allocated for the whole
// prompt when its first chunk is scheduled, so a started request never waits for memory.
//
// Page reuse (page_reuse.h): a failed request finishes at once, but its source pages, metadata
// slot and state slot stay quarantined, its sender kept, until the sender's PagesReusable() (pdlib
// reads none of them any more) on every TP rank; the check rides on the step's PollAndAllReduce.
//
// Owned by the host; every dependency must outlive it. Not thread-safe: one thread (the host's
// scheduler loop) calls every method. The destructor destroys every sender and gives every page
// and slot back to the pools at once, quarantined ones included: it is for shutdown, with the
// KVManager going next. A host that keeps the manager and pools for another scheduler waits for
// quarantined_size() 0.
#ifndef PDLIB_EXAMPLES_SCHEDULER_PREFILL_SCHEDULER_H_
#define PDLIB_EXAMPLES_SCHEDULER_PREFILL_SCHEDULER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "examples/scheduler/engine.h"
#include "examples/scheduler/metrics.h"
#include "examples/scheduler/pools.h"
#include "examples/scheduler/scheduler_core.h"
#include "pdlib/metadata_buffers.h"
#include "pdlib/poll_reduce.h"

namespace pdlib::sched {

struct PrefillSchedulerOptions {
  // Request slots: requests holding pages (being prefilled or in flight).
  int32_t max_running_requests = 16;
  // Token budget of one forward pass; longer prompts are prefilled in chunks.
  int32_t chunked_prefill_size = 512;
  // Longest prompt accepted.
  int32_t max_context_len = 4096;
  // When > 0, a prompt token outside [0, vocab_size) is refused at AddRequest.
  int32_t vocab_size = 0;
  // Hybrid models: recurrent-state slots (one per request holding pages); 0 without state.
  int32_t num_state_slots = 0;
  // Sliding-window models (StateType::kSwa): the window in positions; the last chunk then sends
  // as state indices the request's page-table entries SlidingWindowPages(prompt length)
  // (scheduler_core.h). 0: none. Not with num_state_slots.
  int32_t sliding_window = 0;
  // NSA-style models (StateType::kNsa): the state indices are the request's page-table entries
  // of its prompt, one per page (the indexer's keys). Not with num_state_slots or sliding_window.
  bool whole_sequence_state = false;
  // Bytes of one page over every KV buffer (all layers, K and V), for transferred_bytes.
  uint64_t kv_bytes_per_page = 0;
  // Bytes of one page over every page-indexed state buffer (sliding-window or index pools), for
  // kv_bytes of the state pages sent.
  uint64_t page_state_bytes_per_page = 0;
  // Layer-wise streaming: each chunk's KV layers are announced to pdlib as the model finishes
  // them (ModelRunner::ForwardStreaming -> KVSender::SendLayers), so the transfer runs during
  // the forward and only the last layers, aux and state remain after it. Off: Send() after the
  // forward. Either way decode gets the same bytes.
  bool layerwise = false;
  // Which way pdlib moves the KV (KVManagerOptions::direction of the senders' manager). kPush:
  // a request waits in the bootstrap queue for decode's TransferInfo, learns decode's prefix
  // there and sends only the pages after it. kPull: decode reads, so a request is admitted at
  // once (Send() publishes its pages whether or not decode has come: prefill never waits for
  // decode memory) and every page of the prompt is sent, decode reading only those after its
  // prefix (KVSender::PagesAfterPrefix in pull). The transfer ends when every decode rank has
  // read them (Success, PagesReusable).
  TransferDirection direction = TransferDirection::kPush;
  // The TP group whose ranks must agree on every request's state; null for a single rank.
  ProcessGroup* group = nullptr;
  // Microsecond clock for latency metrics; null means std::chrono::steady_clock.
  std::function<int64_t()> now_us;
};

struct PrefillDeps {
  PageAllocator* pages = nullptr;       // the model's KV pages
  MetadataBuffers* metadata = nullptr;  // registered with pdlib as KVArgs::aux
  SenderFactory* senders = nullptr;
  ModelRunner* model = nullptr;
};

// The request lifecycle, polling, page accounting and metrics live in SchedulerCore
// (scheduler_core.h); this class is the prefill policy: bootstrap, chunked prefill, Send.
class PrefillScheduler final : public SchedulerCore {
 public:
  // kInvalidArgument for a missing dependency or an option out of range (named).
  static StatusOr<std::unique_ptr<PrefillScheduler>> Create(const PrefillSchedulerOptions& options,
                                                            const PrefillDeps& deps);
  ~PrefillScheduler() override;

  // Validates the request and creates its sender. Refused, with the numbers: an empty prompt,
  // one longer than max_context_len or than the whole KV cache, a room already live or still
  // quarantined.
  Status AddRequest(const Request& request);
  // Step() (SchedulerCore) is one loop iteration: poll, admit bootstrapped requests, run one
  // (chunked) prefill batch, send its KV, release finished transfers. TakeFinished() and
  // quarantined_size() come from there too.
  //
  // Fails every live request with `why` (its sender is aborted with that reason, so decode
  // learns it) and frees its pages and slots, or quarantines them like any failed request's;
  // TakeFinished returns them. For a host that shuts down or gives up; `why` must not be OK.
  void FailAll(const Status& why);

  SchedulerMetrics metrics() const;
  // No live request (quarantined ones are finished: they only hold memory).
  bool idle() const { return bootstrap_.empty() && waiting_.empty() && inflight_.empty(); }
  size_t bootstrap_queue_size() const { return bootstrap_.size(); }
  size_t waiting_queue_size() const { return waiting_.size(); }
  size_t inflight_queue_size() const { return inflight_.size(); }

 private:
  struct Req;

  PrefillScheduler(const PrefillSchedulerOptions& options, const PrefillDeps& deps);
  void AppendPolledHandles(std::vector<const KVPollable*>* handles) const override;
  void OnPolls(std::span<const KVPoll> polls) override;
  void Schedule() override { RunPrefillBatch(); }
  void ProcessInflight(std::span<const KVPoll> polls);
  void ProcessWaiting(std::span<const KVPoll> polls);
  void ProcessBootstrap(std::span<const KVPoll> polls);
  void RunPrefillBatch();
  Status SendChunk(Req& r, const ForwardOutput* last);
  // The page-table entries a chunk that ends with `filled` tokens prefilled sends (SPEC R5.2:
  // whole pages unless it is the last).
  std::span<const int32_t> ChunkPages(const Req& r, int32_t filled, bool last) const;
  // Notes when in-flight transfers reached Success (for the exposed transfer time), between
  // polls too: from inside a forward pass. Decides nothing.
  void NoteSuccesses();
  void WriteMetadata(uint32_t slot, uint64_t room, const ForwardOutput& out);
  void Finish(std::unique_ptr<Req> r, Status status, FailStage stage);

  PrefillSchedulerOptions options_;
  PrefillDeps deps_;
  std::deque<std::unique_ptr<Req>> bootstrap_, waiting_, inflight_;
};

}  // namespace pdlib::sched

#endif  // PDLIB_EXAMPLES_SCHEDULER_PREFILL_SCHEDULER_H_
