// DecodeScheduler: the decode side's event loop (SPEC R9.2, R9.3), as SGLang's disaggregated
// decode runs it, over pdlib receivers.
//
//   AddRequest -> prealloc queue: a KVReceiver per request; once it is connected
//                 (WaitingForInput) and the allocatable-token formula allows, pages, a request
//                 slot, a metadata slot (and a state slot) are pre-allocated and handed to
//                 KVReceiver::Init
//              -> transfer queue: polled until the KV and the metadata slot arrived; the slot's
//                 bootstrap_room is checked and the first token read
//              -> waiting queue:  a prebuilt batch, no prefill forward: the request joins the
//                 running batch with its received KV and first token
//              -> running batch:  continuous batching, one token per request per step
//
// Under memory pressure a running request is retracted: its KV goes to host memory
// (ModelRunner::OffloadKV) and its pages are freed. Retracted requests are resumed before any new
// request is pre-allocated, and join the running batch ahead of newly transferred ones.
//
// Host loop: as for PrefillScheduler (prefill_scheduler.h): AddRequest, Step, TakeFinished.
// The prealloc and transfer queues are polled every `polling_interval` steps (one
// PollAndAllReduce over both), to spare the collective when decode steps are short.
//
// Page reuse (page_reuse.h): a request that fails before its KV arrived finishes at once, but its
// pages, request slot, metadata slot and state slot stay quarantined, its receiver kept, until
// the receiver's PagesReusable() (on every TP rank: the check rides on the poll's
// PollAndAllReduce; on a single rank it is also made on the steps in between). Retraction only
// touches requests whose transfer succeeded, so it frees at once.
//
// Owned by the host; every dependency must outlive it. Not thread-safe: one thread calls every
// method. The destructor destroys every receiver and gives every page and slot back to the
// pools at once, quarantined ones included: it is for shutdown, with the KVManager going next. A
// host that keeps the manager and pools for another scheduler waits for quarantined_size() 0.
#ifndef PDLIB_EXAMPLES_SCHEDULER_DECODE_SCHEDULER_H_
#define PDLIB_EXAMPLES_SCHEDULER_DECODE_SCHEDULER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "examples/scheduler/decode_memory.h"
#include "examples/scheduler/engine.h"
#include "examples/scheduler/metrics.h"
#include "examples/scheduler/pools.h"
#include "examples/scheduler/prefix_cache.h"
#include "examples/scheduler/scheduler_core.h"
#include "pdlib/metadata_buffers.h"
#include "pdlib/poll_reduce.h"

namespace pdlib::sched {

struct DecodeSchedulerOptions {
  // Requests in the running batch at most.
  int32_t max_running_requests = 16;
  // Request slots beyond max_running_requests for requests being pre-allocated, transferred or
  // waiting (DecodeReqToTokenPool).
  int32_t pre_alloc_size = 16;
  // Longest prompt + max_new_tokens accepted.
  int32_t max_context_len = 4096;
  // Tokens kept free per admitted request for its coming decode steps (SGLang's
  // num_reserved_decode_tokens).
  int32_t reserved_decode_tokens = 64;
  // max_new_tokens is clipped to this in the worst-case estimate (CLIP_MAX_NEW_TOKENS).
  int32_t clip_max_new_tokens = 4096;
  // Poll the prealloc and transfer queues every this many steps (>= 1).
  int32_t polling_interval = 1;
  // Hybrid models: recurrent-state slots; 0 without state.
  int32_t num_state_slots = 0;
  // Sliding-window models (StateType::kSwa): the window in positions; KVReceiver::Init then gets
  // as state indices the request's page-table entries SlidingWindowPages(prompt length)
  // (scheduler_core.h), what prefill sends. 0: none. Not with num_state_slots.
  int32_t sliding_window = 0;
  // NSA-style models (StateType::kNsa): the state indices are the request's page-table entries
  // of its prompt, one per page (the indexer's keys). Not with num_state_slots or sliding_window.
  bool whole_sequence_state = false;
  // Decode prefix reuse (prefix_cache.h): finished requests' full KV pages stay cached, up to this
  // many pages, and a new request whose prompt starts with cached pages borrows them and hands
  // prefill only the rest (KVReceiver::Init with decode_prefix_len). 0: off. Only for models
  // without per-request state (num_state_slots, sliding_window, whole_sequence_state all off).
  int32_t prefix_cache_pages = 0;
  // When > 0, a prompt token outside [0, vocab_size) is refused at AddRequest, and a first
  // token from prefill outside it fails the request.
  int32_t vocab_size = 0;
  // Generation stops after this token; -1 for none.
  int32_t eos_token_id = -1;
  // Bytes of one page over every KV buffer, for transferred_bytes.
  uint64_t kv_bytes_per_page = 0;
  // Bytes of one page over every page-indexed state buffer (sliding-window or index pools), for
  // kv_bytes of the state pages received.
  uint64_t page_state_bytes_per_page = 0;
  ProcessGroup* group = nullptr;    // TP group; null for a single rank
  std::function<int64_t()> now_us;  // latency clock; null means std::chrono::steady_clock
  // Called from Step() for every token as it is produced (index 0: the first token, when it
  // arrives with the KV), so a host can stream them; null: tokens only come with TakeFinished.
  std::function<void(uint64_t room, int32_t index, int32_t token)> on_token;
  // Called from Step() when a request's KV (and state) has arrived, before its first decode
  // step, with its page table (the first `num_tokens` tokens' pages hold the received KV).
  // Hosts may inspect the pages; the example hosts' test-only fault corrupts them. May be null.
  std::function<void(uint64_t room, std::span<const int32_t> page_table, int64_t num_tokens)>
      on_kv_arrived;
};

struct DecodeDeps {
  PageAllocator* pages = nullptr;
  MetadataBuffers* metadata = nullptr;  // registered with pdlib as KVArgs::aux
  ReceiverFactory* receivers = nullptr;
  ModelRunner* model = nullptr;
};

// The request lifecycle, polling, page accounting and metrics live in SchedulerCore
// (scheduler_core.h); this class is the decode policy: pre-allocation, receiving, prebuilt batch,
// decode steps and retraction.
class DecodeScheduler final : public SchedulerCore {
 public:
  static StatusOr<std::unique_ptr<DecodeScheduler>> Create(const DecodeSchedulerOptions& options,
                                                           const DecodeDeps& deps);
  ~DecodeScheduler() override;

  // Validates the request and creates its receiver. Refused, with the numbers: an empty prompt,
  // max_new_tokens < 1, prompt + max_new_tokens beyond max_context_len or the whole KV cache,
  // a room already live or still quarantined.
  Status AddRequest(const Request& request);
  // Step() (SchedulerCore) is one loop iteration: (every polling_interval steps) poll; resume
  // retracted requests, pre-allocate, collect finished transfers; merge the waiting queue into
  // the running batch; run one decode step (retracting first if pages are short).
  // TakeFinished() and quarantined_size() come from there too.
  //
  // Fails every live request with `why` (its receiver is aborted with that reason, so prefill
  // learns it) and frees its pages and slots, or quarantines them like any failed request's;
  // TakeFinished returns them. For a host that shuts down or gives up; `why` must not be OK.
  void FailAll(const Status& why);

  // The allocatable-token formula on the current queues (SPEC R9.3), retracted needs included.
  int64_t AllocatableTokens() const;

  SchedulerMetrics metrics() const;
  // The prefix cache (null when prefix_cache_pages is 0).
  const PrefixCache* prefix_cache() const { return prefix_cache_.get(); }
  // No live request (quarantined ones are finished: they only hold memory).
  bool idle() const;
  size_t prealloc_queue_size() const { return prealloc_.size(); }
  size_t transfer_queue_size() const { return transfer_.size(); }
  size_t waiting_queue_size() const { return waiting_.size(); }
  size_t running_size() const { return running_.size(); }
  size_t retracted_queue_size() const { return retracted_.size(); }
  // Rooms in the running batch / retracted queue, in order (tests and debugging).
  std::vector<uint64_t> running_rooms() const;
  std::vector<uint64_t> retracted_rooms() const;
  std::vector<uint64_t> waiting_rooms() const;

 private:
  struct Req;

  DecodeScheduler(const DecodeSchedulerOptions& options, const DecodeDeps& deps);
  void AppendPolledHandles(std::vector<const KVPollable*>* handles) const override;
  void OnPolls(std::span<const KVPoll> polls) override;
  void Schedule() override;
  void ResumeRetracted();
  void PreallocNew();
  Status CommitTransfer(Req& r);
  void MergeWaiting();
  void RunDecodeBatch();
  bool Retract(size_t index);
  bool Done(const Req& r) const;
  AllocatableTokensInput FormulaInput(bool count_retracted) const;
  void Finish(std::unique_ptr<Req> r, Status status, FailStage stage);
  // Gives the request's borrowed prefix pages back to the cache and drops them from its page
  // table, which then holds only pages the request owns (what Release frees).
  void DropPrefix(Req& r);
  // Hands pages the cache let go of back to the page allocator.
  void FreeCached(const std::vector<int32_t>& pages);

  DecodeSchedulerOptions options_;
  DecodeDeps deps_;
  std::deque<std::unique_ptr<Req>> prealloc_, transfer_, waiting_, retracted_;
  std::vector<std::unique_ptr<Req>> running_;
  std::unique_ptr<PrefixCache> prefix_cache_;
};

}  // namespace pdlib::sched

#endif  // PDLIB_EXAMPLES_SCHEDULER_DECODE_SCHEDULER_H_
