// PrefillCore: TransferInfo and Abort from decode, validated before use, and those that arrive
// before the engine created their room (bounded in count and bytes).
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
namespace {
constexpr size_t kMaxEarlyAborts = 1 << 16;
}  // namespace

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
          {msg.room, options_.args.parallel.tp_rank, options_.args.parallel.pp_rank, s, {}});
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
    // Its session's connection was closed here while the TransferInfo was on its way (replaced:
    // ReplaceFailedPeers, or gone). Decode fails the room when it hears of the close; this side
    // fails it now (or its sender at creation) instead of after bootstrap_timeout.
    Status why = Status::Unavailable(absl::StrFormat(
        "room %d: its TransferInfo came from decode session %d, whose connection is closed",
        msg.room, msg.session));
    PDLIB_LOG(kWarning, "prefill: %s", why.ToString());
    if (room) return FailRoom(room, why);
    MutexLock lock(&mu_);
    if (early_aborts_.size() < kMaxEarlyAborts) early_aborts_[msg.room] = {absl::Now(), why};
    return;
  }
  // Validate before use (SPEC R3.2): every index against the decode side's registered sizes.
  uint64_t dst_pages_cap = UINT64_MAX, dst_aux_cap = UINT64_MAX;
  for (const auto& d : peer->reg.kv) dst_pages_cap = std::min(dst_pages_cap, d.length / d.item_len);
  for (const auto& d : peer->reg.aux) dst_aux_cap = std::min(dst_aux_cap, d.length / d.item_len);
  // Per decode state family: the items every buffer of it holds (Register checked the extents).
  std::vector<uint64_t> dst_state_caps;
  {
    size_t at = 0;
    for (const StateFamilyExtent& f : peer->reg.state_families) {
      uint64_t cap = UINT64_MAX;
      for (int32_t i = 0; i < f.count && at < peer->reg.state.size(); ++i, ++at) {
        cap = std::min(cap, peer->reg.state[at].length / peer->reg.state[at].item_len);
      }
      dst_state_caps.push_back(f.count == 0 ? 0 : cap);
    }
  }
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
  // A dummy (R5.5) writes nothing and carries no state; a real TransferInfo names every family.
  if (!msg.dst_state_counts.empty() || (!dst_state_caps.empty() && !msg.is_dummy)) {
    if (msg.dst_state_counts.size() != dst_state_caps.size()) {
      return reject(Status::InvalidArgument(absl::StrFormat(
          "room %d: TransferInfo has state indices for %d families, decode registered %d", msg.room,
          msg.dst_state_counts.size(), dst_state_caps.size())));
    }
  }
  if (Status s = ValidateStateIndices(dst_state_caps, msg.dst_state_indices, msg.dst_state_counts,
                                      "decode");
      !s.ok()) {
    return reject(s.WithPrefix(absl::StrFormat("room %d", msg.room)));
  }
  if (msg.decode_prefix_len % peer->reg.page_size != 0) {
    return reject(Status::InvalidArgument(
        absl::StrFormat("room %d: decode_prefix_len %d is not a multiple of page_size %d", msg.room,
                        msg.decode_prefix_len, peer->reg.page_size)));
  }
  // The planner sees one chunk at a time; a decode index repeated across chunks is caught here
  // (state: within each family; two families are different buffers).
  thread_local std::vector<int32_t> scratch;
  if (Status s = planner::CheckDistinct(msg.dst_kv_pages, "kv page", "decode", &scratch); !s.ok()) {
    return reject(s.WithPrefix(absl::StrFormat("room %d", msg.room)));
  }
  {
    size_t at = 0;
    for (size_t f = 0; f < msg.dst_state_counts.size(); ++f) {
      const std::string what = absl::StrFormat("state family %d", f);
      std::span<const int32_t> list(msg.dst_state_indices.data() + at, msg.dst_state_counts[f]);
      at += msg.dst_state_counts[f];
      if (Status s = planner::CheckDistinct(list, what.c_str(), "decode", &scratch); !s.ok()) {
        return reject(s.WithPrefix(absl::StrFormat("room %d", msg.room)));
      }
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
    } else if (first && msg.decode_prefix_len != first->decode_prefix_len) {
      // Decode ranks of one request must agree on what their prefix cache holds.
      refused = Status::InvalidArgument(absl::StrFormat(
          "room %d: decode ranks disagree on the decode prefix: %d tokens from session %d, %d "
          "tokens from session %d",
          msg.room, msg.decode_prefix_len, msg.session, first->decode_prefix_len, first->session));
    } else if (first && (msg.required_dst_info_num != first->required_dst_info_num ||
                         msg.is_dummy != first->is_dummy)) {
      refused = Status::InvalidArgument(absl::StrFormat(
          "room %d: TransferInfo from session %d (%s, required_dst_info_num %d) disagrees with "
          "the room's first one (%s, required_dst_info_num %d)",
          msg.room, msg.session, msg.is_dummy ? "dummy" : "real", msg.required_dst_info_num,
          first->is_dummy ? "dummy" : "real", first->required_dst_info_num));
    } else if (pull() &&
               !(refused = AddReader(*room, msg, !msg.is_dummy && peer->plan.active)).ok()) {
      // What the engine already published does not fit this decode rank's request.
    } else {
      room->infos.push_back(msg);
      room->peers.push_back(peer);
      room->digests.push_back(room->digested ? EmptyDigestFor(*peer, msg) : KvDigest{});
      ready = room->infos.size() >= room->infos.front().required_dst_info_num;
      ready_infos = room->infos.size();
    }
  }
  if (!refused.ok()) return reject(std::move(refused));
  if (room->state->Poll() == KVPoll::kFailed) {
    // Failed before this decode rank was known (abort, timeout): tell it now.
    peer->link->SendStatus({msg.room,
                            options_.args.parallel.tp_rank,
                            options_.args.parallel.pp_rank,
                            room->state->FailureReason(),
                            {}});
    return;
  }
  if (ready && room->state->Advance(KVPoll::kWaitingForInput)) {
    PDLIB_ROOM_LOG(room->state->logged(),
                   "prefill: room %d registered: TransferInfo from %d decode rank(s), last from "
                   "session %d",
                   msg.room, ready_infos, msg.session);
  }
  if (pull()) {
    PublishPending(room);
    MaybePullSuccess(room);
  }
}

void PrefillCore::OnAbort(uint64_t room_id, uint64_t session, const std::string& reason) {
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

}  // namespace v1
}  // namespace pdlib
