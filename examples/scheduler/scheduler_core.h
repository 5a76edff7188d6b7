// SchedulerCore: what the prefill and decode schedulers share, so that each side holds only its
// policy (prefill: chunking and Send; decode: pre-allocation, receiving, decode steps).
//
//  - The loop: Step() polls every live handle the side names (AppendPolledHandles), in its queue
//    order, and the quarantine through one PollAndAllReduce every `polling_interval` steps, so
//    every TP rank that runs the same scheduler on the same requests makes the same decisions;
//    then hands the polls to the side (OnPolls) and lets it schedule (Schedule). A broken pool
//    invariant seen during the step (Check) is what Step() returns.
//  - Page accounting: the request slots (with their page tables), KV pages, metadata slots and
//    state slots a request holds (RequestMemory), allocated and freed here.
//  - The request lifecycle: which rooms are live, rejection, Finish (abort a live handle, count
//    by stage, hand the FinishedRequest out, free the memory or quarantine it), metrics.
//  - Page reuse (page_reuse.h): a failed request's memory stays quarantined, its handle kept,
//    until the handle's PagesReusable() on every TP rank; the check rides on the step's
//    PollAndAllReduce, and on a single rank it is also made on the steps that do not poll.
//
// Not thread-safe: the host's scheduler thread calls every method. Destroying the core frees the
// quarantined memory at once (shutdown); the side frees what its queues hold in its destructor.
#ifndef PDLIB_EXAMPLES_SCHEDULER_SCHEDULER_CORE_H_
#define PDLIB_EXAMPLES_SCHEDULER_SCHEDULER_CORE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "examples/scheduler/engine.h"
#include "examples/scheduler/metrics.h"
#include "examples/scheduler/pools.h"
#include "pdlib/metadata_buffers.h"
#include "pdlib/poll_reduce.h"

namespace pdlib::sched {

// Where a failed request was: counted as bootstrap_failed_reqs or transfer_failed_reqs.
enum class FailStage { kBootstrap, kTransfer };

// The pool memory one request holds while it lives, and while it is quarantined.
struct RequestMemory {
  int32_t req_slot = -1;             // request slot, holding the page table
  std::optional<uint32_t> aux_slot;  // metadata slot
  int32_t state_slot = -1;           // recurrent-state slot (hybrid models)

  bool holds_any() const { return req_slot >= 0 || aux_slot.has_value() || state_slot >= 0; }
};

struct SchedulerCoreOptions {
  std::string name{};  // "prefill scheduler": prefixes host-level errors
  // Why a quarantined room cannot come back, for the AddRequest error ("pdlib may still read
  // them").
  std::string quarantine_why{};
  int32_t polling_interval = 1;  // poll every this many steps (>= 1)
  int32_t num_state_slots = 0;
  uint64_t kv_bytes_per_page = 0;
  // Sliding-window models: positions a sliding-window layer attends to (0: none). The state
  // pdlib moves is then the request's window pages (StateIndices), not a state slot.
  int32_t sliding_window = 0;
  // NSA-style models (StateType::kNsa): the state is one item per KV page of the prompt (the
  // indexer's keys), so StateIndices are the prompt's page-table entries.
  bool whole_sequence_state = false;
  // Bytes of one page over every page-indexed state buffer (sliding-window pools, index pools),
  // for kv_bytes of the state pages.
  uint64_t page_state_bytes_per_page = 0;
  ProcessGroup* group = nullptr;      // TP group; null for a single rank
  std::function<int64_t()> now_us{};  // null: std::chrono::steady_clock
};

// The indices into a request's page table, [first, end), of the pages a sliding-window layer of
// `window` positions still reads when the request's next token is at position `num_tokens`:
// those holding positions [max(0, num_tokens - window + 1), num_tokens). Empty without a window
// (window < 1), tokens, or for a window of 1. The same function as the example model's
// ModelConfig::SlidingWindowPages, which both sides must agree on.
struct PageRange {
  int32_t first = 0;
  int32_t end = 0;
};
PageRange SlidingWindowPages(int64_t num_tokens, int32_t window, int32_t page_size);

// Walks `queue` beside its polls (queue[k] was polled as polls[k]). `visit(r, poll)` may move r
// on (to another queue, or to Finish); whatever it leaves in place stays, in order, and so do
// requests beyond the polls.
template <typename Req, typename Visit>
void SweepQueue(std::deque<std::unique_ptr<Req>>& queue, std::span<const KVPoll> polls,
                Visit visit) {
  std::deque<std::unique_ptr<Req>> kept;
  for (size_t k = 0; k < queue.size(); ++k) {
    if (k < polls.size()) visit(queue[k], polls[k]);
    if (queue[k] != nullptr) kept.push_back(std::move(queue[k]));
  }
  queue.swap(kept);
}

class SchedulerCore {
 public:
  virtual ~SchedulerCore();
  SchedulerCore(const SchedulerCore&) = delete;
  SchedulerCore& operator=(const SchedulerCore&) = delete;

  // One loop iteration: poll (every polling_interval steps), OnPolls, Schedule. Request failures
  // become FinishedRequests; only a failed collective or a broken invariant is returned.
  Status Step();
  std::vector<FinishedRequest> TakeFinished();
  // Failed requests whose memory waits for PagesReusable().
  size_t quarantined_size() const { return quarantined_.size(); }

 protected:
  // `req_slots` is the side's request-slot pool; `aux_slots` the number of metadata slots.
  SchedulerCore(SchedulerCoreOptions options, PageAllocator* pages, ModelRunner* model,
                std::unique_ptr<ReqToTokenPool> req_slots, size_t aux_slots);

  // The side's part of the loop. AppendPolledHandles names the handles to poll, in the order
  // OnPolls gets their polls back (already agreed across the group).
  virtual void AppendPolledHandles(std::vector<const KVPollable*>* handles) const = 0;
  virtual void OnPolls(std::span<const KVPoll> polls) = 0;
  virtual void Schedule() = 0;

  // Admission: a room already live or still quarantined is refused (kAlreadyExists). Reject
  // counts a refusal and returns `why`; Admit counts the request and marks its room live.
  Status CheckRoomFree(uint64_t room) const;
  // With vocab_size > 0: kInvalidArgument naming the first prompt token outside
  // [0, vocab_size). Checked at admission so that one bad prompt fails alone, not the forward
  // batch it would have joined.
  static Status CheckPromptTokens(const Request& request, int32_t vocab_size);
  // kInvalidArgument, prefixed with `who`, when more than one kind of state is configured (state
  // slots, a sliding window, whole-sequence state): a request moves one kind.
  static Status CheckOneStateKind(const char* who, int32_t num_state_slots, int32_t sliding_window,
                                  bool whole_sequence_state);
  Status Reject(Status why);
  void Admit(uint64_t room);

  // The reason a handle that polled kFailed (on some rank) failed.
  Status FailureOf(const KVPollable& handle) const;
  // A pdlib call on this rank's handle failed (KVSender::Init or Send, KVReceiver::Init).
  // Finishing the request here alone would leave this rank's queues, and so its polls and its
  // forward batches, different from the other TP ranks' (whose calls succeeded) and break the
  // collectives of the next step. Instead the handle is aborted with the reason and the request
  // stays queued: the next poll reports it Failed on every rank in the same step, with this
  // reason on this rank.
  template <typename Handle>
  static void FailEverywhere(Handle& handle, const Status& why) {
    handle.Abort(why.message());
  }

  // A request slot, the pages for `kv_tokens` tokens and (with state slots) a state slot; false,
  // with nothing taken, when one of them is short.
  // `borrowed`: pages the request's table starts with that it does not own (a decode prefix from
  // the prefix cache); only the pages after them are allocated. Release() frees every page of
  // the table: drop borrowed pages from it first.
  bool Allocate(RequestMemory& mem, uint64_t room, int64_t kv_tokens,
                std::span<const int32_t> borrowed = {});
  bool AllocAux(RequestMemory& mem);
  size_t aux_available() const { return aux_slots_.available(); }
  void FreeAux(RequestMemory& mem);
  // Gives every page and slot `mem` holds back to the pools.
  void Release(RequestMemory& mem, uint64_t room);
  std::vector<int32_t>& page_table(const RequestMemory& mem) {
    return req_slots_->page_table(mem.req_slot);
  }
  const std::vector<int32_t>& page_table(const RequestMemory& mem) const {
    return req_slots_->page_table(mem.req_slot);
  }

  // The state indices pdlib moves for a request holding `num_tokens` tokens (prefill: with the
  // last chunk; decode: KVReceiver::Init): its window pages' page-table entries with a sliding
  // window, its state slot with state slots, none otherwise.
  std::vector<int32_t> StateIndices(const RequestMemory& mem, int64_t num_tokens) const;

  // One forward pass, counted; an error when the model returns the wrong number of results.
  Status Forward(std::span<const ForwardChunk> chunks, std::vector<ForwardOutput>* results,
                 const std::function<void(int32_t)>& kv_layers_done = {});
  void CountTransferredPages(uint64_t pages);
  void CountTransferLatency(int64_t start_us, int64_t end_us);

  // Ends a request: aborts its handle when `f.status` is an error and the handle is still live
  // (so the peer learns why), counts it, hands `f` to TakeFinished and frees `mem`, or
  // quarantines it with the handle when pdlib may still touch it. `transferred`: Success on
  // every TP rank, so pdlib touches none of it again.
  template <typename Handle>
  void FinishRequest(FinishedRequest f, FailStage stage, std::unique_ptr<Handle> handle,
                     RequestMemory& mem, bool transferred) {
    if (!f.status.ok() && !IsTerminal(handle->Poll())) handle->Abort(f.status.ToString());
    Retire(std::move(f), stage, std::move(handle), mem, transferred);
  }

  // Records a broken invariant; the step returns the first one.
  void Check(Status s);
  int64_t Now() const;
  // The counters, plus the memory and quarantine gauges; the side adds its queue sizes.
  SchedulerMetrics CoreMetrics() const;
  SchedulerMetrics& counters() { return counters_; }
  int32_t page_size() const { return page_size_; }
  const SchedulerCoreOptions& core_options() const { return core_options_; }

 private:
  struct Quarantined {
    uint64_t room = 0;
    std::unique_ptr<KVPollable> handle;
    RequestMemory mem;
  };

  void Retire(FinishedRequest f, FailStage stage, std::unique_ptr<KVPollable> handle,
              RequestMemory& mem, bool transferred);
  Status Poll();
  // Frees the memory of quarantined_[k] for every k < reusable.size() with reusable[k] ==
  // kSuccess (ReusablePoll's answer, reduced over the group).
  void ReleaseQuarantined(std::span<const KVPoll> reusable);

  SchedulerCoreOptions core_options_;
  PageAllocator* pages_;
  ModelRunner* model_;
  int32_t page_size_;
  std::unique_ptr<ReqToTokenPool> req_slots_;
  MetadataSlotAllocator aux_slots_;
  IndexAllocator state_slots_;
  std::vector<Quarantined> quarantined_;  // finished; memory held, oldest first
  std::set<uint64_t> live_rooms_;
  std::vector<FinishedRequest> finished_;
  SchedulerMetrics counters_;
  Status internal_error_;
  uint64_t steps_ = 0;
};

}  // namespace pdlib::sched

#endif  // PDLIB_EXAMPLES_SCHEDULER_SCHEDULER_CORE_H_
