#include "examples/scheduler/prefill_scheduler.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"
#include "pdlib/page_index.h"

namespace pdlib::sched {

struct PrefillScheduler::Req {
  Request request;
  std::unique_ptr<KVSender> sender;
  bool transferred = false;  // Success on every TP rank: pdlib reads none of its memory again
  RequestMemory mem;
  int32_t filled = 0;        // prompt tokens whose KV has been computed
  int32_t sent_pages = 0;    // page-table entries handed to Send, or skipped: decode's prefix
  int32_t prefix_pages = 0;  // push: the prompt's first pages decode already holds (not sent)
  int32_t sent_state = 0;    // state indices handed to Send (sliding window: window pages)
  int32_t first_token = -1;
  int64_t first_sent_us = 0;
  int64_t last_sent_us = 0;
  int64_t first_token_us = 0;
  int64_t transfer_end_us = 0;  // when Success was first seen (NoteSuccesses or a poll)
};

StatusOr<std::unique_ptr<PrefillScheduler>> PrefillScheduler::Create(
    const PrefillSchedulerOptions& options, const PrefillDeps& deps) {
  if (deps.pages == nullptr || deps.metadata == nullptr || deps.senders == nullptr ||
      deps.model == nullptr) {
    return Status::InvalidArgument(
        "prefill scheduler: pages, metadata, senders and model must all be set");
  }
  if (options.max_running_requests < 1 || options.chunked_prefill_size < 1 ||
      options.max_context_len < 1 || options.num_state_slots < 0 || options.sliding_window < 0 ||
      options.vocab_size < 0) {
    return Status::InvalidArgument(absl::StrFormat(
        "prefill scheduler: max_running_requests %d, chunked_prefill_size %d and "
        "max_context_len %d must be >= 1, num_state_slots %d, sliding_window %d and vocab_size "
        "%d >= 0",
        options.max_running_requests, options.chunked_prefill_size, options.max_context_len,
        options.num_state_slots, options.sliding_window, options.vocab_size));
  }
  if (Status s = CheckOneStateKind("prefill scheduler", options.num_state_slots,
                                   options.sliding_window, options.whole_sequence_state);
      !s.ok()) {
    return s;
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
    : SchedulerCore(
          {.name = "prefill scheduler",
           .quarantine_why = "pdlib may still read them",
           .polling_interval = 1,
           .num_state_slots = options.num_state_slots,
           .kv_bytes_per_page = options.kv_bytes_per_page,
           .sliding_window = options.sliding_window,
           .whole_sequence_state = options.whole_sequence_state,
           .page_state_bytes_per_page = options.page_state_bytes_per_page,
           .group = options.group,
           .now_us = options.now_us},
          deps.pages, deps.model,
          std::make_unique<ReqToTokenPool>(options.max_running_requests, options.max_context_len,
                                           deps.pages->page_size()),
          deps.metadata->num_slots()),
      options_(options),
      deps_(deps) {}

PrefillScheduler::~PrefillScheduler() {
  // Shutdown: every page and slot goes back to the pools (SchedulerCore frees the quarantined
  // ones) and every sender is destroyed (a live one aborts).
  for (auto* q : {&bootstrap_, &waiting_, &inflight_}) {
    for (auto& r : *q) Release(r->mem, r->request.room);
  }
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
    if (Status t = CheckPromptTokens(request, options_.vocab_size); !t.ok()) return t;
    const uint64_t pages =
        PageCount(static_cast<uint64_t>(len), static_cast<uint32_t>(page_size()));
    if (pages > static_cast<uint64_t>(deps_.pages->num_pages())) {
      return Status::ResourceExhausted(absl::StrFormat(
          "room %d: prompt of %d tokens needs %d pages of %d tokens, but the KV cache holds only "
          "%d pages (%d tokens)",
          request.room, len, pages, page_size(), deps_.pages->num_pages(),
          deps_.pages->capacity_tokens()));
    }
    return CheckRoomFree(request.room);
  }();
  if (!s.ok()) return Reject(std::move(s));
  auto sender = deps_.senders->CreateSender(request.room);
  if (!sender.ok()) {
    return Reject(
        sender.status().WithPrefix(absl::StrFormat("room %d: CreateSender", request.room)));
  }
  auto r = std::make_unique<Req>();
  r->request = request;
  r->request.max_new_tokens = 1;  // prefill produces only the first token
  r->sender = std::move(*sender);
  Admit(request.room);
  bootstrap_.push_back(std::move(r));
  return Status::OK();
}

void PrefillScheduler::AppendPolledHandles(std::vector<const KVPollable*>* handles) const {
  for (const auto* q : {&bootstrap_, &waiting_, &inflight_}) {
    for (const auto& r : *q) handles->push_back(r->sender.get());
  }
}

void PrefillScheduler::OnPolls(std::span<const KVPoll> polls) {
  const size_t nb = bootstrap_.size(), nw = waiting_.size(), ni = inflight_.size();
  // Back to front: each stage only appends to the next one.
  ProcessInflight(polls.subspan(nb + nw, ni));
  ProcessWaiting(polls.subspan(nb, nw));
  ProcessBootstrap(polls.first(nb));
}

void PrefillScheduler::ProcessInflight(std::span<const KVPoll> polls) {
  SweepQueue(inflight_, polls, [&](std::unique_ptr<Req>& r, KVPoll p) {
    if (p == KVPoll::kSuccess) {
      r->transferred = true;
      if (r->transfer_end_us == 0) r->transfer_end_us = Now();
      CountTransferLatency(r->last_sent_us, r->transfer_end_us);
      Finish(std::move(r), Status::OK(), FailStage::kTransfer);
    } else if (p == KVPoll::kFailed) {
      Status why = FailureOf(*r->sender);
      Finish(std::move(r), std::move(why), FailStage::kTransfer);
    }
  });
}

void PrefillScheduler::ProcessWaiting(std::span<const KVPoll> polls) {
  SweepQueue(waiting_, polls, [&](std::unique_ptr<Req>& r, KVPoll p) {
    if (p != KVPoll::kFailed) return;
    Status why = FailureOf(*r->sender);
    Finish(std::move(r), std::move(why), FailStage::kTransfer);
  });
}

void PrefillScheduler::ProcessBootstrap(std::span<const KVPoll> polls) {
  bool out_of_slots = false;
  SweepQueue(bootstrap_, polls, [&](std::unique_ptr<Req>& r, KVPoll p) {
    if (p == KVPoll::kFailed) {
      Status why = FailureOf(*r->sender);
      Finish(std::move(r), std::move(why), FailStage::kBootstrap);
      return;
    }
    // Push: bootstrapped once decode's TransferInfo arrived. Pull: at once (the pages are
    // published for decode to read whenever it comes). Admitted in arrival order while metadata
    // slots last.
    const bool pull = options_.direction == TransferDirection::kPull;
    if ((p == KVPoll::kBootstrapping && !pull) || out_of_slots) return;
    if (!AllocAux(r->mem)) {
      out_of_slots = true;
      return;
    }
    const uint64_t len = r->request.prompt.size();
    if (pull) {
      // Every page of the prompt is published, whatever decode's prefix (decode reads only the
      // pages after it): prefix_pages stays 0 and nothing is skipped.
      const uint64_t pages = PageCount(len, static_cast<uint32_t>(page_size()));
      if (Status s = r->sender->Init(pages, r->mem.aux_slot); !s.ok()) {
        FailEverywhere(*r->sender, s.WithPrefix("KVSender::Init"));
      }
      waiting_.push_back(std::move(r));
      return;
    }
    // Decode prefix reuse: decode holds the prompt's first pages already; prefill still computes
    // the whole prompt but sends only the pages after them (every TP rank learns the same
    // prefix, so the ranks stay in lockstep).
    const uint64_t prefix = r->sender->decode_prefix_len().value_or(0);
    if (prefix > len || prefix % static_cast<uint64_t>(page_size()) != 0) {
      FailEverywhere(*r->sender,
                     Status::OutOfRange(absl::StrFormat(
                         "room %d: decode's prefix of %d tokens does not fit a prompt of %d "
                         "tokens in %d-token pages",
                         r->request.room, prefix, len, page_size())));
    } else {
      r->prefix_pages = static_cast<int32_t>(prefix / static_cast<uint64_t>(page_size()));
      r->sent_pages = r->prefix_pages;
      const uint64_t pages = PageCount(len - prefix, static_cast<uint32_t>(page_size()));
      if (Status s = r->sender->Init(pages, r->mem.aux_slot); !s.ok()) {
        FailEverywhere(*r->sender, s.WithPrefix("KVSender::Init"));
      }
    }
    waiting_.push_back(std::move(r));
  });
}

void PrefillScheduler::RunPrefillBatch() {
  // Waiting requests in order under the token budget; only the last one planned can end up
  // partly prefilled (it comes first next step). Pages are allocated for the whole prompt when
  // its first chunk is scheduled, so a started request never waits for memory.
  int32_t budget = options_.chunked_prefill_size;
  std::vector<ForwardChunk> chunks;
  for (auto& r : waiting_) {
    if (budget == 0) break;
    if (r->mem.req_slot < 0 &&
        !Allocate(r->mem, r->request.room, static_cast<int64_t>(r->request.prompt.size()))) {
      break;
    }
    const int32_t len =
        std::min(static_cast<int32_t>(r->request.prompt.size()) - r->filled, budget);
    budget -= len;
    chunks.push_back({.room = r->request.room,
                      .tokens = std::span(r->request.prompt).subspan(r->filled, len),
                      .start_pos = r->filled,
                      .page_table = page_table(r->mem),
                      .state_slot = r->mem.state_slot});
  }
  if (chunks.empty()) return;
  const size_t n = chunks.size();
  // Layer-wise streaming: the pages each chunk sends, announced as layers finish; the last
  // layers go with SendChunk's Send() after the forward (with the first token, aux and state).
  struct Streamed {
    KVSender* sender;
    std::span<const int32_t> pages;
    bool last;
    int32_t layers;  // the sender's KV layers
    Status status;
  };
  std::vector<Streamed> streamed;
  std::function<void(int32_t)> on_layers;
  if (options_.layerwise) {
    for (size_t k = 0; k < n; ++k) {
      const Req& r = *waiting_[k];
      const int32_t filled = r.filled + static_cast<int32_t>(chunks[k].tokens.size());
      const bool last = filled == static_cast<int32_t>(r.request.prompt.size());
      std::span<const int32_t> pages = ChunkPages(r, filled, last);
      if (!pages.empty() && r.sender->num_layers() > 0) {
        streamed.push_back({r.sender.get(), pages, last, r.sender->num_layers(), Status::OK()});
      }
    }
    on_layers = [&](int32_t done) {
      for (Streamed& s : streamed) {
        if (s.status.ok() && done < s.layers)
          s.status = s.sender->SendLayers(s.pages, done, s.last);
      }
      NoteSuccesses();
    };
  }
  std::vector<ForwardOutput> results;
  const Status forward = Forward(chunks, &results, on_layers);
  for (const Streamed& s : streamed) {
    // A request whose announcement failed fails on every rank at the next poll (its Send below
    // fails too when the room is gone; a refused announcement is a scheduler bug: say so).
    if (!s.status.ok()) FailEverywhere(*s.sender, s.status.WithPrefix("KVSender::SendLayers"));
  }
  std::deque<std::unique_ptr<Req>> partial;
  for (size_t k = 0; k < n; ++k) {
    std::unique_ptr<Req> r = std::move(waiting_[k]);
    if (!forward.ok()) {
      Finish(std::move(r), forward.WithPrefix("prefill forward"), FailStage::kTransfer);
      continue;
    }
    r->filled += static_cast<int32_t>(chunks[k].tokens.size());
    const bool last = r->filled == static_cast<int32_t>(r->request.prompt.size());
    if (Status s = SendChunk(*r, last ? &results[k] : nullptr); !s.ok()) {
      FailEverywhere(*r->sender, s);
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

std::span<const int32_t> PrefillScheduler::ChunkPages(const Req& r, int32_t filled,
                                                      bool last) const {
  const std::vector<int32_t>& table = page_table(r.mem);
  // A non-last chunk sends only whole pages (SPEC R5.2): the partial page is still being filled.
  const int32_t end = last ? static_cast<int32_t>(table.size()) : filled / page_size();
  // A chunk inside decode's prefix sends nothing (sent_pages starts after the prefix).
  if (end <= r.sent_pages) return {};
  return std::span(table).subspan(r.sent_pages, end - r.sent_pages);
}

void PrefillScheduler::NoteSuccesses() {
  for (auto& r : inflight_) {
    if (r->transfer_end_us == 0 && r->sender->Poll() == KVPoll::kSuccess) {
      r->transfer_end_us = Now();
    }
  }
}

Status PrefillScheduler::SendChunk(Req& r, const ForwardOutput* last) {
  std::span<const int32_t> pages = ChunkPages(r, r.filled, last != nullptr);
  const int32_t end = r.sent_pages + static_cast<int32_t>(pages.size());
  if (last == nullptr && pages.empty()) return Status::OK();
  std::vector<int32_t> state;
  if (last != nullptr) {
    r.first_token = last->token;
    r.first_token_us = Now();
    WriteMetadata(*r.mem.aux_slot, r.request.room, *last);
    state = StateIndices(r.mem, static_cast<int64_t>(r.request.prompt.size()));
  }
  if (Status s = r.sender->Send(pages, last != nullptr, state); !s.ok()) {
    return s.WithPrefix(absl::StrFormat("room %d: KVSender::Send", r.request.room));
  }
  r.sent_pages = end;
  r.sent_state += static_cast<int32_t>(state.size());
  r.last_sent_us = Now();
  if (r.first_sent_us == 0) r.first_sent_us = r.last_sent_us;
  CountTransferredPages(pages.size());
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

void PrefillScheduler::Finish(std::unique_ptr<Req> r, Status status, FailStage stage) {
  // KV pages that moved: push sent only those after decode's prefix; pull published every page
  // and decode read those after its prefix (known once its TransferInfo came; 0 before).
  int32_t moved_pages = r->sent_pages - r->prefix_pages;
  if (options_.direction == TransferDirection::kPull) {
    const uint64_t prefix = r->sender->decode_prefix_len().value_or(0);
    moved_pages -= static_cast<int32_t>(
        std::min<uint64_t>(prefix / static_cast<uint64_t>(page_size()), moved_pages));
  }
  FinishedRequest f{
      .room = r->request.room,
      .status = std::move(status),
      .output_ids = {},
      .first_token_us = r->first_token_us,
      .transfer_start_us = r->first_sent_us,
      .transfer_end_us = r->transfer_end_us,
      .kv_bytes = static_cast<uint64_t>(moved_pages) * options_.kv_bytes_per_page +
                  static_cast<uint64_t>(r->sent_state) * options_.page_state_bytes_per_page};
  if (f.status.ok()) f.output_ids.push_back(r->first_token);
  // Tells decode why before the sender goes (destroying a live sender aborts it anyway).
  FinishRequest(std::move(f), stage, std::move(r->sender), r->mem, r->transferred);
}

void PrefillScheduler::FailAll(const Status& why) {
  for (auto* q : {&bootstrap_, &waiting_, &inflight_}) {
    const FailStage stage = q == &bootstrap_ ? FailStage::kBootstrap : FailStage::kTransfer;
    for (auto& r : std::exchange(*q, {})) Finish(std::move(r), why, stage);
  }
}

SchedulerMetrics PrefillScheduler::metrics() const {
  SchedulerMetrics m = CoreMetrics();
  m.bootstrap_queue_size = bootstrap_.size();
  m.waiting_queue_size = waiting_.size();
  m.inflight_queue_size = inflight_.size();
  return m;
}

}  // namespace pdlib::sched
