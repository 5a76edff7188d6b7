// The UCX transport's progress thread: the only thread that calls UCX with the worker. It accepts
// batches, posts their puts paced by each endpoint's window, drives ucp_worker_progress, turns
// request completions into batch completions, closes dead endpoints, and sleeps on the worker's
// fd and the wake fd when there is nothing to do.
#include <sched.h>
#include <sys/epoll.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "backends/ucx/ucx_send.h"
#include "backends/ucx/ucx_transport.h"
#include "lib/base/crc32c.h"
#include "lib/base/log_internal.h"

namespace pdlib {
inline namespace v1 {
namespace ucx {
namespace {

constexpr int kProgressRounds = 64;  // ucp_worker_progress calls before looking at commands again
constexpr auto kStallCheckPeriod = std::chrono::milliseconds(100);
// Closing: how long a healthy endpoint may take to flush the puts already posted, and how long
// UCX may take to close and to complete the requests it cancels (a backstop: both are prompt).
constexpr auto kFlushGrace = std::chrono::seconds(2);
// How long a close waits for the target to confirm that it cut the connection off (inside
// kFlushGrace). A live target answers within milliseconds; a frozen one never does, and the wait
// holds up whoever disconnects (the prefill core, under its transport lock), so it is short.
constexpr auto kCutGrace = std::chrono::milliseconds(500);
constexpr auto kCloseGrace = std::chrono::seconds(5);
constexpr int kSleepTimeoutMs = 100;  // wake up anyway for UCX's timers (keepalive) and stalls
// While writes are outstanding: poll (yielding) this long after the last progress, then sleep in
// short steps (see ProgressLoop).
constexpr auto kOutstandingPollFor = std::chrono::milliseconds(2);
constexpr int kOutstandingSleepMs = 1;
// "am" reads: a new request message waits until 1/kAmReadRefill of the window is free.
constexpr uint64_t kAmReadRefill = 4;
// ucx.rails: a batch's "am" ops stay on one rail for this many bytes before it moves to the
// rail with the most room (between whole ops, so a page never spans two rails). Small enough
// that one request's bytes spread over every rail, large enough that a read request message
// still names many ranges.
constexpr uint64_t kRailStripeBytes = uint64_t{256} << 10;

}  // namespace

void UcxTransport::ProgressLoop() {
  toolkit::IdlePolicy idle(std::chrono::microseconds(options_.busy_poll_us));
  while (true) {
    now_ = Clock::now();
    if (DrainCommands()) break;
    bool worked = rail_service_ && ServiceLanes(now_);
    worked |= PostReady();
    worked |= ProgressWorkers();
    worked |= ReapPeers(now_);
    worked |= ReapClosedTargets(now_, false);
    ReapRetired();
    if (!completions_.empty()) {
      worked = true;
      RunCompletions();
    }
    if (now_ >= next_stall_check_) {
      CheckStalls(now_);
      next_stall_check_ = now_ + kStallCheckPeriod;
    }
    if (idle.ShouldSleep(now_, worked)) {
      // With writes outstanding, keep polling (yielding the core to whoever needs it) for a
      // while before sleeping: UCX does not signal the worker fd when a peer frees room in a
      // shared-memory FIFO or socket, so an armed sleep there lasts until the timeout. With
      // nothing outstanding, sleep until a command or a UCX event arrives.
      const bool outstanding = !outstanding_seqs_.empty() || am_replies_in_flight_ > 0;
      if (outstanding && now_ - idle.last_work() < kOutstandingPollFor) {
        sched_yield();
      } else {
        SleepUntilWoken(outstanding ? kOutstandingSleepMs : kSleepTimeoutMs);
      }
    }
  }
  Shutdown();
}

bool UcxTransport::DrainCommands() {
  bool stop = false;
  if (progress_.RunCommands([this](std::unique_ptr<Batch> b) { AcceptBatch(std::move(b)); },
                            &stop)) {
    RunCompletions();
  }
  return stop;
}

void UcxTransport::AcceptBatch(std::unique_ptr<Batch> owned) {
  owned->seq = ++last_seq_;
  outstanding_seqs_.insert(owned->seq);
  auto it = peer_states_.find(owned->peer_id);
  if (it == peer_states_.end()) {  // disconnected after the batch was validated
    owned->status =
        Status::Cancelled("ucx: peer " + std::to_string(owned->peer_id) + " was disconnected");
    outstanding_seqs_.erase(owned->seq);
    completions_.Add(std::move(owned));
    return;
  }
  PeerState& peer = *it->second;
  if (peer.batches.empty()) peer.last_activity = now_;
  owned->peer = &peer;
  Batch& batch = peer.batches.Add(std::move(owned));
  if (!peer.failure.ok()) {
    batch.Fail(peer.failure);
  } else if (!batch.ops.empty()) {
    if (batch.am_messages > 0) {  // a reference until the target acknowledges the batch
      batch.awaiting_ack = true;
      batch.AddPart();
      awaiting_ack_.emplace(batch.seq, &batch);
    }
    peer.to_post.push_back(&batch);  // keeps the posting reference until fully posted
    return;
  }
  ReleaseRef(batch);
}

bool UcxTransport::PostReady() {
  bool posted = false;
  for (auto& [id, peer] : peer_states_) {
    if (!peer->to_post.empty() && peer->failure.ok()) posted |= PostChunks(*peer);
  }
  return posted;
}

bool UcxTransport::PostChunks(PeerState& peer) {
  bool posted = false;
  while (!peer.to_post.empty() && peer.failure.ok()) {
    Batch& batch = *peer.to_post.front();
    while (batch.next_op < batch.ops.size()) {
      const ResolvedOp& op = batch.ops[batch.next_op];
      if (op.length == 0) {
        ++batch.next_op;
        continue;
      }
      const uint64_t offset = batch.next_offset;
      // An "am" read is one request per chunk, answered in ucx.am_chunk_bytes replies.
      const bool read_request = op.am && batch.reads;
      const uint64_t limit = read_request ? std::min(options_.chunk_bytes, kMaxAmReadRequestBytes)
                             : op.am      ? options_.am_chunk_bytes
                                          : options_.chunk_bytes;
      const uint64_t length = toolkit::ChunkLength(op.length, offset, limit);
      if (op.am && offset == 0 && !PickRail(peer, batch, read_request)) return posted;
      Lane& lane = op.am ? *peer.lanes[batch.rail] : *peer.lanes[0];
      toolkit::InflightWindow& window = read_request ? lane.read_window : lane.window;
      if (read_request && batch.read_open.empty() && window.in_flight() > 0 &&
          window.limit() - std::min(window.limit(), window.in_flight()) <
              window.limit() / kAmReadRefill) {
        // Wait for a quarter of the window to free up, so that the next message names many
        // ranges instead of one per reply that drained.
        return posted;
      }
      if (read_request && !FitsAmReadBatch(static_cast<uint32_t>(batch.read_open.size()),
                                           batch.read_open_bytes, length)) {
        if (!SendReadRequests(peer, batch)) break;
      }
      if (!window.CanPost(length) || !peer.failure.ok()) {
        if (read_request) SendReadRequests(peer, batch);
        return posted;
      }
      ucp_request_param_t param{};
      param.op_attr_mask =
          UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
      param.cb.send = &UcxTransport::OnRequestDone;
      param.user_data = this;
      param.memh = op.memh;
      ucs_status_ptr_t request = nullptr;
      uint64_t cookie = 0;
      if (read_request) {
        // A range of the batch's next request message (SendReadRequests sends it).
        cookie = ++last_read_cookie_;
        batch.read_open.push_back(AmReadRange{op.am_region, 0, cookie, op.remote + offset, length});
        batch.read_open_bytes += length;
      } else if (op.am) {
        // Eager only: the target's handler applies the data it is handed (no rendezvous), and
        // the reply endpoint carries the ack. The header lives in the batch until it is done.
        param.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
        batch.am_headers.push_back(AmPutHeader{kAmPutMagic, batch.am_messages, peer.target,
                                               batch.seq, op.remote + offset});
        batch.lanes_used |= uint8_t(1u << lane.rail);
        request = ucp_am_send_nbx(lane.ep.get(), kAmPutId, &batch.am_headers.back(),
                                  sizeof(AmPutHeader), op.local + offset, length, &param);
        DigestSend(op, offset, length);
      } else if (batch.reads) {
        // Done (now, or when the request completes) means the bytes are in op.local.
        request = ucp_get_nbx(lane.ep.get(), op.local + offset, length, op.remote + offset, op.rkey,
                              &param);
      } else {
        request = ucp_put_nbx(lane.ep.get(), op.local + offset, length, op.remote + offset, op.rkey,
                              &param);
        DigestSend(op, offset, length);
      }
      posted = true;
      peer.last_activity = now_;
      if (op.am) batch.rail_bytes += length;
      batch.next_offset += length;
      if (batch.next_offset == op.length) {
        ++batch.next_op;
        batch.next_offset = 0;
      }
      if (read_request) {
        // Answered (or given up) by OnAmReadReply, FinishAmRead or DropAmReads; the window
        // counts the bytes until then.
        am_reads_.emplace(cookie, AmRead{&batch, &peer, lane.rail, op.local + offset, length, 0});
        ++peer.am_reads;
        batch.AddPart();
        lane.read_window.OnPosted(length);
        continue;
      }
      if (request == nullptr) continue;  // done already (the local buffer is reusable)
      if (UCS_PTR_IS_ERR(request)) {
        Status failed = Status::Unavailable(std::string("ucx: ") +
                                            (op.am         ? "message"
                                             : batch.reads ? "get"
                                                           : "put") +
                                            " to peer " + std::to_string(peer.id) +
                                            " failed: " + UcsStatusName(UCS_PTR_STATUS(request)));
        if (op.am && RailsMayFail(peer, lane.rail)) {  // the batches that used the rail fail
          LaneDown(peer, lane.rail,
                   std::string("a message on it failed: ") + UcsStatusName(UCS_PTR_STATUS(request)),
                   false);
          return posted;
        }
        batch.Fail(failed);
        batch.next_op = batch.ops.size();
        // The target will never count this batch's messages complete: the connection goes.
        if (batch.awaiting_ack) FailPeer(peer, failed);
        break;
      }
      auto* context = static_cast<RequestContext*>(request);
      context->batch = &batch;
      context->bytes = length;
      context->rail = lane.rail;
      batch.AddPart();
      lane.window.OnPosted(length);
    }
    if (!batch.read_open.empty() && !SendReadRequests(peer, batch)) return posted;
    peer.to_post.pop_front();
    if (batch.status.ok() && batch.has_puts) PostFlush(batch);
    ReleaseRef(batch);  // the posting reference; may complete the batch
  }
  return posted;
}

// Right after the piece's send: UCX has just read it (its copy into the socket or the FIFO, or a
// put's), so the digest finds it in cache; digesting first would read it from memory instead.
// Where UCX sends later (zero-copy, a full socket), the source is still what it sends: the
// engine keeps it unchanged until the request ends.
void UcxTransport::DigestSend(const ResolvedOp& op, uint64_t offset, uint64_t length) {
  if (op.crc != nullptr) *op.crc = Crc32cRaw(*op.crc, op.local + offset, length);
}

// Sends the batch's open ranges as one request message; false when the send failed (the batch
// and the connection are failed then: no reply will come for those ranges).
bool UcxTransport::SendReadRequests(PeerState& peer, Batch& batch) {
  return SendReadRequests(peer, batch, batch.rail);
}

bool UcxTransport::SendReadRequests(PeerState& peer, Batch& batch, uint32_t rail) {
  if (batch.read_open.empty()) return true;
  if (!peer.failure.ok()) {  // ReapPeers drops the ranges' reads
    batch.read_open.clear();
    batch.read_open_bytes = 0;
    return false;
  }
  batch.read_headers.push_back(AmReadBatchHeader{
      kAmReadBatchMagic, static_cast<uint32_t>(batch.read_open.size()), peer.target});
  batch.read_messages.push_back(std::move(batch.read_open));
  batch.read_open.clear();
  batch.read_open_bytes = 0;
  const std::vector<AmReadRange>& ranges = batch.read_messages.back();
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = &UcxTransport::OnRequestDone;
  param.user_data = this;
  // Eager; the reply endpoint carries the bytes back. Header and ranges live in the batch.
  param.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
  ucs_status_ptr_t request = ucp_am_send_nbx(
      peer.lanes[rail]->ep.get(), kAmReadId, &batch.read_headers.back(), sizeof(AmReadBatchHeader),
      ranges.data(), ranges.size() * sizeof(AmReadRange), &param);
  peer.last_activity = now_;
  if (request == nullptr) return true;
  if (UCS_PTR_IS_ERR(request)) {
    if (RailsMayFail(peer, rail)) {  // its ranges are asked again on another rail
      LaneDown(
          peer, rail,
          std::string("a read request on it failed: ") + UcsStatusName(UCS_PTR_STATUS(request)),
          false);
      return true;
    }
    Status failed = Status::Unavailable("ucx: read request to peer " + std::to_string(peer.id) +
                                        " failed: " + UcsStatusName(UCS_PTR_STATUS(request)));
    batch.Fail(failed);
    batch.next_op = batch.ops.size();
    FailPeer(peer, failed);  // its ranges' reads are dropped by ReapPeers
    return false;
  }
  auto* context = static_cast<RequestContext*>(request);
  context->batch = &batch;
  context->bytes = 0;  // a read's bytes are counted until answered
  context->rail = rail;
  batch.AddPart();
  return true;
}

bool UcxTransport::PickRail(PeerState& peer, Batch& batch, bool read_request) {
  if (peer.lanes.size() < 2 ||
      (batch.rail_bytes < kRailStripeBytes && !peer.lanes[batch.rail]->down)) {
    return true;
  }
  // The most room wins; among equals the next rail after the current one (round robin when
  // the links keep up and every window is empty).
  const size_t n = peer.lanes.size();
  uint32_t best = 0;
  uint64_t best_room = 0;
  bool found = false;
  for (size_t i = 1; i <= n; ++i) {
    const Lane& lane = *peer.lanes[(batch.rail + i) % n];
    if (lane.down) continue;  // rail 0 never is: something is always found
    const toolkit::InflightWindow& w = read_request ? lane.read_window : lane.window;
    const uint64_t room = w.limit() - std::min(w.limit(), w.in_flight());
    if (!found || room > best_room) {
      best = lane.rail;
      best_room = room;
      found = true;
    }
  }
  if (best != batch.rail && !batch.read_open.empty() && !SendReadRequests(peer, batch)) {
    return false;  // ranges gathered for the old rail go there first
  }
  batch.rail = best;
  batch.rail_bytes = 0;
  return true;
}

void UcxTransport::PostFlush(Batch& batch) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &UcxTransport::OnRequestDone;
  param.user_data = this;
  ucs_status_ptr_t request =
      options_.flush == FlushMode::kWorker
          ? ucp_worker_flush_nbx(batch.peer->lanes[0]->worker->worker.get(), &param)
          : ucp_ep_flush_nbx(batch.peer->lanes[0]->ep.get(), &param);
  if (request == nullptr) return;
  if (UCS_PTR_IS_ERR(request)) {
    batch.Fail(Status::Unavailable("ucx: flush to peer " + std::to_string(batch.peer_id) +
                                   " failed: " + UcsStatusName(UCS_PTR_STATUS(request))));
    return;
  }
  auto* context = static_cast<RequestContext*>(request);
  context->batch = &batch;
  context->bytes = 0;
  context->rail = 0;
  batch.AddPart();
}

void UcxTransport::OnRequestDone(void* request, ucs_status_t status, void* user_data) {
  auto* self = static_cast<UcxTransport*>(user_data);
  auto* context = static_cast<RequestContext*>(request);
  Batch& batch = *context->batch;
  const uint64_t bytes = context->bytes;
  const uint32_t rail = context->rail;
  ucp_request_free(request);
  if (batch.orphaned) {  // its peer and callback are gone; only the memory is left to free
    --batch.pending;
    return;
  }
  PeerState& peer = *batch.peer;
  Lane& lane = *peer.lanes[rail];
  lane.window.OnCompleted(bytes);
  lane.last_progress = self->now_;
  peer.last_activity = self->now_;
  if (status != UCS_OK && lane.down) {
    // The rail's endpoint went: its batches are abandoned, its read requests asked again.
  } else if (status != UCS_OK && self->RailsMayFail(peer, rail)) {
    self->LaneDown(peer, rail, std::string("a send on it failed: ") + UcsStatusName(status), false);
  } else if (status != UCS_OK) {
    std::string reason = std::string("ucx: ") + (batch.reads ? "read from" : "write to") +
                         " peer " + std::to_string(peer.id) + " failed: " + UcsStatusName(status);
    batch.Fail(status == UCS_ERR_CANCELED ? Status::Cancelled(reason)
                                          : Status::Unavailable(reason));
    // An ack or a read reply will not come for a message that was not sent.
    if (batch.awaiting_ack || !batch.read_messages.empty()) {
      self->FailPeer(peer, Status::Unavailable(reason));
    }
  }
  self->ReleaseRef(batch);
}

void UcxTransport::OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* lane = static_cast<Lane*>(arg);
  PeerState* peer = lane->peer;
  UcxTransport& self = *peer->transport;
  if (lane->down) {  // a probe's endpoint: the attempt is over (ProbeLane tears it down)
    lane->probe_deadline = self.now_;
    return;
  }
  if (self.RailsMayFail(*peer, lane->rail)) {
    self.LaneDown(*peer, lane->rail, std::string("its endpoint failed: ") + UcsStatusName(status),
                  false);
    return;
  }
  peer->ep_failed = true;
  // With rails, the rail is named: its link (or its NIC) is the likely culprit.
  const std::string rail = peer->lanes.size() > 1 ? " on rail " + std::to_string(lane->rail) +
                                                        " (" + self.options_.rails[lane->rail] + ")"
                                                  : "";
  self.FailPeer(*peer, Status::Unavailable("ucx: connection to peer " + std::to_string(peer->id) +
                                           rail + " failed: " + UcsStatusName(status)));
  // The endpoint is closed from the loop (ReapPeers), outside UCX's callback.
}

ucs_status_t UcxTransport::OnAmPut(void* arg, const void* header, size_t header_length, void* data,
                                   size_t length, const ucp_am_recv_param_t* param) {
  auto* via = static_cast<ConnWorker*>(arg);  // the worker it arrived on
  auto* self = via->transport;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    // pdlib sends eager messages only: a rendezvous request is refused, which fails the send.
    return UCS_ERR_UNSUPPORTED;
  }
  ucp_ep_h reply_ep =
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr;
  AmPutHeader h{};
  if (header_length != sizeof(h)) return UCS_OK;  // not pdlib's: nothing to answer
  std::memcpy(&h, header, sizeof(h));
  if (h.magic != kAmPutMagic) return UCS_OK;
  if (h.target != via->target) {  // not this worker's connection: refused
    if (reply_ep != nullptr) self->SendAmAck(reply_ep, h.batch, kAmCut);
    return UCS_OK;
  }
  bool batch_done = false;
  const AmStatus status = self->ApplyAmPut(h, data, length, &batch_done);
  if (batch_done) self->FoldLanded();  // the batch is acknowledged only once digested
  if (batch_done && reply_ep != nullptr) self->SendAmAck(reply_ep, h.batch, status);
  return UCS_OK;
}

UcxTransport::AmStatus UcxTransport::ApplyAmPut(const AmPutHeader& h, const void* data,
                                                size_t length, bool* batch_done) {
  auto target_it = am_targets_.find(h.target);
  if (target_it == am_targets_.end() || target_it->second.fenced) {
    // Closed or fenced: dropped. Answered at once, so that the initiator gives the batch up.
    *batch_done = true;
    return kAmCut;
  }
  AmTarget& target = target_it->second;
  if (!target.abandoned.empty() && target.abandoned.count(h.batch) != 0) {
    return kAmOk;  // given up with a dead rail (kAmAbandon): dropped, never acknowledged
  }
  AmStatus status = kAmOk;
  if (h.messages == 0) {
    status = kAmBadMessage;
  } else {
    // The destination must lie in memory this process registered for "am" writes.
    const auto dst = static_cast<uintptr_t>(h.dst);
    bool inside = false;
    for (const AmRegion& r : am_regions_) {
      if (dst >= r.addr && length <= r.length && dst - r.addr <= r.length - length) {
        inside = true;
        break;
      }
    }
    if (!inside) {
      status = kAmBadAddress;
    } else if (length > 0) {
      CopyLanding(reinterpret_cast<uint8_t*>(dst), data, length);
    }
  }
  if (h.messages == 1 || status == kAmBadMessage) {
    *batch_done = true;
    return status;
  }
  auto [it, inserted] = target.batches.try_emplace(h.batch);
  AmBatchProgress& progress = it->second;
  if (inserted) {
    if (target.batches.size() > kMaxAmBatchesPerTarget) {
      target.batches.erase(it);
      *batch_done = true;
      return kAmBadMessage;
    }
    progress.expected = h.messages;
  } else if (progress.expected != h.messages) {
    progress.status = kAmBadMessage;
  }
  if (status != kAmOk && progress.status == kAmOk) progress.status = status;
  if (++progress.received < progress.expected) return kAmOk;
  status = progress.status;
  target.batches.erase(it);
  *batch_done = true;
  return status;
}

void UcxTransport::CopyLanding(uint8_t* dst, const void* data, uint64_t length) {
  if (landing_watch_count_.load(std::memory_order_relaxed) == 0 && landed_pending_.empty()) {
    std::memcpy(dst, data, length);
    return;
  }
  // The pieces of watched cells the copy covers (a chunk spans a few cells at most) are found,
  // and the previous chunks' digests folded in, in one hold of the leaf lock before the copy: a
  // locked instruction right after the copy would wait for all of its stores.
  const auto start = reinterpret_cast<uint64_t>(dst);
  const uint64_t end = start + length;
  {
    MutexLock lock(&landing_mu_);
    FoldLandedLocked();  // leaves landed_pending_ empty
    auto it = landing_cells_.upper_bound(start);
    if (it != landing_cells_.begin() && std::prev(it)->second.end > start) --it;
    for (; it != landing_cells_.end() && it->first < end; ++it) {
      const uint64_t from = std::max(start, it->first);
      const uint64_t to = std::min(end, it->second.end);
      if (from < to) {
        landed_pending_.push_back(
            {it->first, it->second.watch, from - start, to - from, it->second.end - to, 0});
      }
    }
  }
  // The copy, each watched piece copied and digested in one pass (Crc32cCopy: the message's bytes
  // are loaded once, stored and folded; reading the destination back would wait for the copy's
  // stores), the bytes between pieces copied plainly. Pieces come in address order.
  const auto* src = static_cast<const uint8_t*>(data);
  uint64_t done = 0;
  for (LandedPiece& p : landed_pending_) {
    if (p.offset > done) std::memcpy(dst + done, src + done, p.offset - done);
    p.crc =
        Crc32cAppendZeros(Crc32cCopy(0, dst + p.offset, src + p.offset, p.bytes), p.zeros_after);
    done = p.offset + p.bytes;
  }
  if (done < length) std::memcpy(dst + done, src + done, length - done);
}

void UcxTransport::FoldLanded() {
  if (landed_pending_.empty()) return;
  MutexLock lock(&landing_mu_);
  FoldLandedLocked();
}

void UcxTransport::FoldLandedLocked() {
  for (const LandedPiece& p : landed_pending_) {
    // A watch taken or dropped meanwhile has no cell there any more (or another watch's).
    auto it = landing_cells_.find(p.cell);
    if (it == landing_cells_.end() || it->second.watch != p.watch) continue;
    it->second.digest->crc ^= p.crc;
    it->second.digest->bytes += p.bytes;
  }
  landed_pending_.clear();
}

void UcxTransport::EraseLandingWatch(
    uint64_t watch, std::vector<std::map<uint64_t, LandingCell>::node_type>* freed) {
  auto it = landing_watches_.find(watch);
  if (it == landing_watches_.end()) return;
  for (uint64_t start : it->second.starts) freed->push_back(landing_cells_.extract(start));
  landing_watches_.erase(it);
  landing_watch_count_.fetch_sub(1, std::memory_order_relaxed);
}

void UcxTransport::SendAmAck(ucp_ep_h reply_ep, uint64_t batch, AmStatus status) {
  // A failed send means the initiator is gone or its endpoint failed: the ack is moot.
  SendHeaderOnly(reply_ep, kAmAckId, AmAckHeader{kAmAckMagic, status, batch},
                 UCP_AM_SEND_FLAG_EAGER);
}

ucs_status_t UcxTransport::OnAmAck(void* arg, const void* header, size_t header_length, void* data,
                                   size_t length, const ucp_am_recv_param_t* param) {
  auto* via = static_cast<ConnWorker*>(arg);  // the worker it arrived on
  auto* self = via->transport;
  AmAckHeader ack{};
  if (header_length != sizeof(ack)) return UCS_OK;
  std::memcpy(&ack, header, sizeof(ack));
  if (ack.magic != kAmAckMagic) return UCS_OK;
  auto it = self->awaiting_ack_.find(ack.batch);
  if (it == self->awaiting_ack_.end()) return UCS_OK;  // already given up (peer failed)
  Batch& batch = *it->second;
  PeerState& peer = *batch.peer;
  peer.last_activity = self->now_;
  if (Lane* lane = self->LaneOf(via, peer.id)) lane->last_progress = self->now_;
  if (ack.status != kAmOk) {
    const char* why = ack.status == kAmCut ? "closed or fenced this connection"
                      : ack.status == kAmBadAddress
                          ? "refused a write outside its registered memory"
                          : "refused a malformed message";
    Status failed = Status::Unavailable("ucx: peer " + std::to_string(peer.id) + " " + why);
    batch.Fail(failed);
    if (ack.status == kAmCut) self->FailPeer(peer, failed);
  }
  self->ReleaseAck(batch);
  return UCS_OK;
}

// The target's side of an "am" read: checked here, answered with copies of the bytes (so no
// send still points into a region after a fence or a deregistration), never fatal.
ucs_status_t UcxTransport::OnAmRead(void* arg, const void* header, size_t header_length, void* data,
                                    size_t length, const ucp_am_recv_param_t* param) {
  auto* via = static_cast<ConnWorker*>(arg);  // the worker it arrived on
  auto* self = via->transport;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) return UCS_ERR_UNSUPPORTED;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0)
    return UCS_OK;  // nowhere to answer
  std::optional<std::vector<AmReadRequest>> requests =
      DecodeAmReadBatch(header, header_length, data, length);
  if (!requests) return UCS_OK;  // not pdlib's: no cookie to answer
  for (const AmReadRequest& request : *requests) {
    if (request.target != via->target) {  // not this worker's connection: refused
      self->SendAmReadReply(param->reply_ep, {}, request.cookie, 0, kAmCut, nullptr, 0);
      continue;
    }
    self->AnswerAmRead(param->reply_ep, request);
  }
  return UCS_OK;
}

void UcxTransport::AnswerAmRead(ucp_ep_h reply_ep, const AmReadRequest& request) {
  auto target = am_targets_.find(request.target);
  if (target == am_targets_.end() || target->second.fenced) {
    SendAmReadReply(reply_ep, {}, request.cookie, 0, kAmCut, nullptr, 0);
    return;
  }
  const AmRegion* region = FindReadableRange(am_regions_, request);
  if (region == nullptr) {
    SendAmReadReply(reply_ep, {}, request.cookie, 0, kAmBadAddress, nullptr, 0);
    return;
  }
  const ReplySource source{request.target, region->id};
  const auto* src = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(request.addr));
  const uint64_t chunk = std::max<uint64_t>(options_.am_chunk_bytes, 1);
  for (uint64_t offset = 0; offset < request.length; offset += chunk) {
    SendAmReadReply(reply_ep, source, request.cookie, offset, kAmOk, src + offset,
                    std::min(chunk, request.length - offset));
  }
}

namespace {

// One reply in flight: owned by its send until UCX completes it (UCX may read the header, and
// the bytes in the region, until then).
struct AmReadReplyMessage {
  AmReadReply header;
  UcxTransport* transport;
  uint64_t target;
  uint32_t region;
};

}  // namespace

void UcxTransport::ReplySent(const ReplySource& source) {
  --am_replies_in_flight_;
  if (auto it = replies_by_target_.find(source.target);
      it != replies_by_target_.end() && --it->second == 0) {
    replies_by_target_.erase(it);
  }
  if (auto it = replies_by_region_.find(source.region);
      it != replies_by_region_.end() && --it->second == 0) {
    replies_by_region_.erase(it);
  }
}

void UcxTransport::NoteReplyFailure(ucs_status_t status) {
  // A reader that died or closed: its replies have nowhere to go. Logged, never fatal.
  if (am_reply_failures_++ % 1000 == 0) {
    PDLIB_LOG(kWarning, "ucx: dropped a read reply the peer no longer takes: %s (%d so far)",
              UcsStatusName(status), am_reply_failures_);
  }
}

// The bytes go from the region itself, not from a copy: the copy cost a quarter of a tcp pull's
// throughput. What keeps that safe: a fence waits for the connection's replies still in flight,
// a deregistration for the region's (WaitForReplies), and the destructor destroys the worker,
// which ends every send, before the regions' owner can free them.
void UcxTransport::SendAmReadReply(ucp_ep_h reply_ep, const ReplySource& source, uint64_t cookie,
                                   uint64_t offset, AmStatus status, const uint8_t* data,
                                   size_t length) {
  auto message = std::make_unique<AmReadReplyMessage>();
  message->header = AmReadReply{kAmReadReplyMagic, status, cookie, offset};
  message->transport = this;
  message->target = source.target;
  message->region = source.region;
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  // Eager; REPLY lets the initiator check that the reply came on the request's connection.
  param.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY;
  param.cb.send = [](void* request, ucs_status_t st, void* user_data) {
    std::unique_ptr<AmReadReplyMessage> owned(static_cast<AmReadReplyMessage*>(user_data));
    UcxTransport& self = *owned->transport;
    if (owned->region != 0)
      self.ReplySent({owned->target, owned->region});
    else
      --self.am_replies_in_flight_;
    if (st != UCS_OK) self.NoteReplyFailure(st);
    ucp_request_free(request);
  };
  param.user_data = message.get();
  ucs_status_ptr_t request = ucp_am_send_nbx(reply_ep, kAmReadReplyId, &message->header,
                                             sizeof(AmReadReply), data, length, &param);
  if (UCS_PTR_IS_PTR(request)) {
    ++am_replies_in_flight_;
    if (source.region != 0) {
      ++replies_by_target_[source.target];
      ++replies_by_region_[source.region];
    }
    message.release();  // the callback owns it now
  } else if (UCS_PTR_IS_ERR(request)) {
    NoteReplyFailure(UCS_PTR_STATUS(request));
  }
}

uint64_t UcxTransport::WaitForReplies(const std::function<uint64_t()>& count,
                                      Clock::duration grace) {
  // On the progress thread (a call from a completion callback) nothing can progress meanwhile.
  if (progress_.OnThread()) return count();
  const auto deadline = Clock::now() + grace;
  while (true) {
    // A stopping thread answers kCancelled: nothing is sent any more, nothing to wait for.
    StatusOr<uint64_t> left = progress_.Run<StatusOr<uint64_t>>([&] { return count(); });
    if (!left.ok() || *left == 0) return 0;
    if (Clock::now() >= deadline) return *left;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// The initiator's side: a reply is copied only into a live request of a healthy connection and
// batch, and only inside that request.
ucs_status_t UcxTransport::OnAmReadReply(void* arg, const void* header, size_t header_length,
                                         void* data, size_t length,
                                         const ucp_am_recv_param_t* param) {
  auto* via = static_cast<ConnWorker*>(arg);  // the worker it arrived on
  auto* self = via->transport;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) return UCS_ERR_UNSUPPORTED;
  std::optional<AmReadReply> reply = DecodeAmReadReply(header, header_length);
  if (!reply) return UCS_OK;
  auto it = self->am_reads_.find(reply->cookie);
  if (it == self->am_reads_.end()) return UCS_OK;  // finished, dropped, or never ours
  AmRead& read = it->second;
  PeerState& peer = *read.peer;
  const ucp_ep_h from =
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr;
  if (from == nullptr || from != peer.lanes[read.rail]->ep.get()) {
    return UCS_OK;  // not the request's connection (or rail)
  }
  if (!peer.failure.ok()) return UCS_OK;  // DropAmReads finishes the request
  peer.last_activity = self->now_;
  peer.lanes[read.rail]->last_progress = self->now_;
  Batch& batch = *read.batch;
  if (reply->status != kAmOk) {
    const char* why = reply->status == kAmCut ? "closed or fenced this connection"
                      : reply->status == kAmBadAddress
                          ? "refused a read outside its registered memory"
                          : "refused a malformed read request";
    Status failed = Status::Unavailable("ucx: peer " + std::to_string(peer.id) + " " + why);
    batch.Fail(failed);
    if (reply->status == kAmCut) self->FailPeer(peer, failed);
    self->FinishAmRead(reply->cookie);
    return UCS_OK;
  }
  if (!ReplyFits(read.length, reply->offset, length)) {
    batch.Fail(Status::Unavailable("ucx: peer " + std::to_string(peer.id) + " sent " +
                                   std::to_string(length) + " bytes at offset " +
                                   std::to_string(reply->offset) + " for a read of " +
                                   std::to_string(read.length) + " bytes"));
    self->FinishAmRead(reply->cookie);
    return UCS_OK;
  }
  if (batch.status.ok() && length > 0) {
    self->CopyLanding(read.dst + reply->offset, data, length);
  }
  read.received += length;
  if (read.received >= read.length) self->FinishAmRead(reply->cookie);
  return UCS_OK;
}

void UcxTransport::FinishAmRead(uint64_t cookie) {
  auto it = am_reads_.find(cookie);
  if (it == am_reads_.end()) return;
  const AmRead read = it->second;
  am_reads_.erase(it);
  --read.peer->am_reads;
  read.peer->lanes[read.rail]->read_window.OnCompleted(read.length);
  ReleaseRef(*read.batch);
}

void UcxTransport::DropAmReads(PeerState& peer) {
  std::vector<uint64_t> cookies;
  for (const auto& [cookie, read] : am_reads_) {
    if (read.peer == &peer) cookies.push_back(cookie);
  }
  for (uint64_t cookie : cookies) FinishAmRead(cookie);
}

void UcxTransport::ReleaseAck(Batch& batch) {
  if (!batch.awaiting_ack) return;
  batch.awaiting_ack = false;
  awaiting_ack_.erase(batch.seq);
  ReleaseRef(batch);
}

void UcxTransport::ReleaseRef(Batch& batch) {
  if (!batch.PartDone() || batch.orphaned) return;
  outstanding_seqs_.erase(batch.seq);
  completions_.Add(batch.peer->batches.Remove(batch));
}

void UcxTransport::FailPeer(PeerState& peer, const Status& status) {
  if (peer.failure.ok()) {
    peer.failure = status;
    MutexLock lock(&mu_);
    peers_.MarkFailed(peer.id, status);  // refuse new batches up front
  }
  // Only marks: this may run inside UCX calls (the error callback), so nothing is freed here.
  // Unposted chunks are dropped by ReapPeers and PostChunks stops at the failure.
  for (auto& batch : peer.batches) batch->Fail(peer.failure);
}

// Closing an endpoint. On the "am" path a healthy one is first cut off at the target (a close
// message, whose echo says that no message of ours can still be applied: an eager message the
// target has not handled yet would otherwise land after the batch's callback said it ended).
// A healthy one is then flushed, so that the peer has handled every put
// already posted before the connection goes: UCX 1.13 aborts a process that handles an emulated
// put arriving on an endpoint it has already marked failed (ucp_put_handler cannot send its
// completion, "Fatal: unexpected error"), which a forced close with puts in flight causes. A
// failed endpoint, or one whose flush does not finish within kFlushGrace, is closed by force.
void UcxTransport::AdvanceClose(PeerState& peer) {
  switch (peer.close_state) {
    case CloseState::kOpen: {
      peer.close_deadline = now_ + kFlushGrace;
      if (peer.ep_failed) {
        CloseEndpoint(peer, /*force=*/true);
        return;
      }
      if (peer.am && SendClose(peer)) {
        peer.close_state = CloseState::kCutting;
        peer.cut_deadline = now_ + kCutGrace;
        return;
      }
      StartFlush(peer);
      return;
    }
    case CloseState::kCutting: {
      if (!peer.cut && !peer.ep_failed && now_ < peer.cut_deadline) return;
      if (!peer.cut && !peer.ep_failed) {
        PDLIB_LOG(kWarning,
                  "ucx: peer %d did not confirm within %d ms that it cut our connection off "
                  "(frozen or overloaded): a message of ours it has not handled yet may still "
                  "land",
                  peer.id, static_cast<int>(kCutGrace / std::chrono::milliseconds(1)));
      }
      if (peer.ep_failed) {
        CloseEndpoint(peer, /*force=*/true);
        return;
      }
      StartFlush(peer);  // within what is left of kFlushGrace
      return;
    }
    case CloseState::kFlushing: {
      ucs_status_t st = ucp_request_check_status(peer.flush_request);
      if (st == UCS_INPROGRESS && !peer.ep_failed && now_ < peer.close_deadline) return;
      // Freeing a request still in progress is allowed: UCX finishes it without telling us.
      ucp_request_free(std::exchange(peer.flush_request, nullptr));
      CloseEndpoint(peer, /*force=*/st != UCS_OK || peer.ep_failed);
      return;
    }
    case CloseState::kClosing: {
      bool in_progress = false;
      for (auto& lane : peer.lanes) {
        in_progress |= lane->close_request != nullptr &&
                       ucp_request_check_status(lane->close_request) == UCS_INPROGRESS;
      }
      if (in_progress && now_ < peer.close_deadline) return;
      for (auto& lane : peer.lanes) {
        if (lane->close_request != nullptr) {
          ucp_request_free(std::exchange(lane->close_request, nullptr));
        }
      }
      peer.close_state = CloseState::kClosed;
      return;
    }
    case CloseState::kClosed: return;
  }
}

void UcxTransport::StartFlush(PeerState& peer) {
  ucp_request_param_t param{};  // no callback: polled by AdvanceClose
  // Lane 0 carries the puts; the other rails' "am" messages are refused after the cut.
  ucs_status_ptr_t request = ucp_ep_flush_nbx(peer.lanes[0]->ep.get(), &param);
  if (UCS_PTR_IS_PTR(request)) {
    peer.flush_request = request;
    peer.close_state = CloseState::kFlushing;
    return;
  }
  CloseEndpoint(peer, /*force=*/UCS_PTR_STATUS(request) != UCS_OK);
}

// False when the message could not be sent (the endpoint failed): there is no echo to wait for,
// and the close goes on with the flush.
bool UcxTransport::SendClose(PeerState& peer) {
  return SendHeaderOnly(peer.lanes[0]->ep.get(), kAmCloseId,
                        AmCloseHeader{kAmCloseMagic, 0, peer.target, peer.id},
                        UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER);
}

// The target's side of a close: the connection is cut off as by a fence (every later message
// of it is refused), its partly applied batches are forgotten, and the header is echoed.
ucs_status_t UcxTransport::OnAmClose(void* arg, const void* header, size_t header_length,
                                     void* /*data*/, size_t /*length*/,
                                     const ucp_am_recv_param_t* param) {
  auto* via = static_cast<ConnWorker*>(arg);  // the worker it arrived on
  auto* self = via->transport;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) return UCS_ERR_UNSUPPORTED;
  AmCloseHeader h{};
  if (header_length != sizeof(h)) return UCS_OK;  // not pdlib's: nothing to answer
  std::memcpy(&h, header, sizeof(h));
  if (h.magic != kAmCloseMagic || h.target != via->target) return UCS_OK;
  if (auto it = self->am_targets_.find(h.target); it != self->am_targets_.end()) {
    it->second.fenced = true;
    it->second.batches.clear();
  }
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0) return UCS_OK;
  // A failed send means the initiator is gone: it closes by force, nothing to confirm.
  SendHeaderOnly(param->reply_ep, kAmClosedId, AmCloseHeader{kAmClosedMagic, 0, h.target, h.peer},
                 UCP_AM_SEND_FLAG_EAGER);
  return UCS_OK;
}

ucs_status_t UcxTransport::OnAmClosed(void* arg, const void* header, size_t header_length,
                                      void* /*data*/, size_t /*length*/,
                                      const ucp_am_recv_param_t* /*param*/) {
  auto* via = static_cast<ConnWorker*>(arg);  // the worker it arrived on
  auto* self = via->transport;
  AmCloseHeader h{};
  if (header_length != sizeof(h)) return UCS_OK;
  std::memcpy(&h, header, sizeof(h));
  if (h.magic != kAmClosedMagic) return UCS_OK;
  auto it = self->peer_states_.find(static_cast<spi::PeerId>(h.peer));
  // Checked against the connection's target too: a peer id is never reused, but be exact.
  if (it != self->peer_states_.end() && it->second->target == h.target) it->second->cut = true;
  return UCS_OK;
}

void UcxTransport::CloseEndpoint(PeerState& peer, bool force) {
  peer.close_deadline = now_ + kCloseGrace;
  bool pending = false;
  for (auto& lane : peer.lanes) {
    if (!lane->ep) continue;  // a down rail's, already closed (ResetLane)
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    // Force: outstanding requests complete with UCS_ERR_CANCELED instead of draining to a peer
    // that is dead or does not answer. The other rails carry "am" messages only, which the
    // target refuses once it cut the connection off: closed by force.
    param.flags = force || lane->rail != 0 ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    ucs_status_ptr_t request = ucp_ep_close_nbx(lane->ep.Release(), &param);
    if (UCS_PTR_IS_PTR(request)) {
      lane->close_request = request;
      pending = true;
    }
  }
  peer.close_state = pending ? CloseState::kClosing : CloseState::kClosed;
}

bool UcxTransport::ReapPeers(Clock::time_point now) {
  bool changed = false;
  for (auto it = peer_states_.begin(); it != peer_states_.end();) {
    PeerState& peer = *it->second;
    if (!peer.failure.ok() && peer.am_reads > 0) {
      DropAmReads(peer);  // the reply handler copies nothing for a failed peer any more
      changed = true;
    }
    if (!peer.failure.ok() && !peer.to_post.empty()) {
      std::deque<Batch*> unposted;
      unposted.swap(peer.to_post);
      for (Batch* batch : unposted) ReleaseRef(*batch);  // their posting references
      changed = true;
    }
    if (!peer.failure.ok() && peer.close_state != CloseState::kClosed) {
      CloseState before = peer.close_state;
      AdvanceClose(peer);
      changed |= peer.close_state != before;
    }
    if (peer.close_state == CloseState::kClosed) {
      // Nothing more leaves for the target: acks still awaited will not come.
      std::vector<Batch*> unacked;
      for (auto& batch : peer.batches) {
        if (batch->awaiting_ack) unacked.push_back(batch.get());
      }
      for (Batch* batch : unacked) ReleaseAck(*batch);
      changed |= !unacked.empty();
      if (!peer.batches.empty() && now >= peer.close_deadline) {
        PDLIB_LOG(kWarning, "ucx: %d batches to peer %d still outstanding after closing it",
                  static_cast<int>(peer.batches.size()), peer.id);
        OrphanBatches(peer);
        changed = true;
      }
      if (peer.batches.empty() && !peer.rkeys.empty()) {
        peer.rkeys.clear();  // after the endpoint and every request that used them
        changed = true;
      }
      if (peer.batches.empty() && peer.disconnecting) {
        // Signalled after RunCompletions: Disconnect returns once every callback has run.
        for (auto& promise : peer.on_erased) completions_.AddSignal(std::move(promise));
        peer.rkeys.clear();
        // Its worker goes with it (and whatever a dead target left in its receive FIFO); the
        // sends UCX still holds (orphaned batches') complete meanwhile.
        for (auto& lane : peer.lanes) DestroyWorker(std::move(lane->worker));
        it = peer_states_.erase(it);
        continue;
      }
    }
    ++it;
  }
  return changed;
}

void UcxTransport::OrphanBatches(PeerState& peer) {
  peer.to_post.clear();
  for (auto& batch : peer.batches.TakeAll()) {
    batch->orphaned = true;
    if (batch->awaiting_ack) awaiting_ack_.erase(batch->seq);
    outstanding_seqs_.erase(batch->seq);
    Status status = batch->status.ok() ? Status::Cancelled("ucx: endpoint closed") : batch->status;
    completions_.AddCall(std::move(batch->done), std::move(status));
    orphans_.push_back(std::move(batch));
  }
}

void UcxTransport::CheckStalls(Clock::time_point now) {
  CheckRailStalls(now);
  if (options_.stall_timeout_ms == 0) return;
  const auto limit = std::chrono::milliseconds(options_.stall_timeout_ms);
  for (auto& [id, peer] : peer_states_) {
    if (peer->failure.ok() && !peer->batches.empty() && now - peer->last_activity > limit) {
      peer->ep_failed = true;  // do not wait for a flush either
      FailPeer(*peer,
               Status::Unavailable("ucx: no write to peer " + std::to_string(id) +
                                   " completed for " + std::to_string(options_.stall_timeout_ms) +
                                   " ms (ucx.stall_timeout_ms); the peer is presumed dead"));
    }
  }
}

void UcxTransport::ReapRetired() {
  if (retired_.empty()) return;
  const uint64_t oldest = outstanding_seqs_.empty() ? ~uint64_t{0} : *outstanding_seqs_.begin();
  std::erase_if(retired_, [oldest](const auto& entry) { return entry.first < oldest; });
}

void UcxTransport::RunCompletions() {
  FoldLanded();  // a read batch completes only once what it copied is digested
  completions_.Run();
}

bool UcxTransport::ProgressWorkers() {
  bool worked = false;
  for (ConnWorker* w : workers_) {
    for (int i = 0; i < kProgressRounds && ucp_worker_progress(w->worker.get()) != 0; ++i) {
      worked = true;
    }
  }
  return worked;
}

bool UcxTransport::ReapClosedTargets(Clock::time_point now, bool all) {
  if (closed_targets_.empty()) return false;
  bool reaped = false;
  for (auto it = closed_targets_.begin(); it != closed_targets_.end();) {
    if (!all && now < it->first) {
      ++it;
      continue;
    }
    for (auto& w : it->second) DestroyWorker(std::move(w));
    it = closed_targets_.erase(it);
    reaped = true;
  }
  return reaped;
}

void UcxTransport::SleepUntilWoken(int timeout_ms) {
  bool armed = true;
  for (ConnWorker* w : workers_) {
    const ucs_status_t st = ucp_worker_arm(w->worker.get());
    if (st == UCS_ERR_BUSY) {
      // Events are pending that progress did not consume, e.g. a shared-memory FIFO slot that a
      // preempted peer thread has claimed but not yet filled: give the core away before polling
      // again, or an oversubscribed machine spins here for a whole time slice.
      sched_yield();
      return;
    }
    armed &= st == UCS_OK;
  }
  epoll_event events[8];
  // Should arming fail otherwise, do not trust the workers' fds: nap briefly instead. The loop
  // re-checks everything afterwards: which fd fired does not matter.
  progress_.Sleep(armed ? timeout_ms : 1, events);
}

void UcxTransport::Shutdown() {
  // Every command queued before stopping_ was set has run; fail and close everything.
  for (auto& [id, peer] : peer_states_) {
    peer->disconnecting = true;
    FailPeer(*peer, Status::Cancelled("ucx: the transport is being destroyed"));
  }
  // Healthy peers are flushed first (AdvanceClose); every wait is bounded by its grace period.
  while (!peer_states_.empty()) {
    now_ = Clock::now();
    const bool progressed = ProgressWorkers();
    ReapPeers(now_);
    RunCompletions();
    if (!progressed) sched_yield();
  }
  ReapClosedTargets(Clock::now(), true);
  RunCompletions();
  retired_.clear();
}

}  // namespace ucx
}  // namespace v1
}  // namespace pdlib
