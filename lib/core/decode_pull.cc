// DecodeCore in pull (KVManagerOptions::direction kPull): this rank reads prefill's published
// pages into its own. Each prefill rank's ReadReady names a chunk of prefill's pages; the chunk
// is planned with the same planner as a push (prefill -> this rank) and every planned write is
// posted reversed, as a read, in one batch. When a rank's last chunk and every batch from it are
// done, ReadsDone tells it so; the room succeeds when every such rank confirms (OnStatus), and
// its pages are held while any read batch is in flight, whatever the room's state.
#include <algorithm>
#include <string>

#include "absl/strings/str_format.h"
#include "lib/base/log_internal.h"
#include "lib/core/decode_core.h"
#include "lib/core/decode_types.h"
#include "lib/core/transfer_layout.h"

namespace pdlib {
inline namespace v1 {

StatusOr<std::shared_ptr<const DecodeCore::ReadSource>> DecodeCore::ConnectReadSource(
    const RegisterAckMsg& ack, PrefillLink& link) {
  if (!ack.source) {
    return Status::FailedPrecondition(
        "the RegisterAck does not describe prefill's pages (a prefill that pushes?)");
  }
  if (ack.source->direction != TransferDirection::kPull) {
    return Status::FailedPrecondition("prefill's RegisterAck describes a pushing rank");
  }
  auto theirs = PlannerLayout(*ack.source, "prefill");
  if (!theirs.ok()) return theirs.status();
  auto plan = planner::MakePairPlan(*theirs, layout_);
  if (!plan.ok()) return plan.status();
  auto source = std::make_shared<ReadSource>();
  source->plan = std::move(*plan);
  source->heartbeat_every = absl::Milliseconds(std::max<uint32_t>(ack.lease_ms, 300) / 3);
  MutexLock lock(&transport_mu_);
  if (!transport_) return Status::Unavailable("decode manager is shutting down");
  auto conn = transport_->Connect(ack.source->endpoint);
  if (!conn.ok()) return conn.status().WithPrefix("connecting to prefill's endpoint");
  source->peer = conn->peer;
  for (auto [descs, ids] :
       {std::pair{&ack.source->kv, &source->kv}, std::pair{&ack.source->aux, &source->aux},
        std::pair{&ack.source->state, &source->state}}) {
    for (const RegionDesc& d : *descs) {
      auto id = transport_->ImportRemoteRegion(conn->peer, {d.addr, d.length, d.key});
      if (!id.ok()) {
        transport_->Disconnect(conn->peer);
        return id.status().WithPrefix("importing prefill region");
      }
      ids->push_back(*id);
    }
  }
  // Before any TransferInfo on this link: prefill completes its endpoint before it publishes.
  link.SendPullConnect({session_, std::move(conn->reply)});
  return std::shared_ptr<const ReadSource>(std::move(source));
}

void DecodeCore::OnReadReady(const std::string& key, const ReadReadyMsg& msg) {
  std::shared_ptr<const ReadSource> source;
  std::shared_ptr<PrefillLink> link;
  {
    MutexLock lock(&mu_);
    if (auto it = connections_.find(key); it != connections_.end()) {
      source = it->second.source;
      link = it->second.link;
    }
  }
  if (!link) return;  // the connection is gone: prefill retires this session's readers itself
  auto refuse = [&](const Status& why) {
    PDLIB_LOG(kWarning, "decode: room %d: ReadReady from prefill %s refused: %s", msg.room, key,
              why.ToString());
    link->SendReadsDone({msg.room, session_, why});
  };
  if (!source) return refuse(Status::FailedPrecondition("this decode rank pushes"));
  const planner::RankId from{msg.prefill_tp_rank, msg.prefill_pp_rank};
  auto room = FindRoom(msg.room);
  if (!room) {
    return refuse(Status::NotFound(absl::StrFormat("room %d is not live here", msg.room)));
  }
  // Plan first (no lock: the ReadSource is immutable, the room's request fixed after Init).
  size_t index = 0;
  bool found = false;
  TransferInfoMsg info;
  {
    MutexLock lock(&room->mu);
    for (size_t i = 0; i < room->prefills.size() && i < room->pull.size(); ++i) {
      if (room->prefills[i].key == key && !room->prefills[i].target.dummy &&
          room->prefills[i].target.rank == from) {
        index = i;
        found = true;
      }
    }
    if (found) {
      room->pull[index].published = true;
      info = room->info;
    }
  }
  if (!found) {
    return refuse(Status::InvalidArgument(
        absl::StrFormat("room %d: prefill tp %d pp %d at %s is not a rank this room reads from",
                        msg.room, from.tp_rank, from.pp_rank, key)));
  }
  // A room that is over reads nothing more: that rank hears its reads are over.
  if (IsTerminal(room->state->Poll())) return SendReadsDone(room);
  thread_local planner::PlanOutput out;
  uint64_t dst_begin = 0, dst_end = 0;
  bool final = false;
  Status planned = PlanPublishedChunk(source->plan, info, msg, &out, &dst_begin, &dst_end, &final);
  if (planned.ok() && room->digested) {
    // KV integrity: what prefill says this chunk offers this rank.
    MutexLock lock(&room->mu);
    planned = !msg.digest              ? Status::FailedPrecondition(absl::StrFormat(
                                             "room %d: a ReadReady without a KV digest (prefill's checksum "
                                                          "setting differs from this rank's?)",
                                             msg.room))
              : !room->digest_expected ? Status::FailedPrecondition("a ReadReady before Init()")
                                       : room->digest_expected->Merge(*msg.digest);
    if (!planned.ok()) planned = Status::DataLoss(std::string(planned.message()));
  }
  if (!planned.ok()) {
    FailRoom(room, planned.WithPrefix(absl::StrFormat("prefill %s", key)), true);
    return SendReadsDone(room);  // whether or not this call was the one that failed it
  }
  // The planner's writes, reversed: prefill's buffer is the remote side of a read.
  std::vector<spi::ReadOp> ops;
  AppendReads(out.writes, {local_.kv.ids, local_.aux.ids, local_.state.ids},
              {source->kv, source->aux, source->state}, &ops);
  if (!ops.empty() && injector_.Roll(FailureStage::kCorrupt) && !room->corrupted.exchange(true) &&
      CorruptOneOp(&ops, true)) {
    counters_.Add(counters_.corrupted);
    PDLIB_LOG(kWarning,
              "decode: room %d: injected corruption (stage corrupt): one read of the "
              "chunk lands its bytes shifted by one",
              msg.room);
  }
  const uint32_t layers = static_cast<uint32_t>(msg.layer_end - msg.layer_begin);
  const uint64_t bytes = out.bytes;
  bool counted = true;
  {
    // Checked and counted in one step: a room failing meanwhile either sees this batch (and
    // holds its pages until the batch is over) or is seen failed here (nothing is posted).
    MutexLock lock(&room->mu);
    if (IsTerminal(room->state->Poll())) {
      counted = false;
    } else {
      ++room->pull[index].outstanding;
      ++room->reads_outstanding;
      room->pull[index].final_seen |= final;
    }
  }
  if (!counted) return SendReadsDone(room);
  if (ops.empty()) {
    // Nothing of this chunk is this rank's to read (the prefix, an empty last chunk).
    return OnReadBatchDone(room, index, dst_begin, dst_end, layers, 0, Status::OK());
  }
  auto self = shared_from_this();
  room->state->NoteProgress();  // prefill published and reads go out: the transfer started
  Status posted;
  {
    MutexLock lock(&transport_mu_);
    posted = transport_ ? transport_->PostReads(
                              source->peer, ops,
                              [self, room, index, dst_begin, dst_end, layers, bytes](Status st) {
                                self->OnReadBatchDone(room, index, dst_begin, dst_end, layers,
                                                      bytes, std::move(st));
                              })
                        : Status::Unavailable("decode manager is shutting down");
  }
  if (!posted.ok()) {
    OnReadBatchDone(room, index, dst_begin, dst_end, layers, 0, posted.WithPrefix("posting reads"));
  }
}

void DecodeCore::OnReadBatchDone(const std::shared_ptr<Room>& room, size_t source,
                                 uint64_t dst_begin, uint64_t dst_end, uint32_t layers,
                                 uint64_t bytes, Status status) {
  {
    MutexLock lock(&room->mu);
    --room->pull[source].outstanding;
    --room->reads_outstanding;
    if (status.ok()) {
      for (uint64_t i = dst_begin; i < dst_end && i < room->page_layers.size(); ++i) {
        room->page_layers[i] += layers;
      }
    } else {
      room->pull[source].failed = true;
    }
  }
  if (status.ok() && bytes > 0) {
    room->state->NoteProgress();
    counters_.Add(counters_.bytes, bytes);
    counters_.Add(counters_.batches);
  }
  if (!status.ok()) {
    std::string key;
    {
      MutexLock lock(&room->mu);
      key = room->prefills[source].key;
    }
    FailRoom(room,
             status.WithPrefix(
                 absl::StrFormat("room %d: reading from prefill %s", room->state->room(), key)),
             true);
  }
  SendReadsDone(room);
  ReleaseReadHold(room);
}

void DecodeCore::SendReadsDone(const std::shared_ptr<Room>& room) {
  std::vector<std::pair<std::string, Status>> done;
  const bool failed = room->state->Poll() == KVPoll::kFailed;
  {
    MutexLock lock(&room->mu);
    for (size_t i = 0; i < room->pull.size(); ++i) {
      auto& p = room->pull[i];
      if (!p.published || p.done_sent || p.outstanding > 0) continue;
      if (!failed && !p.final_seen) continue;  // more chunks to come from that rank
      p.done_sent = true;
      Status st;
      if (p.failed || failed) {
        st = failed ? room->state->FailureReason()
                    : Status::Unavailable(
                          absl::StrFormat("room %d: a read failed", room->state->room()));
      }
      done.emplace_back(room->prefills[i].key, std::move(st));
    }
  }
  for (auto& [key, st] : done) {
    std::shared_ptr<PrefillLink> link;
    {
      MutexLock lock(&mu_);
      if (auto it = connections_.find(key); it != connections_.end()) link = it->second.link;
    }
    if (link) link->SendReadsDone({room->state->room(), session_, st});
  }
}

void DecodeCore::ReleaseReadHold(const std::shared_ptr<Room>& room) {
  {
    MutexLock lock(&room->mu);
    if (!room->quarantined || room->reads_outstanding > 0) return;
    for (const Exposure& e : room->exposed) {
      if (e.open) return;
    }
    room->quarantined = false;
  }
  {
    MutexLock lock(&mu_);
    quarantine_.erase(room.get());
    ++released_by_[static_cast<int>(Release::kDrained)];
  }
  MutexLock lock(&room->mu);
  room->state->MarkReusable();
  if (room->released) released_.Add(room->state->room());
}

void DecodeCore::DropFailedSources() {
  struct Source {
    std::string key;
    uint64_t gen;
    spi::PeerId peer;
  };
  std::vector<Source> sources;
  {
    MutexLock lock(&mu_);
    for (auto& [key, conn] : connections_) {
      if (conn.source) sources.push_back({key, conn.gen, conn.source->peer});
    }
  }
  if (sources.empty()) return;
  std::vector<std::pair<Source, Status>> failed;
  {
    MutexLock transport_lock(&transport_mu_);
    if (!transport_) return;
    for (Source& s : sources) {
      if (Status st = transport_->PeerStatus(s.peer); !st.ok()) failed.emplace_back(s, st);
    }
  }
  for (auto& [source, why] : failed) {
    {
      MutexLock lock(&mu_);
      auto it = connections_.find(source.key);
      if (it == connections_.end() || it->second.gen != source.gen) continue;  // replaced
    }
    OnPrefillGone(source.key, Status::Unavailable(absl::StrFormat(
                                  "the transport connection to prefill %s failed (%s); the next "
                                  "request connects again",
                                  source.key, why.ToString())));
  }
}

void DecodeCore::SendHeartbeats(absl::Time now) {
  std::vector<std::pair<std::string, std::shared_ptr<PrefillLink>>> due;
  {
    MutexLock lock(&mu_);
    for (auto& [key, conn] : connections_) {
      if (!conn.source || now < conn.next_heartbeat) continue;
      conn.next_heartbeat = now + conn.source->heartbeat_every;
      due.emplace_back(key, conn.link);
    }
  }
  if (due.empty()) return;
  std::vector<std::shared_ptr<Room>> rooms;
  {
    MutexLock lock(&mu_);
    for (auto& [id, room] : room_data_) rooms.push_back(room);
  }
  for (auto& [key, link] : due) {
    HeartbeatMsg beat{session_, {}};
    for (auto& room : rooms) {
      if (IsTerminal(room->state->Poll())) continue;
      MutexLock lock(&room->mu);
      for (const BoundPrefill& p : room->prefills) {
        if (p.key == key && !p.target.dummy) {
          beat.rooms.push_back(room->state->room());
          break;
        }
      }
    }
    if (!beat.rooms.empty()) link->SendHeartbeat(beat);
  }
}

std::vector<int32_t> DecodeCore::InvalidPages(uint64_t room_id, const RoomState* state) const {
  if (state->Poll() != KVPoll::kFailed) return {};
  std::shared_ptr<Room> room;
  {
    MutexLock lock(&mu_);
    if (auto it = room_data_.find(room_id);
        it != room_data_.end() && it->second->state.get() == state) {
      room = it->second;
    }
  }
  if (!room) return {};
  MutexLock lock(&room->mu);
  if (!pull() || room->page_layers.size() != room->info.dst_kv_pages.size()) {
    return room->info.dst_kv_pages;  // push (or never sent): decode cannot tell what landed
  }
  std::vector<int32_t> out;
  for (size_t i = 0; i < room->page_layers.size(); ++i) {
    if (room->page_layers[i] < room->layers_expected) out.push_back(room->info.dst_kv_pages[i]);
  }
  // Pages read in full whose bytes did not match the KV digest.
  for (int32_t p : room->corrupt_pages) {
    if (std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
  }
  return out;
}

}  // namespace v1
}  // namespace pdlib
