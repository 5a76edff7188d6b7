#include "examples/scheduler/scheduler_core.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_format.h"
#include "examples/scheduler/page_reuse.h"
#include "pdlib/page_index.h"

namespace pdlib::sched {

PageRange SlidingWindowPages(int64_t num_tokens, int32_t window, int32_t page_size) {
  if (window < 1 || num_tokens < 1 || page_size < 1) return {};
  const int64_t first_pos = std::max<int64_t>(0, num_tokens - window + 1);
  if (first_pos >= num_tokens) return {};  // a window of 1: the next token reads only itself
  return {static_cast<int32_t>(first_pos / page_size),
          static_cast<int32_t>((num_tokens - 1) / page_size + 1)};
}

SchedulerCore::SchedulerCore(SchedulerCoreOptions options, PageAllocator* pages, ModelRunner* model,
                             std::unique_ptr<ReqToTokenPool> req_slots, size_t aux_slots)
    : core_options_(std::move(options)),
      pages_(pages),
      model_(model),
      page_size_(pages->page_size()),
      req_slots_(std::move(req_slots)),
      aux_slots_(aux_slots),
      state_slots_(core_options_.num_state_slots, "state slot") {}

SchedulerCore::~SchedulerCore() {
  // Shutdown: nothing waits for PagesReusable() (the KVManager goes next).
  for (Quarantined& q : quarantined_) Release(q.mem, q.room);
}

Status SchedulerCore::Step() {
  if (steps_++ % static_cast<uint64_t>(core_options_.polling_interval) == 0) {
    if (Status s = Poll(); !s.ok()) return s;
  } else if (core_options_.group == nullptr && !quarantined_.empty()) {
    // One rank agrees with itself: the quarantine is checked on every step, not only on polls.
    std::vector<KVPoll> reusable;
    for (const Quarantined& q : quarantined_) {
      reusable.push_back(ReusablePoll(q.handle.get()).Poll());
    }
    ReleaseQuarantined(reusable);
  }
  Schedule();
  Status s = std::move(internal_error_);
  internal_error_ = Status::OK();
  return s;
}

Status SchedulerCore::Poll() {
  // One collective over the side's live handles, in its queue order, so that all TP ranks see
  // the same states (Failed on any rank wins), then whether each quarantined request's memory is
  // reusable (on every rank). Every rank holds the same requests, so every rank skips an empty
  // poll alike.
  std::vector<const KVPollable*> handles;
  AppendPolledHandles(&handles);
  const size_t live = handles.size();
  std::vector<ReusablePoll> reuse;
  reuse.reserve(quarantined_.size());
  for (const Quarantined& q : quarantined_) {
    handles.push_back(&reuse.emplace_back(q.handle.get()));
  }
  if (handles.empty()) return Status::OK();
  auto polls = PollAndAllReduce(handles, core_options_.group);
  if (!polls.ok()) return polls.status().WithPrefix(core_options_.name + ": PollAndAllReduce");
  std::span<const KVPoll> all(*polls);
  // First, so that this step can hand the memory out again; failures below join the back.
  ReleaseQuarantined(all.subspan(live));
  OnPolls(all.first(live));
  return Status::OK();
}

std::vector<FinishedRequest> SchedulerCore::TakeFinished() {
  std::vector<FinishedRequest> out;
  out.swap(finished_);
  return out;
}

Status SchedulerCore::CheckRoomFree(uint64_t room) const {
  if (live_rooms_.count(room) > 0) {
    return Status::AlreadyExists(absl::StrFormat("room %d is already live", room));
  }
  for (const Quarantined& q : quarantined_) {
    if (q.room == room) {
      return Status::AlreadyExists(
          absl::StrFormat("room %d: its failed request's pages are still quarantined (%s)", room,
                          core_options_.quarantine_why));
    }
  }
  return Status::OK();
}

Status SchedulerCore::Reject(Status why) {
  ++counters_.rejected_reqs;
  return why;
}

void SchedulerCore::Admit(uint64_t room) {
  live_rooms_.insert(room);
  ++counters_.requests_total;
}

Status SchedulerCore::CheckPromptTokens(const Request& request, int32_t vocab_size) {
  if (vocab_size <= 0) return Status::OK();
  for (size_t i = 0; i < request.prompt.size(); ++i) {
    const int32_t token = request.prompt[i];
    if (token < 0 || token >= vocab_size) {
      return Status::InvalidArgument(
          absl::StrFormat("room %d: prompt token %d at position %d is not in the model's "
                          "vocabulary [0, %d)",
                          request.room, token, i, vocab_size));
    }
  }
  return Status::OK();
}

Status SchedulerCore::CheckOneStateKind(const char* who, int32_t num_state_slots,
                                        int32_t sliding_window, bool whole_sequence_state) {
  if ((num_state_slots > 0) + (sliding_window > 0) + whole_sequence_state <= 1) {
    return Status::OK();
  }
  return Status::InvalidArgument(absl::StrFormat(
      "%s: num_state_slots %d, sliding_window %d and whole_sequence_state %d: a request moves one "
      "kind of state",
      who, num_state_slots, sliding_window, int{whole_sequence_state}));
}

Status SchedulerCore::FailureOf(const KVPollable& handle) const {
  Status why = handle.FailureReason();
  if (!why.ok()) return why;
  // Failed on another TP rank only: this rank's handle does not know why.
  return Status::Aborted(
      absl::StrFormat("room %d: the transfer failed on another TP rank", handle.room()));
}

bool SchedulerCore::Allocate(RequestMemory& mem, uint64_t room, int64_t kv_tokens,
                             std::span<const int32_t> borrowed) {
  const int32_t pages =
      std::max<int32_t>(0, static_cast<int32_t>(PageCount(static_cast<uint64_t>(kv_tokens),
                                                          static_cast<uint32_t>(page_size_))) -
                               static_cast<int32_t>(borrowed.size()));
  const bool with_state = core_options_.num_state_slots > 0;
  if (req_slots_->available() < 1 || pages_->free_pages() < pages ||
      (with_state && state_slots_.available() < 1)) {
    return false;
  }
  const int32_t slot = *req_slots_->Alloc();
  req_slots_->page_table(slot).assign(borrowed.begin(), borrowed.end());
  if (!pages_->Alloc(pages, room, &req_slots_->page_table(slot))) {
    req_slots_->page_table(slot).clear();
    Check(Status::Internal("page allocation failed with enough free pages"));
    Check(req_slots_->Free(slot));
    return false;
  }
  mem.req_slot = slot;
  if (with_state) mem.state_slot = *state_slots_.Alloc();
  return true;
}

bool SchedulerCore::AllocAux(RequestMemory& mem) {
  mem.aux_slot = aux_slots_.Alloc();
  return mem.aux_slot.has_value();
}

void SchedulerCore::FreeAux(RequestMemory& mem) {
  if (mem.aux_slot) Check(aux_slots_.Free(*mem.aux_slot));
  mem.aux_slot.reset();
}

void SchedulerCore::Release(RequestMemory& mem, uint64_t room) {
  if (mem.req_slot >= 0) {
    Check(pages_->Free(req_slots_->page_table(mem.req_slot), room));
    Check(req_slots_->Free(mem.req_slot));
    mem.req_slot = -1;
  }
  FreeAux(mem);
  if (mem.state_slot >= 0) Check(state_slots_.Free(mem.state_slot));
  mem.state_slot = -1;
}

std::vector<int32_t> SchedulerCore::StateIndices(const RequestMemory& mem,
                                                 int64_t num_tokens) const {
  if (core_options_.sliding_window > 0) {
    const PageRange range =
        SlidingWindowPages(num_tokens, core_options_.sliding_window, page_size_);
    const std::vector<int32_t>& table = page_table(mem);
    const int32_t end = std::min(range.end, static_cast<int32_t>(table.size()));
    if (range.first >= end) return {};
    return {table.begin() + range.first, table.begin() + end};
  }
  if (core_options_.whole_sequence_state) {
    const std::vector<int32_t>& table = page_table(mem);
    const auto pages =
        std::min<int64_t>(static_cast<int64_t>(table.size()),
                          static_cast<int64_t>(PageCount(static_cast<uint64_t>(num_tokens),
                                                         static_cast<uint32_t>(page_size_))));
    return {table.begin(), table.begin() + pages};
  }
  if (mem.state_slot >= 0) return {mem.state_slot};
  return {};
}

Status SchedulerCore::Forward(std::span<const ForwardChunk> chunks,
                              std::vector<ForwardOutput>* results,
                              const std::function<void(int32_t)>& kv_layers_done) {
  Status s = kv_layers_done ? model_->ForwardStreaming(chunks, kv_layers_done, results)
                            : model_->Forward(chunks, results);
  if (s.ok() && results->size() != chunks.size()) {
    s = Status::Internal(
        absl::StrFormat("model returned %d results for %d chunks", results->size(), chunks.size()));
  }
  ++counters_.forward_passes;
  if (s.ok()) {
    for (const ForwardChunk& c : chunks) counters_.forward_tokens += c.tokens.size();
  }
  return s;
}

void SchedulerCore::CountTransferredPages(uint64_t pages) {
  counters_.transferred_pages += pages;
  counters_.transferred_bytes += pages * core_options_.kv_bytes_per_page;
}

void SchedulerCore::CountTransferLatency(int64_t start_us, int64_t end_us) {
  counters_.transfer_latency_us_sum +=
      static_cast<uint64_t>(std::max<int64_t>(0, end_us - start_us));
  ++counters_.transfer_latency_count;
}

void SchedulerCore::Retire(FinishedRequest f, FailStage stage, std::unique_ptr<KVPollable> handle,
                           RequestMemory& mem, bool transferred) {
  const uint64_t room = f.room;
  if (f.status.ok()) {
    ++counters_.finished_reqs;
  } else if (stage == FailStage::kBootstrap) {
    ++counters_.bootstrap_failed_reqs;
  } else {
    ++counters_.transfer_failed_reqs;
  }
  live_rooms_.erase(room);
  finished_.push_back(std::move(f));
  // Without a group this rank's answer is the agreed one; with one, a failed request's memory
  // waits for the next poll, so that every rank frees it on the same step.
  const bool reusable = transferred || (core_options_.group == nullptr && handle->PagesReusable());
  if (mem.holds_any() && !reusable) {
    quarantined_.push_back({.room = room, .handle = std::move(handle), .mem = mem});
    mem = RequestMemory{};
    return;
  }
  Release(mem, room);
}

void SchedulerCore::ReleaseQuarantined(std::span<const KVPoll> reusable) {
  size_t kept = 0;
  for (size_t k = 0; k < quarantined_.size(); ++k) {
    if (k < reusable.size() && reusable[k] == KVPoll::kSuccess) {
      Release(quarantined_[k].mem, quarantined_[k].room);
      quarantined_[k].handle.reset();
      continue;
    }
    if (kept != k) quarantined_[kept] = std::move(quarantined_[k]);
    ++kept;
  }
  quarantined_.resize(kept);
}

void SchedulerCore::Check(Status s) {
  if (!s.ok() && internal_error_.ok()) internal_error_ = s.WithPrefix(core_options_.name);
}

int64_t SchedulerCore::Now() const {
  if (core_options_.now_us) return core_options_.now_us();
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

SchedulerMetrics SchedulerCore::CoreMetrics() const {
  SchedulerMetrics m = counters_;
  m.total_tokens = static_cast<uint64_t>(pages_->capacity_tokens());
  m.free_tokens = static_cast<uint64_t>(pages_->available_tokens());
  m.quarantined_requests = quarantined_.size();
  for (const Quarantined& q : quarantined_) {
    if (q.mem.req_slot >= 0) m.quarantined_pages += req_slots_->page_table(q.mem.req_slot).size();
  }
  return m;
}

}  // namespace pdlib::sched
