#include "lib/core/grpc_kv_manager.h"

#include <deque>
#include <random>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_format.h"
#include "lib/base/log_internal.h"
#include "lib/base/mutex.h"
#include "lib/control/bootstrap_server.h"
#include "lib/control/discovery.h"
#include "lib/control/net_address.h"
#include "lib/control/peer_client.h"
#include "lib/control/peer_server.h"
#include "lib/core/handles.h"
#include "lib/core/manager_common.h"

namespace pdlib {
inline namespace v1 {
namespace {

// A bootstrap lookup or connection that failed this way may succeed on a later try: no such
// rank registered yet, bootstrap or prefill unreachable or slow.
bool MaySucceedLater(StatusCode code) {
  return code == StatusCode::kNotFound || code == StatusCode::kUnavailable ||
         code == StatusCode::kDeadlineExceeded;
}

control::ControlSecurity Security(const KVManagerOptions& o) {
  return {o.auth_secret, o.tls_cert_file, o.tls_key_file, o.tls_ca_file};
}

// ---------------------------------------------------------------------------------------------
// Prefill
// ---------------------------------------------------------------------------------------------

class GrpcPrefillManager final : public PrefillManagerBase {
 public:
  static StatusOr<std::unique_ptr<KVManager>> Create(const KVManagerOptions& options,
                                                     std::unique_ptr<spi::Transport> transport) {
    std::unique_ptr<GrpcPrefillManager> m(new GrpcPrefillManager());
    KVManagerOptions o = options;
    if (o.start_bootstrap_server) {
      control::BootstrapServerOptions bo;
      bo.host = o.bootstrap_host;
      bo.port = o.bootstrap_port;  // 0: a free port, which every later use below then names
      bo.security = Security(o);
      auto server = control::BootstrapServer::Start(bo);
      if (!server.ok()) return server.status().WithPrefix("starting the bootstrap server");
      m->bootstrap_server_ = std::move(*server);
      o.bootstrap_port = static_cast<uint16_t>(m->bootstrap_server_->port());
      m->bootstrap_endpoint_ = control::JoinHostPort(o.bootstrap_host, o.bootstrap_port);
    }
    auto core = PrefillCore::Create(o, std::move(transport));
    if (!core.ok()) return core.status();
    m->core_ = *core;
    control::PeerServerOptions po;
    po.host = o.listen_host;
    po.port = o.listen_port;
    po.liveness_timeout = o.liveness_timeout;
    po.security = Security(o);
    auto server = control::PeerServer::Start(po, m->core_);
    if (!server.ok()) return server.status();
    m->peer_server_ = std::move(*server);
    m->endpoint_ = control::JoinHostPort(o.listen_host, m->peer_server_->port());

    auto discovery = control::DiscoveryBackend::Create(o);
    if (!discovery.ok()) return discovery.status();
    m->discovery_ = std::move(*discovery);
    control::RankRegistration reg;
    reg.parallel = o.args.parallel;
    reg.host = o.listen_host;
    reg.port = static_cast<uint32_t>(m->peer_server_->port());
    reg.page_size = o.args.page_size;
    reg.fingerprint = o.args.fingerprint;
    auto publisher = m->discovery_->Publish(reg);
    if (!publisher.ok()) {
      return publisher.status().WithPrefix("registering with " + m->discovery_->Describe());
    }
    m->publisher_ = std::move(*publisher);
    m->relay_ = std::thread([mgr = m.get()] { mgr->RelayLoop(); });
    PDLIB_LOG(kInfo, "prefill manager listening on %s (backend %s)", m->endpoint_, o.backend);
    return std::unique_ptr<KVManager>(std::move(m));
  }

  ~GrpcPrefillManager() override {
    if (relay_.joinable()) {
      {
        MutexLock lock(&relay_mu_);
        relay_stop_ = true;
      }
      relay_cv_.SignalAll();
      discovery_->CancelReports();  // a report waiting on a dead bootstrap server ends now
      relay_.join();
    }
    // Withdraw this rank's address first so decode stops choosing it.
    publisher_.reset();
    if (discovery_) discovery_->Cancel();
    if (peer_server_) peer_server_->Shutdown();  // decode sees every stream end
    if (core_) core_->Shutdown();
    bootstrap_server_.reset();
  }

  std::string endpoint() const override { return endpoint_; }
  std::string bootstrap_endpoint() const override { return bootstrap_endpoint_; }

 private:
  GrpcPrefillManager() = default;

  std::unique_ptr<control::BootstrapServer> bootstrap_server_;
  std::unique_ptr<control::PeerServer> peer_server_;
  std::unique_ptr<control::DiscoveryBackend> discovery_;
  std::unique_ptr<control::RankPublisher> publisher_;
  std::string endpoint_;
  std::string bootstrap_endpoint_;  // "host:port" of bootstrap_server_, "" without one

  // The room-failure relay: every 200 ms, rooms this rank failed before any decode rank was
  // bound to them go to the deployment's directory (bootstrap server or etcd; best effort:
  // dropped on an error).
  void RelayLoop() {
    while (true) {
      {
        MutexLock lock(&relay_mu_);
        if (!relay_stop_) relay_cv_.WaitFor(&relay_mu_, std::chrono::milliseconds(200));
        if (relay_stop_) return;
      }
      std::vector<PrefillCore::UnboundFailure> taken = core_->TakeUnboundFailures();
      for (size_t at = 0; at < taken.size(); at += control::kMaxRoomFailuresPerCall) {
        std::vector<control::RoomFailure> batch;
        for (size_t i = at; i < taken.size() && i < at + control::kMaxRoomFailuresPerCall; ++i) {
          batch.push_back({taken[i].room, std::move(taken[i].reason)});
        }
        if (Status s = discovery_->ReportRoomFailures(batch); !s.ok()) {
          PDLIB_LOG(kDebug, "prefill: relaying %d room failures to %s: %s", batch.size(),
                    discovery_->Describe(), s.ToString());
        }
      }
    }
  }
  Mutex relay_mu_;
  CondVar relay_cv_;
  bool relay_stop_ ABSL_GUARDED_BY(relay_mu_) = false;
  std::thread relay_;
};

// ---------------------------------------------------------------------------------------------
// Decode
// ---------------------------------------------------------------------------------------------

class GrpcDecodeManager final : public DecodeManagerBase {
 public:
  static StatusOr<std::unique_ptr<KVManager>> Create(const KVManagerOptions& o,
                                                     std::unique_ptr<spi::Transport> transport) {
    // A random session id: prefill tells a restarted decode from its predecessor.
    uint64_t session = std::random_device{}();
    session = (session << 32) ^ std::random_device{}();
    auto core = DecodeCore::Create(o, std::move(transport), session);
    if (!core.ok()) return core.status();
    auto discovery = control::DiscoveryBackend::Create(o);
    if (!discovery.ok()) return discovery.status();
    std::unique_ptr<GrpcDecodeManager> m(new GrpcDecodeManager(o, *core));
    m->discovery_ = std::move(*discovery);
    // A rank that registered anew, moved or died: the cached lookup goes at once, so the next
    // room of that deployment resolves afresh instead of trying a stale address.
    Status watched = m->discovery_->Watch([mgr = m.get()](const std::string& deployment) {
      MutexLock lock(&mgr->mu_);
      ++mgr->discovery_generation_;
      if (deployment.empty()) {
        mgr->deployments_.clear();
      } else if (mgr->deployments_.erase(deployment) > 0) {
        PDLIB_LOG(kInfo, "decode: deployment %s changed in %s: its ranks will be looked up again",
                  deployment, mgr->discovery_->Describe());
      }
    });
    if (!watched.ok()) return watched.WithPrefix("watching " + m->discovery_->Describe());
    for (int i = 0; i < kBootstrapWorkers; ++i) {
      m->workers_.emplace_back([mgr = m.get()] { mgr->BootstrapLoop(); });
    }
    m->prober_ = std::thread([mgr = m.get()] { mgr->ProbeLoop(); });
    m->relay_ = std::thread([mgr = m.get()] { mgr->RelayLoop(); });
    return std::unique_ptr<KVManager>(std::move(m));
  }

  ~GrpcDecodeManager() override {
    {
      MutexLock lock(&mu_);
      stopping_ = true;
      for (auto& [addr, directory] : directories_) directory->Cancel();
    }
    discovery_->Cancel();  // ends the watch: no callback runs after this
    cv_.SignalAll();
    probe_cv_.SignalAll();
    for (std::thread& t : workers_) t.join();
    if (prober_.joinable()) prober_.join();
    if (relay_.joinable()) relay_.join();
    core_->Shutdown();
  }

  std::string endpoint() const override {
    return absl::StrFormat("decode/%016x", core_->session());
  }

  Status Connect(const BootstrapAddress& bootstrap, std::chrono::milliseconds timeout) override {
    using Clock = std::chrono::steady_clock;
    const std::string addr = AddrKey(bootstrap);
    const auto deadline = Clock::now() + timeout;
    {  // The address is this call's while it runs: the workers leave its rooms queued.
      MutexLock lock(&mu_);
      while (resolving_.contains(addr) && !stopping_ && Clock::now() < deadline) {
        cv_.WaitFor(&mu_, std::chrono::milliseconds(10));
      }
      if (stopping_) return Status::Unavailable("decode manager is shutting down");
      if (resolving_.contains(addr)) {
        return Status::DeadlineExceeded(
            absl::StrFormat("connecting to %s: another lookup of it took longer than %d ms", addr,
                            timeout.count()));
      }
      resolving_.insert(addr);
    }
    Status result = ConnectAll(bootstrap, addr, deadline);
    {
      MutexLock lock(&mu_);
      resolving_.erase(addr);
      if (!result.ok()) deployments_.erase(addr);
    }
    cv_.SignalAll();
    if (result.ok()) PDLIB_LOG(kInfo, "decode: connected to the deployment at %s", addr);
    return result;
  }

  StatusOr<std::unique_ptr<KVReceiver>> CreateReceiver(const BootstrapAddress& bootstrap,
                                                       uint64_t room,
                                                       std::optional<int32_t> dp) override {
    auto state = core_->CreateRoom(room);
    if (!state.ok()) return state.status();
    auto handle = std::make_unique<CoreReceiver>(core_, *state);
    Pending p{room, bootstrap, dp, AddrKey(bootstrap)};
    {
      MutexLock lock(&mu_);
      relay_rooms_[room] = p.addr;  // for refusals relayed by the deployment's directory
    }
    // Fast path: the prefill ranks are known and connected; no thread hop.
    if (auto prefills = CachedConnected(p); !prefills.empty()) {
      core_->BindRoom(room, std::move(prefills));
    } else {
      {
        MutexLock lock(&mu_);
        queue_.push_back(std::move(p));
      }
      cv_.Signal();
    }
    return std::unique_ptr<KVReceiver>(std::move(handle));
  }

 private:
  struct Pending {
    uint64_t room;
    BootstrapAddress bootstrap;
    std::optional<int32_t> dp;
    std::string addr;  // AddrKey(bootstrap)
    std::chrono::steady_clock::time_point first_try{};
    std::chrono::steady_clock::time_point next_try{};
    std::chrono::milliseconds backoff{20};
  };
  // What one bootstrap server told us; used only while the rank's connection is alive.
  struct Deployment {
    control::ParallelInfo info;
    // dp rank -> the prefill ranks of that DP group this decode rank talks to
    absl::flat_hash_map<int32_t, std::vector<BoundPrefill>> by_dp;
  };

  GrpcDecodeManager(const KVManagerOptions& o, std::shared_ptr<DecodeCore> core)
      : DecodeManagerBase(std::move(core)), options_(o) {}

  static std::string AddrKey(const BootstrapAddress& b) {
    return control::JoinHostPort(b.host, b.port);
  }

  // The cached prefill ranks for `p` when every one of them is still connected, else empty.
  std::vector<BoundPrefill> CachedConnected(const Pending& p) {
    std::vector<BoundPrefill> prefills;
    {
      MutexLock lock(&mu_);
      auto it = deployments_.find(AddrKey(p.bootstrap));
      if (it == deployments_.end()) return {};
      int32_t dp = p.dp.value_or(static_cast<int32_t>(p.room % it->second.info.dp_size));
      auto k = it->second.by_dp.find(dp);
      if (k == it->second.by_dp.end()) return {};
      prefills = k->second;
    }
    for (const auto& b : prefills) {
      if (!core_->IsConnected(b.key)) return {};
    }
    return prefills;
  }

  // Workers that resolve and connect pending rooms (cache misses). Each takes a due room whose
  // bootstrap address no other worker is resolving: rooms of one deployment go one at a time
  // (the first fills the cache for the rest), and a deployment whose bootstrap server or prefill
  // ranks do not answer holds one worker for up to connect_timeout while the others serve every
  // other deployment. Bounded: at most this many stalled addresses stall everything.
  static constexpr int kBootstrapWorkers = 4;

  // One worker. A lookup that may succeed later (no such rank registered yet, bootstrap or
  // prefill unreachable) is retried with backoff until connect_timeout has passed since the
  // room's first try; other errors fail the room at once.
  void BootstrapLoop() {
    using Clock = std::chrono::steady_clock;
    while (true) {
      Pending p;
      {
        MutexLock lock(&mu_);
        while (true) {
          if (stopping_) return;
          auto now = Clock::now();
          auto due = queue_.end();
          auto earliest = Clock::time_point::max();
          bool any_free = false;
          for (auto it = queue_.begin(); it != queue_.end(); ++it) {
            if (resolving_.contains(it->addr)) continue;  // another worker's
            any_free = true;
            if (it->next_try <= now) {
              due = it;
              break;
            }
            earliest = std::min(earliest, it->next_try);
          }
          if (due != queue_.end()) {
            p = std::move(*due);
            queue_.erase(due);
            resolving_.insert(p.addr);
            break;
          }
          if (!any_free) {  // nothing, or only addresses other workers hold: wait for a change
            cv_.Wait(&mu_);
          } else {
            cv_.WaitFor(&mu_, earliest - now);
          }
        }
      }
      auto now = Clock::now();
      if (p.first_try == Clock::time_point{}) p.first_try = now;
      auto key = Resolve(p);
      {
        // The address is free for the next worker; a failed lookup or connection purges what
        // we cached about this deployment (R6.2).
        MutexLock lock(&mu_);
        resolving_.erase(p.addr);
        if (!key.ok()) deployments_.erase(p.addr);
      }
      cv_.SignalAll();  // rooms of this address may be due for a waiting worker
      if (key.ok()) {
        core_->BindRoom(p.room, std::move(*key));
        continue;
      }
      StatusCode code = key.status().code();
      bool retryable = MaySucceedLater(code);
      if (retryable && now - p.first_try < options_.connect_timeout &&
          !IsTerminal(RoomPoll(p.room))) {
        p.next_try = now + p.backoff;
        p.backoff = std::min(p.backoff * 2, std::chrono::milliseconds(500));
        MutexLock lock(&mu_);
        queue_.push_back(std::move(p));
        continue;
      }
      core_->FailRoomWith(p.room, key.status().WithPrefix(absl::StrFormat(
                                      "room %d: bootstrap via %s", p.room, AddrKey(p.bootstrap))));
    }
  }

  // Connect(): every DP group's prefill ranks, each lookup retried like a room's until
  // `deadline`.
  Status ConnectAll(const BootstrapAddress& bootstrap, const std::string& addr,
                    std::chrono::steady_clock::time_point deadline) {
    auto backoff = std::chrono::milliseconds(20);
    int32_t dp_size = 1;
    for (int32_t dp = 0; dp < dp_size; ++dp) {
      while (true) {
        Pending p{0, bootstrap, dp, addr};
        auto bound = Resolve(p);
        if (bound.ok()) {
          MutexLock lock(&mu_);
          // Not cached when the deployment changed meanwhile: keep the size known so far.
          if (auto it = deployments_.find(addr); it != deployments_.end()) {
            dp_size = it->second.info.dp_size;
          }
          break;
        }
        const StatusCode code = bound.status().code();
        const bool retryable = MaySucceedLater(code);
        if (!retryable || std::chrono::steady_clock::now() + backoff >= deadline) {
          return bound.status().WithPrefix(
              absl::StrFormat("connecting to the deployment at %s (dp group %d)", addr, dp));
        }
        {
          MutexLock lock(&mu_);
          if (stopping_) return Status::Unavailable("decode manager is shutting down");
        }
        std::this_thread::sleep_for(backoff);
        backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
      }
    }
    return Status::OK();
  }

  KVPoll RoomPoll(uint64_t room) const { return core_->RoomPoll(room); }

  // Every 250 ms, on a thread of its own (a lookup may wait out connect_timeout while a
  // bootstrap server is down; the quarantine prober must not).
  void RelayLoop() {
    while (true) {
      {
        MutexLock lock(&mu_);
        if (stopping_) return;
        probe_cv_.WaitFor(&mu_, std::chrono::milliseconds(250));
        if (stopping_) return;
      }
      CheckRelayedFailures();
    }
  }

  // The room-failure relay: rooms still waiting for prefill (at least 300 ms old) are looked up
  // in their deployment's directory; one a prefill rank failed before decode was bound to it (a
  // refused pairing on another DP group) fails here at once with prefill's reason.
  void CheckRelayedFailures() {
    std::vector<std::pair<uint64_t, std::string>> rooms;
    {
      MutexLock lock(&mu_);
      rooms.assign(relay_rooms_.begin(), relay_rooms_.end());
    }
    absl::flat_hash_map<std::string, std::vector<uint64_t>> by_deployment;
    std::vector<uint64_t> done;
    for (const auto& [room, addr] : rooms) {
      if (IsTerminal(core_->RoomPoll(room))) {
        done.push_back(room);
      } else if (core_->RoomAwaitingPrefill(room, absl::Milliseconds(300))) {
        auto& list = by_deployment[addr];
        if (list.size() < control::kMaxRoomFailuresPerCall) list.push_back(room);
      }
    }
    if (!done.empty()) {
      MutexLock lock(&mu_);
      for (uint64_t room : done) relay_rooms_.erase(room);
    }
    for (const auto& [addr, list] : by_deployment) {
      control::DeploymentDirectory* directory = nullptr;
      {
        MutexLock lock(&mu_);
        if (stopping_) return;
        if (auto it = directories_.find(addr); it != directories_.end()) {
          directory = it->second.get();  // lives until the manager is destroyed
        }
      }
      if (directory == nullptr) continue;
      auto failed = directory->GetRoomFailures(list);
      if (!failed.ok()) {
        PDLIB_LOG(kDebug, "decode: asking %s for refused rooms: %s", addr,
                  failed.status().ToString());
        continue;
      }
      for (const control::RoomFailure& f : *failed) {
        // The ranks this room is bound to hold its TransferInfo for a sender that will not
        // come: told, they drop it and report the room drained (its pages become reusable).
        core_->FailRoomWith(f.room,
                            Status::FailedPrecondition(absl::StrFormat(
                                "room %d: prefill failed it before decode was bound (via %s): %s",
                                f.room, addr, f.reason)),
                            true);
      }
    }
  }

  control::PeerClientOptions PeerOptions(const std::string& host, uint16_t port) const {
    control::PeerClientOptions pco;
    pco.host = host;
    pco.port = port;
    pco.key = control::JoinHostPort(host, port);
    pco.liveness_timeout = options_.liveness_timeout;
    pco.connect_timeout = options_.connect_timeout;
    pco.security = Security(options_);
    return pco;
  }

  Status Connect(const control::PeerClientOptions& pco) {
    std::weak_ptr<DecodeHandler> handler = core_;
    return core_->EnsureConnected(pco.key, [&]() -> StatusOr<std::shared_ptr<PrefillLink>> {
      auto link = control::PeerClient::Open(pco, handler);
      if (!link.ok()) return link.status();
      return std::shared_ptr<PrefillLink>(std::move(*link));
    });
  }

  // Quarantined rooms wait on prefill ranks whose connection is gone (kv_manager.h, "Page
  // reuse"). Every probe period each such address is tried: nothing listening there means that
  // prefill manager has shut down or exited, so its writes are over; a listener is reconnected
  // to, and its RegisterAck says which rooms it drained meanwhile (or that another instance now
  // holds the address). A frozen prefill is still "listening" (the kernel accepts for it) and
  // does not answer: its rooms stay quarantined until it resumes or dies.
  void ProbeLoop() {
    constexpr auto kPeriod = std::chrono::milliseconds(250);
    while (true) {
      {
        MutexLock lock(&mu_);
        if (stopping_) return;
        probe_cv_.WaitFor(&mu_, kPeriod);
        if (stopping_) return;
      }
      for (const std::string& key : core_->KeysAwaitingPrefill()) {
        std::optional<control::PeerClientOptions> pco;
        {
          MutexLock lock(&mu_);
          if (stopping_) return;
          if (auto it = addresses_.find(key); it != addresses_.end()) pco = it->second;
        }
        if (!pco) continue;
        const auto probe = control::ProbeTcpPort(
            pco->host, static_cast<uint16_t>(pco->port),
            std::min<std::chrono::milliseconds>(options_.connect_timeout, kPeriod));
        if (probe == control::PortProbe::kRefused) {
          PDLIB_LOG(kInfo, "decode: nothing listens at prefill %s any more: its writes are over",
                    key);
          core_->OnPrefillExited(key, std::nullopt);
        } else if (probe == control::PortProbe::kListening) {
          if (Status s = Connect(*pco); !s.ok()) {
            PDLIB_LOG(kDebug, "decode: reconnecting to prefill %s for its drained rooms: %s", key,
                      s.ToString());
          }
        }
      }
    }
  }

  // Finds the prefill ranks for `p` (the planner says which), connecting to each if needed.
  // Runs on the bootstrap thread.
  StatusOr<std::vector<BoundPrefill>> Resolve(const Pending& p) {
    if (auto prefills = CachedConnected(p); !prefills.empty()) return prefills;
    const std::string addr = AddrKey(p.bootstrap);
    control::DeploymentDirectory* directory = nullptr;
    uint64_t generation = 0;  // what is read below is cached only if no change came meanwhile
    {
      MutexLock lock(&mu_);
      generation = discovery_generation_;
      auto& d = directories_[addr];
      if (!d) {
        auto opened = discovery_->Open(p.bootstrap.host, p.bootstrap.port);
        if (!opened.ok()) {
          directories_.erase(addr);
          return opened.status();
        }
        d = std::move(*opened);
      }
      directory = d.get();  // directories_ entries live until the manager is destroyed
    }
    auto info = directory->GetParallelInfo();
    if (!info.ok()) return info.status();
    const KVArgs& mine = options_.args;
    if (info->page_size != mine.page_size) {
      return Status::FailedPrecondition(
          absl::StrFormat("page size mismatch: prefill (bootstrap %s) uses %d, decode uses %d",
                          addr, info->page_size, mine.page_size));
    }
    auto targets = PrefillTargetsFor(core_->layout(), mine.kv_head_num, mine.is_mla, info->tp_size,
                                     info->pp_size);
    if (!targets.ok()) return targets.status();
    int32_t dp = p.dp.value_or(static_cast<int32_t>(p.room % info->dp_size));
    if (dp < 0 || dp >= info->dp_size) {
      return Status::InvalidArgument(
          absl::StrFormat("prefill dp rank %d out of range [0, %d)", dp, info->dp_size));
    }
    std::vector<BoundPrefill> prefills;
    for (const PrefillTarget& t : *targets) {
      auto rank = directory->GetRankAddress({dp, t.rank.tp_rank, t.rank.pp_rank});
      if (!rank.ok()) return rank.status();
      control::PeerClientOptions pco = PeerOptions(rank->host, static_cast<uint16_t>(rank->port));
      const std::string key = pco.key;
      {
        MutexLock lock(&mu_);
        addresses_[key] = pco;  // for the quarantine prober
      }
      if (Status s = Connect(pco); !s.ok()) return s;
      prefills.push_back({key, t});
    }
    if (Status s = core_->CheckStageCoverage(prefills); !s.ok()) return s;
    MutexLock lock(&mu_);
    if (discovery_generation_ != generation) {
      return prefills;  // the deployment changed while we read it: use once, do not cache
    }
    Deployment& d = deployments_[addr];
    d.info = *info;
    d.by_dp[dp] = prefills;
    return prefills;
  }

  const KVManagerOptions options_;

  Mutex mu_;
  CondVar cv_;        // the bootstrap thread's
  CondVar probe_cv_;  // the prober's (only shutdown wakes it early)
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<Pending> queue_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<control::DiscoveryBackend> discovery_;
  absl::flat_hash_map<std::string, std::unique_ptr<control::DeploymentDirectory>> directories_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Deployment> deployments_ ABSL_GUARDED_BY(mu_);
  // Changes the discovery's watch reported (any deployment): a lookup that overlapped one is
  // used once and not cached.
  uint64_t discovery_generation_ ABSL_GUARDED_BY(mu_) = 0;
  // Rooms of this manager and their deployment ("host:port"), for CheckRelayedFailures; a
  // room leaves once terminal.
  absl::flat_hash_map<uint64_t, std::string> relay_rooms_ ABSL_GUARDED_BY(mu_);
  // Every prefill rank ever resolved, by key (bounded by the deployment's ranks).
  absl::flat_hash_map<std::string, control::PeerClientOptions> addresses_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> workers_;  // kBootstrapWorkers BootstrapLoop()s
  // Bootstrap addresses a worker is resolving now (guarded by mu_).
  absl::flat_hash_set<std::string> resolving_ ABSL_GUARDED_BY(mu_);
  std::thread prober_;
  std::thread relay_;  // RelayLoop()
};

}  // namespace

StatusOr<std::unique_ptr<KVManager>> CreateGrpcKVManager(const KVManagerOptions& options) {
  const spi::TransportOptions topts = TransportOptionsFor(options);
  auto transport = spi::CreateTransport(options.backend, topts);
  if (!transport.ok()) return transport.status();
  if (options.mode == Mode::kPrefill) {
    return GrpcPrefillManager::Create(options, std::move(*transport));
  }
  return GrpcDecodeManager::Create(options, std::move(*transport));
}

}  // namespace v1
}  // namespace pdlib
