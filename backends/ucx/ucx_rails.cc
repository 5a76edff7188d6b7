// A rail that dies, and comes back (ucx.rails; backends/ucx/README.md, "A rail that dies").
//
// A lane goes down on a stall (CheckRailStalls: work on it and nothing completed or arrived for
// ucx.rail_stall_ms, a probe sent halfway unanswered), an endpoint error or a failed send
// (LaneDown, which may run inside UCX's callbacks and so only marks). The loop then
// (ServiceLanes):
//   1. gives up the write batches that had messages on it: a kAmAbandon message on a live rail
//      names them; the target forgets their progress and drops their later messages from any
//      rail (a late original on the dead rail included), then echoes. Only on the echo do those
//      batches end (failed, naming the rail): after it nothing of theirs can land in a page
//      that decode reuses. No echo within kAbandonGrace fails the connection.
//   2. asks again, on a live rail, for the read ranges requested on the dead one (reads are
//      idempotent; a late reply names a cookie that is gone and is dropped): pull requests do
//      not fail.
//   3. tears the lane's endpoint and worker down (their sends end, cancelled) and probes the
//      rail every ucx.rail_retry_ms from a fresh worker and endpoint; when a probe comes back,
//      the lane rejoins the stripe with that endpoint.
// Why writes are not re-sent on another rail instead: an "am" send completes when UCX handed the
// bytes to the socket, not when the target applied them, so the initiator cannot tell which of
// the dead rail's messages landed; the target counts a batch's messages, and a message sent
// twice would be counted twice. Rail 0 carries puts, gets, remote keys and the close handshake:
// when it dies the connection fails (naming the rail) and the core reconnects.
#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "backends/ucx/ucx_send.h"
#include "backends/ucx/ucx_transport.h"
#include "lib/base/log_internal.h"

namespace pdlib {
inline namespace v1 {
namespace ucx {
namespace {

// How long the target has to confirm that it dropped abandoned batches: it answers within
// milliseconds unless frozen, and the abandoned requests wait for it.
constexpr auto kAbandonGrace = std::chrono::seconds(2);
// Seqs per kAmAbandon message.
constexpr size_t kMaxAbandonSeqs = 4096;

// Closes `ep` by force without waiting: a tcp endpoint still connecting to a partitioned
// address completes its close only once the link is back (UcpEp's destructor would spin on
// it); the request is freed at once (UCX finishes it on its own), the worker goes next.
void CloseNow(UcpEp& ep) {
  if (!ep) return;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t request = ucp_ep_close_nbx(ep.Release(), &param);
  if (UCS_PTR_IS_PTR(request)) ucp_request_free(request);
}

int Ms(std::chrono::steady_clock::duration d) {
  return static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(d).count());
}

// A rail message's header, when `header` is one with `magic` (else nullopt: not pdlib's).
template <typename Header>
std::optional<Header> ReadHeader(const void* header, size_t length, uint32_t magic) {
  Header h{};
  if (length != sizeof(h)) return std::nullopt;
  std::memcpy(&h, header, sizeof(h));
  if (h.magic != magic) return std::nullopt;
  return h;
}

}  // namespace

std::string UcxTransport::RailName(uint32_t rail) const {
  std::string name = "rail " + std::to_string(rail);
  if (rail < options_.rails.size()) name += " (" + options_.rails[rail] + ")";
  return name;
}

UcxTransport::Lane* UcxTransport::ControlLane(PeerState& peer) {
  for (auto& lane : peer.lanes) {
    if (!lane->down) return lane.get();
  }
  return nullptr;
}

UcxTransport::Lane* UcxTransport::LaneOf(const ConnWorker* via, uint64_t peer) {
  auto it = peer_states_.find(static_cast<spi::PeerId>(peer));
  if (it == peer_states_.end() || via->rail >= it->second->lanes.size()) return nullptr;
  Lane* lane = it->second->lanes[via->rail].get();
  return lane->worker.get() == via ? lane : nullptr;
}

bool UcxTransport::RailsMayFail(const PeerState& peer, uint32_t rail) const {
  // Rail 0 is never down, so another rail is always up when `rail` is not 0.
  return peer.failure.ok() && peer.am && peer.lanes.size() > 1 && rail != 0 &&
         rail < peer.lanes.size();
}

void UcxTransport::LaneDown(PeerState& peer, uint32_t rail, const std::string& why, bool stalled) {
  if (!peer.failure.ok() || rail >= peer.lanes.size()) return;
  Lane& lane = *peer.lanes[rail];
  if (lane.down) return;
  if (!RailsMayFail(peer, rail)) {
    if (stalled) peer.ep_failed = true;  // nothing comes back on it: no flush, no cut to wait for
    FailPeer(peer, Status::Unavailable("ucx: connection to peer " + std::to_string(peer.id) +
                                       " failed on " + RailName(rail) + ": " + why));
    return;
  }
  lane.down = true;
  lane.reset = true;
  lane.down_since = now_;
  lane.down_reason = why;
  rail_service_ = true;
  const Status failed =
      Status::Unavailable("ucx: " + RailName(rail) + " to peer " + std::to_string(peer.id) +
                          " went down (" + why + "), and the request had bytes on it");
  std::vector<uint64_t> seqs;
  for (auto& batch : peer.batches) {
    if (batch->reads || !batch->awaiting_ack || (batch->lanes_used & (1u << rail)) == 0) continue;
    batch->Fail(failed);
    batch->next_op = batch->ops.size();  // nothing more of it is posted
    batch->next_offset = 0;
    seqs.push_back(batch->seq);
  }
  for (size_t at = 0; at < seqs.size(); at += kMaxAbandonSeqs) {
    PeerState::Abandonment a;
    a.token = ++last_rail_token_;
    a.rail = rail;
    a.seqs.assign(seqs.begin() + at, seqs.begin() + std::min(seqs.size(), at + kMaxAbandonSeqs));
    peer.abandonments.push_back(std::move(a));
  }
  PDLIB_LOG(kWarning,
            "ucx: %s to peer %d is down (%s): %d write batches that used it fail, the rest go on "
            "over the other rails; probing it every %d ms",
            RailName(rail).c_str(), peer.id, why.c_str(), static_cast<int>(seqs.size()),
            static_cast<int>(options_.rail_retry_ms));
}

void UcxTransport::CheckRailStalls(Clock::time_point now) {
  if (options_.rail_stall_ms == 0) return;
  const auto limit = std::chrono::milliseconds(options_.rail_stall_ms);
  for (auto& [id, peer] : peer_states_) {
    if (!peer->failure.ok() || peer->lanes.size() < 2) continue;
    uint32_t awaiting = 0;  // rails that batches awaiting an ack sent messages on
    for (auto& batch : peer->batches) {
      if (batch->awaiting_ack) awaiting |= batch->lanes_used;
    }
    for (auto& owned : peer->lanes) {
      Lane& lane = *owned;
      if (lane.down) continue;
      const bool work = lane.window.in_flight() > 0 || lane.read_window.in_flight() > 0 ||
                        (awaiting & (1u << lane.rail)) != 0;
      if (!work) {  // an idle rail is not stalled: its clock starts when work does
        lane.last_progress = now;
        continue;
      }
      // A probe on a live rail unanswered past its deadline no longer holds the next one back.
      if (lane.probe_sent != 0 && now >= lane.probe_deadline) lane.probe_sent = 0;
      const auto quiet = now - lane.last_progress;
      if (quiet > limit) {
        LaneDown(*peer, lane.rail,
                 "nothing it carried completed or arrived for " + std::to_string(Ms(quiet)) +
                     " ms (ucx.rail_stall_ms)",
                 /*stalled=*/true);
        if (!peer->failure.ok()) break;
      } else if (quiet > limit / 2 && lane.probe_sent == 0) {
        // Its bytes may all be in the socket while the batches wait for acks: a live rail
        // answers the probe (behind them), a dead one does not.
        SendProbe(*peer, lane);
      }
    }
  }
}

bool UcxTransport::SendProbe(PeerState& peer, Lane& lane) {
  lane.probe_sent = ++last_rail_token_;
  lane.probe_deadline = now_ + std::chrono::milliseconds(options_.rail_retry_ms);
  return SendOwned(lane.ep.get(), kAmProbeId,
                   AmRailHeader{kAmProbeMagic, lane.rail, peer.target, peer.id, lane.probe_sent},
                   {}, UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER);
}

bool UcxTransport::ServiceLanes(Clock::time_point now) {
  bool worked = false;
  bool more = false;
  for (auto& [id, owned] : peer_states_) {
    PeerState& peer = *owned;
    if (!peer.failure.ok()) {
      // The connection's close ends every batch (ReapPeers); the lanes go with it.
      peer.abandonments.clear();
      continue;
    }
    // 1. Abandonments out, or overdue.
    for (auto& a : peer.abandonments) {
      Lane* control = ControlLane(peer);
      if (!a.sent) {
        a.sent = control != nullptr &&
                 SendOwned(control->ep.get(), kAmAbandonId,
                           AmRailHeader{kAmAbandonMagic, a.rail, peer.target, peer.id, a.token},
                           a.seqs, UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER);
        a.deadline = now + kAbandonGrace;
        worked = true;
        if (!a.sent) {
          FailPeer(peer, Status::Unavailable("ucx: " + RailName(a.rail) + " to peer " +
                                             std::to_string(peer.id) +
                                             " went down, and telling the peer to drop the "
                                             "requests that used it failed"));
          break;
        }
      } else if (now >= a.deadline) {
        FailPeer(peer, Status::Unavailable(
                           "ucx: " + RailName(a.rail) + " to peer " + std::to_string(peer.id) +
                           " went down, and the peer did not confirm within " +
                           std::to_string(Ms(kAbandonGrace)) + " ms that it dropped the " +
                           std::to_string(a.seqs.size()) + " write batches that used it"));
        break;
      }
    }
    if (!peer.failure.ok()) {
      peer.abandonments.clear();
      continue;
    }
    // 2. Lanes just down: reads asked again elsewhere, endpoint and worker torn down; lanes
    // down: probed.
    for (auto& lane : peer.lanes) {
      if (lane->reset) {
        FailOverReads(peer, lane->rail);
        ResetLane(*lane);
        worked = true;
      } else if (lane->down) {
        ProbeLane(peer, *lane);
      }
      more |= lane->down;
    }
    more |= !peer.abandonments.empty();
  }
  rail_service_ = more;
  return worked;
}

void UcxTransport::ResetLane(Lane& lane) {
  lane.reset = false;
  lane.probe_sent = 0;
  CloseNow(lane.ep);
  // Its outstanding sends end here, cancelled (OnRequestDone ignores a down lane's failures).
  DestroyWorker(std::move(lane.worker));
  lane.window = toolkit::InflightWindow(options_.max_inflight_bytes);
  lane.read_window = toolkit::InflightWindow(options_.max_inflight_read_bytes);
  lane.next_probe = now_ + std::chrono::milliseconds(options_.rail_retry_ms);
}

void UcxTransport::ProbeLane(PeerState& peer, Lane& lane) {
  if (lane.probe_sent != 0) {
    if (now_ < lane.probe_deadline) return;
    // No answer (or the endpoint failed): this attempt goes, another follows.
    lane.probe_sent = 0;
    CloseNow(lane.ep);
    DestroyWorker(std::move(lane.worker));
    lane.next_probe = now_ + std::chrono::milliseconds(options_.rail_retry_ms);
    return;
  }
  if (now_ < lane.next_probe) return;
  lane.next_probe = now_ + std::chrono::milliseconds(options_.rail_retry_ms);
  auto worker = MakeWorker(0, lane.rail);
  if (!worker.ok()) {
    PDLIB_LOG(kWarning, "ucx: probing %s to peer %d: %s", RailName(lane.rail).c_str(), peer.id,
              worker.status().ToString().c_str());
    return;
  }
  lane.worker = std::move(*worker);
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(lane.remote_address.data());
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &UcxTransport::OnEndpointError;
  params.err_handler.arg = &lane;
  ucp_ep_h ep = nullptr;
  if (ucp_ep_create(lane.worker->worker.get(), &params, &ep) != UCS_OK) {
    DestroyWorker(std::move(lane.worker));
    return;
  }
  lane.ep = UcpEp(lane.worker->worker.get(), ep);
  if (!SendProbe(peer, lane)) lane.probe_deadline = now_;  // torn down at the next round
}

void UcxTransport::FailOverReads(PeerState& peer, uint32_t rail) {
  Lane* to = ControlLane(peer);
  if (to == nullptr) return;
  Lane& from = *peer.lanes[rail];
  // Ranges gathered for the dead rail and not sent yet: they go with the next message, on `to`.
  for (auto& owned : peer.batches) {
    Batch& batch = *owned;
    if (!batch.reads || batch.rail != rail) continue;
    for (const AmReadRange& range : batch.read_open) {
      auto it = am_reads_.find(range.cookie);
      if (it == am_reads_.end()) continue;
      it->second.rail = to->rail;
      from.read_window.OnCompleted(range.length);
      to->read_window.OnPosted(range.length);
    }
    batch.rail = to->rail;
    batch.rail_bytes = UINT64_MAX;  // its next op picks a rail again
  }
  // Requests sent on the dead rail and not fully answered: asked again under new cookies (the
  // old ones are forgotten, so a late reply to them is dropped).
  std::vector<uint64_t> lost;
  for (const auto& [cookie, read] : am_reads_) {
    if (read.peer == &peer && read.rail == rail) lost.push_back(cookie);
  }
  std::sort(lost.begin(), lost.end());
  size_t again = 0;
  for (uint64_t cookie : lost) {
    const AmRead read = am_reads_.at(cookie);
    Batch& batch = *read.batch;
    const AmReadRange* range = nullptr;
    for (const auto& message : batch.read_messages) {
      for (const AmReadRange& r : message) {
        if (r.cookie == cookie) range = &r;
      }
    }
    if (range != nullptr && batch.status.ok()) {
      if (!FitsAmReadBatch(static_cast<uint32_t>(batch.read_open.size()), batch.read_open_bytes,
                           range->length)) {
        SendReadRequests(peer, batch, to->rail);
      }
      const uint64_t fresh = ++last_read_cookie_;
      batch.read_open.push_back(AmReadRange{range->region, 0, fresh, range->addr, range->length});
      batch.read_open_bytes += range->length;
      am_reads_.emplace(fresh, AmRead{&batch, &peer, to->rail, read.dst, read.length, 0});
      ++peer.am_reads;
      batch.AddPart();
      to->read_window.OnPosted(read.length);
      ++again;
    }
    FinishAmRead(cookie);  // the old request: its window share and its part
    if (range != nullptr && batch.status.ok() && batch.rail != to->rail) {
      // The batch's open ranges are for `to` now; later ones pick their rail again.
      batch.rail = to->rail;
      batch.rail_bytes = UINT64_MAX;
    }
  }
  for (auto& owned : peer.batches) {
    if (owned->reads && owned->rail == to->rail && !owned->read_open.empty()) {
      SendReadRequests(peer, *owned, to->rail);
    }
  }
  if (again > 0) {
    PDLIB_LOG(kInfo, "ucx: %d read requests on %s to peer %d asked again on %s",
              static_cast<int>(again), RailName(rail).c_str(), peer.id, RailName(to->rail).c_str());
  }
}

// The target's side of kAmAbandon: the batches are forgotten and their later messages dropped.
ucs_status_t UcxTransport::OnAmAbandon(void* arg, const void* header, size_t header_length,
                                       void* data, size_t length,
                                       const ucp_am_recv_param_t* param) {
  auto* via = static_cast<ConnWorker*>(arg);
  auto* self = via->transport;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) return UCS_ERR_UNSUPPORTED;
  const auto read = ReadHeader<AmRailHeader>(header, header_length, kAmAbandonMagic);
  if (!read) return UCS_OK;  // not pdlib's
  AmRailHeader h = *read;
  if (h.target != via->target) return UCS_OK;
  if (length % sizeof(uint64_t) != 0 || length / sizeof(uint64_t) > kMaxAbandonSeqs) {
    return UCS_OK;  // malformed: no echo, the initiator's grace fails the connection
  }
  if (auto it = self->am_targets_.find(h.target);
      it != self->am_targets_.end() && !it->second.fenced) {
    AmTarget& target = it->second;
    for (size_t i = 0; i < length / sizeof(uint64_t); ++i) {
      uint64_t seq = 0;
      std::memcpy(&seq, static_cast<const uint8_t*>(data) + i * sizeof(seq), sizeof(seq));
      target.batches.erase(seq);
      target.abandoned.insert(seq);
    }
    if (target.abandoned.size() > kMaxAmBatchesPerTarget) {
      // A misbehaving initiator: cut off as by a fence, which drops everything of it.
      target.fenced = true;
      target.batches.clear();
      target.abandoned.clear();
    }
  }
  // Closed or fenced targets apply nothing of anyone: the echo is true for them as well.
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0) return UCS_OK;
  h.magic = kAmAbandonedMagic;
  SendOwned(param->reply_ep, kAmAbandonedId, h, {}, UCP_AM_SEND_FLAG_EAGER);
  return UCS_OK;
}

ucs_status_t UcxTransport::OnAmAbandoned(void* arg, const void* header, size_t header_length,
                                         void* /*data*/, size_t /*length*/,
                                         const ucp_am_recv_param_t* /*param*/) {
  auto* via = static_cast<ConnWorker*>(arg);
  auto* self = via->transport;
  const auto read = ReadHeader<AmRailHeader>(header, header_length, kAmAbandonedMagic);
  if (!read) return UCS_OK;  // not pdlib's
  AmRailHeader h = *read;
  auto it = self->peer_states_.find(static_cast<spi::PeerId>(h.peer));
  if (it == self->peer_states_.end() || it->second->target != h.target) return UCS_OK;
  PeerState& peer = *it->second;
  auto a = std::find_if(peer.abandonments.begin(), peer.abandonments.end(),
                        [&](const PeerState::Abandonment& x) { return x.token == h.token; });
  if (a == peer.abandonments.end()) return UCS_OK;
  const std::vector<uint64_t> seqs = std::move(a->seqs);
  peer.abandonments.erase(a);
  // Nothing of these batches lands any more: they end now, failed (LaneDown set why).
  for (uint64_t seq : seqs) {
    if (auto b = self->awaiting_ack_.find(seq); b != self->awaiting_ack_.end()) {
      self->ReleaseAck(*b->second);
    }
  }
  return UCS_OK;
}

ucs_status_t UcxTransport::OnAmProbe(void* arg, const void* header, size_t header_length,
                                     void* /*data*/, size_t /*length*/,
                                     const ucp_am_recv_param_t* param) {
  auto* via = static_cast<ConnWorker*>(arg);
  auto* self = via->transport;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) return UCS_ERR_UNSUPPORTED;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0) return UCS_OK;
  const auto read = ReadHeader<AmRailHeader>(header, header_length, kAmProbeMagic);
  if (!read) return UCS_OK;  // not pdlib's
  AmRailHeader h = *read;
  if (h.target != via->target || h.rail != via->rail) return UCS_OK;
  auto it = self->am_targets_.find(h.target);
  if (it == self->am_targets_.end() || it->second.fenced) return UCS_OK;  // not coming back
  h.magic = kAmProbeAckMagic;
  SendOwned(param->reply_ep, kAmProbeAckId, h, {}, UCP_AM_SEND_FLAG_EAGER);
  return UCS_OK;
}

ucs_status_t UcxTransport::OnAmProbeAck(void* arg, const void* header, size_t header_length,
                                        void* /*data*/, size_t /*length*/,
                                        const ucp_am_recv_param_t* /*param*/) {
  auto* via = static_cast<ConnWorker*>(arg);
  auto* self = via->transport;
  const auto read = ReadHeader<AmRailHeader>(header, header_length, kAmProbeAckMagic);
  if (!read) return UCS_OK;  // not pdlib's
  AmRailHeader h = *read;
  Lane* lane = self->LaneOf(via, h.peer);
  if (lane == nullptr || lane->peer->target != h.target || lane->rail != h.rail ||
      lane->probe_sent != h.token) {
    return UCS_OK;  // an older probe's, or not ours
  }
  lane->probe_sent = 0;
  lane->last_progress = self->now_;
  if (lane->down && !lane->reset && lane->peer->failure.ok()) {
    lane->down = false;
    PDLIB_LOG(kInfo, "ucx: %s to peer %d is back after %d ms; it rejoins the stripe",
              self->RailName(lane->rail).c_str(), lane->peer->id,
              Ms(self->now_ - lane->down_since));
  }
  return UCS_OK;
}

}  // namespace ucx
}  // namespace v1
}  // namespace pdlib
