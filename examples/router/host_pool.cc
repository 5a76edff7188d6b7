#include "examples/router/host_pool.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <charconv>
#include <set>

#include "lib/control/grpc_status.h"

namespace pdlib::router {
namespace {

using Clock = std::chrono::steady_clock;

// Prometheus label values: backslash, quote and newline escaped.
std::string LabelValue(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '\\' || c == '"') out.push_back('\\');
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out.push_back(c);
  }
  return out;
}

// Reconnect quickly: gRPC's default backoff grows to minutes, so a host that starts late or
// restarts would stay unreachable long after it is up.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

}  // namespace

std::string_view HostRoleName(HostRole role) {
  return role == HostRole::kPrefill ? "prefill" : "decode";
}

Status ValidateHostPort(std::string_view address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string_view::npos || colon == 0) {
    return Status::InvalidArgument("host address '" + std::string(address) + "' is not host:port");
  }
  std::string_view host = address.substr(0, colon);
  std::string_view port = address.substr(colon + 1);
  if (host.find(':') != std::string_view::npos && (host.front() != '[' || host.back() != ']')) {
    return Status::InvalidArgument("host address '" + std::string(address) +
                                   "': put an IPv6 host in brackets, e.g. [::1]:5000");
  }
  int value = 0;
  auto [ptr, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (port.empty() || ec != std::errc() || ptr != port.data() + port.size() || value < 1 ||
      value > 65535) {
    return Status::InvalidArgument("host address '" + std::string(address) +
                                   "': port must be a number in [1, 65535]");
  }
  return Status::OK();
}

Host::Host(HostRole role, std::string address)
    : role_(role),
      address_(std::move(address)),
      channel_(MakeChannel(address_)),
      stub_(serving::Host::NewStub(channel_)) {}

Host::LoadInfo Host::load_info() const {
  MutexLock lock(&mu_);
  return info_;
}

bool Host::Available(Clock::time_point now) const {
  MutexLock lock(&mu_);
  return now >= info_.skip_until;
}

void Host::RecordLoad(const serving::LoadReply& reply) {
  MutexLock lock(&mu_);
  if (reply.role() != HostRoleName(role_)) {
    info_.last_error = "GetLoad says role '" + reply.role() + "', but it was given as --" +
                       std::string(HostRoleName(role_));
    return;
  }
  info_.answered = true;
  info_.reported_load = int64_t{reply.running()} + reply.queued();
  info_.tp_size = reply.tp_size();
  info_.dp_size = reply.dp_size();
  if (role_ == HostRole::kPrefill) {
    // A host that reports no bootstrap host means "mine": the host part of its address.
    info_.bootstrap_host = reply.bootstrap_host();
    if (info_.bootstrap_host.empty()) {
      info_.bootstrap_host = address_.substr(0, address_.rfind(':'));
      if (info_.bootstrap_host.size() >= 2 && info_.bootstrap_host.front() == '[') {
        info_.bootstrap_host = info_.bootstrap_host.substr(1, info_.bootstrap_host.size() - 2);
      }
    }
    info_.bootstrap_port = reply.bootstrap_port();
  }
  info_.last_error.clear();
  info_.skip_until = {};
}

void Host::RecordError(const std::string& what, bool unavailable,
                       std::chrono::milliseconds backoff) {
  MutexLock lock(&mu_);
  info_.last_error = what;
  if (unavailable) info_.skip_until = Clock::now() + backoff;
}

HostPool::HostPool(const HostPoolOptions& options) : options_(options) {}

StatusOr<std::unique_ptr<HostPool>> HostPool::Create(const HostPoolOptions& options) {
  if (options.prefill.empty() || options.decode.empty()) {
    return Status::InvalidArgument(
        "the router needs at least one prefill host and one decode host (--prefill, --decode)");
  }
  std::set<std::string> seen;
  for (const auto* list : {&options.prefill, &options.decode}) {
    for (const std::string& address : *list) {
      if (Status s = ValidateHostPort(address); !s.ok()) return s;
      if (!seen.insert(address).second) {
        return Status::InvalidArgument("host " + address + " is given more than once");
      }
    }
  }
  if (options.poll_interval.count() <= 0 || options.rpc_timeout.count() <= 0) {
    return Status::InvalidArgument("load poll interval and GetLoad timeout must be > 0 ms");
  }
  auto pool = std::unique_ptr<HostPool>(new HostPool(options));
  for (const std::string& a : options.prefill)
    pool->prefill_.push_back(std::make_unique<Host>(HostRole::kPrefill, a));
  for (const std::string& a : options.decode)
    pool->decode_.push_back(std::make_unique<Host>(HostRole::kDecode, a));
  return pool;
}

HostPool::~HostPool() { StopPolling(); }

void HostPool::PollOnce() {
  for (const auto* list : {&prefill_, &decode_}) {
    for (const auto& host : *list) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + options_.rpc_timeout);
      serving::LoadRequest request;
      serving::LoadReply reply;
      grpc::Status s = host->stub()->GetLoad(&ctx, request, &reply);
      if (s.ok()) {
        host->RecordLoad(reply);
      } else {
        host->RecordError("GetLoad: " + control::FromGrpcStatus(s).ToString(),
                          s.error_code() == grpc::StatusCode::UNAVAILABLE,
                          options_.unavailable_backoff);
      }
    }
  }
}

Status HostPool::WaitReady(std::chrono::milliseconds timeout,
                           const std::function<void(const std::string&)>& progress) {
  const auto deadline = Clock::now() + timeout;
  auto next_progress = Clock::now() + std::chrono::seconds(1);
  while (true) {
    PollOnce();
    std::vector<std::string> missing;
    for (const auto* list : {&prefill_, &decode_}) {
      for (const auto& host : *list) {
        Host::LoadInfo info = host->load_info();
        if (info.answered) continue;
        missing.push_back(std::string(HostRoleName(host->role())) + " " + host->address() +
                          (info.last_error.empty() ? "" : " (" + info.last_error + ")"));
      }
    }
    if (missing.empty()) return Status::OK();
    std::string list;
    for (const std::string& m : missing) list += (list.empty() ? "" : "; ") + m;
    const auto now = Clock::now();
    if (now >= deadline) {
      return Status::Unavailable(std::to_string(missing.size()) + " host(s) did not answer " +
                                 "GetLoad within " + std::to_string(timeout.count()) +
                                 " ms: " + list);
    }
    if (progress && now >= next_progress) {
      progress("waiting for " + std::to_string(missing.size()) + " host(s): " + list);
      next_progress = now + std::chrono::seconds(1);
    }
    std::this_thread::sleep_for(
        std::min<Clock::duration>(std::chrono::milliseconds(100), deadline - now));
  }
}

void HostPool::StartPolling() {
  MutexLock lock(&poll_mu_);
  if (poller_.joinable() || stop_polling_) return;
  // Waits first: WaitReady has just polled.
  poller_ = std::thread([this] {
    while (true) {
      {
        MutexLock lock(&poll_mu_);
        if (stop_polling_) return;
        poll_cv_.WaitFor(&poll_mu_, options_.poll_interval);  // a spurious wake-up polls early
        if (stop_polling_) return;
      }
      PollOnce();
    }
  });
}

void HostPool::StopPolling() {
  {
    MutexLock lock(&poll_mu_);
    stop_polling_ = true;
  }
  poll_cv_.SignalAll();
  if (poller_.joinable()) poller_.join();
}

std::vector<HostLoad> HostPool::Loads(HostRole role) const {
  const auto now = Clock::now();
  std::vector<HostLoad> loads;
  for (const auto& host : hosts(role)) {
    Host::LoadInfo info = host->load_info();
    // Relaxed: a statistic; a slightly stale count only makes a policy slightly less exact.
    const int64_t in_flight = host->in_flight.load(std::memory_order_relaxed);
    loads.push_back(
        {.load = std::max(in_flight, info.reported_load), .available = now >= info.skip_until});
  }
  return loads;
}

void HostPool::AppendMetrics(std::string* out) const {
  struct Metric {
    const char* name;
    const char* type;
    const char* help;
    std::function<std::string(const Host&, const Host::LoadInfo&)> value;
  };
  const auto now = Clock::now();
  const Metric metrics[] = {
      {"pdlib_router_host_in_flight", "gauge", "Requests the router has in flight on the host.",
       [](const Host& h, const Host::LoadInfo&) {
         return std::to_string(h.in_flight.load(std::memory_order_relaxed));
       }},
      {"pdlib_router_host_requests_total", "counter", "Requests the router sent to the host.",
       [](const Host& h, const Host::LoadInfo&) {
         return std::to_string(h.requests.load(std::memory_order_relaxed));
       }},
      {"pdlib_router_host_failures_total", "counter", "Requests that failed on the host.",
       [](const Host& h, const Host::LoadInfo&) {
         return std::to_string(h.failures.load(std::memory_order_relaxed));
       }},
      {"pdlib_router_host_reported_load", "gauge",
       "Running + queued requests from the host's last GetLoad.",
       [](const Host&, const Host::LoadInfo& i) { return std::to_string(i.reported_load); }},
      {"pdlib_router_host_available", "gauge",
       "1 unless the policies skip the host after an UNAVAILABLE error.",
       [now](const Host&, const Host::LoadInfo& i) {
         return std::string(now >= i.skip_until ? "1" : "0");
       }},
  };
  for (const Metric& m : metrics) {
    *out +=
        std::string("# HELP ") + m.name + " " + m.help + "\n# TYPE " + m.name + " " + m.type + "\n";
    for (const auto* list : {&prefill_, &decode_}) {
      for (const auto& host : *list) {
        const Host::LoadInfo info = host->load_info();
        *out += std::string(m.name) + "{role=\"" + std::string(HostRoleName(host->role())) +
                "\",host=\"" + LabelValue(host->address()) + "\"} " + m.value(*host, info) + "\n";
      }
    }
  }
}

}  // namespace pdlib::router
