// PrefillCore: decode connections (Register and its checks, a connection's loss, draining the
// writes still in flight to it) and the Drained reports that free decode's pages.
#include <algorithm>
#include <string>

#include "absl/strings/str_format.h"
#include "lib/base/log_internal.h"
#include "lib/control/bootstrap_types.h"
#include "lib/core/prefill_core.h"
#include "lib/core/prefill_types.h"
#include "lib/core/transfer_layout.h"
#include "lib/core/validate.h"

namespace pdlib {
inline namespace v1 {

void PrefillCore::DisconnectPeer(spi::PeerId peer) {
  MutexLock lock(&transport_mu_);
  if (transport_) transport_->Disconnect(peer);
}

RegisterAckMsg PrefillCore::OnRegister(const RegisterMsg& msg, std::shared_ptr<DecodeLink> link) {
  RegisterAckMsg ack;
  ack.prefill_tp_rank = options_.args.parallel.tp_rank;
  ack.prefill_pp_rank = options_.args.parallel.pp_rank;
  const KVArgs& mine = options_.args;
  {
    MutexLock lock(&mu_);
    if (stopping_) {
      ack.status = Status::Unavailable("prefill manager is shutting down");
      return ack;
    }
  }
  auto refuse = [&](Status s) {
    PDLIB_LOG(kWarning, "prefill: refusing decode session %d: %s", msg.session, s.ToString());
    ack.status = std::move(s);
    return ack;
  };
  if (msg.direction != options_.direction) {
    return refuse(Status::FailedPrecondition(absl::StrFormat(
        "direction mismatch: decode uses %s, prefill uses %s (KVManagerOptions::direction must "
        "be the same on both sides)",
        TransferDirectionName(msg.direction), TransferDirectionName(options_.direction))));
  }
  if (msg.transport != transport_->name()) {
    return refuse(Status::FailedPrecondition(
        absl::StrFormat("transport mismatch: decode uses '%s', prefill uses '%s'", msg.transport,
                        transport_->name())));
  }
  if (msg.page_size != mine.page_size) {
    return refuse(Status::FailedPrecondition(absl::StrFormat(
        "page size mismatch: decode %d, prefill %d", msg.page_size, mine.page_size)));
  }
  if (const std::string diff = control::FingerprintDifference(msg.fingerprint, mine.fingerprint);
      !diff.empty()) {
    return refuse(Status::FailedPrecondition(
        absl::StrFormat("model fingerprint mismatch (decode's value first): %s", diff)));
  }
  if (Status st = CheckOpaqueCompatible(mine.kv_head_num, mine.parallel.tp_size, mine.is_mla,
                                        msg.kv_head_num, msg.parallel.tp_size, msg.is_mla);
      !st.ok()) {
    return refuse(std::move(st));
  }
  // The planner checks the rest of both shapes (heads, layouts, layers, aux, state, PP) and
  // decides what this rank writes to that one.
  auto theirs = PlannerLayout(msg);
  if (!theirs.ok()) return refuse(theirs.status());
  auto plan = planner::MakePairPlan(layout_, *theirs);
  if (!plan.ok()) return refuse(plan.status());
  uint32_t required = 1;
  if (plan->active) {
    auto n = planner::RequiredDstInfoNum(plan->topology, plan->prefill);
    if (!n.ok()) return refuse(n.status());
    required = *n;
  }

  if (injector_.Roll(FailureStage::kRegister)) {
    return refuse(Status::Internal(
        absl::StrFormat("decode session %d: injected failure at stage register (probability %g)",
                        msg.session, injector_.prob())));
  }
  auto peer = std::make_shared<Peer>();
  std::shared_ptr<Peer> old;
  spi::Blob reply;
  {
    MutexLock transport_lock(&transport_mu_);  // Shutdown destroys the transport under it
    if (!transport_) return refuse(Status::Unavailable("prefill manager is shutting down"));
    peer->session = msg.session;
    peer->reg = msg;
    peer->digest_items = DigestItemsOf(msg.kv, msg.aux, msg.state);
    peer->plan = std::move(*plan);
    peer->required_dst_info_num = required;
    peer->link = std::move(link);
    // Undoes what the transport holds for this connection (on a refusal below).
    auto undo = [&] {
      if (pull()) {
        transport_->CloseTargetEndpoint(peer->target);
      } else {
        transport_->Disconnect(peer->peer);
      }
    };
    if (pull()) {
      if (Status s = AcceptReader(msg, peer.get(), &ack); !s.ok()) return refuse(std::move(s));
    } else {
      auto conn = transport_->Connect(msg.endpoint);
      if (!conn.ok()) return refuse(conn.status().WithPrefix("connecting to decode's endpoint"));
      peer->peer = conn->peer;
      reply = std::move(conn->reply);
      for (auto [descs, ids] : {std::pair{&msg.kv, &peer->kv}, std::pair{&msg.aux, &peer->aux},
                                std::pair{&msg.state, &peer->state}}) {
        for (const RegionDesc& d : *descs) {
          auto id = transport_->ImportRemoteRegion(conn->peer, {d.addr, d.length, d.key});
          if (!id.ok()) {
            undo();
            return refuse(id.status().WithPrefix("importing decode region"));
          }
          ids->push_back(*id);
        }
      }
    }
    {
      MutexLock lock(&mu_);
      if (stopping_) {
        undo();
        return refuse(Status::Unavailable("prefill manager is shutting down"));
      }
      auto& slot = peers_[msg.session];
      old = std::move(slot);
      slot = peer;
      if (auto d = pending_drained_.find(msg.session); d != pending_drained_.end()) {
        pending_drained_count_ -= d->second.size();
        ack.drained_rooms = std::move(d->second);
        pending_drained_.erase(d);
      }
    }
  }
  ack.instance = instance_;
  if (old) {
    // The same decode session reconnected: its previous connection's rooms fail, and that
    // transport peer goes once no write to it is in flight.
    RetirePeer(
        old, Status::Unavailable(absl::StrFormat(
                 "decode session %d reconnected; its previous connection is closed", msg.session)));
  }
  ack.reply = std::move(reply);
  FillAckExtent(layout_, &ack);
  PDLIB_LOG(kInfo, "prefill: registered decode session %d (tp %d/%d pp %d/%d)%s", msg.session,
            msg.parallel.tp_rank, msg.parallel.tp_size, msg.parallel.pp_rank, msg.parallel.pp_size,
            peer->plan.active ? "" : ", dummy transfers only");
  return ack;
}

void PrefillCore::OnDecodeGone(uint64_t session, const DecodeLink* link, const Status& reason) {
  std::shared_ptr<Peer> peer;
  {
    MutexLock lock(&mu_);
    auto it = peers_.find(session);
    if (it == peers_.end()) return;
    if (link != nullptr && it->second->link.get() != link) return;  // a newer connection
    peer = std::move(it->second);
    peers_.erase(it);
    std::vector<uint64_t> dropped;  // never written: drained, for the session's next Register
    for (auto e = early_infos_.begin(); e != early_infos_.end();) {
      std::erase_if(e->second.infos, [&](const TransferInfoMsg& info) {
        if (info.session != session) return false;
        dropped.push_back(info.room);
        e->second.bytes -= EarlyInfoBytes(info);
        early_bytes_ -= EarlyInfoBytes(info);
        return true;
      });
      if (e->second.infos.empty()) {
        early_infos_.erase(e++);
      } else {
        ++e;
      }
    }
    auto& pending = pending_drained_[session];
    pending.insert(pending.end(), dropped.begin(), dropped.end());
    pending_drained_count_ += dropped.size();
  }
  RetirePeer(peer, reason);
  PDLIB_LOG(kInfo, "prefill: decode session %d disconnected: %s", session, reason.ToString());
}

void PrefillCore::RetirePeer(const std::shared_ptr<Peer>& peer, const Status& reason) {
  if (pull()) return RetireReader(peer, reason);
  std::vector<std::shared_ptr<Room>> rooms;
  {
    MutexLock lock(&mu_);
    for (auto& [id, room] : room_data_) rooms.push_back(room);
    for (auto& [id, room] : lingering_) rooms.push_back(room);
  }
  DrainingPeer draining{
      peer, absl::Now() + absl::FromChrono(options_.liveness_timeout), reason, {}};
  for (auto& room : rooms) {
    Status why = reason.WithPrefix(absl::StrFormat("room %d", room->state->room()));
    bool bound = false, busy = false, wait_chunks = false;
    {
      MutexLock lock(&room->mu);
      for (auto& p : room->peers) bound |= p == peer;
      // Any batch in flight to that peer, whatever the room's state: the transport peer stays
      // until it completes (bounded by DrainPeers).
      busy = bound && (room->outstanding > 0 || room->tail_outstanding > 0);
      // Chunk batches in flight: the room fails with their completion error if one comes.
      wait_chunks =
          busy && room->outstanding > 0 && !room->finalizing && !IsTerminal(room->state->Poll());
      if (wait_chunks) room->peer_gone = why;
    }
    if (busy) draining.rooms.push_back(room);
    if (bound && !wait_chunks) FailRoom(room, why);
  }
  if (draining.rooms.empty()) {
    DisconnectPeer(peer->peer);
    return;
  }
  // UCX 1.13 aborts a target that handles an emulated put on a connection its initiator closed:
  // never close one with puts to it in flight unless they are overdue.
  PDLIB_LOG(kInfo, "prefill: decode session %d: waiting up to %d ms for %d rooms' writes in flight",
            peer->session, static_cast<int>(options_.liveness_timeout.count()),
            static_cast<int>(draining.rooms.size()));
  MutexLock lock(&mu_);
  draining_.push_back(std::move(draining));
}

void PrefillCore::MaybeDrained(const std::shared_ptr<Room>& room) {
  std::vector<uint64_t> sessions;
  bool released = false;
  const KVPoll st = room->state->Poll();
  {
    MutexLock lock(&room->mu);
    if (room->drained || !IsTerminal(st) || room->outstanding > 0 || room->tail_outstanding > 0 ||
        room->open_readers > 0) {
      return;
    }
    room->drained = true;
    room->state->MarkReusable();
    released = room->released;
    // Success needs no notice: decode's room succeeded (or will hear of the drain if it failed
    // it meanwhile, through its Abort, see OnAbort).
    if (st == KVPoll::kFailed) {
      for (const auto& info : room->infos) {
        if (std::find(sessions.begin(), sessions.end(), info.session) == sessions.end()) {
          sessions.push_back(info.session);
        }
      }
    }
  }
  if (st == KVPoll::kFailed) undrained_.fetch_sub(1, std::memory_order_relaxed);
  if (released) {
    MutexLock lock(&mu_);
    released_.Add(room->state->room());
    if (auto l = lingering_.find(room->state->room()); l != lingering_.end() && l->second == room) {
      lingering_.erase(l);
    }
  }
  // Pull: decode's pages were never exposed to this rank; nothing to report.
  if (pull()) return;
  for (uint64_t session : sessions) SendDrained(session, {room->state->room()});
}

void PrefillCore::SendDrained(uint64_t session, std::vector<uint64_t> rooms) {
  // Far above what one decode session can have failed while away; past it the oldest notices
  // are dropped (their pages stay quarantined on decode until this instance is gone) and said.
  constexpr size_t kMaxPendingDrained = size_t{1} << 18;
  std::shared_ptr<DecodeLink> link;
  {
    MutexLock lock(&mu_);
    if (auto it = peers_.find(session); it != peers_.end()) {
      link = it->second->link;
    } else if (!stopping_) {
      if (pending_drained_count_ + rooms.size() > kMaxPendingDrained) {
        PDLIB_LOG(kError,
                  "prefill: %d drained-room notices wait for disconnected decode sessions; "
                  "dropping room %d's for session %d (its pages stay quarantined there)",
                  pending_drained_count_, rooms.front(), session);
        return;
      }
      auto& pending = pending_drained_[session];
      pending.insert(pending.end(), rooms.begin(), rooms.end());
      pending_drained_count_ += rooms.size();
      return;
    }
  }
  if (!link) return;
  link->SendDrained({instance_, options_.args.parallel.tp_rank, options_.args.parallel.pp_rank,
                     std::move(rooms)});
}

// A failed transport peer never recovers, and decode, whose control stream is still up, would go
// on sending this session's TransferInfos: every later request would fail with the old reason.
// The stream is closed instead; decode drops the connection and registers again (a fresh endpoint,
// a fresh transport peer) for its next request.
void PrefillCore::ReplaceFailedPeers() {
  if (pull()) return;  // decode is the initiator: it notices its own failed peer
  std::vector<std::shared_ptr<Peer>> peers;
  {
    MutexLock lock(&mu_);
    if (stopping_) return;
    peers.reserve(peers_.size());
    for (auto& [session, peer] : peers_) peers.push_back(peer);
  }
  std::vector<std::pair<std::shared_ptr<Peer>, Status>> failed;
  {
    MutexLock transport_lock(&transport_mu_);
    if (!transport_) return;
    for (auto& peer : peers) {
      if (Status s = transport_->PeerStatus(peer->peer); !s.ok()) failed.emplace_back(peer, s);
    }
  }
  for (auto& [peer, why] : failed) {
    Status reason = Status::Unavailable(absl::StrFormat(
        "prefill tp %d pp %d: the transport connection to decode session %d failed (%s); its "
        "control stream is closed so that the next request connects again",
        options_.args.parallel.tp_rank, options_.args.parallel.pp_rank, peer->session,
        why.ToString()));
    PDLIB_LOG(kWarning, "%s", reason.message());
    // Closed first: a decode that registers again at once retires this peer itself (OnRegister),
    // and the OnDecodeGone below then finds a newer connection and does nothing.
    peer->link->Close(reason);
    OnDecodeGone(peer->session, peer->link.get(), reason);
  }
}

// Drops the transport peers of ended decode connections once their rooms' writes are resolved,
// or at their deadline, failing the rooms still waiting.
void PrefillCore::DrainPeers(absl::Time now) {
  std::vector<DrainingPeer> pending, done;
  {
    MutexLock lock(&mu_);
    if (draining_.empty()) return;
    pending.swap(draining_);
  }
  // Room locks are taken with mu_ released.
  std::vector<DrainingPeer> keep;
  for (DrainingPeer& d : pending) {
    const bool settled =
        now >= d.deadline || std::all_of(d.rooms.begin(), d.rooms.end(), [](const auto& room) {
          MutexLock room_lock(&room->mu);
          return room->outstanding == 0 && room->tail_outstanding == 0;
        });
    (settled ? done : keep).push_back(std::move(d));
  }
  if (!keep.empty()) {
    MutexLock lock(&mu_);
    for (DrainingPeer& d : keep) draining_.push_back(std::move(d));
  }
  for (DrainingPeer& d : done) {
    for (auto& room : d.rooms) {
      FailRoom(room,
               d.reason.WithPrefix(absl::StrFormat(
                   "room %d (its writes in flight had not completed %d ms later)",
                   room->state->room(), static_cast<int>(options_.liveness_timeout.count()))));
    }
    DisconnectPeer(d.peer->peer);
  }
}

}  // namespace v1
}  // namespace pdlib
