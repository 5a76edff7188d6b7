// PrefillCore: lifecycle, the room table, failing and releasing rooms, timeouts, metrics.
#include "lib/core/prefill_core.h"

#include <algorithm>
#include <random>
#include <string>

#include "absl/strings/str_format.h"
#include "lib/base/log_internal.h"
#include "lib/core/prefill_types.h"
#include "lib/core/transfer_layout.h"
#include "lib/core/validate.h"

namespace pdlib {
inline namespace v1 {

StatusOr<std::shared_ptr<PrefillCore>> PrefillCore::Create(
    const KVManagerOptions& options, std::unique_ptr<spi::Transport> transport) {
  std::shared_ptr<PrefillCore> core(new PrefillCore(options, std::move(transport)));
  auto layout = PlannerLayout(options.args, "prefill");
  if (!layout.ok()) return layout.status();
  core->layout_ = std::move(*layout);
  auto families = EffectiveStateFamilies(options.args);
  if (!families.ok()) return families.status();
  core->state_caps_ = StateCapacities(*families);
  if (Status s = CheckDirectionSupported(*core->transport_, options); !s.ok()) return s;
  if (Status s = CheckChecksumSupported(*core->transport_, options); !s.ok()) return s;
  auto local = RegisterBuffers(*core->transport_, options.args);
  if (!local.ok()) return local.status();
  core->local_ = std::move(*local);
  core->digest_src_ = DigestMemoryOf(core->local_, options.args.memory_kind == MemoryKind::kCuda
                                                       ? core->transport_.get()
                                                       : nullptr);
  // Push from host pools: the transport's send digests, where it has them.
  core->send_digests_ = !core->pull() && options.args.memory_kind != MemoryKind::kCuda &&
                        core->transport_->capabilities().digests_sends;
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

std::shared_ptr<PrefillCore::Room> PrefillCore::FindRoomOrLingering(uint64_t room) const {
  MutexLock lock(&mu_);
  if (auto it = room_data_.find(room); it != room_data_.end()) return it->second;
  if (auto it = lingering_.find(room); it != lingering_.end()) return it->second;
  return nullptr;
}

std::shared_ptr<PrefillCore::Room> PrefillCore::FindRoom(uint64_t room) const {
  MutexLock lock(&mu_);
  auto it = room_data_.find(room);
  return it == room_data_.end() ? nullptr : it->second;
}

StatusOr<std::shared_ptr<RoomState>> PrefillCore::CreateRoom(uint64_t room_id) {
  auto state = rooms_.Insert(room_id);
  if (!state.ok()) return state.status();
  counters_.Add(counters_.requests);
  (*state)->set_logged(room_log_.Sample(room_id));
  auto room = std::make_shared<Room>(*state);
  room->digested = ChecksumRoom(options_, room_id);
  if (room->digested) counters_.Add(counters_.checksummed);
  std::vector<TransferInfoMsg> early;
  std::optional<Status> aborted;
  {
    MutexLock lock(&mu_);
    if (stopping_) {
      rooms_.Erase(room_id, state->get());
      return Status::Unavailable("prefill manager is shutting down");
    }
    room_data_[room_id] = room;
    if (pull()) {
      MutexLock room_lock(&room->mu);
      room->lease_until = absl::Now() + absl::FromChrono(options_.pull_lease);
    }
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

std::optional<uint64_t> PrefillCore::DecodePrefix(uint64_t room_id) const {
  auto room = FindRoom(room_id);
  if (!room) return std::nullopt;
  const KVPoll state = room->state->Poll();
  if (state < KVPoll::kWaitingForInput && state != KVPoll::kFailed) return std::nullopt;
  MutexLock lock(&room->mu);
  // Every TransferInfo of the room carries the same prefix (OnTransferInfo refuses others).
  for (const TransferInfoMsg& info : room->infos) {
    if (!info.is_dummy) return info.decode_prefix_len;
  }
  if (!room->infos.empty()) return room->infos.front().decode_prefix_len;
  return std::nullopt;
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

KvDigest PrefillCore::EmptyDigestFor(const Peer& peer, const TransferInfoMsg& info) const {
  return KvDigest::Empty(peer.reg.kv.size(), info.dst_kv_pages.size(), peer.reg.aux.size(),
                         peer.reg.state.size(), peer.reg.state_families.size());
}

void PrefillCore::SendStatusToDecode(const std::shared_ptr<Room>& room, const Status& status) {
  std::vector<std::shared_ptr<Peer>> peers;
  std::vector<std::optional<KvDigest>> digests;
  {
    MutexLock lock(&room->mu);
    if (room->status_sent) return;
    room->status_sent = true;
    peers = room->peers;
    // Push: a digested room's success carries what this rank wrote to each decode rank (pull
    // sent it with the ReadReady messages).
    digests.resize(peers.size());
    for (size_t i = 0; i < peers.size() && i < room->digests.size(); ++i) {
      if (room->digested && status.ok() && !pull() && !room->infos[i].is_dummy) {
        digests[i] = room->digests[i];
      }
    }
  }
  if (peers.empty() && !status.ok()) {
    // No decode rank is bound: one bound to another rank (another DP group) would wait for
    // its own timeout. The manager relays the reason through the deployment's directory.
    MutexLock lock(&unbound_mu_);
    if (unbound_failures_.size() >= 4096) unbound_failures_.pop_front();
    unbound_failures_.push_back({room->state->room(), status.ToString()});
  }
  for (size_t i = 0; i < peers.size(); ++i) {
    peers[i]->link->SendStatus({room->state->room(), options_.args.parallel.tp_rank,
                                options_.args.parallel.pp_rank, status, std::move(digests[i])});
  }
}

std::vector<PrefillCore::UnboundFailure> PrefillCore::TakeUnboundFailures() {
  MutexLock lock(&unbound_mu_);
  std::vector<UnboundFailure> out(std::make_move_iterator(unbound_failures_.begin()),
                                  std::make_move_iterator(unbound_failures_.end()));
  unbound_failures_.clear();
  return out;
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
  if (pull()) {
    // A pull room lives by its lease alone (from its creation, renewed by publications,
    // TransferInfos and heartbeats): decode may come long after prefill, and the engine decides
    // when to publish, so the per-state timeouts do not apply.
    {
      MutexLock lock(&mu_);
      for (auto& [id, room] : lingering_) rooms.push_back(room);
    }
    CheckLeases(now, rooms);
    rooms.clear();
  }
  for (auto& room : rooms) {
    if (Status s = CheckRoomDeadline(*room->state, options_, now); !s.ok()) FailRoom(room, s);
  }
  DrainPeers(now);
  ReplaceFailedPeers();
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
