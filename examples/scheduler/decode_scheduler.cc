#include "examples/scheduler/decode_scheduler.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"
#include "pdlib/page_index.h"

namespace pdlib::sched {

struct DecodeScheduler::Req {
  Request request;
  std::unique_ptr<KVReceiver> receiver;
  bool bootstrapped = false;  // the receiver reached WaitingForInput (on every TP rank)
  bool transferred = false;   // ... and Success (on every TP rank): pdlib is done with its memory
  RequestMemory mem;
  std::vector<int32_t> output_ids;  // [0] is the first token, from prefill
  int64_t kv_tokens = 0;            // tokens whose KV is in the cache (or in `offloaded`)
  int64_t prealloc_tokens = 0;      // tokens pre-allocated for the transfer
  int64_t init_us = 0;
  int64_t arrived_us = 0;       // the KV and the first token arrived
  uint64_t received_pages = 0;  // pages the transfer filled
  uint64_t received_state = 0;  // state indices handed to Init (sliding window: window pages)
  int32_t prefix_pages = 0;     // the page table's first pages, borrowed from the prefix cache
  HostKV offloaded;             // while retracted

  int64_t prompt_len() const { return static_cast<int64_t>(request.prompt.size()); }
  // Tokens held: the prompt and every output so far.
  int64_t held_tokens() const { return prompt_len() + static_cast<int64_t>(output_ids.size()); }
};

StatusOr<std::unique_ptr<DecodeScheduler>> DecodeScheduler::Create(
    const DecodeSchedulerOptions& options, const DecodeDeps& deps) {
  if (deps.pages == nullptr || deps.metadata == nullptr || deps.receivers == nullptr ||
      deps.model == nullptr) {
    return Status::InvalidArgument(
        "decode scheduler: pages, metadata, receivers and model must all be set");
  }
  if (options.max_running_requests < 1 || options.pre_alloc_size < 0 ||
      options.max_context_len < 1 || options.reserved_decode_tokens < 0 ||
      options.clip_max_new_tokens < 1 || options.polling_interval < 1 ||
      options.num_state_slots < 0 || options.vocab_size < 0 || options.sliding_window < 0) {
    return Status::InvalidArgument(absl::StrFormat(
        "decode scheduler: max_running_requests %d, max_context_len %d, clip_max_new_tokens %d "
        "and polling_interval %d must be >= 1; pre_alloc_size %d, reserved_decode_tokens %d, "
        "num_state_slots %d, sliding_window %d and vocab_size %d must be >= 0",
        options.max_running_requests, options.max_context_len, options.clip_max_new_tokens,
        options.polling_interval, options.pre_alloc_size, options.reserved_decode_tokens,
        options.num_state_slots, options.sliding_window, options.vocab_size));
  }
  if (Status s = CheckOneStateKind("decode scheduler", options.num_state_slots,
                                   options.sliding_window, options.whole_sequence_state);
      !s.ok()) {
    return s;
  }
  if (options.prefix_cache_pages < 0 ||
      (options.prefix_cache_pages > 0 &&
       (options.num_state_slots > 0 || options.sliding_window > 0 ||
        options.whole_sequence_state))) {
    return Status::InvalidArgument(absl::StrFormat(
        "decode scheduler: prefix_cache_pages %d: the prefix cache holds KV pages only, a model "
        "with per-request state (recurrent, sliding-window or index state) cannot reuse them",
        options.prefix_cache_pages));
  }
  if (deps.pages->page_size() < 1) {
    return Status::InvalidArgument(
        absl::StrFormat("decode scheduler: page_size %d must be >= 1", deps.pages->page_size()));
  }
  if (deps.metadata->num_slots() < 1) {
    return Status::InvalidArgument("decode scheduler: the metadata buffers have no slots");
  }
  return std::unique_ptr<DecodeScheduler>(new DecodeScheduler(options, deps));
}

DecodeScheduler::DecodeScheduler(const DecodeSchedulerOptions& options, const DecodeDeps& deps)
    : SchedulerCore({.name = "decode scheduler",
                     .quarantine_why = "prefill may still write them",
                     .polling_interval = options.polling_interval,
                     .num_state_slots = options.num_state_slots,
                     .kv_bytes_per_page = options.kv_bytes_per_page,
                     .sliding_window = options.sliding_window,
                     .whole_sequence_state = options.whole_sequence_state,
                     .page_state_bytes_per_page = options.page_state_bytes_per_page,
                     .group = options.group,
                     .now_us = options.now_us},
                    deps.pages, deps.model,
                    std::make_unique<DecodeReqToTokenPool>(
                        options.max_running_requests, options.pre_alloc_size,
                        options.max_context_len, deps.pages->page_size()),
                    deps.metadata->num_slots()),
      options_(options),
      deps_(deps) {
  if (options.prefix_cache_pages > 0) {
    prefix_cache_ =
        std::make_unique<PrefixCache>(deps.pages->page_size(), options.prefix_cache_pages);
  }
}

// The room the page allocator's events name for pages the prefix cache gives back.
constexpr uint64_t kPrefixCacheRoom = ~uint64_t{0};

void DecodeScheduler::FreeCached(const std::vector<int32_t>& pages) {
  if (!pages.empty()) Check(deps_.pages->Free(pages, kPrefixCacheRoom));
}

void DecodeScheduler::DropPrefix(Req& r) {
  if (r.prefix_pages == 0 || r.mem.req_slot < 0) return;
  std::vector<int32_t>& table = page_table(r.mem);
  const auto n = static_cast<std::ptrdiff_t>(
      std::min<size_t>(static_cast<size_t>(r.prefix_pages), table.size()));
  Check(prefix_cache_->Unlock(std::span(table).first(static_cast<size_t>(n))));
  table.erase(table.begin(), table.begin() + n);
  r.prefix_pages = 0;
}

DecodeScheduler::~DecodeScheduler() {
  // Shutdown: every page and slot goes back to the pools (SchedulerCore frees the quarantined
  // ones) and every receiver is destroyed (a live one aborts).
  for (auto* q : {&prealloc_, &transfer_, &waiting_, &retracted_}) {
    for (auto& r : *q) {
      DropPrefix(*r);
      Release(r->mem, r->request.room);
    }
  }
  for (auto& r : running_) {
    DropPrefix(*r);
    Release(r->mem, r->request.room);
  }
  if (prefix_cache_) FreeCached(prefix_cache_->Clear());
}

Status DecodeScheduler::AddRequest(const Request& request) {
  Status s = [&]() -> Status {
    const int64_t len = static_cast<int64_t>(request.prompt.size());
    if (len == 0)
      return Status::InvalidArgument(absl::StrFormat("room %d: empty prompt", request.room));
    if (request.max_new_tokens < 1) {
      return Status::InvalidArgument(absl::StrFormat("room %d: max_new_tokens %d must be >= 1",
                                                     request.room, request.max_new_tokens));
    }
    if (Status t = CheckPromptTokens(request, options_.vocab_size); !t.ok()) return t;
    const int64_t total = len + request.max_new_tokens;
    if (total > options_.max_context_len) {
      return Status::InvalidArgument(absl::StrFormat(
          "room %d: prompt of %d tokens + max_new_tokens %d exceeds max_context_len %d",
          request.room, len, request.max_new_tokens, options_.max_context_len));
    }
    if (total > deps_.pages->capacity_tokens()) {
      return Status::ResourceExhausted(absl::StrFormat(
          "room %d: prompt of %d tokens + max_new_tokens %d needs %d tokens, but the KV cache "
          "holds only %d pages of %d tokens (%d tokens)",
          request.room, len, request.max_new_tokens, total, deps_.pages->num_pages(), page_size(),
          deps_.pages->capacity_tokens()));
    }
    return CheckRoomFree(request.room);
  }();
  if (!s.ok()) return Reject(std::move(s));
  auto receiver =
      deps_.receivers->CreateReceiver(request.bootstrap, request.room, request.prefill_dp_rank);
  if (!receiver.ok()) {
    return Reject(
        receiver.status().WithPrefix(absl::StrFormat("room %d: CreateReceiver", request.room)));
  }
  auto r = std::make_unique<Req>();
  r->request = request;
  r->receiver = std::move(*receiver);
  Admit(request.room);
  prealloc_.push_back(std::move(r));
  return Status::OK();
}

void DecodeScheduler::AppendPolledHandles(std::vector<const KVPollable*>* handles) const {
  for (const auto* q : {&prealloc_, &transfer_}) {
    for (const auto& r : *q) handles->push_back(r->receiver.get());
  }
}

void DecodeScheduler::OnPolls(std::span<const KVPoll> polls) {
  const size_t np = prealloc_.size();
  SweepQueue(transfer_, polls.subspan(np), [&](std::unique_ptr<Req>& r, KVPoll p) {
    if (p == KVPoll::kSuccess) {
      r->transferred = true;
      if (Status s = CommitTransfer(*r); !s.ok()) {
        Finish(std::move(r), std::move(s), FailStage::kTransfer);
      } else {
        waiting_.push_back(std::move(r));
      }
    } else if (p == KVPoll::kFailed) {
      Status why = FailureOf(*r->receiver);
      Finish(std::move(r), std::move(why), FailStage::kTransfer);
    }
  });
  SweepQueue(prealloc_, polls.first(np), [&](std::unique_ptr<Req>& r, KVPoll p) {
    if (p == KVPoll::kFailed) {
      Status why = FailureOf(*r->receiver);
      Finish(std::move(r), std::move(why), FailStage::kBootstrap);
    } else if (p >= KVPoll::kWaitingForInput) {
      r->bootstrapped = true;
    }
  });
}

void DecodeScheduler::Schedule() {
  ResumeRetracted();
  PreallocNew();
  MergeWaiting();
  RunDecodeBatch();
}

AllocatableTokensInput DecodeScheduler::FormulaInput(bool count_retracted) const {
  AllocatableTokensInput in;
  in.available_tokens = deps_.pages->available_tokens();
  // Unlocked cached pages are given back on demand (PreallocNew evicts before allocating).
  if (prefix_cache_) {
    in.available_tokens += int64_t{prefix_cache_->evictable_pages()} * page_size();
  }
  in.reserved_decode_tokens = options_.reserved_decode_tokens;
  in.num_running = static_cast<int64_t>(running_.size());
  in.num_transfer = static_cast<int64_t>(transfer_.size());
  in.num_waiting = static_cast<int64_t>(waiting_.size());
  if (!count_retracted) return in;  // resuming: the retracted requests are what is being sized
  for (const auto& r : running_) {
    const int64_t need =
        r->prompt_len() + std::min(r->request.max_new_tokens, options_.clip_max_new_tokens);
    in.max_single_request_need = std::max(in.max_single_request_need, need);
    in.retractable_tokens += r->held_tokens();
  }
  for (const auto& r : retracted_) {
    in.retracted_need += r->held_tokens() + options_.reserved_decode_tokens;
  }
  return in;
}

int64_t DecodeScheduler::AllocatableTokens() const {
  return sched::AllocatableTokens(FormulaInput(/*count_retracted=*/true));
}

void DecodeScheduler::ResumeRetracted() {
  if (retracted_.empty()) return;
  int64_t allocatable = sched::AllocatableTokens(FormulaInput(/*count_retracted=*/false));
  std::deque<std::unique_ptr<Req>> resumed;
  while (!retracted_.empty()) {
    Req& r = *retracted_.front();
    const int64_t required = r.held_tokens() + options_.reserved_decode_tokens;
    if (required > allocatable) break;
    if (prefix_cache_) {
      const int64_t need = static_cast<int64_t>(
          PageCount(static_cast<uint64_t>(r.kv_tokens), static_cast<uint32_t>(page_size())));
      std::vector<int32_t> evicted;
      prefix_cache_->Evict(static_cast<int32_t>(need - deps_.pages->free_pages()), &evicted);
      FreeCached(evicted);
    }
    if (!Allocate(r.mem, r.request.room, r.kv_tokens)) break;
    allocatable -= required;
    std::unique_ptr<Req> owned = std::move(retracted_.front());
    retracted_.pop_front();
    Status s =
        deps_.model->RestoreKV(owned->offloaded, page_table(owned->mem), owned->mem.state_slot);
    owned->offloaded = HostKV{};
    if (!s.ok()) {
      Finish(std::move(owned), s.WithPrefix("restoring retracted KV"), FailStage::kTransfer);
      continue;
    }
    ++counters().resumed_reqs;
    resumed.push_back(std::move(owned));
  }
  // Resumed requests go ahead of newly transferred ones.
  for (auto it = resumed.rbegin(); it != resumed.rend(); ++it) waiting_.push_front(std::move(*it));
}

void DecodeScheduler::PreallocNew() {
  // While a retracted request waits, new requests get no memory: it resumes first.
  if (!retracted_.empty() || prealloc_.empty()) return;
  int64_t allocatable = AllocatableTokens();
  int64_t retractable = 0;
  for (const auto& r : running_) retractable += r->held_tokens();
  std::deque<std::unique_ptr<Req>> still;
  bool blocked = false;  // first-come first-served: once one cannot fit, later ones wait too
  for (auto& r : prealloc_) {
    if (blocked || !r->bootstrapped) {
      still.push_back(std::move(r));
      continue;
    }
    const std::optional<int64_t> charge =
        PreallocCharge(allocatable, r->prompt_len(),
                       std::min(r->request.max_new_tokens, options_.clip_max_new_tokens),
                       options_.reserved_decode_tokens, retractable);
    // Decode prefix reuse: the prompt's leading pages still cached are borrowed, not received.
    PrefixCache::Match prefix;
    if (charge && aux_available() >= 1 && prefix_cache_) {
      prefix = prefix_cache_->Lookup(r->request.prompt, r->prompt_len());
      const int64_t need = static_cast<int64_t>(PageCount(static_cast<uint64_t>(r->prompt_len()),
                                                          static_cast<uint32_t>(page_size()))) -
                           static_cast<int64_t>(prefix.pages.size());
      std::vector<int32_t> evicted;
      prefix_cache_->Evict(static_cast<int32_t>(need - deps_.pages->free_pages()), &evicted);
      FreeCached(evicted);
    }
    if (!charge || aux_available() < 1 ||
        !Allocate(r->mem, r->request.room, r->prompt_len(), prefix.pages)) {
      if (!prefix.pages.empty()) Check(prefix_cache_->Unlock(prefix.pages));
      blocked = true;
      still.push_back(std::move(r));
      continue;
    }
    allocatable -= *charge;
    AllocAux(r->mem);
    r->prefix_pages = static_cast<int32_t>(prefix.pages.size());
    r->prealloc_tokens = r->prompt_len() - prefix.tokens;
    const std::vector<int32_t> state = StateIndices(r->mem, r->prompt_len());
    r->received_state = state.size();
    const std::span<const int32_t> table = page_table(r->mem);
    ReceiveRequest request;
    request.kv_page_indices = table.subspan(static_cast<size_t>(r->prefix_pages));
    request.aux_index = r->mem.aux_slot;
    request.state.indices = state;
    request.decode_prefix_len = static_cast<uint64_t>(prefix.tokens);
    request.prompt_len = static_cast<uint64_t>(r->prompt_len());
    if (Status s = r->receiver->Init(request); !s.ok()) {
      FailEverywhere(*r->receiver, s.WithPrefix("KVReceiver::Init"));
    }
    r->init_us = Now();
    transfer_.push_back(std::move(r));
  }
  prealloc_.swap(still);
}

Status DecodeScheduler::CommitTransfer(Req& r) {
  const uint32_t slot = *r.mem.aux_slot;
  // SPEC R4.4: the slot must carry this request's room, or the bytes belong to someone else.
  const uint64_t got = deps_.metadata->bootstrap_room(slot)[0];
  if (got != r.request.room) {
    return Status::DataLoss(absl::StrFormat(
        "room %d: metadata slot %d carries bootstrap_room %d instead", r.request.room, slot, got));
  }
  const int32_t first = deps_.metadata->output_ids(slot)[0];
  if (first < 0 || (options_.vocab_size > 0 && first >= options_.vocab_size)) {
    return Status::DataLoss(absl::StrFormat(
        "room %d: first token %d from prefill (metadata slot %d) is outside [0, %d)",
        r.request.room, first, slot, options_.vocab_size > 0 ? options_.vocab_size : INT32_MAX));
  }
  r.output_ids = {first};
  r.kv_tokens = r.prompt_len();
  r.arrived_us = Now();
  if (options_.on_token) options_.on_token(r.request.room, 0, first);
  FreeAux(r.mem);
  r.received_pages = page_table(r.mem).size() - static_cast<size_t>(r.prefix_pages);
  if (options_.on_kv_arrived)
    options_.on_kv_arrived(r.request.room, page_table(r.mem), r.kv_tokens);
  CountTransferredPages(r.received_pages);
  CountTransferLatency(r.init_us, r.arrived_us);
  r.prealloc_tokens = 0;
  return Status::OK();
}

bool DecodeScheduler::Done(const Req& r) const {
  if (static_cast<int64_t>(r.output_ids.size()) >= r.request.max_new_tokens) return true;
  return options_.eos_token_id >= 0 && !r.output_ids.empty() &&
         r.output_ids.back() == options_.eos_token_id;
}

void DecodeScheduler::MergeWaiting() {
  // The prebuilt batch: requests whose KV is in place join the running batch without a
  // forward pass; one that already has all its tokens (max_new_tokens 1, or EOS first) ends here.
  std::deque<std::unique_ptr<Req>> still;
  for (auto& r : waiting_) {
    if (Done(*r)) {
      Finish(std::move(r), Status::OK(), FailStage::kTransfer);
    } else if (running_.size() < static_cast<size_t>(options_.max_running_requests)) {
      running_.push_back(std::move(r));
    } else {
      still.push_back(std::move(r));
    }
  }
  waiting_.swap(still);
}

bool DecodeScheduler::Retract(size_t index) {
  // Only running requests are retracted: their transfer succeeded, so pdlib writes none of their
  // pages again and they can be freed at once.
  Req& r = *running_[index];
  auto kv = deps_.model->OffloadKV(page_table(r.mem), r.kv_tokens, r.mem.state_slot);
  if (!kv.ok()) return false;
  r.offloaded = std::move(*kv);
  DropPrefix(r);  // the offloaded copy holds the prefix's KV too; it resumes into own pages
  Release(r.mem, r.request.room);
  retracted_.push_back(std::move(running_[index]));
  running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(index));
  ++counters().retracted_reqs;
  return true;
}

void DecodeScheduler::RunDecodeBatch() {
  if (running_.empty()) return;
  // This step writes each request's last token at position kv_tokens.
  auto needs_page = [&](const Req& r) {
    return PageCount(static_cast<uint64_t>(r.kv_tokens + 1), static_cast<uint32_t>(page_size())) >
           page_table(r.mem).size();
  };
  auto pages_needed = [&] {
    int32_t n = 0;
    for (const auto& r : running_) n += needs_page(*r) ? 1 : 0;
    return n;
  };
  while (pages_needed() > deps_.pages->free_pages() && running_.size() > 1) {
    std::vector<RetractCandidate> candidates;
    for (const auto& r : running_) {
      candidates.push_back({static_cast<int64_t>(r->output_ids.size()), r->prompt_len()});
    }
    if (!Retract(*PickRetractVictim(candidates))) break;
  }
  std::vector<std::unique_ptr<Req>> batch;
  for (auto& r : running_) {
    if (needs_page(*r) && !deps_.pages->Alloc(1, r->request.room, &page_table(r->mem))) {
      Finish(std::move(r),
             Status::ResourceExhausted(absl::StrFormat(
                 "room %d: no free KV page for token %d and nothing left to retract (%d pages "
                 "free)",
                 r->request.room, r->kv_tokens, deps_.pages->free_pages())),
             FailStage::kTransfer);
      continue;
    }
    batch.push_back(std::move(r));
  }
  running_.clear();
  if (batch.empty()) return;

  std::vector<ForwardChunk> chunks;
  for (const auto& r : batch) {
    chunks.push_back({.room = r->request.room,
                      .tokens = std::span(r->output_ids).last(1),
                      .start_pos = static_cast<int32_t>(r->kv_tokens),
                      .page_table = page_table(r->mem),
                      .state_slot = r->mem.state_slot});
  }
  std::vector<ForwardOutput> results;
  const Status forward = Forward(chunks, &results);
  for (size_t k = 0; k < batch.size(); ++k) {
    auto& r = batch[k];
    if (!forward.ok()) {
      Finish(std::move(r), forward.WithPrefix("decode forward"), FailStage::kTransfer);
      continue;
    }
    r->kv_tokens += 1;
    r->output_ids.push_back(results[k].token);
    if (options_.on_token) {
      options_.on_token(r->request.room, static_cast<int32_t>(r->output_ids.size()) - 1,
                        results[k].token);
    }
    if (Done(*r)) {
      Finish(std::move(r), Status::OK(), FailStage::kTransfer);
    } else {
      running_.push_back(std::move(r));
    }
  }
}

void DecodeScheduler::Finish(std::unique_ptr<Req> r, Status status, FailStage stage) {
  FinishedRequest f{
      .room = r->request.room,
      .status = std::move(status),
      .output_ids = {},
      .first_token_us = r->arrived_us,
      .transfer_start_us = r->init_us,
      .transfer_end_us = r->arrived_us,
      .kv_bytes =
          r->received_pages * options_.kv_bytes_per_page +
          (r->received_pages > 0 ? r->received_state * options_.page_state_bytes_per_page : 0)};
  if (f.status.ok() && prefix_cache_ && r->mem.req_slot >= 0) {
    // The request's full pages (prompt and outputs whose KV is computed) stay for later
    // prompts that extend this one; the cache takes those it does not hold yet.
    std::vector<int32_t> tokens = r->request.prompt;
    tokens.insert(tokens.end(), r->output_ids.begin(), r->output_ids.end());
    tokens.resize(
        static_cast<size_t>(std::min<int64_t>(r->kv_tokens, static_cast<int64_t>(tokens.size()))));
    std::vector<int32_t>& table = page_table(r->mem);
    std::vector<int32_t> evicted;
    const std::vector<size_t> adopted = prefix_cache_->Insert(tokens, table, &evicted);
    FreeCached(evicted);
    // What the cache adopted is no longer the request's to free.
    std::vector<int32_t> own;
    size_t next = 0;
    for (size_t i = 0; i < table.size(); ++i) {
      if (next < adopted.size() && adopted[next] == i) {
        ++next;
        continue;
      }
      own.push_back(table[i]);
    }
    // Borrowed pages stay first in `own` (Insert never adopts them): DropPrefix below.
    table = std::move(own);
  }
  DropPrefix(*r);
  if (f.status.ok()) f.output_ids = std::move(r->output_ids);
  // Tells prefill why before the receiver goes (destroying a live receiver aborts it anyway).
  FinishRequest(std::move(f), stage, std::move(r->receiver), r->mem, r->transferred);
}

void DecodeScheduler::FailAll(const Status& why) {
  for (auto* q : {&prealloc_, &transfer_, &waiting_, &retracted_}) {
    const FailStage stage = q == &prealloc_ ? FailStage::kBootstrap : FailStage::kTransfer;
    for (auto& r : std::exchange(*q, {})) Finish(std::move(r), why, stage);
  }
  for (auto& r : std::exchange(running_, {})) Finish(std::move(r), why, FailStage::kTransfer);
}

bool DecodeScheduler::idle() const {
  return prealloc_.empty() && transfer_.empty() && waiting_.empty() && running_.empty() &&
         retracted_.empty();
}

std::vector<uint64_t> DecodeScheduler::running_rooms() const {
  std::vector<uint64_t> out;
  for (const auto& r : running_) out.push_back(r->request.room);
  return out;
}

std::vector<uint64_t> DecodeScheduler::retracted_rooms() const {
  std::vector<uint64_t> out;
  for (const auto& r : retracted_) out.push_back(r->request.room);
  return out;
}

std::vector<uint64_t> DecodeScheduler::waiting_rooms() const {
  std::vector<uint64_t> out;
  for (const auto& r : waiting_) out.push_back(r->request.room);
  return out;
}

SchedulerMetrics DecodeScheduler::metrics() const {
  SchedulerMetrics m = CoreMetrics();
  m.prealloc_queue_size = prealloc_.size();
  m.transfer_queue_size = transfer_.size();
  m.waiting_queue_size = waiting_.size();
  m.running_requests = running_.size();
  m.retracted_queue_size = retracted_.size();
  for (const auto& r : transfer_) m.prealloc_tokens += static_cast<uint64_t>(r->prealloc_tokens);
  return m;
}

}  // namespace pdlib::sched
