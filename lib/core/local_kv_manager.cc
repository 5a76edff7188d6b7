#include "lib/core/local_kv_manager.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_format.h"
#include "lib/base/log_internal.h"
#include "lib/base/mutex.h"
#include "lib/core/decode_core.h"
#include "lib/core/handles.h"
#include "lib/core/manager_common.h"
#include "lib/core/prefill_core.h"

namespace pdlib {
inline namespace v1 {
namespace {

// The rooms a decode manager created, with the deployment ("host:port") each went to: where a
// relayed refusal finds the rooms it ends. Pruned of finished rooms as it grows.
class RelayWatch {
 public:
  explicit RelayWatch(std::weak_ptr<DecodeCore> core) : core_(std::move(core)) {}
  void Add(uint64_t room, const std::string& bootstrap) {
    MutexLock lock(&mu_);
    if (rooms_.size() >= prune_at_) {
      if (auto core = core_.lock()) {
        absl::erase_if(rooms_,
                       [&](const auto& kv) { return IsTerminal(core->RoomPoll(kv.first)); });
      }
      prune_at_ = std::max<size_t>(1024, 2 * rooms_.size());
    }
    rooms_[room] = bootstrap;
  }
  // The decode core, when `room` of deployment `bootstrap` is one of its rooms.
  std::shared_ptr<DecodeCore> Find(uint64_t room, const std::string& bootstrap) const {
    MutexLock lock(&mu_);
    auto it = rooms_.find(room);
    if (it == rooms_.end() || it->second != bootstrap) return nullptr;
    return core_.lock();
  }

 private:
  const std::weak_ptr<DecodeCore> core_;
  mutable Mutex mu_;
  absl::flat_hash_map<uint64_t, std::string> rooms_ ABSL_GUARDED_BY(mu_);
  size_t prune_at_ ABSL_GUARDED_BY(mu_) = 1024;
};

// How long, and how many, refusals the in-process directory keeps (as the bootstrap server).
constexpr absl::Duration kRelayKeep = absl::Minutes(10);
constexpr size_t kRelayKept = 65536;

// Fails `room` on `core` with prefill's reason when it still waits for prefill, telling the
// ranks it is bound to (they drop its TransferInfo, so its pages become reusable).
void FailRelayed(DecodeCore& core, uint64_t room, const std::string& bootstrap,
                 const std::string& reason) {
  if (!core.RoomAwaitingPrefill(room, absl::ZeroDuration())) return;
  core.FailRoomWith(room,
                    Status::FailedPrecondition(absl::StrFormat(
                        "room %d: prefill failed it before decode was bound (via %s): %s", room,
                        bootstrap, reason)),
                    true);
}

// Where in-process managers find each other: prefill ranks by bootstrap address and rank,
// decode managers by session. Holds weak references only. It is also the deployments'
// directory of refusals (the room-failure relay: what the bootstrap server or etcd keeps for
// the gRPC control plane).
class LocalHub {
 public:
  struct PrefillEntry {
    std::string key;  // "local://host:port" of the rank
    std::weak_ptr<PrefillCore> core;
    ParallelConfig parallel;
    uint32_t page_size = 0;
  };

  static LocalHub& Get() {
    static LocalHub* hub = new LocalHub();  // never destroyed: managers may outlive main()
    return *hub;
  }

  StatusOr<std::string> AddPrefill(const KVManagerOptions& o, std::weak_ptr<PrefillCore> core) {
    MutexLock lock(&mu_);
    std::string bootstrap = absl::StrFormat("%s:%d", o.bootstrap_host, o.bootstrap_port);
    uint16_t port = o.listen_port != 0 ? o.listen_port : next_port_++;
    PrefillEntry entry{absl::StrFormat("local://%s:%d", o.listen_host, port), std::move(core),
                       o.args.parallel, o.args.page_size};
    auto& ranks = prefills_[bootstrap];
    for (auto& r : ranks) {
      if (r.key == entry.key) {
        return Status::AlreadyExists(entry.key + " is already used by a live prefill manager");
      }
      if (r.parallel.tp_size != entry.parallel.tp_size ||
          r.parallel.dp_size != entry.parallel.dp_size ||
          r.parallel.pp_size != entry.parallel.pp_size || r.page_size != entry.page_size) {
        return Status::FailedPrecondition(absl::StrFormat(
            "bootstrap %s: this rank has tp/dp/pp %d/%d/%d page %d, an earlier rank %d/%d/%d "
            "page %d",
            bootstrap, entry.parallel.tp_size, entry.parallel.dp_size, entry.parallel.pp_size,
            entry.page_size, r.parallel.tp_size, r.parallel.dp_size, r.parallel.pp_size,
            r.page_size));
      }
    }
    // A restarted rank replaces its predecessor's entry.
    std::erase_if(ranks, [&](const PrefillEntry& r) {
      return r.parallel.tp_rank == entry.parallel.tp_rank &&
             r.parallel.dp_rank == entry.parallel.dp_rank &&
             r.parallel.pp_rank == entry.parallel.pp_rank;
    });
    ranks.push_back(entry);
    return entry.key;
  }

  void RemovePrefill(const std::string& key) {
    MutexLock lock(&mu_);
    for (auto& [bootstrap, ranks] : prefills_) {
      std::erase_if(ranks, [&](const PrefillEntry& r) { return r.key == key; });
    }
  }

  // The prefill ranks decode rank `decode` talks to for `room` (the planner decides which),
  // with their entries.
  struct Found {
    BoundPrefill bound;
    std::weak_ptr<PrefillCore> core;
  };
  // The DP size of the deployment behind `b`, if any rank of it is registered.
  std::optional<int32_t> DpSize(const BootstrapAddress& b) {
    MutexLock lock(&mu_);
    auto it = prefills_.find(absl::StrFormat("%s:%d", b.host, b.port));
    if (it == prefills_.end() || it->second.empty()) return std::nullopt;
    return it->second.front().parallel.dp_size;
  }

  StatusOr<std::vector<Found>> FindPrefills(const BootstrapAddress& b, uint64_t room,
                                            std::optional<int32_t> dp_override,
                                            const DecodeCore& decode) {
    const KVArgs& mine = decode.options().args;
    MutexLock lock(&mu_);
    std::string bootstrap = absl::StrFormat("%s:%d", b.host, b.port);
    auto it = prefills_.find(bootstrap);
    if (it == prefills_.end() || it->second.empty()) {
      return Status::Unavailable("bootstrap " + bootstrap + ": no prefill rank is registered");
    }
    const PrefillEntry& any = it->second.front();
    if (any.page_size != mine.page_size) {
      return Status::FailedPrecondition(
          absl::StrFormat("page size mismatch: prefill (bootstrap %s) uses %d, decode uses %d",
                          bootstrap, any.page_size, mine.page_size));
    }
    auto targets = PrefillTargetsFor(decode.layout(), mine.kv_head_num, mine.is_mla,
                                     any.parallel.tp_size, any.parallel.pp_size);
    if (!targets.ok()) return targets.status();
    int32_t dp = dp_override.value_or(static_cast<int32_t>(room % any.parallel.dp_size));
    if (dp < 0 || dp >= any.parallel.dp_size) {
      return Status::InvalidArgument(
          absl::StrFormat("prefill dp rank %d out of range [0, %d)", dp, any.parallel.dp_size));
    }
    std::vector<Found> out;
    for (const PrefillTarget& t : *targets) {
      const PrefillEntry* entry = nullptr;
      for (const auto& r : it->second) {
        if (r.parallel.dp_rank == dp && r.parallel.tp_rank == t.rank.tp_rank &&
            r.parallel.pp_rank == t.rank.pp_rank) {
          entry = &r;
        }
      }
      if (!entry) {
        return Status::Unavailable(
            absl::StrFormat("bootstrap %s: prefill rank dp %d tp %d pp %d is not registered",
                            bootstrap, dp, t.rank.tp_rank, t.rank.pp_rank));
      }
      out.push_back({{entry->key, t}, entry->core});
    }
    return out;
  }

  uint64_t NewSession() {
    MutexLock lock(&mu_);
    return next_session_++;
  }
  void AddDecode(uint64_t session, std::weak_ptr<DecodeCore> core) {
    MutexLock lock(&mu_);
    decodes_[session] = std::move(core);
  }
  void RemoveDecode(uint64_t session) {
    MutexLock lock(&mu_);
    decodes_.erase(session);
  }

  std::vector<std::shared_ptr<DecodeCore>> Decodes() {
    MutexLock lock(&mu_);
    std::vector<std::shared_ptr<DecodeCore>> out;
    for (auto& [s, w] : decodes_) {
      if (auto d = w.lock()) out.push_back(std::move(d));
    }
    return out;
  }
  void AddWatch(uint64_t session, std::shared_ptr<RelayWatch> watch) {
    MutexLock lock(&mu_);
    watches_[session] = std::move(watch);
  }
  void RemoveWatch(uint64_t session) {
    MutexLock lock(&mu_);
    watches_.erase(session);
  }

  // A prefill rank of deployment `bootstrap` failed `room` before any decode rank was bound to
  // it: kept for a decode that comes later, and the decode rooms waiting for it fail now.
  // Called without locks held (the prefill manager's relay thread).
  void ReportRoomFailure(const std::string& bootstrap, uint64_t room, const std::string& reason) {
    std::vector<std::shared_ptr<RelayWatch>> watches;
    {
      MutexLock lock(&mu_);
      const absl::Time now = absl::Now();
      while (!failed_order_.empty() &&
             (failed_order_.size() >= kRelayKept || failed_order_.front().expires <= now)) {
        auto it = failed_.find(failed_order_.front().key);
        if (it != failed_.end() && it->second.expires == failed_order_.front().expires) {
          failed_.erase(it);
        }
        failed_order_.pop_front();
      }
      FailedKey key{bootstrap, room};
      failed_[key] = {reason, now + kRelayKeep};
      failed_order_.push_back({std::move(key), now + kRelayKeep});
      for (auto& [session, w] : watches_) watches.push_back(w);
    }
    for (const auto& w : watches) {
      if (auto core = w->Find(room, bootstrap)) FailRelayed(*core, room, bootstrap, reason);
    }
  }
  // Prefill's reason, when a rank of `bootstrap` failed `room` before decode was bound.
  std::optional<std::string> RoomFailure(const std::string& bootstrap, uint64_t room) {
    MutexLock lock(&mu_);
    auto it = failed_.find(FailedKey{bootstrap, room});
    if (it == failed_.end() || it->second.expires <= absl::Now()) return std::nullopt;
    return it->second.reason;
  }

  std::vector<std::shared_ptr<PrefillCore>> Prefills() {
    MutexLock lock(&mu_);
    std::vector<std::shared_ptr<PrefillCore>> out;
    for (auto& [b, ranks] : prefills_) {
      for (auto& r : ranks) {
        if (auto p = r.core.lock()) out.push_back(std::move(p));
      }
    }
    return out;
  }

 private:
  using FailedKey = std::pair<std::string, uint64_t>;  // (deployment, room)
  struct Failed {
    std::string reason;
    absl::Time expires;
  };
  struct FailedOrder {
    FailedKey key;
    absl::Time expires;
  };
  Mutex mu_;
  absl::flat_hash_map<std::string, std::vector<PrefillEntry>> prefills_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::weak_ptr<DecodeCore>> decodes_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::shared_ptr<RelayWatch>> watches_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<FailedKey, Failed> failed_ ABSL_GUARDED_BY(mu_);
  std::deque<FailedOrder> failed_order_ ABSL_GUARDED_BY(mu_);  // oldest first
  uint16_t next_port_ ABSL_GUARDED_BY(mu_) = 20000;
  uint64_t next_session_ ABSL_GUARDED_BY(mu_) = 1;
};

class LocalDecodeLink final : public DecodeLink {
 public:
  LocalDecodeLink(std::weak_ptr<DecodeCore> decode, std::string key)
      : decode_(std::move(decode)), key_(std::move(key)) {}
  void SendStatus(const TransferStatusMsg& msg) override {
    if (auto d = decode_.lock()) d->OnStatus(msg);
  }
  void SendDrained(const RoomsDrainedMsg& msg) override {
    if (auto d = decode_.lock()) d->OnDrained(key_, msg);
  }
  void SendReadReady(const ReadReadyMsg& msg) override {
    if (auto d = decode_.lock()) d->OnReadReady(key_, msg);
  }
  void Close(const Status& reason) override {
    if (auto d = decode_.lock()) d->OnPrefillGone(key_, reason);
  }

 private:
  std::weak_ptr<DecodeCore> decode_;
  const std::string key_;  // the prefill rank, as the decode side names it
};

class LocalPrefillLink final : public PrefillLink {
 public:
  LocalPrefillLink(std::weak_ptr<PrefillCore> prefill, std::weak_ptr<DecodeCore> decode,
                   std::string key)
      : prefill_(std::move(prefill)), decode_(std::move(decode)), key_(std::move(key)) {}
  RegisterAckMsg Register(const RegisterMsg& msg) override {
    auto p = prefill_.lock();
    if (!p) {
      RegisterAckMsg refused;
      refused.status = Status::Unavailable("prefill rank exited");
      return refused;
    }
    return p->OnRegister(msg, std::make_shared<LocalDecodeLink>(decode_, key_));
  }
  void SendTransferInfo(const TransferInfoMsg& msg) override {
    if (auto p = prefill_.lock()) p->OnTransferInfo(msg);
  }
  void SendAbort(uint64_t room, uint64_t session, const std::string& reason) override {
    if (auto p = prefill_.lock()) p->OnAbort(room, session, reason);
  }
  void SendPullConnect(const PullConnectMsg& msg) override {
    if (auto p = prefill_.lock()) p->OnPullConnect(msg);
  }
  void SendReadsDone(const ReadsDoneMsg& msg) override {
    if (auto p = prefill_.lock()) p->OnReadsDone(msg);
  }
  void SendHeartbeat(const HeartbeatMsg& msg) override {
    if (auto p = prefill_.lock()) p->OnHeartbeat(msg);
  }

 private:
  std::weak_ptr<PrefillCore> prefill_;
  std::weak_ptr<DecodeCore> decode_;
  const std::string key_;
};

class LocalPrefillManager final : public PrefillManagerBase {
 public:
  LocalPrefillManager(std::shared_ptr<PrefillCore> core, std::string key, std::string bootstrap)
      : key_(std::move(key)), bootstrap_(std::move(bootstrap)) {
    core_ = std::move(core);
    relay_ = std::thread([this] { RelayLoop(); });
  }
  ~LocalPrefillManager() override {
    {
      MutexLock lock(&relay_mu_);
      relay_stop_ = true;
    }
    relay_cv_.SignalAll();
    relay_.join();
    LocalHub::Get().RemovePrefill(key_);
    core_->Shutdown();  // its transport is destroyed: nothing of it can write any more
    for (auto& d : LocalHub::Get().Decodes()) {
      d->OnPrefillGone(key_, Status::Unavailable("prefill rank exited"));
      d->OnPrefillExited(key_, core_->instance());
    }
  }
  std::string endpoint() const override { return key_; }

 private:
  // The room-failure relay, as the gRPC manager's: every 200 ms, rooms this rank failed before
  // any decode rank was bound to them go to the hub, which fails the decode rooms waiting for
  // them and keeps them for decode rooms still to come.
  void RelayLoop() {
    while (true) {
      {
        MutexLock lock(&relay_mu_);
        if (!relay_stop_) relay_cv_.WaitFor(&relay_mu_, std::chrono::milliseconds(200));
        if (relay_stop_) return;
      }
      for (const PrefillCore::UnboundFailure& f : core_->TakeUnboundFailures()) {
        LocalHub::Get().ReportRoomFailure(bootstrap_, f.room, f.reason);
      }
    }
  }

  const std::string key_;
  const std::string bootstrap_;  // "host:port" of the deployment
  Mutex relay_mu_;
  CondVar relay_cv_;
  bool relay_stop_ ABSL_GUARDED_BY(relay_mu_) = false;
  std::thread relay_;
};

class LocalDecodeManager final : public DecodeManagerBase {
 public:
  explicit LocalDecodeManager(std::shared_ptr<DecodeCore> core)
      : DecodeManagerBase(std::move(core)), watch_(std::make_shared<RelayWatch>(core_)) {
    LocalHub::Get().AddWatch(core_->session(), watch_);
  }
  ~LocalDecodeManager() override {
    LocalHub::Get().RemoveWatch(core_->session());
    LocalHub::Get().RemoveDecode(core_->session());
    core_->Shutdown();
    for (auto& p : LocalHub::Get().Prefills()) {
      p->OnDecodeGone(core_->session(), nullptr, Status::Unavailable("decode manager exited"));
    }
  }
  std::string endpoint() const override {
    return absl::StrFormat("local://decode/%d", core_->session());
  }
  StatusOr<std::unique_ptr<KVReceiver>> CreateReceiver(const BootstrapAddress& bootstrap,
                                                       uint64_t room,
                                                       std::optional<int32_t> dp) override {
    auto state = core_->CreateRoom(room);
    if (!state.ok()) return state.status();
    auto handle = std::make_unique<CoreReceiver>(core_, *state);
    auto bound = ConnectRanks(bootstrap, room, dp);
    if (bound.ok()) {
      core_->BindRoom(room, std::move(*bound));
      // Watched first, then looked up: a refusal reported in between is found by one or both.
      const std::string deployment = absl::StrFormat("%s:%d", bootstrap.host, bootstrap.port);
      watch_->Add(room, deployment);
      if (auto reason = LocalHub::Get().RoomFailure(deployment, room)) {
        FailRelayed(*core_, room, deployment, *reason);
      }
    } else {
      core_->FailRoomWith(room,
                          bound.status().WithPrefix(absl::StrFormat("room %d: bootstrap", room)));
    }
    return std::unique_ptr<KVReceiver>(std::move(handle));
  }

  Status Connect(const BootstrapAddress& bootstrap, std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (int32_t dp = 0; dp < LocalHub::Get().DpSize(bootstrap).value_or(1); ++dp) {
      while (true) {
        auto bound = ConnectRanks(bootstrap, static_cast<uint64_t>(dp), dp);
        if (bound.ok()) break;
        if (bound.status().code() != StatusCode::kUnavailable ||
            std::chrono::steady_clock::now() >= deadline) {
          return bound.status().WithPrefix(
              absl::StrFormat("connecting to the deployment at %s:%d (dp group %d)", bootstrap.host,
                              bootstrap.port, dp));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    return Status::OK();
  }

 private:
  // Bootstrap: resolves the prefill ranks of `room` (or of DP group `dp`) and connects to each
  // once (cached).
  StatusOr<std::vector<BoundPrefill>> ConnectRanks(const BootstrapAddress& bootstrap, uint64_t room,
                                                   std::optional<int32_t> dp) {
    auto found = LocalHub::Get().FindPrefills(bootstrap, room, dp, *core_);
    if (!found.ok()) return found.status();
    std::vector<BoundPrefill> bound;
    for (const auto& f : *found) {
      std::weak_ptr<PrefillCore> prefill = f.core;
      std::weak_ptr<DecodeCore> self = core_;
      Status s =
          core_->EnsureConnected(f.bound.key, [&]() -> StatusOr<std::shared_ptr<PrefillLink>> {
            return std::shared_ptr<PrefillLink>(
                std::make_shared<LocalPrefillLink>(prefill, self, f.bound.key));
          });
      if (!s.ok()) return s;
      bound.push_back(f.bound);
    }
    if (Status s = core_->CheckStageCoverage(bound); !s.ok()) return s;
    return bound;
  }

  const std::shared_ptr<RelayWatch> watch_;
};

}  // namespace

StatusOr<std::unique_ptr<KVManager>> CreateLocalKVManager(const KVManagerOptions& options) {
  const spi::TransportOptions topts = TransportOptionsFor(options);
  auto transport = spi::CreateTransport(options.backend, topts);
  if (!transport.ok()) return transport.status();
  if (options.mode == Mode::kPrefill) {
    auto core = PrefillCore::Create(options, std::move(*transport));
    if (!core.ok()) return core.status();
    auto key = LocalHub::Get().AddPrefill(options, *core);
    if (!key.ok()) return key.status();
    PDLIB_LOG(kInfo, "prefill manager %s up (backend %s)", *key, options.backend);
    return std::unique_ptr<KVManager>(std::make_unique<LocalPrefillManager>(
        *core, *key, absl::StrFormat("%s:%d", options.bootstrap_host, options.bootstrap_port)));
  }
  auto& hub = LocalHub::Get();
  uint64_t session = hub.NewSession();
  auto core = DecodeCore::Create(options, std::move(*transport), session);
  if (!core.ok()) return core.status();
  hub.AddDecode(session, *core);
  return std::unique_ptr<KVManager>(std::make_unique<LocalDecodeManager>(*core));
}

}  // namespace v1
}  // namespace pdlib
