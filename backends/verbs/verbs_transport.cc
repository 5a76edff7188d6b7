// The verbs transport's API side: setup, blobs, validation, work-request planning and hand-over
// to the progress thread (whose side lives in verbs_progress.cc).
#include "backends/verbs/verbs_transport.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "backends/verbs/verbs_wire.h"
#include "lib/base/log_internal.h"
#include "lib/registry/builtin_registration.h"

namespace pdlib {
inline namespace v1 {
namespace verbs {

VerbsTransport::VerbsTransport(VerbsOptions options, std::vector<std::unique_ptr<Device>> devices)
    : options_(std::move(options)),
      devices_(std::move(devices)),
      rail_retry_at_(devices_.size()),
      psn_rng_(std::random_device{}()),
      device_outstanding_(devices_.size(), 0) {}

StatusOr<std::unique_ptr<VerbsTransport>> VerbsTransport::Create(
    const spi::TransportOptions& options) {
  auto parsed = ParseVerbsOptions(options);
  if (!parsed.ok()) return parsed.status();
  if (parsed->devices.empty()) {  // neither verbs.devices nor nic_names: by topology
    std::string why;
    auto closest = DevicesByTopology(*parsed, options, &why);
    if (!closest.ok()) return closest.status();
    parsed->devices = std::move(*closest);
    PDLIB_LOG(kInfo, "verbs: devices by topology: %s%s", why.c_str(),
              parsed->devices.empty() ? " (the first device with an active port is used)" : "");
  }
  auto devices = OpenDevices(*parsed);
  if (!devices.ok()) return devices.status();
  for (const auto& d : *devices) {
    PDLIB_LOG(kInfo,
              "verbs: using %s (%s, GID index %d, MTU %d, max_sge %d, max message %d bytes, send "
              "queue %d, CQ %d)",
              d->label(), d->global ? "RoCE" : "InfiniBand", d->gid_index,
              128 << static_cast<int>(d->active_mtu), d->limits.max_sge,
              d->limits.max_message_bytes, d->sq_depth, d->cq_depth);
    if (RcRetryCount(*d, *parsed) != parsed->retry_cnt) {
      PDLIB_LOG(kInfo,
                "verbs: %s is Soft-RoCE, which would retry forever at verbs.retry_cnt=%d: its "
                "QPs use %d",
                d->label(), static_cast<int>(parsed->retry_cnt),
                static_cast<int>(RcRetryCount(*d, *parsed)));
    }
  }
  std::unique_ptr<VerbsTransport> transport(
      new VerbsTransport(std::move(*parsed), std::move(*devices)));
  if (Status s = transport->Init(); !s.ok()) return s;
  return transport;
}

Status VerbsTransport::Init() {
  probe_landing_.assign(devices_.size(), 0);
  for (size_t i = 0; i < devices_.size(); ++i) {
    MrPtr mr(ibv_reg_mr(devices_[i]->pd.get(), &probe_landing_[i], sizeof(uint64_t),
                        IBV_ACCESS_LOCAL_WRITE));
    if (!mr) {
      return Status::Internal("verbs: registering the probe buffer on " + devices_[i]->label() +
                              " failed: " + ErrnoText(errno));
    }
    probe_mrs_.push_back(std::move(mr));
  }
  std::vector<int> fds;
  for (const auto& d : devices_) {
    fds.push_back(d->channel->fd);
    // Asynchronous events (QP fatal errors, port changes) are read without blocking too.
    const int async_fd = d->context->async_fd;
    const int flags = fcntl(async_fd, F_GETFL);
    if (flags < 0 || fcntl(async_fd, F_SETFL, flags | O_NONBLOCK) != 0) {
      return Status::Internal("verbs: cannot make the async event fd non-blocking: " +
                              ErrnoText(errno));
    }
    fds.push_back(async_fd);
  }
  if (Status s = progress_.Open(fds); !s.ok()) return s;
  progress_.Start([this] { ProgressLoop(); });
  return Status::OK();
}

VerbsTransport::~VerbsTransport() {
  progress_.Stop();  // completes every outstanding batch with kCancelled first (Shutdown)
  // QPs before MRs, both before the devices' CQs, PDs and contexts (members, destroyed last).
  peer_states_.clear();
  {
    MutexLock lock(&targets_mu_);
    targets_.Clear();
  }
  progress_.ClearCommands();
  {
    MutexLock lock(&mu_);
    peers_.Clear();
    local_regions_.Clear();
  }
  completions_.Clear();
}

spi::TransportCapabilities VerbsTransport::capabilities() const {
  spi::TransportCapabilities caps;
  caps.moves_bytes = true;
  caps.needs_reply = true;  // RC QPs are connected from both ends
  caps.supports_cuda_memory = CudaRegistrationPossible();
  caps.fences = true;  // FenceTarget: the target's QPs go to the error state (reads stop too)
  caps.reads = true;   // RDMA READ
  caps.max_writes_per_batch = 0;
  caps.max_write_bytes = 0;  // split into messages of at most max_msg_sz here
  return caps;
}

std::vector<std::string> VerbsTransport::device_labels() const {
  std::vector<std::string> labels;
  for (const auto& d : devices_) labels.push_back(d->label());
  return labels;
}

uint32_t VerbsTransport::RandomPsn() {
  MutexLock lock(&mu_);
  return static_cast<uint32_t>(psn_rng_()) & 0xffffff;
}

StatusOr<spi::LocalRegionId> VerbsTransport::RegisterMemory(const spi::MemoryRegion& region,
                                                            spi::Blob* key_blob) {
  if (region.addr == nullptr || region.length == 0) {
    return Status::InvalidArgument("verbs: cannot register an empty region");
  }
  const auto addr = reinterpret_cast<uint64_t>(region.addr);
  if (addr + region.length < addr) return Status::InvalidArgument("verbs: region wraps around");
  auto mrs = std::make_shared<RegionMrs>();
  LocalRegion entry{addr, region.length, {}, mrs};
  std::vector<uint32_t> rkeys;
  for (const auto& device : devices_) {
    auto mr = RegisterRegion(*device, region);
    if (!mr.ok()) return mr.status();
    entry.lkeys.push_back((*mr)->lkey);
    rkeys.push_back((*mr)->rkey);
    mrs->mrs.push_back(std::move(*mr));
  }
  if (key_blob != nullptr) *key_blob = EncodeKeys(rkeys);
  MutexLock lock(&mu_);
  return local_regions_.Add(std::move(entry));
}

Status VerbsTransport::DeregisterMemory(spi::LocalRegionId region) {
  std::shared_ptr<RegionMrs> mrs;
  {
    MutexLock lock(&mu_);
    auto removed = local_regions_.Remove(region);
    if (!removed.ok()) return removed.status();
    mrs = std::move(removed->mrs);
  }
  // The MRs are deregistered here unless a batch still holds them; then with its last reference.
  return Status::OK();
}

StatusOr<spi::TargetEndpoint> VerbsTransport::CreateTargetEndpoint() {
  // Two QPs per rail: entry d is the rail's primary, n + d its standby (a rail that fails
  // rejoins on it, see FailPair). A rail whose port is not ACTIVE now has neither.
  const size_t n = devices_.size();
  TargetEntry entry;
  std::vector<QpAddress> addresses(2 * n, QpAddress::Absent());
  entry.qps.resize(2 * n);
  entry.psns.assign(2 * n, 0);
  std::string down;  // rails left out
  for (size_t d = 0; d < n; ++d) {
    Device& device = *devices_[d];
    if (Status active = PortActive(device); !active.ok()) {
      down += (down.empty() ? "" : "; ") + std::string(active.message());
      continue;
    }
    for (size_t i : {d, n + d}) {
      auto qp = CreateRcQp(device);
      if (!qp.ok()) return qp.status();
      entry.psns[i] = RandomPsn();
      addresses[i] = LocalAddress(device, **qp, entry.psns[i]);
      entry.qps[i] = std::move(*qp);
    }
  }
  if (down.size() > 0) {
    if (std::none_of(entry.qps.begin(), entry.qps.end(), [](const QpPtr& qp) { return !!qp; })) {
      return Status::Unavailable("verbs: no rail to take a connection on: " + down);
    }
    PDLIB_LOG(kWarning, "verbs: a target endpoint without some rails: %s", down);
  }
  MutexLock lock(&targets_mu_);
  const spi::TargetId id = targets_.Add(std::move(entry));
  return spi::TargetEndpoint{id, EncodeQpAddresses(kEndpointMagic, addresses)};
}

Status VerbsTransport::CompleteTargetEndpoint(spi::TargetId target, const spi::Blob& reply) {
  auto remote = DecodeQpAddresses(reply, kReplyMagic, "reply");
  if (!remote.ok()) return remote.status();
  MutexLock lock(&targets_mu_);
  auto found = targets_.FindUnfenced(target);
  if (!found.ok()) return found.status();
  TargetEntry& entry = **found;
  if (entry.connected) {
    return Status::FailedPrecondition("verbs: target endpoint " + std::to_string(target) +
                                      " is already connected");
  }
  if (remote->size() != entry.qps.size()) {
    return Status::InvalidArgument("verbs: reply blob has " + std::to_string(remote->size()) +
                                   " QPs for the " + std::to_string(entry.qps.size()) +
                                   " of target endpoint " + std::to_string(target));
  }
  for (size_t i = 0; i < entry.qps.size(); ++i) {
    // A rail either side left out; the initiator leaves out the ones this side did.
    if (!entry.qps[i] || (*remote)[i].absent()) continue;
    Status s = ConnectRcQp(entry.qps[i].get(), *devices_[i % devices_.size()], (*remote)[i],
                           entry.psns[i], options_);
    if (!s.ok()) return s.WithPrefix("target endpoint " + std::to_string(target));
  }
  entry.connected = true;
  return Status::OK();
}

void VerbsTransport::CloseTargetEndpoint(spi::TargetId target) {
  std::optional<TargetEntry> closed;
  {
    MutexLock lock(&targets_mu_);
    closed = targets_.Take(target);
  }
  // The QPs are destroyed here, outside the lock; a target QP never has requests of its own.
}

Status VerbsTransport::FenceTarget(spi::TargetId target) {
  // Under targets_mu_, so that CloseTargetEndpoint cannot destroy the QPs meanwhile and
  // CompleteTargetEndpoint cannot connect them afterwards.
  MutexLock lock(&targets_mu_);
  auto found = targets_.Find(target);
  if (!found.ok()) return found.status();
  TargetEntry& entry = **found;
  if (entry.fenced) return Status::OK();
  // Every QP, even after one fails: each one in the error state is one less path for writes.
  Status first_error;
  for (size_t i = 0; i < entry.qps.size(); ++i) {
    if (!entry.qps[i]) continue;  // a rail without a QP in this connection
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_ERR;
    if (int rc = ibv_modify_qp(entry.qps[i].get(), &attr, IBV_QP_STATE); rc != 0) {
      if (first_error.ok()) {
        first_error = Status::Internal("verbs: fencing target endpoint " + std::to_string(target) +
                                       ": moving QP " + std::to_string(entry.qps[i]->qp_num) +
                                       " on " + devices_[i % devices_.size()]->label() +
                                       " to the error state failed: " + ErrnoText(rc));
      }
    }
  }
  if (!first_error.ok()) return first_error;
  entry.fenced = true;
  PDLIB_LOG(kInfo, "verbs: target endpoint %d fenced: its %d QPs are in the error state", target,
            static_cast<int>(entry.qps.size()));
  return Status::OK();
}

StatusOr<spi::Connection> VerbsTransport::Connect(const spi::Blob& target_endpoint) {
  auto remote = DecodeQpAddresses(target_endpoint, kEndpointMagic, "endpoint");
  if (!remote.ok()) return remote.status();
  // Entry k < m is the target's rail k primary QP, m + k its standby (CreateTargetEndpoint);
  // the reply has the same shape.
  if (remote->size() % 2 != 0) {
    return Status::InvalidArgument("verbs: endpoint blob has " + std::to_string(remote->size()) +
                                   " QPs: a primary and a standby per rail expected");
  }
  const size_t m = remote->size() / 2;
  auto state = std::make_unique<PeerState>();
  PeerEntry entry;
  std::vector<QpAddress> reply(2 * m, QpAddress::Absent());
  // Which pairs get QPs: both ports ACTIVE, and not a rail that failed within
  // verbs.rail_retry_ms (unless every usable rail did: then those are tried again at once).
  std::vector<Status> usable(m);
  for (size_t k = 0; k < m; ++k) {
    usable[k] = (*remote)[k].absent() || (*remote)[m + k].absent()
                    ? Status::Unavailable("the peer's rail " + std::to_string(k) + " is down")
                    : PortActive(*devices_[k % devices_.size()]);
  }
  {
    const auto now = Clock::now();
    std::vector<Status> rested = usable;
    MutexLock lock(&mu_);
    for (size_t k = 0; k < rested.size(); ++k) {
      const size_t d = k % devices_.size();
      if (rested[k].ok() && now < rail_retry_at_[d]) {
        rested[k] = Status::Unavailable(
            "rail " + devices_[d]->label() + " failed " +
            std::to_string(
                std::chrono::duration_cast<std::chrono::milliseconds>(
                    now - (rail_retry_at_[d] - std::chrono::milliseconds(options_.rail_retry_ms)))
                    .count()) +
            " ms ago (verbs.rail_retry_ms " + std::to_string(options_.rail_retry_ms) + ")");
      }
    }
    if (std::any_of(rested.begin(), rested.end(), [](const Status& st) { return st.ok(); })) {
      usable = std::move(rested);
    }
  }
  std::string down;  // rails left out
  for (size_t k = 0; k < m; ++k) {
    const size_t d = k % devices_.size();
    Device& device = *devices_[d];
    entry.pair_device.push_back(d);
    auto pair = std::make_unique<PairState>();
    pair->index = k;
    pair->device = d;
    if (const Status& active = usable[k]; !active.ok()) {
      // A pair without QPs keeps the indices (the peer's rkeys are by its rail): nothing is
      // striped onto it.
      down += (down.empty() ? "" : "; ") + std::string(active.message());
      state->pairs.push_back(std::move(pair));
      continue;
    }
    for (size_t i : {k, m + k}) {
      auto qp = CreateRcQp(device);
      if (!qp.ok()) return qp.status();
      const uint32_t psn = RandomPsn();
      if (Status st = ConnectRcQp(qp->get(), device, (*remote)[i], psn, options_); !st.ok()) {
        return st.WithPrefix("connecting to the peer's QP " + std::to_string(i));
      }
      reply[i] = LocalAddress(device, **qp, psn);
      if (i == k) {
        pair->qp = std::move(*qp);
      } else {
        pair->standby = std::move(*qp);
        pair->standby_psn = psn;
        pair->standby_remote = (*remote)[i];
      }
    }
    pair->budget = SendQueueBudget(device.sq_depth, options_.signal_every,
                                   ReadDepth(device.initiator_depth, (*remote)[k].rd_atomic));
    state->pairs.push_back(std::move(pair));
    entry.live_pairs.push_back(k);
  }
  if (entry.live_pairs.empty()) {
    return Status::Unavailable("verbs: no rail to connect over: " + down);
  }
  if (!down.empty()) {
    PDLIB_LOG(kWarning, "verbs: connecting over %d of %d rails: %s",
              static_cast<int>(entry.live_pairs.size()), static_cast<int>(m), down);
  }
  spi::PeerId id = 0;
  {
    MutexLock lock(&mu_);
    id = peers_.NextId();
    state->id = id;
    // Queued under mu_, before the peer is visible: it reaches the progress thread before any
    // batch posted to it.
    auto shared = std::shared_ptr<PeerState>(std::move(state));
    const bool queued = progress_.Post([this, shared] {
      for (size_t k = 0; k < shared->pairs.size(); ++k) {
        PairState& pair = *shared->pairs[k];
        pair.uid = next_pair_uid_++;
        pair_owner_[pair.uid] = {shared->id, k};
        if (pair.standby) {
          pair.probe_uid = next_pair_uid_++;
          pair_owner_[pair.probe_uid] = {shared->id, k};
        }
      }
      const spi::PeerId peer_id = shared->id;
      auto owned = std::make_unique<PeerState>(std::move(*shared));
      peer_states_.emplace(peer_id, std::move(owned));
    });
    if (!queued) return Status::Cancelled("verbs: the transport is shutting down");
    peers_.Add(id, std::move(entry));
  }
  return spi::Connection{id, EncodeQpAddresses(kReplyMagic, reply)};
}

StatusOr<spi::RemoteRegionId> VerbsTransport::ImportRemoteRegion(spi::PeerId peer,
                                                                 const spi::RemoteRegion& region) {
  auto rkeys = DecodeKeys(region.key);
  if (!rkeys.ok()) return rkeys.status();
  if (Status s = toolkit::CheckRemoteRegion("verbs", region); !s.ok()) return s;
  MutexLock lock(&mu_);
  PeerEntry* entry = peers_.Find(peer);
  if (entry == nullptr) return Status::NotFound("verbs: unknown peer " + std::to_string(peer));
  if (rkeys->size() != entry->pair_device.size()) {
    return Status::InvalidArgument("verbs: key blob has " + std::to_string(rkeys->size()) +
                                   " rkeys but peer " + std::to_string(peer) + " has " +
                                   std::to_string(entry->pair_device.size()) + " devices");
  }
  entry->regions.push_back(RemoteRegionEntry{region.addr, region.length, std::move(*rkeys)});
  return static_cast<spi::RemoteRegionId>(entry->regions.size() - 1);
}

Status VerbsTransport::PostWrites(spi::PeerId peer, std::span<const spi::WriteOp> ops,
                                  spi::WriteCallback done) {
  return Post(peer, ops, std::move(done), toolkit::OpKind::kWrite);
}

Status VerbsTransport::PostReads(spi::PeerId peer, std::span<const spi::ReadOp> ops,
                                 spi::ReadCallback done) {
  return Post(peer, ops, std::move(done), toolkit::OpKind::kRead);
}

Status VerbsTransport::Post(spi::PeerId peer, std::span<const spi::WriteOp> ops,
                            spi::WriteCallback done, toolkit::OpKind kind) {
  auto batch = std::make_unique<Batch>();
  batch->peer_id = peer;
  batch->done = std::move(done);
  batch->reads = kind == toolkit::OpKind::kRead;
  std::vector<std::vector<WriteSegment>> segments;
  std::vector<size_t> pair_device;
  {
    MutexLock lock(&mu_);
    auto found = peers_.ForWrites(peer);
    if (!found.ok()) return found.status();
    const PeerEntry& entry = **found;
    pair_device = entry.pair_device;
    segments.resize(pair_device.size());
    // Striped by bytes over the pairs with a QP (devices, rails), whole ops, kStripeBytes each.
    std::vector<uint64_t> lengths(ops.size());
    for (size_t i = 0; i < ops.size(); ++i) lengths[i] = ops[i].length;
    const size_t live = entry.live_pairs.size();
    const std::vector<size_t> stripe =
        StripeOverPairs(lengths, live, kStripeBytes, next_stripe_.fetch_add(1) % live);
    for (size_t i = 0; i < ops.size(); ++i) {
      const spi::WriteOp& op = ops[i];
      auto resolved = peers_.ResolveWrite(peer, entry, local_regions_, i, op, kind);
      if (!resolved.ok()) return resolved.status();
      const LocalRegion& local = *resolved->first;
      const RemoteRegionEntry& dst = *resolved->second;
      if (op.length == 0) continue;
      const size_t k = entry.live_pairs[stripe[i]];
      segments[k].push_back({local.addr + op.local_offset, local.lkeys[pair_device[k]],
                             dst.addr + op.remote_offset, dst.rkeys[k], op.length});
      if (std::find(batch->regions.begin(), batch->regions.end(), local.mrs) ==
          batch->regions.end()) {
        batch->regions.push_back(local.mrs);
      }
    }
  }
  // Planning needs no lock: the batch holds its MRs and the keys were copied.
  batch->plans.resize(segments.size());
  batch->next_wr.assign(segments.size(), 0);
  for (size_t k = 0; k < segments.size(); ++k) {
    const Device& device = *devices_[pair_device[k]];
    PlanWrites(segments[k], batch->reads ? device.read_limits : device.limits, &batch->plans[k]);
  }
  if (!progress_.Enqueue({std::move(batch), {}})) {
    return Status::Cancelled("verbs: the transport is shutting down");
  }
  return Status::OK();
}

void VerbsTransport::Disconnect(spi::PeerId peer) {
  {
    MutexLock lock(&mu_);
    if (!peers_.Erase(peer)) return;
  }
  // On the progress thread: fails the peer's batches (their callbacks run at the loop's next
  // safe point) and signals `erased` once they have run.
  auto begin = [this, peer](std::promise<void>* erased) {
    auto it = peer_states_.find(peer);
    if (it != peer_states_.end()) {
      it->second->disconnecting = true;
      FailPeer(*it->second,
               Status::Cancelled("verbs: peer " + std::to_string(peer) + " disconnected"));
    }
    if (erased != nullptr) completions_.AddSignal(std::move(*erased));
  };
  if (progress_.OnThread()) {  // from a completion callback: cannot wait for ourselves
    begin(nullptr);
    return;
  }
  std::promise<void> erased;
  std::future<void> erased_future = erased.get_future();
  if (!progress_.Post([&] { begin(&erased); })) return;  // the destructor cancels all
  erased_future.wait();
}

}  // namespace verbs

void RegisterVerbsBackend() {
  internal::RegisterBuiltinTransport(
      "verbs",
      [](const spi::TransportOptions& options) -> StatusOr<std::unique_ptr<spi::Transport>> {
        auto transport = verbs::VerbsTransport::Create(options);
        if (!transport.ok()) return transport.status();
        return std::unique_ptr<spi::Transport>(std::move(*transport));
      })
      .IgnoreError();  // only fails if "verbs" is registered twice, which the call_once prevents
}

}  // namespace v1
}  // namespace pdlib
