#include "tools/chaos/chaos_faults.h"

#include <algorithm>
#include <sstream>

namespace pdlib_chaos {
namespace {

constexpr FaultKind kAllKinds[] = {FaultKind::kKill,
                                   FaultKind::kStop,
                                   FaultKind::kPartition,
                                   FaultKind::kLoss,
                                   FaultKind::kBandwidth,
                                   FaultKind::kLatency,
                                   FaultKind::kBootstrapRestart,
                                   FaultKind::kEtcdMember,
                                   FaultKind::kRail};

// Uniform in [0.5, 1.5] x mean, at least 1 ms.
int64_t AroundMean(int64_t mean_ms, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> f(0.5, 1.5);
  return std::max<int64_t>(1, int64_t(double(mean_ms) * f(rng)));
}

int Between(int lo, int hi, std::mt19937_64& rng) {
  return std::uniform_int_distribution<int>(lo, hi)(rng);
}

}  // namespace

std::string_view FaultKindName(FaultKind kind) {
  switch (kind) {
    case FaultKind::kKill: return "kill";
    case FaultKind::kStop: return "stop";
    case FaultKind::kPartition: return "partition";
    case FaultKind::kLoss: return "loss";
    case FaultKind::kBandwidth: return "bandwidth";
    case FaultKind::kLatency: return "latency";
    case FaultKind::kBootstrapRestart: return "bootstrap_restart";
    case FaultKind::kEtcdMember: return "etcd_member";
    case FaultKind::kRail: return "rail";
  }
  return "unknown";
}

bool IsProcessFault(FaultKind k) { return k == FaultKind::kKill || k == FaultKind::kStop; }

bool IsLinkFault(FaultKind k) {
  return k == FaultKind::kPartition || k == FaultKind::kLoss || k == FaultKind::kBandwidth ||
         k == FaultKind::kLatency || k == FaultKind::kRail;
}

bool IsDiscoveryFault(FaultKind k) {
  return k == FaultKind::kBootstrapRestart || k == FaultKind::kEtcdMember;
}

bool ParseFaultKinds(std::string_view text, bool etcd, std::vector<FaultKind>* kinds,
                     std::string* error) {
  const FaultKind discovery = etcd ? FaultKind::kEtcdMember : FaultKind::kBootstrapRestart;
  std::vector<FaultKind> named;
  bool none = false;
  size_t words = 0;
  std::string_view rest = text;
  while (true) {
    const size_t comma = rest.find(',');
    const std::string_view word = rest.substr(0, comma);
    ++words;
    if (word == "none") {
      none = true;
    } else if (word == "process") {
      named.insert(named.end(), {FaultKind::kKill, FaultKind::kStop});
    } else if (word == "network") {
      named.insert(named.end(), {FaultKind::kPartition, FaultKind::kLoss, FaultKind::kBandwidth,
                                 FaultKind::kLatency, discovery});
    } else {
      const auto* it = std::find_if(std::begin(kAllKinds), std::end(kAllKinds),
                                    [&](FaultKind k) { return FaultKindName(k) == word; });
      if (it == std::end(kAllKinds)) {
        *error = "unknown fault '" + std::string(word) +
                 "' (expected a comma list of process, network, kill, stop, partition, loss, "
                 "bandwidth, latency, bootstrap_restart, etcd_member, rail, or none)";
        return false;
      }
      if (IsDiscoveryFault(*it) && *it != discovery) {
        *error = std::string(FaultKindName(*it)) +
                 (etcd ? " needs --discovery bootstrap (there is no bootstrap server with etcd)"
                       : " needs --discovery etcd");
        return false;
      }
      named.push_back(*it);
    }
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  if (none && words > 1) {
    *error = "'none' cannot go with other faults";
    return false;
  }
  kinds->clear();
  for (FaultKind k : kAllKinds) {  // the canonical order, once each
    if (std::find(named.begin(), named.end(), k) != named.end()) kinds->push_back(k);
  }
  return true;
}

FaultParams DrawFaultParams(FaultKind kind, const FaultTimes& times, std::mt19937_64& rng,
                            int rails) {
  FaultParams p;
  switch (kind) {
    case FaultKind::kKill: p.duration_ms = Between(50, 500, rng); break;
    case FaultKind::kStop: p.duration_ms = AroundMean(times.stop_ms, rng); break;
    case FaultKind::kPartition: p.duration_ms = AroundMean(times.partition_ms, rng); break;
    case FaultKind::kLoss:
      p.loss_percent = Between(1, 10, rng);
      p.duration_ms = AroundMean(times.link_ms, rng);
      break;
    case FaultKind::kBandwidth:
      p.rate_mbit = Between(50, 500, rng);
      p.duration_ms = AroundMean(times.link_ms, rng);
      break;
    case FaultKind::kLatency:
      p.delay_ms = Between(1, 50, rng);
      p.jitter_ms = Between(0, p.delay_ms / 2, rng);
      p.duration_ms = AroundMean(times.link_ms, rng);
      break;
    case FaultKind::kBootstrapRestart:
    case FaultKind::kEtcdMember: p.duration_ms = AroundMean(times.discovery_down_ms, rng); break;
    case FaultKind::kRail:
      p.rail = Between(0, std::max(rails, 1) - 1, rng);
      p.rate_mbit = Between(0, 2, rng) == 0 ? Between(50, 500, rng) : 0;  // 0: partitioned
      p.duration_ms = AroundMean(p.rate_mbit > 0 ? times.link_ms : times.partition_ms, rng);
      break;
  }
  return p;
}

std::string DescribeFault(FaultKind kind, const FaultParams& p) {
  std::ostringstream o;
  o << FaultKindName(kind);
  switch (kind) {
    case FaultKind::kKill: o << ", restart after " << p.duration_ms << " ms"; return o.str();
    case FaultKind::kLoss: o << " " << p.loss_percent << "%"; break;
    case FaultKind::kBandwidth: o << " " << p.rate_mbit << " Mbit/s"; break;
    case FaultKind::kLatency: o << " " << p.delay_ms << "+-" << p.jitter_ms << " ms"; break;
    case FaultKind::kRail:
      o << " " << p.rail << " ";
      if (p.rate_mbit > 0) {
        o << p.rate_mbit << " Mbit/s";
      } else {
        o << "partition";
      }
      break;
    default: break;
  }
  o << " for " << p.duration_ms << " ms";
  return o.str();
}

bool Touches(const FaultWindow& w, std::chrono::steady_clock::time_point start,
             std::chrono::steady_clock::time_point finish,
             std::chrono::steady_clock::duration settle) {
  if (w.begin > finish) return false;
  if (w.end == std::chrono::steady_clock::time_point::max()) return true;
  return w.end + settle >= start;
}

}  // namespace pdlib_chaos
