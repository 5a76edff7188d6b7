// The verbs transport's progress thread: the only thread that posts to the initiator QPs and
// polls the CQs. It accepts batches, posts their work requests in chains within each send queue
// and CQ, turns completions into batch completions, fails a rail (its last live one: the peer) on
// an error completion or a stall, drains and destroys failed QPs, and sleeps on the completion
// channels (and the wake fd) when idle.
#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "backends/verbs/verbs_transport.h"
#include "lib/base/log_internal.h"

namespace pdlib {
inline namespace v1 {
namespace verbs {
namespace {

constexpr int kPollBatch = 64;   // completions per ibv_poll_cq
constexpr int kPollRounds = 16;  // ibv_poll_cq calls per CQ before looking at commands again
// A failed QP is destroyed once every request on it has completed (flushed) or after this long.
constexpr auto kDrainGrace = std::chrono::seconds(2);
constexpr auto kAsyncCheckPeriod = std::chrono::milliseconds(100);
constexpr int kIdleSleepMs = 100;  // backstop; completions and commands wake the thread at once

// wr_id: the pair's uid above kSeqBits, the request's sequence number on its QP below.
constexpr int kSeqBits = 40;
constexpr uint64_t kSeqMask = (uint64_t{1} << kSeqBits) - 1;
uint64_t WrId(uint32_t uid, uint64_t seq) { return (uint64_t{uid} << kSeqBits) | (seq & kSeqMask); }

}  // namespace

void VerbsTransport::ProgressLoop() {
  toolkit::IdlePolicy idle(std::chrono::microseconds(options_.busy_poll_us));
  while (true) {
    now_ = Clock::now();
    if (DrainCommands()) break;
    bool worked = PostReady();
    worked |= PollCqs();
    worked |= ReapPeers(now_);
    if (!completions_.empty()) {
      worked = true;
      RunCompletions();
    }
    if (now_ >= next_async_check_) {
      HandleAsyncEvents();
      CheckStalledPairs();
      CheckRejoins();
      next_async_check_ = now_ + kAsyncCheckPeriod;
    }
    if (idle.ShouldSleep(now_, worked)) Sleep();
  }
  Shutdown();
}

bool VerbsTransport::DrainCommands() {
  bool stop = false;
  if (progress_.RunCommands([this](std::unique_ptr<Batch> b) { AcceptBatch(std::move(b)); },
                            &stop)) {
    RunCompletions();
  }
  return stop;
}

void VerbsTransport::AcceptBatch(std::unique_ptr<Batch> owned) {
  owned->seq = ++last_seq_;
  auto it = peer_states_.find(owned->peer_id);
  if (it == peer_states_.end()) {  // disconnected after the batch was validated
    owned->Fail(
        Status::Cancelled("verbs: peer " + std::to_string(owned->peer_id) + " was disconnected"));
    completions_.Add(std::move(owned));
    return;
  }
  PeerState& peer = *it->second;
  if (!peer.failure.ok()) {
    owned->Fail(peer.failure);
    completions_.Add(std::move(owned));
    return;
  }
  Batch& batch = peer.batches.Add(std::move(owned));
  for (size_t k = 0; k < batch.plans.size() && k < peer.pairs.size(); ++k) {
    if (batch.plans[k].wrs.empty()) continue;
    batch.AddPart();
    peer.pairs[k]->to_post.push_back(&batch);
  }
  ReleaseRef(batch, peer);  // the acceptance reference: completes an empty batch at once
}

bool VerbsTransport::PostReady() {
  bool posted = false;
  for (auto& [id, peer] : peer_states_) {
    if (!peer->failure.ok()) continue;
    for (auto& pair : peer->pairs) {
      if (pair->to_post.empty()) continue;
      posted |= PostPair(*peer, *pair);
      if (!peer->failure.ok()) break;
    }
  }
  return posted;
}

// Posts as many queued requests of `pair` as its send queue, its device's CQ and the chain length
// allow, in one ibv_post_send per chain.
bool VerbsTransport::PostPair(PeerState& peer, PairState& pair) {
  const Device& device = *devices_[pair.device];
  uint64_t& device_outstanding = device_outstanding_[pair.device];
  bool posted_any = false;
  while (!pair.to_post.empty()) {
    const uint64_t cq_room =
        device.cq_depth > device_outstanding ? device.cq_depth - device_outstanding : 0;
    const uint32_t room = static_cast<uint32_t>(
        std::min<uint64_t>({pair.budget.room(), cq_room, options_.max_chain}));
    if (room == 0) break;
    // Take up to `room` requests from the queued batches, in order.
    struct Take {
      Batch* batch;
      size_t first;
      size_t count;
    };
    // Reads also stop at the QP's read depth; batches go in order, so a read batch waiting
    // for depth holds back the batches behind it.
    std::vector<Take> takes;
    size_t total = 0, total_sges = 0, left_after = 0;
    uint32_t read_room = pair.budget.read_room();
    const size_t pair_index = pair.index;
    for (Batch* batch : pair.to_post) {
      const WrPlan& plan = batch->plans[pair_index];
      const size_t remaining = plan.wrs.size() - batch->next_wr[pair_index];
      size_t cap = room - total;
      if (batch->reads) cap = std::min<size_t>(cap, read_room);
      const size_t n = std::min<size_t>(remaining, cap);
      if (n > 0) {
        takes.push_back({batch, batch->next_wr[pair_index], n});
        for (size_t i = 0; i < n; ++i) {
          total_sges += plan.wrs[batch->next_wr[pair_index] + i].num_sge;
        }
        total += n;
        if (batch->reads) read_room -= static_cast<uint32_t>(n);
      }
      left_after += remaining - n;
      if (n < remaining) break;
    }
    if (total == 0) break;  // the first batch waits for read depth
    wr_scratch_.assign(total, ibv_send_wr{});
    sge_scratch_.resize(total_sges);
    size_t w = 0, g = 0;
    for (const Take& take : takes) {
      const WrPlan& plan = take.batch->plans[pair_index];
      for (size_t i = take.first; i < take.first + take.count; ++i, ++w) {
        const PlannedWr& p = plan.wrs[i];
        const bool last_of_batch = i + 1 == plan.wrs.size();
        // The chain's last request is signalled when the poster stops for room with requests
        // left: its completion is what frees that room.
        const bool last_before_wait = w + 1 == total && left_after > 0;
        const SendQueueBudget::Posted posted =
            pair.budget.Post(last_of_batch || last_before_wait, take.batch->reads);
        ibv_send_wr& wr = wr_scratch_[w];
        wr.wr_id = WrId(pair.uid, posted.seq);
        wr.next = w + 1 < total ? &wr_scratch_[w + 1] : nullptr;
        wr.sg_list = &sge_scratch_[g];
        wr.num_sge = static_cast<int>(p.num_sge);
        wr.opcode = take.batch->reads ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
        wr.send_flags = posted.signalled ? IBV_SEND_SIGNALED : 0;
        wr.wr.rdma.remote_addr = p.remote_addr;
        wr.wr.rdma.rkey = p.rkey;
        for (uint32_t s = 0; s < p.num_sge; ++s, ++g) {
          const Sge& sge = plan.sges[p.first_sge + s];
          sge_scratch_[g] = ibv_sge{sge.addr, sge.length, sge.lkey};
        }
        if (last_of_batch) pair.batch_ends.emplace_back(posted.seq, take.batch);
      }
    }
    device_outstanding += total;
    ibv_send_wr* bad = nullptr;
    if (int rc = ibv_post_send(pair.qp.get(), wr_scratch_.data(), &bad); rc != 0) {
      // Nothing of the chain was taken (batch_ends may hold it: FailPair releases those).
      FailPair(peer, pair,
               Status::Unavailable("verbs: ibv_post_send of " + std::to_string(total) +
                                   " requests on QP " + std::to_string(pair.qp->qp_num) + " (" +
                                   device.label() + ") to peer " + std::to_string(peer.id) +
                                   " failed: " + ErrnoText(rc)));
      return true;
    }
    posted_any = true;
    if (pair.budget.outstanding() == total) pair.last_progress = now_;  // it was idle
    for (const Take& take : takes) {
      take.batch->next_wr[pair_index] += take.count;
    }
    while (!pair.to_post.empty()) {
      Batch* front = pair.to_post.front();
      if (front->next_wr[pair_index] < front->plans[pair_index].wrs.size()) break;
      pair.to_post.pop_front();
    }
  }
  return posted_any;
}

bool VerbsTransport::PollCqs() {
  bool any = false;
  ibv_wc wcs[kPollBatch];
  for (size_t d = 0; d < devices_.size(); ++d) {
    for (int round = 0; round < kPollRounds; ++round) {
      const int n = ibv_poll_cq(devices_[d]->cq.get(), kPollBatch, wcs);
      if (n < 0) {
        PDLIB_LOG(kError, "verbs: ibv_poll_cq on %s failed (%d)", devices_[d]->label(), n);
        break;
      }
      for (int i = 0; i < n; ++i) HandleCompletion(wcs[i]);
      any |= n > 0;
      if (n < kPollBatch) break;
    }
  }
  return any;
}

void VerbsTransport::HandleCompletion(const ibv_wc& wc) {
  const uint32_t uid = static_cast<uint32_t>(wc.wr_id >> kSeqBits);
  const uint64_t seq = wc.wr_id & kSeqMask;
  auto owner = pair_owner_.find(uid);
  if (owner == pair_owner_.end()) return;  // a QP already destroyed
  auto peer_it = peer_states_.find(owner->second.first);
  if (peer_it == peer_states_.end()) return;
  PeerState& peer = *peer_it->second;
  PairState& pair = *peer.pairs[owner->second.second];
  if (pair.probe_uid != 0 && uid == pair.probe_uid) return OnProbeCompletion(peer, pair, wc, seq);
  // RC completes a QP's requests in order: this one retires every earlier one too.
  device_outstanding_[pair.device] -= pair.budget.Retire(seq);
  pair.last_progress = now_;
  if (wc.status == IBV_WC_SUCCESS) {
    while (!pair.batch_ends.empty() && pair.batch_ends.front().first <= seq) {
      Batch* batch = pair.batch_ends.front().second;
      pair.batch_ends.pop_front();
      ReleaseRef(*batch, peer);
    }
    return;
  }
  if (pair.dead) return ReleaseDeadPair(peer, pair);  // a flush of a rail that failed alone
  if (!peer.failure.ok()) return;                     // the flush of a failed peer's QP
  const Device& device = *devices_[pair.device];
  FailPair(peer, pair,
           Status::Unavailable("verbs: RDMA request to peer " + std::to_string(peer.id) + " over " +
                               device.label() + " (QP " + std::to_string(wc.qp_num) +
                               ") failed: work completion status " + std::to_string(wc.status) +
                               " '" + ibv_wc_status_str(wc.status) + "' (vendor error " +
                               std::to_string(wc.vendor_err) + ")"));
}

// One rail of a connection failed. With a live rail left, only the batches with requests on it
// fail (their other rails' parts still complete first); new batches are striped over the rest.
// Its QP is moved to the error state (nothing more of it executes here) and stays until the peer
// goes; late flush completions of it are ignored. The last live rail fails the peer.
void VerbsTransport::FailPair(PeerState& peer, PairState& pair, const Status& status) {
  if (!peer.failure.ok() || pair.dead) return;
  size_t live = 0;
  for (const auto& p : peer.pairs) live += p->qp && !p->dead ? 1 : 0;
  if (live <= 1) return FailPeer(peer, status);
  pair.dead = true;
  ErrorQp(pair);
  const Device& device = *devices_[pair.device];
  {
    MutexLock lock(&mu_);
    if (PeerEntry* entry = peers_.Find(peer.id)) std::erase(entry->live_pairs, pair.index);
    rail_retry_at_[pair.device] = now_ + std::chrono::milliseconds(options_.rail_retry_ms);
  }
  // The batches with a part on this pair: queued (not all of it posted) or posted and awaiting
  // their last completion here. A batch is in one of the two lists at most.
  std::vector<Batch*> hit;
  for (Batch* batch : pair.to_post) hit.push_back(batch);
  for (const auto& [seq, batch] : pair.batch_ends) hit.push_back(batch);
  pair.to_post.clear();
  pair.batch_ends.clear();
  PDLIB_LOG(kWarning,
            "verbs: rail %s of peer %d failed; %d batches with requests on it fail, the "
            "connection goes on over %d rails: %s",
            device.label(), peer.id, static_cast<int>(hit.size()), static_cast<int>(live - 1),
            status.ToString());
  // Their parts here end once the QP flushed what it had outstanding (nothing of it can still
  // execute then), or kDrainGrace later: ReleaseDeadPair.
  pair.dead_since = now_;
  pair.probe_at = now_ + std::chrono::milliseconds(options_.rail_retry_ms);
  for (Batch* batch : hit) {
    batch->Fail(status);
    pair.dead_batches.push_back(batch);
  }
  ReleaseDeadPair(peer, pair);
}

void VerbsTransport::CheckRejoins() {
  const auto retry = std::chrono::milliseconds(options_.rail_retry_ms);
  const auto stall = std::chrono::milliseconds(std::max<uint32_t>(options_.rail_stall_ms, 1000));
  for (auto& [id, peer] : peer_states_) {
    if (!peer->failure.ok()) continue;
    for (auto& owned : peer->pairs) {
      PairState& pair = *owned;
      if (!pair.dead || !pair.standby) continue;
      const Device& device = *devices_[pair.device];
      if (pair.probing) {
        // Unanswered: stop it (its flush, or nothing, comes back as a stale generation) and
        // reset the standby before the next one.
        if (now_ - pair.probe_sent < stall) continue;
        pair.probing = false;
        pair.probe_reset = true;
        --device_outstanding_[pair.device];
        pair.probe_at = now_ + retry;
        PDLIB_LOG(kInfo, "verbs: probe of rail %s to peer %d unanswered after %d ms",
                  device.label(), id, static_cast<int>(stall.count()));
        continue;
      }
      if (now_ < pair.probe_at) continue;
      pair.probe_at = now_ + retry;
      // The failed QP's requests flush first (its batches are released then).
      if (!pair.dead_batches.empty()) continue;
      if (!PortActive(device).ok()) continue;
      std::optional<std::pair<uint64_t, uint32_t>> target;  // a remote address and its rkey
      {
        MutexLock lock(&mu_);
        if (PeerEntry* entry = peers_.Find(id)) {
          for (const RemoteRegionEntry& r : entry->regions) {
            if (r.length > 0 && pair.index < r.rkeys.size()) {
              target.emplace(r.addr, r.rkeys[pair.index]);
              break;
            }
          }
        }
      }
      if (!target) continue;  // nothing imported yet to read a byte of
      if (pair.probe_reset) {
        if (Status s = ResetRcQp(pair.standby.get(), device, pair.standby_remote, pair.standby_psn,
                                 options_);
            !s.ok()) {
          PDLIB_LOG(kWarning, "verbs: rail %s to peer %d cannot rejoin: %s", device.label(), id,
                    s.ToString());
          pair.standby.reset();
          continue;
        }
        pair.probe_reset = false;
      }
      // One byte of the peer's memory read into our landing word: nothing changes there, and a
      // READ the peer already served is served again (the same PSN after a reset).
      ibv_sge sge{reinterpret_cast<uint64_t>(&probe_landing_[pair.device]), 1,
                  probe_mrs_[pair.device]->lkey};
      ibv_send_wr wr{};
      wr.wr_id = WrId(pair.probe_uid, ++pair.probe_gen & kSeqMask);
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.opcode = IBV_WR_RDMA_READ;
      wr.send_flags = IBV_SEND_SIGNALED;
      wr.wr.rdma.remote_addr = target->first;
      wr.wr.rdma.rkey = target->second;
      ibv_send_wr* bad = nullptr;
      if (int rc = ibv_post_send(pair.standby.get(), &wr, &bad); rc != 0) {
        pair.probe_reset = true;
        continue;
      }
      pair.probing = true;
      pair.probe_sent = now_;
      ++device_outstanding_[pair.device];
    }
  }
}

void VerbsTransport::OnProbeCompletion(PeerState& peer, PairState& pair, const ibv_wc& wc,
                                       uint64_t seq) {
  if (!pair.probing || seq != (pair.probe_gen & kSeqMask)) return;  // stale: already written off
  pair.probing = false;
  --device_outstanding_[pair.device];
  if (!peer.failure.ok() || !pair.dead) return;
  if (wc.status == IBV_WC_SUCCESS) return Rejoin(peer, pair);
  pair.probe_reset = true;  // the standby is in the error state now
  PDLIB_LOG(kInfo, "verbs: probe of rail %s to peer %d failed ('%s'); again in %d ms",
            devices_[pair.device]->label(), peer.id, ibv_wc_status_str(wc.status),
            static_cast<int>(options_.rail_retry_ms));
}

void VerbsTransport::Rejoin(PeerState& peer, PairState& pair) {
  const Device& device = *devices_[pair.device];
  // The failed QP goes: whatever it still had outstanding is written off, its uid forgotten (a
  // late completion of it finds nothing).
  device_outstanding_[pair.device] -= pair.budget.outstanding();
  pair_owner_.erase(pair.uid);
  pair_owner_.erase(pair.probe_uid);
  pair.qp = std::move(pair.standby);
  pair.uid = next_pair_uid_++;
  pair.probe_uid = 0;
  pair_owner_[pair.uid] = {peer.id, pair.index};
  pair.budget = SendQueueBudget(device.sq_depth, options_.signal_every,
                                ReadDepth(device.initiator_depth, pair.standby_remote.rd_atomic));
  pair.errored = false;
  pair.dead = false;
  pair.last_progress = now_;
  const auto down_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(now_ - pair.dead_since).count();
  {
    MutexLock lock(&mu_);
    if (PeerEntry* entry = peers_.Find(peer.id)) entry->live_pairs.push_back(pair.index);
    rail_retry_at_[pair.device] = Clock::time_point{};
  }
  PDLIB_LOG(kWarning,
            "verbs: rail %s of peer %d is back after %d ms (its standby QP %d answered); it "
            "rejoins the stripe (a second failure of it stays out of this connection)",
            device.label(), peer.id, static_cast<int>(down_ms), pair.qp->qp_num);
}

void VerbsTransport::ReleaseDeadPair(PeerState& peer, PairState& pair) {
  if (pair.dead_batches.empty()) return;
  if (pair.budget.outstanding() > 0 && now_ - pair.dead_since < kDrainGrace) return;
  for (Batch* batch : std::exchange(pair.dead_batches, {})) ReleaseRef(*batch, peer);
}

// A QP with requests outstanding and no completion for verbs.rail_stall_ms: the RC retry budget
// (verbs.timeout, verbs.retry_cnt) should have failed it long before, but a QP can stall without
// failing (Soft-RoCE whose link went down and came back: its requests neither complete nor fail).
// It fails like a dead rail (FailPair), so that no batch waits on it for ever.
void VerbsTransport::CheckStalledPairs() {
  if (options_.rail_stall_ms == 0) return;
  const auto limit = std::chrono::milliseconds(options_.rail_stall_ms);
  for (auto& [id, peer] : peer_states_) {
    if (!peer->failure.ok()) continue;
    for (auto& pair : peer->pairs) {
      if (pair->dead) ReleaseDeadPair(*peer, *pair);  // past kDrainGrace without its flushes
      if (!pair->qp || pair->dead || pair->budget.outstanding() == 0) continue;
      if (now_ - pair->last_progress < limit) continue;
      const auto quiet =
          std::chrono::duration_cast<std::chrono::milliseconds>(now_ - pair->last_progress);
      FailPair(
          *peer, *pair,
          Status::Unavailable("verbs: rail " + devices_[pair->device]->label() + " (QP " +
                              std::to_string(pair->qp->qp_num) + ") to peer " + std::to_string(id) +
                              " stalled: " + std::to_string(pair->budget.outstanding()) +
                              " requests outstanding and nothing completed for " +
                              std::to_string(quiet.count()) + " ms (verbs.rail_stall_ms)"));
      if (!peer->failure.ok()) break;  // that was its last rail
    }
  }
}

void VerbsTransport::ReleaseRef(Batch& batch, PeerState& peer) {
  if (batch.PartDone()) completions_.Add(peer.batches.Remove(batch));
}

void VerbsTransport::ErrorQp(PairState& pair) {
  if (pair.errored || !pair.qp) return;
  pair.errored = true;
  // In the error state the QP stops and completes (flushes) every outstanding request.
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_ERR;
  if (int rc = ibv_modify_qp(pair.qp.get(), &attr, IBV_QP_STATE); rc != 0) {
    PDLIB_LOG(kWarning, "verbs: moving QP %d to the error state failed: %s", pair.qp->qp_num,
              ErrnoText(rc));
  }
}

void VerbsTransport::FailPeer(PeerState& peer, const Status& status) {
  if (!peer.failure.ok()) return;
  peer.failure = status;
  peer.drain_deadline = now_ + kDrainGrace;
  if (status.code() != StatusCode::kCancelled) {
    PDLIB_LOG(kWarning, "verbs: peer %d failed, %d batches outstanding: %s", peer.id,
              static_cast<int>(peer.batches.size()), status.ToString());
  }
  {
    MutexLock lock(&mu_);
    peers_.MarkFailed(peer.id, status);  // refuse new batches up front
  }
  for (auto& pair : peer.pairs) {
    ErrorQp(*pair);
    pair->to_post.clear();
    pair->batch_ends.clear();
    pair->dead_batches.clear();  // completed below with the rest
    if (pair->probing) {
      pair->probing = false;
      --device_outstanding_[pair->device];
    }
    pair->standby.reset();  // never used: nothing of it can land
  }
  for (auto& batch : peer.batches.TakeAll()) {
    batch->Fail(status);
    completions_.Add(std::move(batch));
  }
}

bool VerbsTransport::ReapPeers(Clock::time_point now) {
  bool changed = false;
  for (auto it = peer_states_.begin(); it != peer_states_.end();) {
    PeerState& peer = *it->second;
    if (peer.failure.ok()) {
      ++it;
      continue;
    }
    bool live = false;
    for (auto& pair : peer.pairs) {
      if (!pair->qp) continue;
      if (pair->budget.outstanding() > 0 && now < peer.drain_deadline) {
        live = true;
        continue;
      }
      if (pair->budget.outstanding() > 0) {
        PDLIB_LOG(kWarning, "verbs: QP %d still had %d requests outstanding %d ms after failing",
                  pair->qp->qp_num, static_cast<int>(pair->budget.outstanding()),
                  static_cast<int>(
                      std::chrono::duration_cast<std::chrono::milliseconds>(kDrainGrace).count()));
      }
      device_outstanding_[pair->device] -= pair->budget.outstanding();
      pair_owner_.erase(pair->uid);
      if (pair->probe_uid != 0) pair_owner_.erase(pair->probe_uid);
      pair->qp.reset();
      changed = true;
    }
    if (!live && peer.disconnecting) {
      it = peer_states_.erase(it);
      changed = true;
      continue;
    }
    ++it;
  }
  return changed;
}

void VerbsTransport::HandleAsyncEvents() {
  for (const auto& device : devices_) {
    ibv_async_event event{};
    while (ibv_get_async_event(device->context.get(), &event) == 0) {
      const char* what = ibv_event_type_str(event.event_type);
      switch (event.event_type) {
        case IBV_EVENT_QP_FATAL:
        case IBV_EVENT_QP_REQ_ERR:
        case IBV_EVENT_QP_ACCESS_ERR: {
          bool found = false;
          for (auto& [id, peer] : peer_states_) {
            for (auto& pair : peer->pairs) {
              if (pair->qp && pair->qp.get() == event.element.qp) {
                found = true;
                FailPair(*peer, *pair,
                         Status::Unavailable(
                             "verbs: QP " + std::to_string(event.element.qp->qp_num) + " to peer " +
                             std::to_string(id) + " on " + device->label() +
                             " failed: asynchronous event '" + what + "'"));
              }
            }
          }
          if (!found) {
            PDLIB_LOG(kInfo, "verbs: %s on target QP %d (%s)", what, event.element.qp->qp_num,
                      device->label());
          }
          break;
        }
        case IBV_EVENT_DEVICE_FATAL:
          for (auto& [id, peer] : peer_states_) {
            FailPeer(*peer, Status::Unavailable("verbs: device " + device->label() +
                                                " reported a fatal error"));
          }
          break;
        default: PDLIB_LOG(kInfo, "verbs: asynchronous event on %s: %s", device->label(), what);
      }
      ibv_ack_async_event(&event);
    }
  }
}

// Each batch drops its MR references before its callback may deregister memory.
void VerbsTransport::RunCompletions() { completions_.Run(); }

void VerbsTransport::Sleep() {
  // Arm every CQ, then poll once more: a completion that arrived before arming raised no event.
  for (const auto& device : devices_) ibv_req_notify_cq(device->cq.get(), 0);
  if (PollCqs()) return;
  bool draining = false;
  for (auto& [id, peer] : peer_states_) {
    for (auto& pair : peer->pairs) draining |= !peer->failure.ok() && pair->qp != nullptr;
  }
  epoll_event events[1 + 2 * kMaxDevices];
  const int n = progress_.Sleep(draining ? 10 : kIdleSleepMs, events);
  if (n < 0) return;  // a command is queued: no sleep
  for (const auto& device : devices_) {
    ibv_cq* cq = nullptr;
    void* context = nullptr;
    while (ibv_get_cq_event(device->channel.get(), &cq, &context) == 0) {
      ibv_ack_cq_events(cq, 1);
    }
  }
  for (int i = 0; i < n; ++i) {
    for (const auto& device : devices_) {
      if (events[i].data.fd == device->context->async_fd) next_async_check_ = Clock::time_point{};
    }
  }
}

void VerbsTransport::Shutdown() {
  // Every command queued before stopping_ was set has run; fail and drain everything.
  for (auto& [id, peer] : peer_states_) {
    peer->disconnecting = true;
    FailPeer(*peer, Status::Cancelled("verbs: the transport is being destroyed"));
  }
  RunCompletions();
  while (!peer_states_.empty()) {
    now_ = Clock::now();
    const bool polled = PollCqs();
    ReapPeers(now_);
    RunCompletions();
    if (!polled) usleep(1000);
  }
  RunCompletions();
}

}  // namespace verbs
}  // namespace v1
}  // namespace pdlib
