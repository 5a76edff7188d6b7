// The faults of one topology's run (chaos_topology.h): choosing and injecting them, ending them
// when their time has come, and which requests they touched.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "tools/chaos/chaos_topology.h"

namespace pdlib_chaos {
namespace internal {
namespace {

using std::chrono::milliseconds;

// How often a discovery that should be back is asked again (a port not free yet, an etcd
// member still catching up), and how long it may take before that is a problem.
constexpr milliseconds kDiscoveryRetry{100};
constexpr milliseconds kDiscoveryBackTimeout{30000};

std::string SideName(const Proc& p) { return p.prefill ? "prefill" : "decode"; }

}  // namespace

Clock::duration Topology::NextFaultDelay() {
  std::uniform_real_distribution<double> f(0.5, 1.5);
  return milliseconds(int64_t(double(o_.fault_interval_ms) * f(rng_)));
}

std::vector<FaultKind> Topology::InjectableNow() const {
  const bool any_ready = std::any_of(procs_.begin(), procs_.end(),
                                     [](const Proc& p) { return p.state == Proc::State::kReady; });
  const bool any_link_free =
      std::any_of(procs_.begin(), procs_.end(), [](const Proc& p) { return !p.link; });
  std::vector<FaultKind> kinds;
  for (FaultKind k : o_.faults) {
    if (k == FaultKind::kLatency && !o_.latency_skipped.empty()) continue;
    if ((IsProcessFault(k) && any_ready) || (IsLinkFault(k) && any_link_free) ||
        (IsDiscoveryFault(k) && !discovery_down_)) {
      kinds.push_back(k);
    }
  }
  return kinds;
}

void Topology::InjectFault(Clock::time_point now) {
  const std::vector<FaultKind> kinds = InjectableNow();
  if (kinds.empty()) return;
  const FaultKind kind = kinds[rng_() % kinds.size()];
  if (IsProcessFault(kind)) {
    InjectProcessFault(kind, now);
  } else if (IsLinkFault(kind)) {
    InjectLinkFault(kind, now);
  } else {
    InjectDiscoveryFault(kind, now);
  }
}

void Topology::InjectProcessFault(FaultKind kind, Clock::time_point now) {
  std::vector<size_t> targets;
  for (size_t i = 0; i < procs_.size(); ++i) {
    if (procs_[i].state == Proc::State::kReady) targets.push_back(i);
  }
  const size_t slot = targets[rng_() % targets.size()];
  Proc& p = procs_[slot];
  const FaultParams params = DrawFaultParams(kind, o_.times, rng_);
  ++t_.faults;
  ++t_.faults_by_kind[std::string(FaultKindName(kind)) + "_" + SideName(p)];
  if (kind == FaultKind::kKill) {
    const int status = p.child->KillAndReap(milliseconds(5000));
    if (status != 128 + SIGKILL) {
      Problem(p.name() + ": SIGKILL gave status " + std::to_string(status));
    }
    // What it printed before it died still counts.
    std::vector<std::string> lines;
    p.child->ReadLines(&lines);
    for (const auto& line : lines) HandleLine(slot, line);
    const size_t held = p.rooms.size();
    Lose(p, "killed", now);
    p.restart_at = now + milliseconds(params.duration_ms);
    Note("fault: SIGKILL " + p.name() + " with " + std::to_string(held) + " rooms in flight");
    return;
  }
  p.child->Signal(SIGSTOP);
  p.state = Proc::State::kStopped;
  p.last_event = now;
  p.faults.push_back(now);
  OpenProcessWindow(p, now, "SIGSTOP of");
  p.resume_at = now + milliseconds(params.duration_ms);
  Note("fault: SIGSTOP " + p.name() + " for " + std::to_string(params.duration_ms) + " ms with " +
       std::to_string(p.rooms.size()) + " rooms in flight");
}

void Topology::InjectLinkFault(FaultKind kind, Clock::time_point now) {
  std::vector<size_t> targets;
  for (size_t i = 0; i < procs_.size(); ++i) {
    if (!procs_[i].link) targets.push_back(i);
  }
  Proc& p = procs_[targets[rng_() % targets.size()]];
  const FaultParams params = DrawFaultParams(kind, o_.times, rng_, o_.rails);
  if (pdlib::Status s = infra_->StartLinkFault(p.name(), kind, params); !s.ok()) {
    ++t_.fault_errors;
    Problem("could not inject " + DescribeFault(kind, params) + " on host " + p.name() + ": " +
            s.ToString());
    return;
  }
  ++t_.faults;
  ++t_.faults_by_kind[std::string(FaultKindName(kind)) + "_" + SideName(p)];
  p.windows.push_back(
      {now, Clock::time_point::max(), std::string(FaultKindName(kind)) + " of host " + p.name()});
  p.link = LinkFault{kind, params, now + milliseconds(params.duration_ms), p.windows.size() - 1};
  p.last_event = now;
  p.faults.push_back(now);
  Note("fault: " + DescribeFault(kind, params) + " on host " + p.name() + " with " +
       std::to_string(p.rooms.size()) + " rooms in flight");
}

void Topology::EndLinkFault(Proc& p, Clock::time_point now) {
  if (!p.link) return;
  const FaultKind kind = p.link->kind;
  if (pdlib::Status s = infra_->EndLinkFault(p.name(), kind, p.link->params); !s.ok()) {
    ++t_.fault_errors;
    Problem("could not end " + std::string(FaultKindName(kind)) + " on host " + p.name() + ": " +
            s.ToString());
  }
  p.windows[p.link->window].end = now;
  p.heals.push_back(now);
  p.last_event = now;
  p.link.reset();
  Note(std::string(FaultKindName(kind)) + " on host " + p.name() + " ended (healed)");
}

void Topology::InjectDiscoveryFault(FaultKind kind, Clock::time_point now) {
  const FaultParams params = DrawFaultParams(kind, o_.times, rng_);
  std::string what = "bootstrap server stopped";
  if (kind == FaultKind::kEtcdMember) {
    const int member = int(rng_() % uint64_t(std::max(1, infra_->etcd_size())));
    if (pdlib::Status s = infra_->KillEtcd(member); !s.ok()) {
      ++t_.fault_errors;
      Problem("could not kill etcd member " + std::to_string(member) + ": " + s.ToString());
      return;
    }
    etcd_member_ = member;
    etcd_relaunched_ = false;
    what = "etcd member " + std::to_string(member) + " killed (SIGKILL)";
  } else {
    infra_->StopBootstrap();
  }
  ++t_.faults;
  ++t_.faults_by_kind[std::string(FaultKindName(kind))];
  discovery_down_ = true;
  discovery_kind_ = kind;
  discovery_back_at_ = now + milliseconds(params.duration_ms);
  next_discovery_check_ = discovery_back_at_;
  discovery_windows_.push_back({now, Clock::time_point::max(),
                                kind == FaultKind::kEtcdMember
                                    ? "outage of etcd member " + std::to_string(etcd_member_)
                                    : "restart of the bootstrap server"});
  for (Proc& p : procs_) p.faults.push_back(now);
  EventOnAll(now);
  Note("fault: " + what + " for " + std::to_string(params.duration_ms) + " ms");
}

void Topology::RunFaultTimers(Clock::time_point now) {
  for (Proc& p : procs_) {
    if (p.link && now >= p.link->until) EndLinkFault(p, now);
  }
  if (!discovery_down_ || now < next_discovery_check_) return;
  next_discovery_check_ = now + kDiscoveryRetry;
  bool back = false;
  pdlib::Status why;
  if (discovery_kind_ == FaultKind::kBootstrapRestart) {
    why = infra_->StartBootstrap();  // the old socket's port may not be free yet: again later
    back = why.ok();
  } else if (!etcd_relaunched_) {
    why = infra_->RelaunchEtcd(etcd_member_);
    etcd_relaunched_ = why.ok();
  } else {
    back = infra_->EtcdServing(etcd_member_);
  }
  const auto end = Clock::now();
  if (!back) {
    if (end - discovery_back_at_ > kDiscoveryBackTimeout) {
      ++t_.fault_errors;
      Problem(std::string(FaultKindName(discovery_kind_)) + ": the discovery did not come back " +
              "within " + std::to_string(kDiscoveryBackTimeout.count()) + " ms: " + why.ToString());
      discovery_back_at_ = end;  // once per timeout
    }
    return;
  }
  discovery_windows_.back().end = end;
  discovery_down_ = false;
  etcd_member_ = -1;
  EventOnAll(end);
  Note(std::string(FaultKindName(discovery_kind_)) + ": the discovery is back");
}

bool Topology::EndAllFaults(Clock::time_point now) {
  for (Proc& p : procs_) EndLinkFault(p, now);
  if (discovery_down_) {
    discovery_back_at_ = std::min(discovery_back_at_, now);
    next_discovery_check_ = std::min(next_discovery_check_, now);
    RunFaultTimers(now);
  }
  return !discovery_down_;
}

void Topology::EventOnAll(Clock::time_point now) {
  for (Proc& p : procs_) p.last_event = std::max(p.last_event, now);
}

void Topology::OpenProcessWindow(Proc& p, Clock::time_point now, const std::string& what) {
  if (p.open_window) return;  // still down from an earlier loss (a restart that failed)
  p.windows.push_back({now, Clock::time_point::max(), what + " " + p.name()});
  p.open_window = p.windows.size() - 1;
}

void Topology::CloseProcessWindow(Proc& p, Clock::time_point now) {
  if (!p.open_window) return;
  p.windows[*p.open_window].end = now;
  p.open_window.reset();
}

Clock::time_point Topology::LastFaultEnd() const {
  Clock::time_point last{};
  auto consider = [&](const FaultWindow& w) {
    if (w.end != Clock::time_point::max()) last = std::max(last, w.end);
  };
  for (const Proc& p : procs_) std::for_each(p.windows.begin(), p.windows.end(), consider);
  std::for_each(discovery_windows_.begin(), discovery_windows_.end(), consider);
  return last;
}

bool Topology::Touched(const Room& r, Clock::time_point finish) const {
  auto touches = [&](const FaultWindow& w) {
    return pdlib_chaos::Touches(w, r.issued, finish, settle_);
  };
  for (size_t slot : {r.prefill, r.decode}) {
    const auto& w = procs_[slot].windows;
    if (std::any_of(w.begin(), w.end(), touches)) return true;
  }
  return std::any_of(discovery_windows_.begin(), discovery_windows_.end(), touches);
}

bool Topology::AfterHeal(const Room& r) const {
  auto before = [&](Clock::time_point t) { return t < r.issued; };
  for (size_t slot : {r.prefill, r.decode}) {
    const auto& h = procs_[slot].heals;
    if (std::any_of(h.begin(), h.end(), before)) return true;
  }
  return std::any_of(
      discovery_windows_.begin(), discovery_windows_.end(),
      [&](const FaultWindow& w) { return w.end != Clock::time_point::max() && w.end < r.issued; });
}

std::string Topology::LastFaultBefore(const Room& r) const {
  const FaultWindow* last = nullptr;
  auto consider = [&](const FaultWindow& w) {
    if (w.end < r.issued && (last == nullptr || w.end > last->end)) last = &w;
  };
  for (size_t slot : {r.prefill, r.decode}) {
    std::for_each(procs_[slot].windows.begin(), procs_[slot].windows.end(), consider);
  }
  std::for_each(discovery_windows_.begin(), discovery_windows_.end(), consider);
  if (last == nullptr) return "no fault before it";
  return std::to_string(Ms(r.issued - last->end)) + " ms after the " + last->what + " ended";
}

}  // namespace internal
}  // namespace pdlib_chaos
