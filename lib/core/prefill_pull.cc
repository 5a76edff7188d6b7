// PrefillCore in pull (KVManagerOptions::direction kPull): decode reads this rank's pages. Send()
// publishes chunks instead of writing them; each decode rank that reads from this rank (a
// "reader": a real TransferInfo whose plan is active) gets a ReadReady per chunk, in order, once
// its TransferInfo is in, reads, and answers with ReadsDone. The room succeeds when every reader
// has read everything; its pages are held until then under a lease that decode's heartbeats
// renew, and a failed room's pages are reusable once no reader's reads can still run.
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

Status PrefillCore::AcceptReader(const RegisterMsg& msg, Peer* peer, RegisterAckMsg* ack) {
  (void)msg;
  auto target = transport_->CreateTargetEndpoint();
  if (!target.ok()) return target.status().WithPrefix("creating the endpoint decode reads through");
  peer->target = target->id;
  ack->source = DescribeRank(options_, layout_, local_, std::string(transport_->name()), instance_,
                             std::move(target->blob));
  ack->lease_ms = static_cast<uint32_t>(options_.pull_lease.count());
  return Status::OK();
}

void PrefillCore::OnPullConnect(const PullConnectMsg& msg) {
  std::shared_ptr<Peer> peer;
  {
    MutexLock lock(&mu_);
    if (auto it = peers_.find(msg.session); it != peers_.end()) peer = it->second;
  }
  if (!peer || !pull()) {
    PDLIB_LOG(kWarning, "prefill: PullConnect from session %d ignored (%s)", msg.session,
              pull() ? "unknown session" : "this rank pushes");
    return;
  }
  MutexLock lock(&transport_mu_);
  if (!transport_ || !transport_->capabilities().needs_reply) return;
  if (Status s = transport_->CompleteTargetEndpoint(peer->target, msg.reply); !s.ok()) {
    // Decode's reads over this connection will fail, and fail their rooms with the reason.
    PDLIB_LOG(kError, "prefill: completing decode session %d's read endpoint failed: %s",
              msg.session, s.ToString());
  }
}

Status PrefillCore::AddReader(Room& room, const TransferInfoMsg& info, bool reads) {
  if (reads && !room.published.empty()) {
    const uint64_t want =
        info.decode_prefix_len / options_.args.page_size + info.dst_kv_pages.size();
    if (room.pages_queued > want || (room.last_queued && room.pages_queued != want)) {
      return Status::OutOfRange(absl::StrFormat(
          "room %d: %d pages published, but decode session %d expects %d (%d after its prefix)",
          room.state->room(), room.pages_queued, info.session, want, info.dst_kv_pages.size()));
    }
  }
  if (reads && room.last_queued && !room.state_src.empty()) {
    if (Status s = CheckStatePairing(layout_.Families(), info, room.state_src,
                                     room.state_src_counts, options_.args.page_size);
        !s.ok()) {
      return s.WithPrefix(absl::StrFormat("room %d", room.state->room()));
    }
  }
  room.sent_to.push_back(0);
  room.reads_open.push_back(0);
  room.reads_ok.push_back(0);
  room.lease_until = absl::Now() + absl::FromChrono(options_.pull_lease);
  return Status::OK();
}

void PrefillCore::PublishPending(const std::shared_ptr<Room>& room) {
  MutexLock publish_lock(&room->publish_mu);
  std::vector<std::pair<std::shared_ptr<Peer>, ReadReadyMsg>> out;
  std::vector<TransferInfoMsg> readers;  // digested rooms: each message's reader's request
  {
    MutexLock lock(&room->mu);
    if (IsTerminal(room->state->Poll())) return;
    const int32_t layers = layout_.engine_layers();
    for (size_t i = 0; i < room->infos.size(); ++i) {
      if (room->infos[i].is_dummy || !room->peers[i]->plan.active) continue;
      // State pairs up only once both lists are known: checked when the last chunk is published
      // after the TransferInfo (SendLayers) or here, when the TransferInfo came after it.
      while (room->sent_to[i] < room->published.size()) {
        const PublishedChunk& p = room->published[room->sent_to[i]++];
        ReadReadyMsg m;
        m.room = room->state->room();
        m.prefill_tp_rank = options_.args.parallel.tp_rank;
        m.prefill_pp_rank = options_.args.parallel.pp_rank;
        m.src_pages = p.pages;
        m.src_offset = p.offset;
        m.last = p.last;
        m.layer_begin = p.layer_begin;
        m.layer_end = p.layer_end;
        if (p.last && p.layer_end == layers) {
          m.aux_index = room->aux_index;
          m.state_indices = room->state_src;
          m.state_counts = room->state_src_counts;
        }
        out.emplace_back(room->peers[i], std::move(m));
        if (room->digested) readers.push_back(room->infos[i]);
        if (!room->reads_open[i]) {
          room->reads_open[i] = 1;
          ++room->open_readers;
        }
      }
    }
  }
  // KV integrity: each message carries the digest of what that reader will read of the chunk,
  // planned as decode plans its reads; computed here, off the room's lock, while earlier chunks
  // are being read.
  for (size_t k = 0; k < readers.size() && k < out.size(); ++k) {
    auto& [peer, msg] = out[k];
    Status s = DigestOffer(*peer, readers[k], &msg);
    if (!s.ok()) {
      FailRoom(room, s.WithPrefix(absl::StrFormat("room %d: KV digest", room->state->room())));
      return;
    }
  }
  for (auto& [peer, msg] : out) peer->link->SendReadReady(msg);
}

Status PrefillCore::DigestOffer(const Peer& peer, const TransferInfoMsg& info,
                                ReadReadyMsg* msg) const {
  thread_local planner::PlanOutput plan;
  uint64_t dst_begin = 0, dst_end = 0;
  bool final = false;
  planner::TailInput tail;
  if (Status s =
          PlanPublishedChunk(peer.plan, info, *msg, &plan, &dst_begin, &dst_end, &final, &tail);
      !s.ok()) {
    return s;
  }
  KvDigest part = EmptyDigestFor(peer, info);
  if (Status s = AddWritesToDigest(plan.writes, digest_src_, peer.digest_items,
                                   PagePositions(info.dst_kv_pages), &part);
      !s.ok()) {
    return s;
  }
  if (final) {
    if (Status s = FillStateSpans(peer.plan, tail, &part); !s.ok()) return s;
  }
  msg->digest = std::move(part);
  return Status::OK();
}

void PrefillCore::MaybePullSuccess(const std::shared_ptr<Room>& room) {
  {
    MutexLock lock(&room->mu);
    if (!room->last_queued || room->infos.empty() ||
        room->infos.size() < room->infos.front().required_dst_info_num) {
      return;
    }
    for (size_t i = 0; i < room->infos.size(); ++i) {
      if (room->infos[i].is_dummy || !room->peers[i]->plan.active) continue;
      if (room->sent_to[i] < room->published.size() || room->reads_open[i] || !room->reads_ok[i]) {
        return;
      }
    }
  }
  if (IsTerminal(room->state->Poll())) return;
  if (injector_.Roll(FailureStage::kStatus)) {
    return FailRoom(room, injector_.Injected(FailureStage::kStatus, room->state->room()));
  }
  // Every reader is done: nothing reads the pages any more. Marked before Success is visible.
  room->state->MarkReusable();
  if (room->state->Advance(KVPoll::kSuccess)) {
    counters_.CountSuccess(*room->state);
    PDLIB_ROOM_LOG(room->state->logged(), "prefill: room %d read by every decode rank",
                   room->state->room());
    SendStatusToDecode(room, Status::OK());
  }
  MaybeDrained(room);
}

bool PrefillCore::CloseReader(Room& room, size_t reader, bool ok) {
  if (reader >= room.reads_open.size() || !room.reads_open[reader]) return false;
  room.reads_open[reader] = 0;
  room.reads_ok[reader] = ok ? 1 : 0;
  --room.open_readers;
  return true;
}

void PrefillCore::OnReadsDone(const ReadsDoneMsg& msg) {
  auto room = FindRoomOrLingering(msg.room);
  if (!room) return;
  bool closed = false;
  {
    MutexLock lock(&room->mu);
    for (size_t i = 0; i < room->infos.size(); ++i) {
      if (room->infos[i].session == msg.session) closed |= CloseReader(*room, i, msg.status.ok());
    }
  }
  if (!closed) return;  // a duplicate, or a session that was never published to
  if (!msg.status.ok()) {
    FailRoom(room, msg.status.WithPrefix(absl::StrFormat(
                       "room %d: decode session %d could not read it", msg.room, msg.session)));
  } else {
    MaybePullSuccess(room);
  }
  MaybeDrained(room);
}

void PrefillCore::OnHeartbeat(const HeartbeatMsg& msg) {
  std::vector<std::shared_ptr<Room>> rooms;
  {
    MutexLock lock(&mu_);
    if (!peers_.contains(msg.session)) return;
    for (uint64_t id : msg.rooms) {
      if (auto it = room_data_.find(id); it != room_data_.end()) rooms.push_back(it->second);
    }
  }
  const absl::Time until = absl::Now() + absl::FromChrono(options_.pull_lease);
  for (auto& room : rooms) {
    MutexLock lock(&room->mu);
    if (room->lease_until) room->lease_until = std::max(*room->lease_until, until);
  }
}

void PrefillCore::CheckLeases(absl::Time now, const std::vector<std::shared_ptr<Room>>& rooms) {
  for (const auto& room : rooms) {
    std::optional<absl::Time> until, readers_by;
    int open = 0;
    bool published = false, decode_came = false;
    {
      MutexLock lock(&room->mu);
      until = room->lease_until;
      readers_by = room->readers_deadline;
      open = room->open_readers;
      published = !room->published.empty();
      decode_came = !room->infos.empty();
    }
    const KVPoll st = room->state->Poll();
    if (until && !IsTerminal(st) && now > *until) {
      PDLIB_LOG(kWarning,
                "prefill: room %d: pull lease of %d ms expired with %d decode rank(s) still "
                "reading; freeing its pages",
                room->state->room(), static_cast<int>(options_.pull_lease.count()), open);
      const char* why = open > 0      ? "decode did not report its reads done"
                        : published   ? "no decode rank came to read the pages"
                        : decode_came ? "the engine published nothing"
                                      : "the engine published nothing and no decode rank came";
      FailRoom(room, Status::DeadlineExceeded(
                         absl::StrFormat("room %d: pull lease of %d ms expired (%s)",
                                         room->state->room(), options_.pull_lease.count(), why)));
      continue;
    }
    if (st != KVPoll::kFailed || open == 0) continue;
    if (!readers_by) {
      MutexLock lock(&room->mu);
      if (!room->readers_deadline) {
        room->readers_deadline = now + absl::FromChrono(options_.liveness_timeout);
      }
      continue;
    }
    if (now <= *readers_by) continue;
    // A reader of a failed room that never said its reads are over: a read can only copy these
    // pages into that decode's room, which failed too, so they are given back.
    {
      MutexLock lock(&room->mu);
      for (size_t i = 0; i < room->reads_open.size(); ++i) CloseReader(*room, i, false);
    }
    PDLIB_LOG(kError,
              "prefill: room %d: %d decode rank(s) did not report their reads over %d ms after "
              "the room failed; its pages are reusable (a late read lands only in that failed "
              "request's pages on decode)",
              room->state->room(), open, static_cast<int>(options_.liveness_timeout.count()));
    MaybeDrained(room);
  }
}

void PrefillCore::RetireReader(const std::shared_ptr<Peer>& peer, const Status& reason) {
  // Cut the reader off first where the transport can: from then on no read of ours lands there.
  bool fenced = false;
  {
    MutexLock lock(&transport_mu_);
    if (transport_ && transport_->capabilities().fences) {
      fenced = transport_->FenceTarget(peer->target).ok();
    }
  }
  std::vector<std::shared_ptr<Room>> rooms;
  {
    MutexLock lock(&mu_);
    for (auto& [id, room] : room_data_) rooms.push_back(room);
    for (auto& [id, room] : lingering_) rooms.push_back(room);
  }
  for (auto& room : rooms) {
    bool bound = false;
    {
      MutexLock lock(&room->mu);
      for (size_t i = 0; i < room->peers.size(); ++i) {
        if (room->peers[i] != peer) continue;
        bound = true;
        // The session is gone (its stream ended: decode fails the room and its own reads end
        // with the connection); where it was fenced nothing more can be read at all.
        CloseReader(*room, i, false);
      }
    }
    if (!bound) continue;
    FailRoom(room, reason.WithPrefix(absl::StrFormat("room %d", room->state->room())));
    MaybeDrained(room);
  }
  PDLIB_LOG(kInfo, "prefill: decode session %d's read endpoint closed%s", peer->session,
            fenced ? " (fenced)" : "");
  MutexLock lock(&transport_mu_);
  if (transport_) transport_->CloseTargetEndpoint(peer->target);
}

}  // namespace v1
}  // namespace pdlib
