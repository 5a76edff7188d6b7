// PrefillCore: Send() queues chunks, the write workers turn them into batches of one-sided
// writes per decode rank, completions finish the room (metadata and state last).
#include <algorithm>
#include <string>

#include "absl/strings/str_format.h"
#include "lib/base/log_internal.h"
#include "lib/core/prefill_core.h"
#include "lib/core/prefill_types.h"
#include "lib/core/transfer_layout.h"
#include "lib/core/validate.h"

namespace pdlib {
inline namespace v1 {
// Whether prefill's state lists (`src`, per-family `src_counts`) pair up with decode's in `info`
// family by family, by each kind's rule (planner::AlignStateLists).
Status CheckStatePairing(const std::vector<planner::StateFamilySpan>& families,
                         const TransferInfoMsg& info, std::span<const int32_t> src,
                         std::span<const uint32_t> src_counts, uint32_t page_size) {
  if (info.dst_state_counts.size() != families.size()) {
    return Status::InvalidArgument(
        absl::StrFormat("decode sent state indices for %d families, this rank has %d",
                        info.dst_state_counts.size(), families.size()));
  }
  const int64_t request_pages =
      static_cast<int64_t>(info.decode_prefix_len / page_size + info.dst_kv_pages.size());
  for (size_t f = 0; f < families.size(); ++f) {
    const size_t ns = src_counts.empty() ? src.size() : src_counts[f];
    auto pairing =
        planner::AlignStateLists(families[f].type, ns, info.dst_state_counts[f], request_pages);
    if (!pairing.ok()) return pairing.status().WithPrefix(absl::StrFormat("state family %d", f));
  }
  return Status::OK();
}

Status PrefillCore::SendLayers(uint64_t room_id, std::span<const int32_t> pages,
                               int32_t layers_done, bool last, const StateIndices& state_arg) {
  const std::span<const int32_t> state_indices = state_arg.indices;
  auto room = FindRoom(room_id);
  if (!room) return Status::NotFound(absl::StrFormat("room %d is not live", room_id));
  KVPoll state = room->state->Poll();
  if (state == KVPoll::kFailed) return room->state->FailureReason();
  // Pull publishes whenever the engine is ready: decode may come later (its TransferInfo then
  // finds the published chunks).
  if ((state < KVPoll::kWaitingForInput && !pull()) || state == KVPoll::kSuccess) {
    return Status::FailedPrecondition(
        absl::StrFormat("room %d: Send() in state %s (needs the decode side's TransferInfo first)",
                        room_id, KVPollName(state)));
  }
  const int32_t layers = layout_.engine_layers();
  if (layers_done < 0 || layers_done > layers) {
    return Status::OutOfRange(
        absl::StrFormat("room %d: SendLayers() announces %d layers; this rank has %d KV layers",
                        room_id, layers_done, layers));
  }
  const bool completes = layers_done == layers;
  if (Status s = ValidateStateIndices(state_caps_, state_indices, state_arg.counts, "prefill");
      !s.ok()) {
    return s.WithPrefix(absl::StrFormat("room %d", room_id));
  }
  Chunk chunk{room, {pages.begin(), pages.end()}, 0, false, 0, layers_done};
  {
    MutexLock lock(&room->mu);
    if (room->last_queued) {
      return Status::FailedPrecondition(
          absl::StrFormat("room %d: Send() after the last chunk", room_id));
    }
    if (room->open_layers > 0) {
      // Another announcement of the open chunk: the same pages, the same last flag, more layers.
      if (!std::equal(pages.begin(), pages.end(), room->open_pages.begin(),
                      room->open_pages.end())) {
        return Status::InvalidArgument(absl::StrFormat(
            "room %d: SendLayers() with %d pages differing from the %d pages of the chunk whose "
            "first %d layers were announced (finish a chunk before the next one)",
            room_id, pages.size(), room->open_pages.size(), room->open_layers));
      }
      if (last != room->open_last) {
        return Status::InvalidArgument(absl::StrFormat(
            "room %d: SendLayers() with is_last_chunk %s for a chunk announced with %s", room_id,
            last ? "true" : "false", room->open_last ? "true" : "false"));
      }
      if (layers_done < room->open_layers) {
        return Status::InvalidArgument(
            absl::StrFormat("room %d: SendLayers() announces %d layers after %d were announced",
                            room_id, layers_done, room->open_layers));
      }
    } else if (layers_done == 0 && !completes) {
      return Status::OK();  // nothing computed yet: nothing to write
    }
    if (completes && last && !state_indices.empty()) {
      // Each family's two lists must pair up by its kind's rule (checked again when planned).
      for (const auto& info : room->infos) {
        if (info.is_dummy) continue;
        if (Status s = CheckStatePairing(layout_.Families(), info, state_indices, state_arg.counts,
                                         options_.args.page_size);
            !s.ok()) {
          return s.WithPrefix(absl::StrFormat("room %d", room_id));
        }
      }
    }
    if (room->open_layers > 0) {
      if (layers_done == room->open_layers) return Status::OK();  // already announced
      chunk.layer_begin = room->open_layers;
      chunk.dst_offset = room->open_dst_offset;
    } else {
      // The chunk opens: its pages are checked and counted once.
      if (Status s = ValidateIndices(pages, ItemCapacity(options_.args.kv), "kv page", "prefill");
          !s.ok()) {
        return s.WithPrefix(absl::StrFormat("room %d", room_id));
      }
      // A dummy room (this rank writes to nobody, R5.5) takes any chunk and writes nothing.
      const TransferInfoMsg* real = nullptr;
      for (const auto& info : room->infos) {
        if (info.is_dummy) continue;
        if (real && info.dst_kv_pages.size() != real->dst_kv_pages.size()) {
          return Status::FailedPrecondition(
              absl::StrFormat("room %d: decode ranks disagree on the page count", room_id));
        }
        if (!real) real = &info;
      }
      size_t total = room->pages_queued + pages.size();
      // Pull publishes the whole prompt; decode reads the pages after its prefix.
      size_t dst_count = real ? real->dst_kv_pages.size() : total;
      if (real && pull()) dst_count += real->decode_prefix_len / options_.args.page_size;
      if (total > dst_count || (last && total != dst_count)) {
        return Status::OutOfRange(
            absl::StrFormat("room %d: %s chunk brings the pages sent to %d but decode expects %d",
                            room_id, last ? "last" : "non-last", total, dst_count));
      }
      if (room->num_kv_pages && total > *room->num_kv_pages) {
        return Status::OutOfRange(absl::StrFormat("room %d: %d pages sent, Init() announced %d",
                                                  room_id, total, *room->num_kv_pages));
      }
      chunk.dst_offset = room->pages_queued;
      room->pages_queued = total;
    }
    // Validated: from here on the call changes the room.
    if (completes) {
      room->open_layers = 0;
      room->open_pages.clear();
      room->last_queued = last;
      chunk.last = last;
      if (last) {
        room->state_src.assign(state_indices.begin(), state_indices.end());
        room->state_src_counts.assign(state_arg.counts.begin(), state_arg.counts.end());
      }
    } else {
      if (room->open_layers == 0) {
        room->open_pages.assign(pages.begin(), pages.end());
        room->open_last = last;
        room->open_dst_offset = chunk.dst_offset;
      }
      room->open_layers = layers_done;
    }
    if (pull()) {
      room->published.push_back(
          {chunk.src_pages, chunk.dst_offset, last, chunk.layer_begin, chunk.layer_end});
      room->lease_until = absl::Now() + absl::FromChrono(options_.pull_lease);
    } else {
      ++room->outstanding;
    }
  }
  // A chunk handed over is progress: the engine is working on this request (its next chunk may
  // come a while later; a write batch completing also counts, see OnBatchDone).
  room->state->NoteProgress();
  room->state->Advance(KVPoll::kTransferring);
  if (pull()) {
    PublishPending(room);
    MaybePullSuccess(room);
    return Status::OK();
  }
  {
    MutexLock lock(&mu_);
    queue_.push_back(std::move(chunk));
  }
  work_cv_.Signal();
  return Status::OK();
}

void PrefillCore::WorkerLoop() {
  while (true) {
    Chunk chunk;
    {
      MutexLock lock(&mu_);
      while (!WorkReady()) work_cv_.Wait(&mu_);
      if (stopping_) return;
      chunk = std::move(queue_.front());
      queue_.pop_front();
    }
    ProcessChunk(chunk);
  }
}

void PrefillCore::ProcessChunk(const Chunk& chunk) {
  const auto& room = chunk.room;
  if (IsTerminal(room->state->Poll())) return OnBatchDone(room, 0, 0, Status::OK());
  if (injector_.Roll(FailureStage::kChunk)) {
    return OnBatchDone(room, 0, 0, injector_.Injected(FailureStage::kChunk, room->state->room()));
  }
  // The decode ranks this rank writes to, with the slice of their pages this chunk covers.
  struct Target {
    std::shared_ptr<Peer> peer;
    std::vector<int32_t> dst;
    size_t info = 0;               // its entry in room->infos
    std::vector<int32_t> dst_all;  // digested rooms: every page of its request
  };
  std::vector<Target> targets;
  std::optional<Status> gone;
  {
    MutexLock lock(&room->mu);
    gone = room->peer_gone;
    for (size_t i = 0; i < room->infos.size() && !gone; ++i) {
      if (room->infos[i].is_dummy || !room->peers[i]->plan.active) continue;
      const auto& dst = room->infos[i].dst_kv_pages;
      targets.push_back(
          {room->peers[i],
           std::vector<int32_t>(dst.begin() + chunk.dst_offset,
                                dst.begin() + chunk.dst_offset + chunk.src_pages.size()),
           i, room->digested ? dst : std::vector<int32_t>{}});
    }
    // One batch per decode rank; every layer's writes of the chunk go in it (SPEC R5.3). The
    // chunk was counted once when queued; each batch ends with one OnBatchDone.
    if (!targets.empty()) room->outstanding += static_cast<int>(targets.size()) - 1;
  }
  if (gone) {  // not posted: a decode rank is gone
    return OnBatchDone(room, 0, 0,
                       Status(gone->code(), std::string(gone->message()) + " (chunk not sent)"));
  }
  if (targets.empty()) return OnBatchDone(room, 0, 0, Status::OK());
  thread_local planner::PlanOutput plan;
  for (Target& t : targets) {
    plan.writes.clear();
    plan.bytes = 0;
    Status s = planner::PlanKvWrites(
        t.peer->plan, {chunk.src_pages, t.dst, chunk.last, -1, chunk.layer_begin, chunk.layer_end},
        &plan);
    if (!s.ok()) {
      OnBatchDone(room, 0, 0, s.WithPrefix(absl::StrFormat("room %d", room->state->room())));
      continue;
    }
    if (plan.writes.empty()) {  // nothing of this chunk lands on that rank (e.g. an empty chunk)
      OnBatchDone(room, 0, 0, Status::OK());
      continue;
    }
    // The corruption injected (stage corrupt) models bytes going wrong after the sender's
    // digest: such a batch is digested from the intended source by the core itself.
    const bool corrupt = injector_.Roll(FailureStage::kCorrupt) && !room->corrupted.exchange(true);
    // A digested room on a transport that digests what it sends: one CRC per write, each write
    // inside one of decode's items, and no pass of the core's own over the source.
    std::shared_ptr<SentDigest> sent;
    if (room->digested && send_digests_ && !corrupt) {
      sent = std::make_shared<SentDigest>();
      s = SplitWritesAtItems(plan.writes, t.peer->digest_items, &sent->writes);
      if (!s.ok()) {
        OnBatchDone(room, 0, 0, s.WithPrefix(absl::StrFormat("room %d", room->state->room())));
        continue;
      }
      sent->crcs.assign(sent->writes.size(), 0);
      sent->dst_pages = std::move(t.dst_all);
      sent->info = t.info;
    }
    const std::span<const planner::PlannedWrite> writes =
        sent ? std::span<const planner::PlannedWrite>(sent->writes) : plan.writes;
    std::vector<spi::WriteOp> ops = ToWriteOps(*t.peer, writes);
    if (corrupt && CorruptOneOp(&ops, false)) {
      counters_.Add(counters_.corrupted);
      PDLIB_LOG(kWarning,
                "prefill: room %d: injected corruption (stage corrupt): one write of "
                "the chunk lands its bytes shifted by one",
                room->state->room());
    }
    // A chunk announced layer by layer counts its pages once, with its last layers.
    const uint64_t bytes = plan.bytes;
    const uint64_t pages = chunk.layer_end == layout_.engine_layers() ? chunk.src_pages.size() : 0;
    auto self = shared_from_this();
    if (sent) {
      // The transport's CRCs are there when the batch completes: folded into the room's digest
      // before the batch counts as done, so the room cannot finish first.
      std::span<uint32_t> crcs(sent->crcs);
      s = transport_->PostWritesDigested(
          t.peer->peer, ops, crcs, [self, room, bytes, pages, sent, peer = t.peer](Status st) {
            if (st.ok()) {
              st = self->MergeDigest(room, *peer, sent->info, sent->dst_pages, sent->writes,
                                     sent->crcs);
            }
            self->OnBatchDone(room, bytes, pages, std::move(st));
          });
      if (!s.ok()) OnBatchDone(room, 0, 0, s.WithPrefix("posting KV writes"));
      continue;
    }
    // Otherwise a digested room digests the chunk's source pages while its writes are in
    // flight, holding one more count of the room's outstanding batches so that the room cannot
    // finish first.
    if (room->digested) {
      MutexLock lock(&room->mu);
      ++room->outstanding;
      room->digested_by_core.store(true, std::memory_order_relaxed);
    }
    s = transport_->PostWrites(t.peer->peer, ops, [self, room, bytes, pages](Status st) {
      self->OnBatchDone(room, bytes, pages, std::move(st));
    });
    if (!s.ok()) OnBatchDone(room, 0, 0, s.WithPrefix("posting KV writes"));
    if (room->digested) DigestWrites(room, *t.peer, t.info, t.dst_all, plan.writes);
  }
}

Status PrefillCore::MergeDigest(const std::shared_ptr<Room>& room, const Peer& peer, size_t info,
                                std::span<const int32_t> dst_pages,
                                std::span<const planner::PlannedWrite> writes,
                                std::span<const uint32_t> sent) {
  KvDigest part;
  {
    MutexLock lock(&room->mu);
    const KvDigest& d = room->digests[info];
    part = KvDigest::Empty(d.kv.size(), dst_pages.size(), d.aux.size(), d.state.size(),
                           d.state_spans.size());
  }
  Status s = AddWritesToDigest(writes, digest_src_, peer.digest_items, PagePositions(dst_pages),
                               &part, sent);
  if (s.ok()) {
    MutexLock lock(&room->mu);
    s = room->digests[info].Merge(part);
  }
  return s.WithPrefix(absl::StrFormat("room %d: KV digest", room->state->room()));
}

void PrefillCore::DigestWrites(const std::shared_ptr<Room>& room, const Peer& peer, size_t info,
                               std::span<const int32_t> dst_pages,
                               std::span<const planner::PlannedWrite> writes) {
  // Releases the hold ProcessChunk took.
  OnBatchDone(room, 0, 0, MergeDigest(room, peer, info, dst_pages, writes, {}));
}

std::vector<spi::WriteOp> PrefillCore::ToWriteOps(const Peer& peer,
                                                  std::span<const planner::PlannedWrite> writes) {
  std::vector<spi::WriteOp> ops;
  ops.reserve(writes.size());
  for (const planner::PlannedWrite& w : writes) {
    const RegisteredFamily* mine = &local_.kv;
    const std::vector<spi::RemoteRegionId>* theirs = &peer.kv;
    if (w.kind == planner::RegionKind::kAux) {
      mine = &local_.aux;
      theirs = &peer.aux;
    } else if (w.kind == planner::RegionKind::kState) {
      mine = &local_.state;
      theirs = &peer.state;
    }
    // The plan's buffer indices come from layouts validated against these very lists.
    ops.push_back({mine->ids[w.local_buffer], w.local_offset, (*theirs)[w.remote_buffer],
                   w.remote_offset, w.length});
  }
  return ops;
}

void PrefillCore::OnBatchDone(const std::shared_ptr<Room>& room, uint64_t bytes, uint64_t pages,
                              Status s) {
  if (!s.ok()) {
    FailRoom(room, s);
  } else if (bytes > 0) {
    room->state->NoteProgress();
    counters_.Add(counters_.bytes, bytes);
    counters_.Add(counters_.pages, pages);
    counters_.Add(counters_.batches);
  }
  bool finalize = false;
  std::optional<Status> gone;
  {
    MutexLock lock(&room->mu);
    --room->outstanding;
    if (room->outstanding == 0 && room->peer_gone) {
      gone = room->peer_gone;  // every write completed, but a decode rank is gone
    } else if (room->outstanding == 0 && room->last_queued && !room->finalizing) {
      room->finalizing = true;
      room->tail_outstanding = 1;  // Finalize's hold: nothing is drained while it decides
      finalize = true;
    }
  }
  if (gone) FailRoom(room, *gone);
  if (finalize) Finalize(room);
  MaybeDrained(room);
}

// Every KV write of the room is complete: write aux, then state, then report. Called holding
// one count of tail_outstanding (set by OnBatchDone), released here.
void PrefillCore::Finalize(const std::shared_ptr<Room>& room) {
  FinalizeTail(room);
  TailDone(room);
}

void PrefillCore::FinalizeTail(const std::shared_ptr<Room>& room) {
  if (room->state->Poll() == KVPoll::kFailed) return;
  {
    bool has_aux, has_state;
    {
      MutexLock lock(&room->mu);
      has_aux = room->aux_index.has_value();
      has_state = !room->state_src.empty();
    }
    for (auto [stage, has] :
         {std::pair{FailureStage::kAux, has_aux}, std::pair{FailureStage::kState, has_state}}) {
      if (has && injector_.Roll(stage)) {
        return FailRoom(room, injector_.Injected(stage, room->state->room()));
      }
    }
  }
  std::vector<std::pair<std::shared_ptr<Peer>, std::vector<spi::WriteOp>>> batches;
  Status planned;
  {
    thread_local planner::PlanOutput plan;
    MutexLock lock(&room->mu);
    for (size_t i = 0; i < room->infos.size() && planned.ok(); ++i) {
      const TransferInfoMsg& info = room->infos[i];
      const Peer& peer = *room->peers[i];
      if (info.is_dummy || !peer.plan.active) continue;
      planner::TailInput tail;
      if (room->aux_index && info.aux_index) {
        tail.src_aux = *room->aux_index;
        tail.dst_aux = *info.aux_index;
      }
      if (!room->state_src.empty()) {
        tail.src_state = room->state_src;
        tail.src_state_counts = room->state_src_counts;
        tail.dst_state = info.dst_state_indices;
        tail.dst_state_counts = info.dst_state_counts;
      }
      // Full-sequence state covers decode's prefix pages too.
      tail.request_pages = static_cast<int64_t>(info.decode_prefix_len / peer.plan.page_size +
                                                info.dst_kv_pages.size());
      plan.writes.clear();
      plan.bytes = 0;
      planned = planner::PlanTailWrites(peer.plan, tail, &plan);
      if (planned.ok() && room->digested) {
        planned = DigestTail(peer, info, tail, plan.writes, &room->digests[i]);
      }
      if (planned.ok()) batches.emplace_back(room->peers[i], ToWriteOps(peer, plan.writes));
    }
  }
  if (!planned.ok()) {
    return FailRoom(room, planned.WithPrefix(absl::StrFormat("room %d", room->state->room())));
  }
  // A dummy room (no batch) still ends through one_done, once.
  auto remaining =
      std::make_shared<std::atomic<int>>(std::max(1, static_cast<int>(batches.size())));
  auto self = shared_from_this();
  auto one_done = [self, room, remaining](Status s) {
    if (!s.ok()) self->FailRoom(room, s.WithPrefix("writing aux/state"));
    // acq_rel: the last finisher sees every other finisher's failure before reporting.
    if (remaining->fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    if (self->injector_.Roll(FailureStage::kStatus)) {
      return self->FailRoom(room,
                            self->injector_.Injected(FailureStage::kStatus, room->state->room()));
    }
    // Every write of the room is complete; marked before Success is visible (kv_manager.h).
    if (room->state->Poll() != KVPoll::kFailed) room->state->MarkReusable();
    if (room->state->Advance(KVPoll::kSuccess)) {
      self->counters_.CountSuccess(*room->state);
      if (room->digested && !room->digested_by_core.load(std::memory_order_relaxed)) {
        self->counters_.Add(self->counters_.checksummed_in_flight);
      }
      PDLIB_ROOM_LOG(room->state->logged(), "prefill: room %d transferred", room->state->room());
      self->SendStatusToDecode(room, Status::OK());
    }
  };
  if (batches.empty()) return one_done(Status::OK());
  for (auto& [peer, ops] : batches) {
    if (ops.empty()) {
      one_done(Status::OK());
      continue;
    }
    {
      MutexLock lock(&room->mu);
      ++room->tail_outstanding;
    }
    Status s = transport_->PostWrites(peer->peer, ops, [self, room, one_done](Status st) {
      one_done(std::move(st));
      self->TailDone(room);
    });
    if (!s.ok()) {
      one_done(s);
      TailDone(room);
    }
  }
}

Status PrefillCore::DigestTail(const Peer& peer, const TransferInfoMsg& info,
                               const planner::TailInput& tail,
                               std::span<const planner::PlannedWrite> writes,
                               KvDigest* digest) const {
  KvDigest part = EmptyDigestFor(peer, info);
  Status s = AddWritesToDigest(writes, digest_src_, peer.digest_items,
                               PagePositions(info.dst_kv_pages), &part);
  if (!s.ok()) return s;
  if (Status st = FillStateSpans(peer.plan, tail, &part); !st.ok()) return st;
  return digest->Merge(part);
}

void PrefillCore::TailDone(const std::shared_ptr<Room>& room) {
  {
    MutexLock lock(&room->mu);
    --room->tail_outstanding;
  }
  MaybeDrained(room);
}

}  // namespace v1
}  // namespace pdlib
