#include "lib/core/prefill_core.h"

#include <algorithm>
#include <random>
#include <string>

#include "absl/strings/str_format.h"
#include "lib/base/log_internal.h"
#include "lib/control/bootstrap_types.h"
#include "lib/core/transfer_layout.h"
#include "lib/core/validate.h"

namespace pdlib {
inline namespace v1 {

// One connected decode manager.
struct PrefillCore::Peer {
  uint64_t session = 0;
  spi::PeerId peer = 0;
  RegisterMsg reg;
  planner::PairPlan plan;              // what this prefill rank writes to that decode rank
  uint32_t required_dst_info_num = 1;  // TransferInfos per room, when the plan is active
  std::vector<spi::RemoteRegionId> kv, aux, state;
  std::shared_ptr<DecodeLink> link;
};

// Everything prefill tracks for one live request.
struct PrefillCore::Room {
  explicit Room(std::shared_ptr<RoomState> s) : state(std::move(s)) {}
  const std::shared_ptr<RoomState> state;
  Mutex mu;
  std::optional<uint64_t> num_kv_pages ABSL_GUARDED_BY(mu);
  std::optional<uint32_t> aux_index ABSL_GUARDED_BY(mu);
  // One TransferInfo per decode rank this room writes to, each with its connection.
  std::vector<TransferInfoMsg> infos ABSL_GUARDED_BY(mu);
  std::vector<std::shared_ptr<Peer>> peers ABSL_GUARDED_BY(mu);
  size_t pages_queued ABSL_GUARDED_BY(mu) = 0;
  bool last_queued ABSL_GUARDED_BY(mu) = false;
  int outstanding ABSL_GUARDED_BY(mu) = 0;  // chunk batches posted, not yet complete
  bool finalizing ABSL_GUARDED_BY(mu) = false;
  std::vector<int32_t> state_src ABSL_GUARDED_BY(mu);
  bool status_sent ABSL_GUARDED_BY(mu) = false;
  // Set when a decode rank of this room went away while chunk batches were in flight: the room
  // fails with the transport's completion error if one comes, else with this once they are done.
  std::optional<Status> peer_gone ABSL_GUARDED_BY(mu);
  // aux/state batches in flight, plus one while Finalize is deciding what to post.
  int tail_outstanding ABSL_GUARDED_BY(mu) = 0;
  bool drained ABSL_GUARDED_BY(mu) = false;   // terminal, nothing in flight: pages reusable
  bool released ABSL_GUARDED_BY(mu) = false;  // the sender was destroyed before that
};

// A decode connection that ended while KV writes to it were in flight. Its transport peer stays
// up until those writes complete (a dead peer makes them fail with the transport's own error,
// e.g. an RDMA work-completion status) or `deadline` passes, so that the rooms report the cause
// rather than only "stream ended".
struct PrefillCore::DrainingPeer {
  std::shared_ptr<Peer> peer;
  absl::Time deadline;
  Status reason;
  std::vector<std::shared_ptr<Room>> rooms;
};

StatusOr<std::shared_ptr<PrefillCore>> PrefillCore::Create(
    const KVManagerOptions& options, std::unique_ptr<spi::Transport> transport) {
  std::shared_ptr<PrefillCore> core(new PrefillCore(options, std::move(transport)));
  auto layout = PlannerLayout(options.args, "prefill");
  if (!layout.ok()) return layout.status();
  core->layout_ = std::move(*layout);
  auto local = RegisterBuffers(*core->transport_, options.args);
  if (!local.ok()) return local.status();
  core->local_ = std::move(*local);
  for (int i = 0; i < options.transfer_workers; ++i) {
    core->workers_.emplace_back([c = core.get()] { c->WorkerLoop(); });
  }
  core->reaper_ = std::make_unique<PeriodicThread>(absl::Milliseconds(20),
                                                   [c = core.get()] { c->CheckTimeouts(); });
  if (core->injector_.enabled()) {
    PDLIB_LOG(kWarning, "prefill: failure injection on, probability %g", core->injector_.prob());
  }
  return core;
}

namespace {
uint64_t RandomInstance() {
  std::random_device rd;
  uint64_t id = 0;
  while (id == 0) id = (uint64_t{rd()} << 32) ^ rd();
  return id;
}
}  // namespace

PrefillCore::PrefillCore(const KVManagerOptions& options, std::unique_ptr<spi::Transport> transport)
    : options_(options),
      instance_(RandomInstance()),
      transport_(std::move(transport)),
      injector_(ResolveFailureInjectionProb(options), ResolveFailureStages(options)) {}

PrefillCore::~PrefillCore() { Shutdown(); }

void PrefillCore::Shutdown() {
  std::vector<std::shared_ptr<Room>> rooms;
  {
    MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    for (auto& [id, room] : room_data_) rooms.push_back(room);
    queue_.clear();
    peers_.clear();
    draining_.clear();
    early_infos_.clear();
    early_bytes_ = 0;
    early_aborts_.clear();
  }
  work_cv_.SignalAll();
  reaper_.reset();
  for (auto& w : workers_) w.join();
  workers_.clear();
  for (auto& room : rooms) FailRoom(room, Status::Cancelled("prefill manager shut down"));
  // Outstanding batches complete (kCancelled) inside the transport's destructor. Control-plane
  // threads still finishing a call (a stream ending, a Register) hold transport_mu_ while they
  // use it.
  MutexLock lock(&transport_mu_);
  DeregisterBuffers(*transport_, local_);
  transport_.reset();
}

void PrefillCore::DisconnectPeer(spi::PeerId peer) {
  MutexLock lock(&transport_mu_);
  if (transport_) transport_->Disconnect(peer);
}

std::shared_ptr<PrefillCore::Room> PrefillCore::FindRoom(uint64_t room) const {
  MutexLock lock(&mu_);
  auto it = room_data_.find(room);
  return it == room_data_.end() ? nullptr : it->second;
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
    auto conn = transport_->Connect(msg.endpoint);
    if (!conn.ok()) return refuse(conn.status().WithPrefix("connecting to decode's endpoint"));
    peer->session = msg.session;
    peer->peer = conn->peer;
    peer->reg = msg;
    peer->plan = std::move(*plan);
    peer->required_dst_info_num = required;
    peer->link = std::move(link);
    for (auto [descs, ids] : {std::pair{&msg.kv, &peer->kv}, std::pair{&msg.aux, &peer->aux},
                              std::pair{&msg.state, &peer->state}}) {
      for (const RegionDesc& d : *descs) {
        auto id = transport_->ImportRemoteRegion(conn->peer, {d.addr, d.length, d.key});
        if (!id.ok()) {
          transport_->Disconnect(conn->peer);
          return refuse(id.status().WithPrefix("importing decode region"));
        }
        ids->push_back(*id);
      }
    }
    {
      MutexLock lock(&mu_);
      if (stopping_) {
        transport_->Disconnect(conn->peer);
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
    reply = std::move(conn->reply);
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

void PrefillCore::OnTransferInfo(const TransferInfoMsg& msg) {
  constexpr size_t kMaxEarlyRooms = 1 << 16;
  // And by bytes: a TransferInfo may carry millions of page indices.
  constexpr size_t kMaxEarlyBytes = size_t{64} << 20;
  std::shared_ptr<Peer> peer;
  std::shared_ptr<Room> room;
  bool overflow = false;
  {
    MutexLock lock(&mu_);
    if (stopping_) return;
    auto p = peers_.find(msg.session);
    if (p != peers_.end()) peer = p->second;
    auto r = room_data_.find(msg.room);
    if (r != room_data_.end()) room = r->second;
    if (peer && !room) {
      // The engine has not created the sender yet; CreateRoom picks this up. Bounded by the
      // decode side's own room limits: one entry per (room, decode rank).
      // Bounded: a peer cannot grow this without limit.
      const size_t bytes = EarlyInfoBytes(msg);
      if ((early_infos_.size() < kMaxEarlyRooms || early_infos_.contains(msg.room)) &&
          early_bytes_ + bytes <= kMaxEarlyBytes) {
        auto& early = early_infos_[msg.room];
        if (early.infos.empty()) early.arrived = absl::Now();
        if (early.infos.size() < 64) {
          early.infos.push_back(msg);
          early.bytes += bytes;
          early_bytes_ += bytes;
        }
        return;
      }
      overflow = true;
    }
  }
  auto reject = [&](Status s) {
    PDLIB_LOG(kWarning, "prefill: room %d: rejecting TransferInfo: %s", msg.room, s.ToString());
    if (peer) {
      peer->link->SendStatus(
          {msg.room, options_.args.parallel.tp_rank, options_.args.parallel.pp_rank, s});
    }
    bool accepted_before = false;  // an earlier TransferInfo of this session is being served
    if (room) {
      MutexLock lock(&room->mu);
      for (const auto& info : room->infos) accepted_before |= info.session == msg.session;
    }
    if (room) FailRoom(room, s);
    // Nothing was or will be written for this TransferInfo: its pages are free at once.
    if (peer && !accepted_before) SendDrained(msg.session, {msg.room});
  };
  if (overflow) {
    return reject(Status::ResourceExhausted(absl::StrFormat(
        "room %d: the TransferInfos waiting for their sender on this prefill rank are at their "
        "limit (%d rooms, %d bytes)",
        msg.room, kMaxEarlyRooms, kMaxEarlyBytes)));
  }
  if (!peer) {
    PDLIB_LOG(kWarning, "prefill: room %d: TransferInfo from unknown session %d", msg.room,
              msg.session);
    return;
  }
  // Validate before use (SPEC R3.2): every index against the decode side's registered sizes.
  uint64_t dst_pages_cap = UINT64_MAX, dst_aux_cap = UINT64_MAX, dst_state_cap = UINT64_MAX;
  for (const auto& d : peer->reg.kv) dst_pages_cap = std::min(dst_pages_cap, d.length / d.item_len);
  for (const auto& d : peer->reg.aux) dst_aux_cap = std::min(dst_aux_cap, d.length / d.item_len);
  for (const auto& d : peer->reg.state)
    dst_state_cap = std::min(dst_state_cap, d.length / d.item_len);
  if (Status s = ValidateIndices(msg.dst_kv_pages, dst_pages_cap, "kv page", "decode"); !s.ok()) {
    return reject(s.WithPrefix(absl::StrFormat("room %d", msg.room)));
  }
  if (msg.aux_index && (peer->reg.aux.empty() || *msg.aux_index >= dst_aux_cap)) {
    return reject(Status::OutOfRange(
        absl::StrFormat("room %d: aux index %d out of range [0, %d) on decode", msg.room,
                        *msg.aux_index, peer->reg.aux.empty() ? 0 : dst_aux_cap)));
  }
  if (!msg.dst_state_indices.empty() && peer->reg.state.empty()) {
    return reject(Status::OutOfRange(
        absl::StrFormat("room %d: state indices sent but decode has no state buffers", msg.room)));
  }
  if (Status s = ValidateIndices(msg.dst_state_indices, dst_state_cap, "state", "decode");
      !s.ok()) {
    return reject(s.WithPrefix(absl::StrFormat("room %d", msg.room)));
  }
  // The planner sees one chunk at a time; a decode index repeated across chunks is caught here.
  thread_local std::vector<int32_t> scratch;
  for (auto [indices, what] :
       {std::pair{&msg.dst_kv_pages, "kv page"}, std::pair{&msg.dst_state_indices, "state"}}) {
    if (Status s = planner::CheckDistinct(*indices, what, "decode", &scratch); !s.ok()) {
      return reject(s.WithPrefix(absl::StrFormat("room %d", msg.room)));
    }
  }
  // The planner decided at Register who writes to whom: a TransferInfo must agree with it.
  if (msg.is_dummy == peer->plan.active) {
    return reject(Status::InvalidArgument(
        absl::StrFormat("room %d: %s TransferInfo, but this prefill rank %s that decode rank",
                        msg.room, msg.is_dummy ? "a dummy" : "a real",
                        peer->plan.active ? "writes to" : "writes nothing to")));
  }
  const uint32_t want = msg.is_dummy ? 1 : peer->required_dst_info_num;
  if (msg.required_dst_info_num != want) {
    return reject(Status::InvalidArgument(
        absl::StrFormat("room %d: required_dst_info_num %d, but this prefill rank expects %d",
                        msg.room, msg.required_dst_info_num, want)));
  }
  if (injector_.Roll(FailureStage::kTransferInfo)) {
    return reject(injector_.Injected(FailureStage::kTransferInfo, msg.room));
  }
  bool ready = false;
  size_t ready_infos = 0;
  Status refused;
  {
    MutexLock lock(&room->mu);
    bool duplicate = false;
    for (const auto& info : room->infos) duplicate |= info.session == msg.session;
    const TransferInfoMsg* first = room->infos.empty() ? nullptr : &room->infos.front();
    if (duplicate) {
      refused = Status::AlreadyExists(absl::StrFormat(
          "room %d: duplicate TransferInfo from session %d", msg.room, msg.session));
    } else if (first && room->infos.size() >= first->required_dst_info_num) {
      // Once complete, a room's TransferInfos are frozen: queued chunks index into them.
      refused = Status::FailedPrecondition(absl::StrFormat(
          "room %d: TransferInfo from session %d after all %d expected ones arrived", msg.room,
          msg.session, first->required_dst_info_num));
    } else if (first && (msg.required_dst_info_num != first->required_dst_info_num ||
                         msg.is_dummy != first->is_dummy)) {
      refused = Status::InvalidArgument(absl::StrFormat(
          "room %d: TransferInfo from session %d (%s, required_dst_info_num %d) disagrees with "
          "the room's first one (%s, required_dst_info_num %d)",
          msg.room, msg.session, msg.is_dummy ? "dummy" : "real", msg.required_dst_info_num,
          first->is_dummy ? "dummy" : "real", first->required_dst_info_num));
    } else {
      room->infos.push_back(msg);
      room->peers.push_back(peer);
      ready = room->infos.size() >= room->infos.front().required_dst_info_num;
      ready_infos = room->infos.size();
    }
  }
  if (!refused.ok()) return reject(std::move(refused));
  if (room->state->Poll() == KVPoll::kFailed) {
    // Failed before this decode rank was known (abort, timeout): tell it now.
    peer->link->SendStatus({msg.room, options_.args.parallel.tp_rank,
                            options_.args.parallel.pp_rank, room->state->FailureReason()});
    return;
  }
  if (ready && room->state->Advance(KVPoll::kWaitingForInput)) {
    PDLIB_ROOM_LOG(room->state->logged(),
                   "prefill: room %d registered: TransferInfo from %d decode rank(s), last from "
                   "session %d",
                   msg.room, ready_infos, msg.session);
  }
}

void PrefillCore::OnAbort(uint64_t room_id, uint64_t session, const std::string& reason) {
  constexpr size_t kMaxEarlyAborts = 1 << 16;
  Status why = Status::Aborted(absl::StrFormat("room %d aborted by decode: %s", room_id, reason));
  std::shared_ptr<Room> room;
  {
    MutexLock lock(&mu_);
    if (auto e = early_infos_.find(room_id); e != early_infos_.end()) EraseEarlyInfos(e);
    auto it = room_data_.find(room_id);
    if (it != room_data_.end()) {
      room = it->second;
    } else if (auto l = lingering_.find(room_id); l != lingering_.end()) {
      room = l->second;  // its sender is gone, its writes are not
    } else if (peers_.contains(session) && early_aborts_.size() < kMaxEarlyAborts) {
      early_aborts_[room_id] = {absl::Now(), why};
    }
  }
  if (!room) {
    // No sender (yet): nothing was posted for this room, and a later sender fails at once.
    SendDrained(session, {room_id});
    return;
  }
  FailRoom(room, std::move(why));
  bool served = false, drained = false;
  {
    MutexLock lock(&room->mu);
    for (const auto& info : room->infos) served |= info.session == session;
    drained = room->drained;
  }
  // A room that had finished (or never took this session's TransferInfo) has nothing in flight
  // for it; a failing one tells every session when its last batch completes (MaybeDrained).
  if (!served || drained) SendDrained(session, {room_id});
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

StatusOr<std::shared_ptr<RoomState>> PrefillCore::CreateRoom(uint64_t room_id) {
  auto state = rooms_.Insert(room_id);
  if (!state.ok()) return state.status();
  counters_.Add(counters_.requests);
  (*state)->set_logged(room_log_.Sample(room_id));
  auto room = std::make_shared<Room>(*state);
  std::vector<TransferInfoMsg> early;
  std::optional<Status> aborted;
  {
    MutexLock lock(&mu_);
    if (stopping_) {
      rooms_.Erase(room_id, state->get());
      return Status::Unavailable("prefill manager is shutting down");
    }
    room_data_[room_id] = room;
    auto it = early_infos_.find(room_id);
    if (it != early_infos_.end()) {
      early = std::move(it->second.infos);
      EraseEarlyInfos(it);
    }
    if (auto a = early_aborts_.find(room_id); a != early_aborts_.end()) {
      aborted = std::move(a->second.reason);
      early_aborts_.erase(a);
    }
  }
  PDLIB_ROOM_LOG((*state)->logged(), "prefill: room %d created", room_id);
  if (aborted) {
    FailRoom(room, std::move(*aborted));
    return state;
  }
  for (const auto& info : early) OnTransferInfo(info);
  return state;
}

Status PrefillCore::InitRoom(uint64_t room_id, uint64_t num_kv_pages,
                             std::optional<uint32_t> aux_index) {
  auto room = FindRoom(room_id);
  if (!room) return Status::NotFound(absl::StrFormat("room %d is not live", room_id));
  if (aux_index && (local_.aux.ids.empty() || *aux_index >= ItemCapacity(options_.args.aux))) {
    return Status::OutOfRange(
        absl::StrFormat("room %d: aux index %d out of range [0, %d) on prefill", room_id,
                        *aux_index, ItemCapacity(options_.args.aux)));
  }
  MutexLock lock(&room->mu);
  room->num_kv_pages = num_kv_pages;
  room->aux_index = aux_index;
  return Status::OK();
}

Status PrefillCore::Send(uint64_t room_id, std::span<const int32_t> pages, bool last,
                         std::span<const int32_t> state_indices) {
  auto room = FindRoom(room_id);
  if (!room) return Status::NotFound(absl::StrFormat("room %d is not live", room_id));
  KVPoll state = room->state->Poll();
  if (state == KVPoll::kFailed) return room->state->FailureReason();
  if (state < KVPoll::kWaitingForInput || state == KVPoll::kSuccess) {
    return Status::FailedPrecondition(
        absl::StrFormat("room %d: Send() in state %s (needs the decode side's TransferInfo first)",
                        room_id, KVPollName(state)));
  }
  if (Status s = ValidateIndices(pages, ItemCapacity(options_.args.kv), "kv page", "prefill");
      !s.ok()) {
    return s.WithPrefix(absl::StrFormat("room %d", room_id));
  }
  if (Status s =
          ValidateIndices(state_indices, ItemCapacity(options_.args.state), "state", "prefill");
      !s.ok()) {
    return s.WithPrefix(absl::StrFormat("room %d", room_id));
  }
  Chunk chunk{room, {pages.begin(), pages.end()}, 0, last};
  {
    MutexLock lock(&room->mu);
    if (room->last_queued) {
      return Status::FailedPrecondition(
          absl::StrFormat("room %d: Send() after the last chunk", room_id));
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
    size_t dst_count = real ? real->dst_kv_pages.size() : total;
    if (total > dst_count || (last && total != dst_count)) {
      return Status::OutOfRange(
          absl::StrFormat("room %d: %s chunk brings the pages sent to %d but decode expects %d",
                          room_id, last ? "last" : "non-last", total, dst_count));
    }
    if (room->num_kv_pages && total > *room->num_kv_pages) {
      return Status::OutOfRange(absl::StrFormat("room %d: %d pages sent, Init() announced %d",
                                                room_id, total, *room->num_kv_pages));
    }
    if (real && last && !state_indices.empty() &&
        state_indices.size() != real->dst_state_indices.size()) {
      return Status::InvalidArgument(absl::StrFormat("room %d: %d state indices for %d on decode",
                                                     room_id, state_indices.size(),
                                                     real->dst_state_indices.size()));
    }
    chunk.dst_offset = room->pages_queued;
    room->pages_queued = total;
    room->last_queued = last;
    if (last) room->state_src.assign(state_indices.begin(), state_indices.end());
    ++room->outstanding;
  }
  room->state->Advance(KVPoll::kTransferring);
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
  };
  std::vector<Target> targets;
  std::optional<Status> gone;
  {
    MutexLock lock(&room->mu);
    gone = room->peer_gone;
    for (size_t i = 0; i < room->infos.size() && !gone; ++i) {
      if (room->infos[i].is_dummy || !room->peers[i]->plan.active) continue;
      const auto& dst = room->infos[i].dst_kv_pages;
      targets.push_back({room->peers[i], std::vector<int32_t>(dst.begin() + chunk.dst_offset,
                                                              dst.begin() + chunk.dst_offset +
                                                                  chunk.src_pages.size())});
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
    Status s = planner::PlanKvWrites(t.peer->plan, {chunk.src_pages, t.dst, chunk.last, -1}, &plan);
    if (!s.ok()) {
      OnBatchDone(room, 0, 0, s.WithPrefix(absl::StrFormat("room %d", room->state->room())));
      continue;
    }
    std::vector<spi::WriteOp> ops = ToWriteOps(*t.peer, plan.writes);
    if (ops.empty()) {  // nothing of this chunk lands on that rank (e.g. an empty chunk)
      OnBatchDone(room, 0, 0, Status::OK());
      continue;
    }
    const uint64_t bytes = plan.bytes, pages = chunk.src_pages.size();
    auto self = shared_from_this();
    s = transport_->PostWrites(t.peer->peer, ops, [self, room, bytes, pages](Status st) {
      self->OnBatchDone(room, bytes, pages, std::move(st));
    });
    if (!s.ok()) OnBatchDone(room, 0, 0, s.WithPrefix("posting KV writes"));
  }
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
        tail.dst_state = info.dst_state_indices;
      }
      tail.request_pages = static_cast<int64_t>(info.dst_kv_pages.size());
      plan.writes.clear();
      plan.bytes = 0;
      planned = planner::PlanTailWrites(peer.plan, tail, &plan);
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

void PrefillCore::TailDone(const std::shared_ptr<Room>& room) {
  {
    MutexLock lock(&room->mu);
    --room->tail_outstanding;
  }
  MaybeDrained(room);
}

void PrefillCore::MaybeDrained(const std::shared_ptr<Room>& room) {
  std::vector<uint64_t> sessions;
  bool released = false;
  const KVPoll st = room->state->Poll();
  {
    MutexLock lock(&room->mu);
    if (room->drained || !IsTerminal(st) || room->outstanding > 0 || room->tail_outstanding > 0) {
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

std::vector<uint64_t> PrefillCore::TakeReusableRooms() { return released_.Take(); }

void PrefillCore::FailRoom(const std::shared_ptr<Room>& room, Status reason) {
  if (!room->state->Fail(reason)) return;
  undrained_.fetch_add(1, std::memory_order_relaxed);
  counters_.CountFailure(*room->state);
  PDLIB_LOG(kWarning, "prefill: room %d failed: %s", room->state->room(), reason.ToString());
  SendStatusToDecode(room, reason);
  MaybeDrained(room);
}

void PrefillCore::SendStatusToDecode(const std::shared_ptr<Room>& room, const Status& status) {
  std::vector<std::shared_ptr<Peer>> peers;
  {
    MutexLock lock(&room->mu);
    if (room->status_sent) return;
    room->status_sent = true;
    peers = room->peers;
  }
  for (const auto& peer : peers) {
    peer->link->SendStatus({room->state->room(), options_.args.parallel.tp_rank,
                            options_.args.parallel.pp_rank, status});
  }
}

void PrefillCore::AbortRoom(uint64_t room_id, std::string_view reason) {
  if (auto room = FindRoom(room_id)) {
    FailRoom(room,
             Status::Aborted(absl::StrFormat("room %d aborted by prefill: %s", room_id, reason)));
  }
}

void PrefillCore::ReleaseRoom(uint64_t room_id, const RoomState* state) {
  std::shared_ptr<Room> room;
  {
    MutexLock lock(&mu_);
    auto it = room_data_.find(room_id);
    if (it != room_data_.end() && it->second->state.get() == state) {
      room = std::move(it->second);
      room_data_.erase(it);
    }
  }
  if (room && !IsTerminal(room->state->Poll())) {
    FailRoom(room, Status::Aborted(absl::StrFormat("room %d: sender destroyed before the "
                                                   "transfer finished",
                                                   room_id)));
  }
  if (room && room->state->Poll() == KVPoll::kFailed) {
    // TakeReusableRooms reports the room once it drains (at once if it has). Until then it
    // stays findable, so that a decode's Abort is answered only once its writes are over.
    MutexLock lock(&room->mu);
    room->released = true;
    MutexLock core_lock(&mu_);
    if (room->drained) {
      released_.Add(room_id);
    } else {
      lingering_[room_id] = room;
    }
  }
  rooms_.Erase(room_id, state);
}

void PrefillCore::CheckTimeouts() {
  absl::Time now = absl::Now();
  std::vector<std::shared_ptr<Room>> rooms;
  {
    MutexLock lock(&mu_);
    for (auto& [id, room] : room_data_) rooms.push_back(room);
    for (auto e = early_infos_.begin(); e != early_infos_.end();) {
      if (now - e->second.arrived > absl::FromChrono(options_.bootstrap_timeout)) {
        EraseEarlyInfos(e++);
      } else {
        ++e;
      }
    }
    absl::erase_if(early_aborts_, [&](const auto& entry) {
      return now - entry.second.arrived > absl::FromChrono(options_.bootstrap_timeout);
    });
  }
  for (auto& room : rooms) {
    if (Status s = CheckRoomDeadline(*room->state, options_, now); !s.ok()) FailRoom(room, s);
  }
  DrainPeers(now);
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

size_t PrefillCore::EarlyInfoBytes(const TransferInfoMsg& msg) {
  return sizeof(TransferInfoMsg) +
         sizeof(int32_t) * (msg.dst_kv_pages.size() + msg.dst_state_indices.size());
}

void PrefillCore::EraseEarlyInfos(EarlyInfoMap::iterator it) {
  early_bytes_ -= it->second.bytes;
  early_infos_.erase(it);
}

size_t PrefillCore::early_info_bytes() const {
  MutexLock lock(&mu_);
  return early_bytes_;
}

size_t PrefillCore::early_info_count() const {
  MutexLock lock(&mu_);
  return early_infos_.size() + early_aborts_.size();
}

KVManagerMetrics PrefillCore::metrics() const {
  KVManagerMetrics m;
  counters_.FillInto(&m, rooms_);
  MutexLock lock(&mu_);
  m.connections = peers_.size();
  m.quarantined_rooms = undrained_.load(std::memory_order_relaxed);
  // Requests decode announced whose sender does not exist yet also wait in the queue.
  m.bootstrap_queue_size += early_infos_.size();
  return m;
}

}  // namespace v1
}  // namespace pdlib
