#include "examples/scheduler/prefill_scheduler.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"
#include "examples/scheduler/page_reuse.h"
#include "pdlib/page_index.h"

namespace pdlib::sched {

struct PrefillScheduler::Req {
  Request request;
  std::unique_ptr<KVSender> sender;
  bool transferred = false;  // Success on every TP rank: pdlib reads none of its memory again
  std::optional<uint32_t> aux_slot;
  int32_t req_slot = -1;
  int32_t state_slot = -1;
  int32_t filled = 0;      // prompt tokens whose KV has been computed
  int32_t sent_pages = 0;  // page-table entries handed to Send
  int32_t first_token = -1;
  int64_t first_sent_us = 0;
  int64_t last_sent_us = 0;
  int64_t first_token_us = 0;
  int64_t transfer_end_us = 0;
};

StatusOr<std::unique_ptr<PrefillScheduler>> PrefillScheduler::Create(
    const PrefillSchedulerOptions& options, const PrefillDeps& deps) {
  if (deps.pages == nullptr || deps.metadata == nullptr || deps.senders == nullptr ||
      deps.model == nullptr) {
    return Status::InvalidArgument(
        "prefill scheduler: pages, metadata, senders and model must all be set");
  }
  if (options.max_running_requests < 1 || options.chunked_prefill_size < 1 ||
      options.max_context_len < 1 || options.num_state_slots < 0) {
    return Status::InvalidArgument(
        absl::StrFormat("prefill scheduler: max_running_requests %d, chunked_prefill_size %d and "
                        "max_context_len %d must be >= 1, num_state_slots %d >= 0",
                        options.max_running_requests, options.chunked_prefill_size,
                        options.max_context_len, options.num_state_slots));
  }
  if (deps.pages->page_size() < 1) {
    return Status::InvalidArgument(
        absl::StrFormat("prefill scheduler: page_size %d must be >= 1", deps.pages->page_size()));
  }
  if (deps.metadata->num_slots() < static_cast<size_t>(options.max_running_requests)) {
    return Status::InvalidArgument(absl::StrFormat(
        "prefill scheduler: %d metadata slots for max_running_requests %d (SPEC R4.3 asks for "
        "2x)",
        deps.metadata->num_slots(), options.max_running_requests));
  }
  return std::unique_ptr<PrefillScheduler>(new PrefillScheduler(options, deps));
}

PrefillScheduler::PrefillScheduler(const PrefillSchedulerOptions& options, const PrefillDeps& deps)
    : options_(options),
      deps_(deps),
      page_size_(deps.pages->page_size()),
      req_slots_(options.max_running_requests, options.max_context_len, page_size_),
      aux_slots_(deps.metadata->num_slots()),
      state_slots_(options.num_state_slots, "state slot") {}

PrefillScheduler::~PrefillScheduler() {
  // Shutdown: nothing waits for PagesReusable() (the KVManager goes next); every page and slot
  // goes back to the pools and every sender is destroyed (a live one aborts).
  for (auto* q : {&bootstrap_, &waiting_, &inflight_}) {
    for (auto& r : *q) Release(*r);
  }
  for (auto& r : quarantined_) Release(*r);
}

int64_t PrefillScheduler::Now() const {
  if (options_.now_us) return options_.now_us();
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void PrefillScheduler::Check(Status s) {
  if (!s.ok() && internal_error_.ok()) internal_error_ = s.WithPrefix("prefill scheduler");
}

Status PrefillScheduler::AddRequest(const Request& request) {
  Status s = [&]() -> Status {
    const int64_t len = static_cast<int64_t>(request.prompt.size());
    if (len == 0)
      return Status::InvalidArgument(absl::StrFormat("room %d: empty prompt", request.room));
    if (len > options_.max_context_len) {
      return Status::InvalidArgument(
          absl::StrFormat("room %d: prompt of %d tokens is longer than max_context_len %d",
                          request.room, len, options_.max_context_len));
    }
    const uint64_t pages = PageCount(static_cast<uint64_t>(len), static_cast<uint32_t>(page_size_));
    if (pages > static_cast<uint64_t>(deps_.pages->num_pages())) {
      return Status::ResourceExhausted(absl::StrFormat(
          "room %d: prompt of %d tokens needs %d pages of %d tokens, but the KV cache holds only "
          "%d pages (%d tokens)",
          request.room, len, pages, page_size_, deps_.pages->num_pages(),
          deps_.pages->capacity_tokens()));
    }
    if (live_rooms_.count(request.room) > 0) {
      return Status::AlreadyExists(absl::StrFormat("room %d is already live", request.room));
    }
    for (const auto& q : quarantined_) {
      if (q->request.room == request.room) {
        return Status::AlreadyExists(absl::StrFormat(
            "room %d: its failed request's pages are still quarantined (pdlib may still read "
            "them)",
            request.room));
      }
    }
    return Status::OK();
  }();
  if (!s.ok()) {
    ++counters_.rejected_reqs;
    return s;
  }
  auto sender = deps_.senders->CreateSender(request.room);
  if (!sender.ok()) {
    ++counters_.rejected_reqs;
    return sender.status().WithPrefix(absl::StrFormat("room %d: CreateSender", request.room));
  }
  auto r = std::make_unique<Req>();
  r->request = request;
  r->request.max_new_tokens = 1;  // prefill produces only the first token
  r->sender = std::move(*sender);
  live_rooms_.insert(request.room);
  bootstrap_.push_back(std::move(r));
  ++counters_.requests_total;
  return Status::OK();
}

Status PrefillScheduler::Step() {
  // One collective per step over every live sender, in queue order, so that all TP ranks see the
  // same states (Failed on any rank wins), then whether each quarantined request's pages are
  // reusable (on every rank).
  std::vector<const KVPollable*> handles;
  for (const auto* q : {&bootstrap_, &waiting_, &inflight_}) {
    for (const auto& r : *q) handles.push_back(r->sender.get());
  }
  std::vector<ReusablePoll> reuse;
  reuse.reserve(quarantined_.size());
  for (const auto& r : quarantined_) handles.push_back(&reuse.emplace_back(r->sender.get()));
  auto polls = PollAndAllReduce(handles, options_.group);
  if (!polls.ok()) return polls.status().WithPrefix("prefill scheduler: PollAndAllReduce");
  std::span<const KVPoll> all(*polls);
  const size_t nb = bootstrap_.size(), nw = waiting_.size(), ni = inflight_.size();
  // First, so that this step can hand the memory out again; failures below join the back.
  ReleaseQuarantined(all.subspan(nb + nw + ni));
  // Back to front: each stage only appends to the next one.
  ProcessInflight(all.subspan(nb + nw, ni));
  ProcessWaiting(all.subspan(nb, nw));
  ProcessBootstrap(all.first(nb));
  RunPrefillBatch();
  Status s = std::move(internal_error_);
  internal_error_ = Status::OK();
  return s;
}

std::vector<FinishedRequest> PrefillScheduler::TakeFinished() {
  std::vector<FinishedRequest> out;
  out.swap(finished_);
  return out;
}

Status PrefillScheduler::FailureOf(const Req& r) const {
  Status why = r.sender->FailureReason();
  if (!why.ok()) return why;
  // Failed on another TP rank only: this rank's handle does not know why.
  return Status::Aborted(
      absl::StrFormat("room %d: the transfer failed on another TP rank", r.request.room));
}

void PrefillScheduler::ProcessInflight(std::span<const KVPoll> polls) {
  std::deque<std::unique_ptr<Req>> still;
  for (size_t k = 0; k < polls.size(); ++k) {
    auto& r = inflight_[k];
    if (polls[k] == KVPoll::kSuccess) {
      r->transferred = true;
      r->transfer_end_us = Now();
      counters_.transfer_latency_us_sum +=
          static_cast<uint64_t>(std::max<int64_t>(0, r->transfer_end_us - r->last_sent_us));
      ++counters_.transfer_latency_count;
      Finish(std::move(r), Status::OK(), FailStage::kTransfer);
    } else if (polls[k] == KVPoll::kFailed) {
      Status why = FailureOf(*r);
      Finish(std::move(r), std::move(why), FailStage::kTransfer);
    } else {
      still.push_back(std::move(r));
    }
  }
  inflight_.swap(still);
}

void PrefillScheduler::ProcessWaiting(std::span<const KVPoll> polls) {
  std::deque<std::unique_ptr<Req>> still;
  for (size_t k = 0; k < polls.size(); ++k) {
    auto& r = waiting_[k];
    if (polls[k] == KVPoll::kFailed) {
      Status why = FailureOf(*r);
      Finish(std::move(r), std::move(why), FailStage::kTransfer);
    } else {
      still.push_back(std::move(r));
    }
  }
  waiting_.swap(still);
}

void PrefillScheduler::ProcessBootstrap(std::span<const KVPoll> polls) {
  std::deque<std::unique_ptr<Req>> still;
  bool out_of_slots = false;
  for (size_t k = 0; k < polls.size(); ++k) {
    auto& r = bootstrap_[k];
    if (polls[k] == KVPoll::kFailed) {
      Status why = FailureOf(*r);
      Finish(std::move(r), std::move(why), FailStage::kBootstrap);
      continue;
    }
    // Bootstrapped once decode's TransferInfo arrived; admitted in arrival order while metadata
    // slots last.
    if (polls[k] == KVPoll::kBootstrapping || out_of_slots) {
      still.push_back(std::move(r));
      continue;
    }
    std::optional<uint32_t> aux = aux_slots_.Alloc();
    if (!aux) {
      out_of_slots = true;
      still.push_back(std::move(r));
      continue;
    }
    r->aux_slot = aux;
    const uint64_t pages = PageCount(r->request.prompt.size(), static_cast<uint32_t>(page_size_));
    if (Status s = r->sender->Init(pages, aux); !s.ok()) {
      Finish(std::move(r), s.WithPrefix("KVSender::Init"), FailStage::kBootstrap);
      continue;
    }
    waiting_.push_back(std::move(r));
  }
  bootstrap_.swap(still);
}

bool PrefillScheduler::StartRequest(Req& r) {
  const int32_t pages =
      static_cast<int32_t>(PageCount(r.request.prompt.size(), static_cast<uint32_t>(page_size_)));
  if (req_slots_.available() < 1 || deps_.pages->free_pages() < pages ||
      (options_.num_state_slots > 0 && state_slots_.available() < 1)) {
    return false;
  }
  r.req_slot = *req_slots_.Alloc();
  if (!deps_.pages->Alloc(pages, r.request.room, &req_slots_.page_table(r.req_slot))) {
    Check(Status::Internal("page allocation failed with enough free pages"));
    return false;
  }
  if (options_.num_state_slots > 0) r.state_slot = *state_slots_.Alloc();
  return true;
}

void PrefillScheduler::RunPrefillBatch() {
  // Waiting requests in order under the token budget; only the last one planned can end up
  // partly prefilled (it comes first next step).
  int32_t budget = options_.chunked_prefill_size;
  std::vector<ForwardChunk> chunks;
  for (auto& r : waiting_) {
    if (budget == 0) break;
    if (r->req_slot < 0 && !StartRequest(*r)) break;
    const int32_t len =
        std::min(static_cast<int32_t>(r->request.prompt.size()) - r->filled, budget);
    budget -= len;
    chunks.push_back({.room = r->request.room,
                      .tokens = std::span(r->request.prompt).subspan(r->filled, len),
                      .start_pos = r->filled,
                      .page_table = req_slots_.page_table(r->req_slot),
                      .state_slot = r->state_slot});
  }
  if (chunks.empty()) return;
  std::vector<ForwardOutput> results;
  Status forward = deps_.model->Forward(chunks, &results);
  if (forward.ok() && results.size() != chunks.size()) {
    forward = Status::Internal(
        absl::StrFormat("model returned %d results for %d chunks", results.size(), chunks.size()));
  }
  ++counters_.forward_passes;
  const size_t n = chunks.size();
  std::deque<std::unique_ptr<Req>> partial;
  for (size_t k = 0; k < n; ++k) {
    std::unique_ptr<Req> r = std::move(waiting_[k]);
    if (!forward.ok()) {
      Finish(std::move(r), forward.WithPrefix("prefill forward"), FailStage::kTransfer);
      continue;
    }
    counters_.forward_tokens += chunks[k].tokens.size();
    r->filled += static_cast<int32_t>(chunks[k].tokens.size());
    const bool last = r->filled == static_cast<int32_t>(r->request.prompt.size());
    if (Status s = SendChunk(*r, last ? &results[k] : nullptr); !s.ok()) {
      Finish(std::move(r), std::move(s), FailStage::kTransfer);
      continue;
    }
    if (last) {
      inflight_.push_back(std::move(r));
    } else {
      partial.push_back(std::move(r));
    }
  }
  waiting_.erase(waiting_.begin(), waiting_.begin() + static_cast<std::ptrdiff_t>(n));
  for (auto it = partial.rbegin(); it != partial.rend(); ++it) waiting_.push_front(std::move(*it));
}

Status PrefillScheduler::SendChunk(Req& r, const ForwardOutput* last) {
  const std::vector<int32_t>& table = req_slots_.page_table(r.req_slot);
  // A non-last chunk sends only whole pages (SPEC R5.2): the partial page is still being filled.
  const int32_t end = last != nullptr ? static_cast<int32_t>(table.size()) : r.filled / page_size_;
  std::span<const int32_t> pages = std::span(table).subspan(r.sent_pages, end - r.sent_pages);
  if (last == nullptr && pages.empty()) return Status::OK();
  std::vector<int32_t> state;
  if (last != nullptr) {
    r.first_token = last->token;
    r.first_token_us = Now();
    WriteMetadata(*r.aux_slot, r.request.room, *last);
    if (r.state_slot >= 0) state.push_back(r.state_slot);
  }
  if (Status s = r.sender->Send(pages, last != nullptr, state); !s.ok()) {
    return s.WithPrefix(absl::StrFormat("room %d: KVSender::Send", r.request.room));
  }
  r.sent_pages = end;
  r.last_sent_us = Now();
  if (r.first_sent_us == 0) r.first_sent_us = r.last_sent_us;
  counters_.transferred_pages += pages.size();
  counters_.transferred_bytes += pages.size() * options_.kv_bytes_per_page;
  return Status::OK();
}

void PrefillScheduler::WriteMetadata(uint32_t slot, uint64_t room, const ForwardOutput& out) {
  MetadataBuffers& m = *deps_.metadata;
  for (int f = 0; f < kMetadataFieldCount; ++f) {
    std::span<std::byte> row = m.Row(static_cast<MetadataField>(f), slot);
    std::memset(row.data(), 0, row.size());
  }
  m.output_ids(slot)[0] = out.token;
  m.output_token_logprobs_val(slot)[0] = out.logprob;
  m.output_token_logprobs_idx(slot)[0] = out.token;
  const size_t top = std::min(
      {out.top_ids.size(), out.top_logprobs.size(), m.output_top_logprobs_idx(slot).size()});
  for (size_t i = 0; i < top; ++i) {
    m.output_top_logprobs_idx(slot)[i] = out.top_ids[i];
    m.output_top_logprobs_val(slot)[i] = out.top_logprobs[i];
  }
  m.bootstrap_room(slot)[0] = room;
}

void PrefillScheduler::Release(Req& r) {
  if (r.req_slot >= 0) {
    Check(deps_.pages->Free(req_slots_.page_table(r.req_slot), r.request.room));
    Check(req_slots_.Free(r.req_slot));
    r.req_slot = -1;
  }
  if (r.aux_slot) Check(aux_slots_.Free(*r.aux_slot));
  r.aux_slot.reset();
  if (r.state_slot >= 0) Check(state_slots_.Free(r.state_slot));
  r.state_slot = -1;
}

void PrefillScheduler::Retire(std::unique_ptr<Req> r) {
  const bool holds = r->req_slot >= 0 || r->aux_slot.has_value() || r->state_slot >= 0;
  // Without a group this rank's answer is the agreed one; with one, a failed request's memory
  // waits for the next step's poll, so that every rank frees it on the same step.
  const bool reusable = r->transferred || (options_.group == nullptr && r->sender->PagesReusable());
  if (holds && !reusable) {
    quarantined_.push_back(std::move(r));
    return;
  }
  Release(*r);
}

void PrefillScheduler::ReleaseQuarantined(std::span<const KVPoll> reusable) {
  size_t kept = 0;
  for (size_t k = 0; k < quarantined_.size(); ++k) {
    if (k < reusable.size() && reusable[k] == KVPoll::kSuccess) {
      Release(*quarantined_[k]);
      quarantined_[k].reset();  // the sender goes with it
      continue;
    }
    if (kept != k) quarantined_[kept] = std::move(quarantined_[k]);
    ++kept;
  }
  quarantined_.resize(kept);
}

void PrefillScheduler::Finish(std::unique_ptr<Req> r, Status status, FailStage stage) {
  // Tell decode why before the handle goes (destroying a live sender aborts it anyway).
  if (!status.ok() && !IsTerminal(r->sender->Poll())) r->sender->Abort(status.ToString());
  FinishedRequest f{.room = r->request.room,
                    .status = std::move(status),
                    .output_ids = {},
                    .first_token_us = r->first_token_us,
                    .transfer_start_us = r->first_sent_us,
                    .transfer_end_us = r->transfer_end_us,
                    .kv_bytes = static_cast<uint64_t>(r->sent_pages) * options_.kv_bytes_per_page};
  if (f.status.ok()) {
    ++counters_.finished_reqs;
    f.output_ids.push_back(r->first_token);
  } else if (stage == FailStage::kBootstrap) {
    ++counters_.bootstrap_failed_reqs;
  } else {
    ++counters_.transfer_failed_reqs;
  }
  live_rooms_.erase(r->request.room);
  finished_.push_back(std::move(f));
  Retire(std::move(r));
}

void PrefillScheduler::FailAll(const Status& why) {
  for (auto* q : {&bootstrap_, &waiting_, &inflight_}) {
    const FailStage stage = q == &bootstrap_ ? FailStage::kBootstrap : FailStage::kTransfer;
    std::deque<std::unique_ptr<Req>> all;
    all.swap(*q);
    for (auto& r : all) Finish(std::move(r), why, stage);
  }
}

SchedulerMetrics PrefillScheduler::metrics() const {
  SchedulerMetrics m = counters_;
  m.bootstrap_queue_size = bootstrap_.size();
  m.waiting_queue_size = waiting_.size();
  m.inflight_queue_size = inflight_.size();
  m.total_tokens = static_cast<uint64_t>(deps_.pages->capacity_tokens());
  m.free_tokens = static_cast<uint64_t>(deps_.pages->available_tokens());
  m.quarantined_requests = quarantined_.size();
  for (const auto& r : quarantined_) {
    if (r->req_slot >= 0) m.quarantined_pages += req_slots_.page_table(r->req_slot).size();
  }
  return m;
}

}  // namespace pdlib::sched
