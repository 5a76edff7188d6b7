// Discovery through the bootstrap server, the etcd key layout, and the factory. The etcd
// implementation is discovery_etcd.cc.
#include "lib/control/discovery.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "lib/base/log_internal.h"
#include "lib/base/mutex.h"
#include "lib/control/bootstrap_client.h"
#include "lib/control/discovery_etcd.h"
#include "lib/control/net_address.h"

namespace pdlib {
inline namespace v1 {
namespace control {

namespace {

ControlSecurity Security(const KVManagerOptions& o) {
  return {o.auth_secret, o.tls_cert_file, o.tls_key_file, o.tls_ca_file};
}

// A BootstrapClient that never answers from a stale failure. A gRPC channel that failed to
// connect remembers the failure and fails every call with it at once (TRANSIENT_FAILURE), while
// the reconnection it starts after its backoff completes only when some thread polls the
// channel; with no call waiting on it (they all fail at once) that is gRPC's backup poller,
// every 5 s. So after a bootstrap server restart, or a heal of the network, decode's lookups
// kept failing "connection refused" for 5-8 s against a server that was up (pdlib-chaos,
// bootstrap_lookup_restart_test). Here a call that fails UNAVAILABLE or DEADLINE_EXCEEDED drops
// its client, and the next call makes a new channel, whose connection attempt that call drives
// itself: its answer is the server's (or the network's) current one. Thread-safe; Cancel()
// cancels the clients in use and every later call.
class FreshBootstrapClient {
 public:
  FreshBootstrapClient(std::string host, int32_t port, BootstrapClientOptions options)
      : host_(std::move(host)), port_(port), options_(std::move(options)) {}

  // Validates the address and options (what BootstrapClient::Create checks).
  Status Check() {
    auto c = Client();
    return c.ok() ? Status::OK() : c.status();
  }

  // Runs `call(client)` (returning a StatusOr) on the current client. A CANCELLED that Cancel()
  // did not cause is the server giving up on the call at its deadline (it cancels the stream when
  // its own copy of the deadline passes, which can reach the client before the client's timer
  // fires: seen under packet loss): returned as DEADLINE_EXCEEDED, which callers retry.
  template <typename Call>
  auto Run(Call&& call) -> decltype(call(std::declval<BootstrapClient&>())) {
    auto client = Client();
    if (!client.ok()) return client.status();
    auto result = call(**client);
    const StatusCode code = result.status().code();
    if (code != StatusCode::kUnavailable && code != StatusCode::kDeadlineExceeded &&
        code != StatusCode::kCancelled) {
      return result;
    }
    MutexLock lock(&mu_);
    if (current_ == *client) current_.reset();
    if (code == StatusCode::kCancelled && !cancelled_) {
      return Status::DeadlineExceeded(result.status().message());
    }
    return result;
  }

  void Cancel() {
    MutexLock lock(&mu_);
    cancelled_ = true;
    for (const auto& weak : handed_out_) {
      if (auto c = weak.lock()) c->Cancel();
    }
  }

  std::string address() const { return JoinHostPort(host_, port_); }

 private:
  StatusOr<std::shared_ptr<BootstrapClient>> Client() {
    MutexLock lock(&mu_);
    if (cancelled_) {
      return Status::Cancelled(absl::StrFormat("bootstrap %s: cancelled", address()));
    }
    if (current_) return current_;
    auto created = BootstrapClient::Create(host_, port_, options_);
    if (!created.ok()) return created.status();
    current_ = std::shared_ptr<BootstrapClient>(std::move(*created));
    // Clients still in use by other calls stay reachable for Cancel(); forget the finished ones.
    std::erase_if(handed_out_, [](const std::weak_ptr<BootstrapClient>& w) { return w.expired(); });
    handed_out_.push_back(current_);
    return current_;
  }

  const std::string host_;
  const int32_t port_;
  const BootstrapClientOptions options_;
  Mutex mu_;
  std::shared_ptr<BootstrapClient> current_ ABSL_GUARDED_BY(mu_);
  std::vector<std::weak_ptr<BootstrapClient>> handed_out_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

class BootstrapDirectory final : public DeploymentDirectory {
 public:
  explicit BootstrapDirectory(std::unique_ptr<FreshBootstrapClient> client)
      : client_(std::move(client)) {}
  StatusOr<ParallelInfo> GetParallelInfo() override {
    return client_->Run([](BootstrapClient& c) { return c.GetParallelInfo(); });
  }
  StatusOr<RankAddress> GetRankAddress(const RankId& id) override {
    return client_->Run([&](BootstrapClient& c) { return c.GetRankAddress(id); });
  }
  StatusOr<std::vector<RoomFailure>> GetRoomFailures(const std::vector<uint64_t>& rooms) override {
    return client_->Run([&](BootstrapClient& c) { return c.GetRoomFailures(rooms); });
  }
  void Cancel() override { client_->Cancel(); }

 private:
  std::unique_ptr<FreshBootstrapClient> client_;
};

// Registers the rank and keeps it registered; withdraws the registration when destroyed.
//
// A bootstrap server holds its registrations in memory only: one restarted on the same address
// has forgotten every rank, and decode's new lookups would fail until each prefill rank
// restarted too. So after the first registration a thread asks the server for this rank every
// liveness_timeout and registers again when the server no longer has it (NOT_FOUND). A rank the
// server holds at another address was taken by a successor (a restarted rank registers anew)
// and is left alone, as etcd's PutIfAbsent does. The check and the registration are two calls:
// a successor that registers between them (within one round trip, right after a server
// restart) is replaced, and then leaves this rank alone in turn; the rank stays served by a live
// process either way. Until the first registration succeeds (prefill may start before its
// bootstrap server) the thread retries with a backoff.
class BootstrapPublisher final : public RankPublisher {
 public:
  BootstrapPublisher(const KVManagerOptions& o, RankRegistration reg)
      : options_(o),
        registration_(std::move(reg)),
        period_(std::max<std::chrono::milliseconds>(o.liveness_timeout,
                                                    std::chrono::milliseconds(100))) {}

  Status Start() {
    // One attempt per call: the thread below paces the retries itself.
    BootstrapClientOptions bco;
    bco.rpc_timeout = std::clamp<std::chrono::milliseconds>(
        options_.connect_timeout, std::chrono::milliseconds(100), std::chrono::milliseconds(1000));
    bco.register_max_attempts = 1;
    bco.security = Security(options_);
    auto client = std::make_unique<FreshBootstrapClient>(options_.bootstrap_host,
                                                         options_.bootstrap_port, bco);
    if (Status s = client->Check(); !s.ok()) return s.WithPrefix("bootstrap address");
    client_ = std::move(client);
    // One quick attempt now, so a deployment whose bootstrap server is up is reachable as soon
    // as Create returns; otherwise retry in the background.
    bool registered = false;
    if (auto r = Register(); r.ok()) {
      PDLIB_LOG(kInfo, "prefill %s:%d registered with bootstrap %s", registration_.host,
                registration_.port, client_->address());
      registered = true;
    } else if (!Retryable(r.status())) {
      return r.status().WithPrefix("registering with the bootstrap server");
    }
    thread_ = std::thread([this, registered] { Run(registered); });
    return Status::OK();
  }

  ~BootstrapPublisher() override {
    {
      MutexLock lock(&mu_);
      stopping_ = true;
      cv_.SignalAll();
    }
    if (client_) client_->Cancel();
    if (thread_.joinable()) thread_.join();
    if (!client_) return;
    // Withdraw this rank's address so decode stops choosing it (best effort, bounded).
    BootstrapClientOptions quick;
    quick.security = Security(options_);
    quick.rpc_timeout = std::chrono::milliseconds(500);
    if (auto c = BootstrapClient::Create(options_.bootstrap_host, options_.bootstrap_port, quick);
        c.ok()) {
      (*c)->UnregisterRank(registration_.rank_id(), registration_.host, registration_.port)
          .status()
          .IgnoreError();
    }
  }

 private:
  StatusOr<RegisterResult> Register() {
    return client_->Run([&](BootstrapClient& c) { return c.RegisterRank(registration_); });
  }

  static bool Retryable(const Status& s) {
    return s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded;
  }

  bool Stopping() ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    return stopping_;
  }

  // Sleeps for `d` unless the publisher is being destroyed; false when it is.
  bool Pause(std::chrono::milliseconds d) ABSL_LOCKS_EXCLUDED(mu_) {
    const auto until = std::chrono::steady_clock::now() + d;
    MutexLock lock(&mu_);
    while (!stopping_) {
      const auto left = until - std::chrono::steady_clock::now();
      if (left <= std::chrono::steady_clock::duration::zero()) return true;
      cv_.WaitFor(&mu_, left);
    }
    return false;
  }

  void Run(bool registered) {
    std::chrono::milliseconds backoff{50};
    std::string last_error;  // logged once per distinct refusal
    bool taken = false;      // the server holds the rank at a successor's address
    while (Pause(registered ? period_ : backoff)) {
      if (!registered) {
        auto r = Register();
        if (r.ok()) {
          PDLIB_LOG(kInfo, "prefill %s:%d registered with bootstrap %s (%d/%d ranks)",
                    registration_.host, registration_.port, client_->address(), r->ranks_registered,
                    r->ranks_expected);
          registered = true;
        } else if (Stopping()) {
          return;
        } else if (!Retryable(r.status()) && r.status().ToString() != last_error) {
          last_error = r.status().ToString();
          PDLIB_LOG(kError, "prefill %s:%d: registration with bootstrap failed: %s",
                    registration_.host, registration_.port, last_error);
        }
        backoff = std::min(backoff * 2, std::min<std::chrono::milliseconds>(
                                            period_, std::chrono::milliseconds(2000)));
        continue;
      }
      auto held = client_->Run(
          [&](BootstrapClient& c) { return c.GetRankAddress(registration_.rank_id()); });
      if (held.ok()) {
        const bool ours =
            held->host == registration_.host && uint32_t{held->port} == registration_.port;
        if (!ours && !taken) {
          PDLIB_LOG(kInfo,
                    "prefill %s:%d: bootstrap %s now has rank %s at %s (a successor); not "
                    "registering again over it",
                    registration_.host, registration_.port, client_->address(),
                    RankIdString(registration_.rank_id()), JoinHostPort(held->host, held->port));
        }
        taken = !ours;
        continue;
      }
      if (held.status().code() != StatusCode::kNotFound) continue;  // unreachable: next time
      // The server lost the rank (it restarted, or the successor that held it went away).
      auto r = Register();
      if (r.ok()) {
        PDLIB_LOG(kWarning,
                  "prefill %s:%d: bootstrap %s no longer had rank %s (restarted?); registered "
                  "again (%d/%d ranks)",
                  registration_.host, registration_.port, client_->address(),
                  RankIdString(registration_.rank_id()), r->ranks_registered, r->ranks_expected);
        taken = false;
      } else if (Stopping()) {
        return;
      } else if (!Retryable(r.status()) && r.status().ToString() != last_error) {
        last_error = r.status().ToString();
        PDLIB_LOG(kError, "prefill %s:%d: registering again with bootstrap failed: %s",
                  registration_.host, registration_.port, last_error);
      }
    }
  }

  const KVManagerOptions options_;
  const RankRegistration registration_;
  const std::chrono::milliseconds period_;  // between checks that the server still has the rank
  std::unique_ptr<FreshBootstrapClient> client_;
  std::thread thread_;
  Mutex mu_;
  CondVar cv_;  // wakes Pause() at destruction
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

class BootstrapDiscovery final : public DiscoveryBackend {
 public:
  explicit BootstrapDiscovery(const KVManagerOptions& o) : options_(o) {}

  std::string Describe() const override {
    return "bootstrap server " + JoinHostPort(options_.bootstrap_host, options_.bootstrap_port);
  }

  StatusOr<std::unique_ptr<RankPublisher>> Publish(const RankRegistration& reg) override {
    auto publisher = std::make_unique<BootstrapPublisher>(options_, reg);
    if (Status s = publisher->Start(); !s.ok()) return s;
    return std::unique_ptr<RankPublisher>(std::move(publisher));
  }

  StatusOr<std::unique_ptr<DeploymentDirectory>> Open(std::string_view host,
                                                      uint16_t port) override {
    BootstrapClientOptions bco;
    bco.rpc_timeout = options_.connect_timeout;
    bco.security = Security(options_);
    auto client = std::make_unique<FreshBootstrapClient>(std::string(host), port, bco);
    if (Status s = client->Check(); !s.ok()) return s;
    return std::unique_ptr<DeploymentDirectory>(
        std::make_unique<BootstrapDirectory>(std::move(client)));
  }

  Status ReportRoomFailures(const std::vector<RoomFailure>& failures) override {
    FreshBootstrapClient* client = nullptr;
    {
      MutexLock lock(&mu_);
      if (reports_cancelled_) return Status::Cancelled("room-failure reports cancelled");
      if (!reporter_) {
        BootstrapClientOptions bco;
        bco.rpc_timeout = options_.connect_timeout;
        bco.security = Security(options_);
        reporter_ = std::make_unique<FreshBootstrapClient>(options_.bootstrap_host,
                                                           options_.bootstrap_port, bco);
      }
      client = reporter_.get();  // lives until this backend is destroyed
    }
    return client
        ->Run([&](BootstrapClient& c) -> StatusOr<bool> {
          if (Status s = c.ReportRoomFailures(failures); !s.ok()) return s;
          return true;
        })
        .status();
  }

  Status Watch(std::function<void(const std::string&)>) override { return Status::OK(); }
  void Cancel() override { CancelReports(); }
  void CancelReports() override {
    MutexLock lock(&mu_);
    reports_cancelled_ = true;
    if (reporter_) reporter_->Cancel();
  }

 private:
  const KVManagerOptions options_;
  Mutex mu_;
  std::unique_ptr<FreshBootstrapClient> reporter_ ABSL_GUARDED_BY(mu_);
  bool reports_cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

std::string EtcdDeploymentPrefix(std::string_view prefix, std::string_view deployment) {
  return absl::StrFormat("%s/%s/rank/", prefix, deployment);
}

std::string EtcdRoomFailurePrefix(std::string_view prefix, std::string_view deployment) {
  return absl::StrFormat("%s/%s/failed/", prefix, deployment);
}

std::string EtcdRankKey(std::string_view prefix, std::string_view deployment, const RankId& id) {
  return absl::StrFormat("%s%d/%d/%d", EtcdDeploymentPrefix(prefix, deployment), id.dp_rank,
                         id.tp_rank, id.pp_rank);
}

StatusOr<EtcdRankKeyParts> ParseEtcdRankKey(std::string_view prefix, std::string_view key) {
  auto bad = [&](std::string_view why) {
    return Status::InvalidArgument(absl::StrFormat("etcd key '%s' is not a pdlib rank key: %s",
                                                   absl::CHexEscape(std::string(key)), why));
  };
  if (key.size() > 4096) return bad("longer than 4096 bytes");
  if (key.size() <= prefix.size() + 1 || key.substr(0, prefix.size()) != prefix ||
      key[prefix.size()] != '/') {
    return bad(absl::StrFormat("not under '%s/'", prefix));
  }
  std::string_view rest = key.substr(prefix.size() + 1);
  const size_t marker = rest.rfind("/rank/");
  if (marker == std::string_view::npos || marker == 0) return bad("no '<deployment>/rank/'");
  EtcdRankKeyParts parts;
  parts.deployment = std::string(rest.substr(0, marker));
  std::vector<std::string> numbers = absl::StrSplit(std::string(rest.substr(marker + 6)), '/');
  if (numbers.size() != 3) return bad("expected <dp>/<tp>/<pp> after 'rank/'");
  int32_t* fields[3] = {&parts.rank.dp_rank, &parts.rank.tp_rank, &parts.rank.pp_rank};
  for (int i = 0; i < 3; ++i) {
    if (numbers[i].empty() || numbers[i].size() > 9 ||
        numbers[i].find_first_not_of("0123456789") != std::string::npos ||
        !absl::SimpleAtoi(numbers[i], fields[i])) {
      return bad("a rank number is not a non-negative integer");
    }
  }
  return parts;
}

Status ValidateEtcdOptions(const KVManagerOptions& o) {
  if (o.etcd_endpoints.empty()) {
    return Status::InvalidArgument("discovery etcd needs etcd_endpoints (\"host:port\" each)");
  }
  for (const std::string& e : o.etcd_endpoints) {
    const size_t colon = e.rfind(':');
    uint32_t port = 0;
    if (colon == std::string::npos || colon == 0 || !absl::SimpleAtoi(e.substr(colon + 1), &port) ||
        port == 0 || port > 65535) {
      return Status::InvalidArgument(
          absl::StrFormat("etcd endpoint '%s' is not \"host:port\" with a port in [1, 65535]", e));
    }
  }
  const std::string& p = o.etcd_prefix;
  if (p.empty() || p.front() != '/' || p.back() == '/' || p.size() > 256) {
    return Status::InvalidArgument(absl::StrFormat(
        "etcd_prefix '%s' must start with '/', not end with '/' and be at most 256 bytes", p));
  }
  if (o.etcd_username.empty() != o.etcd_password.empty()) {
    return Status::InvalidArgument("etcd_username and etcd_password go together");
  }
  if (o.etcd_tls_cert_file.empty() != o.etcd_tls_key_file.empty()) {
    return Status::InvalidArgument("etcd_tls_cert_file and etcd_tls_key_file go together");
  }
  return Status::OK();
}

StatusOr<std::unique_ptr<DiscoveryBackend>> DiscoveryBackend::Create(
    const KVManagerOptions& options) {
  switch (options.discovery) {
    case pdlib::Discovery::kBootstrapServer:
      return std::unique_ptr<DiscoveryBackend>(std::make_unique<BootstrapDiscovery>(options));
    case pdlib::Discovery::kEtcd:
      if (Status s = ValidateEtcdOptions(options); !s.ok()) return s;
      return CreateEtcdDiscovery(options);
  }
  return Status::InvalidArgument(
      absl::StrFormat("unknown discovery %d", static_cast<int32_t>(options.discovery)));
}

}  // namespace control
}  // namespace v1
}  // namespace pdlib
