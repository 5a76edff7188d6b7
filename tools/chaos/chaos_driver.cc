#include "tools/chaos/chaos_driver.h"

#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tools/chaos/chaos_accounting.h"
#include "tools/chaos/chaos_topology.h"
#include "tools/common/child_process.h"

namespace pdlib_chaos {
namespace internal {
namespace {

using pdlib_tools::ChildOptions;
using pdlib_tools::ChildProcess;
using pdlib_tools::TailOfFile;
using std::chrono::milliseconds;

constexpr size_t kMaxProblems = 20;  // lines of detail kept per topology

}  // namespace

Topology::Topology(const ChaosOptions& o, std::string name, int prefills, int decodes,
                   uint64_t requests, uint64_t room_base)
    : o_(o),
      name_(std::move(name)),
      requests_(requests),
      room_base_(room_base),
      bound_(o.hang_bound_ms > 0 ? o.hang_bound_ms : DerivedHangBound(o.peer)),
      settle_(milliseconds(o.settle_ms > 0 ? o.settle_ms : DerivedSettle(o.peer))),
      rng_(o.seed ^ room_base) {
  for (int i = 0; i < prefills + decodes; ++i) {
    Proc p;
    p.prefill = i < prefills;
    p.index = p.prefill ? i : i - prefills;
    procs_.push_back(std::move(p));
  }
  prefills_ = size_t(prefills);
  t_.hang_bound_ms = bound_;
  t_.settle_ms = Ms(settle_);
}

Tally Topology::Run(std::string* error) {
  const auto began = Clock::now();
  if (!Setup(error)) {
    Teardown();
    return t_;
  }
  // The chaos: requests at `rate`, faults at random moments, until every request is started
  // and every room is over (or hung).
  phase_start_ = Clock::now();
  next_fault_ = phase_start_ + NextFaultDelay();
  issuing_ = true;
  // A run that cannot start its requests (every process crashing, say) still ends.
  const double paced_s = o_.rate > 0 ? double(requests_) / o_.rate : double(requests_) * 0.05;
  const auto give_up = phase_start_ + milliseconds(int64_t(paced_s * 4000) + 120000 + bound_);
  while (issued_ < requests_ || !AllSettledOrHung()) {
    if (Clock::now() > give_up) {
      Problem("gave up after " + std::to_string(Ms(Clock::now() - phase_start_)) + " ms with " +
              std::to_string(requests_ - issued_) + " requests never started; counted as hung");
      t_.hung += requests_ - issued_;
      break;
    }
    Step();
  }
  issuing_ = false;
  Quiesce();
  RunProbes();
  CollectLeaks();
  Teardown();
  Finalize();
  t_.seconds = std::chrono::duration<double>(Clock::now() - began).count();
  if (progress_shown_) std::fprintf(stderr, "\n");
  return t_;
}

// --- setup and teardown -----------------------------------------------------------------------

bool Topology::Setup(std::string* error) {
  InfraOptions io;
  io.netns = o_.netns;
  io.etcd = o_.etcd;
  io.rails = o_.rails;
  std::vector<std::string> hosts;
  for (const Proc& p : procs_) hosts.push_back(p.name());
  auto infra = ChaosInfra::Create(io, hosts);
  if (!infra.ok()) {
    *error = infra.status().ToString();
    return false;
  }
  infra_ = std::move(*infra);
  for (size_t i = 0; i < procs_.size(); ++i) Spawn(i);
  const auto deadline = Clock::now() + kStartTimeout;
  while (!std::all_of(procs_.begin(), procs_.end(),
                      [](const Proc& p) { return p.state == Proc::State::kReady; })) {
    if (Clock::now() > deadline || t_.crashes > 0 || t_.restart_failures > 0) {
      for (const Proc& p : procs_) {
        if (p.state == Proc::State::kReady) continue;
        *error = p.name() + " did not start within " + std::to_string(kStartTimeout.count()) +
                 " ms; its log (" + LogPath(p) + ") ends:\n" + TailOfFile(LogPath(p), 2000);
        break;
      }
      return false;
    }
    Step();
  }
  for (Proc& p : procs_) p.last_event = Clock::time_point{};
  return true;
}

std::string Topology::LogPath(const Proc& p) const {
  return o_.log_dir + "/" + name_ + "-" + p.name() + "." + std::to_string(p.generation) + ".log";
}

void Topology::Spawn(size_t slot) {
  Proc& p = procs_[slot];
  ++p.generation;
  p.stacks_dumped = false;
  PeerConfig c = o_.peer;
  c.mode = p.prefill ? pdlib::Mode::kPrefill : pdlib::Mode::kDecode;
  c.listen_host = infra_->HostIp(p.name());
  c.bootstrap_host = infra_->bootstrap_host();
  c.bootstrap_port = infra_->bootstrap_port();
  c.etcd_endpoints = infra_->etcd_endpoints();
  c.dp_size = p.prefill ? int32_t(prefills_) : 1;
  c.dp_rank = p.prefill ? p.index : 0;
  auto placed =
      infra_->Place(p.name(), ChildOptions{.self_name = "pdlib-chaos",
                                           .args = PeerArgs(c),
                                           .stderr_mode = ChildOptions::Stderr::kAppendToFile,
                                           .stderr_path = LogPath(p)});
  p.state = Proc::State::kStarting;
  p.started_at = Clock::now();
  if (auto it = p.metrics.find("corruptions_injected"); it != p.metrics.end()) {
    p.corruptions_before += it->second;
  }
  p.metrics.clear();
  p.metrics_fresh = false;
  if (!placed.ok()) {
    Note(p.name() + ": " + placed.status().ToString());
    return;  // not READY in time: a restart failure
  }
  p.child = std::make_unique<ChildProcess>(std::move(*placed));
  if (!p.child->started()) Note(p.name() + ": " + p.child->error());
}

// Asks every process to quit and waits for them; a process that does not exit 0 in time is an
// unclean exit (a hang or a crash on shutdown). Then the hosts and the discovery go.
void Topology::Teardown() {
  for (Proc& p : procs_) {
    if (!p.child) continue;
    if (p.state == Proc::State::kStopped) p.child->Signal(SIGCONT);
    p.quitting = true;
    p.child->Send("QUIT");
  }
  const auto deadline = Clock::now() + kQuitTimeout;
  while (
      std::any_of(procs_.begin(), procs_.end(), [](const Proc& p) { return p.child != nullptr; })) {
    if (Clock::now() > deadline) {
      for (Proc& p : procs_) {
        if (!p.child) continue;
        ++t_.unclean_exits;
        Problem(p.name() + " (pid " + std::to_string(p.child->pid()) + ") did not exit within " +
                std::to_string(kQuitTimeout.count()) + " ms of QUIT; killed; log " + LogPath(p));
        p.child->KillAndReap(milliseconds(5000));
        p.child.reset();
      }
      break;
    }
    PollOnce(milliseconds(10));
    ReapChildren();
  }
  infra_.reset();
}

// --- the loop -----------------------------------------------------------------------------------

void Topology::Step() {
  const auto now = Clock::now();
  if (issuing_) {
    IssueRequests(now);
    if (issued_ < requests_ && now >= next_fault_) {
      InjectFault(now);
      next_fault_ = now + NextFaultDelay();
    }
  }
  RunTimers(now);
  RunFaultTimers(now);
  PollOnce(milliseconds(5));
  ReapChildren();
  CheckHung(Clock::now());
  ShowProgress(false);
}

void Topology::PollOnce(milliseconds timeout) {
  std::vector<pollfd> fds;
  std::vector<size_t> owner;
  for (size_t i = 0; i < procs_.size(); ++i) {
    const Proc& p = procs_[i];
    if (!p.child) continue;
    if (p.child->output_fd() >= 0) {
      fds.push_back({p.child->output_fd(), POLLIN, 0});
      owner.push_back(i);
    }
    if (p.child->input_fd_if_pending() >= 0) {
      fds.push_back({p.child->input_fd_if_pending(), POLLOUT, 0});
      owner.push_back(i);
    }
  }
  if (::poll(fds.data(), fds.size(), int(timeout.count())) <= 0) return;
  for (size_t k = 0; k < fds.size(); ++k) {
    if (fds[k].revents == 0) continue;
    Proc& p = procs_[owner[k]];
    if (!p.child) continue;
    if (fds[k].events == POLLOUT) {
      p.child->Flush();
      continue;
    }
    std::vector<std::string> lines;
    p.child->ReadLines(&lines);
    for (const auto& line : lines) HandleLine(owner[k], line);
  }
}

void Topology::HandleLine(size_t slot, const std::string& line) {
  Proc& p = procs_[slot];
  const auto now = Clock::now();
  if (line.starts_with("READY")) {
    if (p.state != Proc::State::kStarting) return;
    p.state = Proc::State::kReady;
    if (p.generation > 0) {
      p.last_event = now;
      CloseProcessWindow(p, now);
      ++t_.restarts;
      Note(p.name() + " restarted (generation " + std::to_string(p.generation) + ") and READY");
    }
  } else if (line.starts_with("ROOM ")) {
    HandleRoomLine(p, line, now);
  } else if (line.starts_with("METRICS ")) {
    p.metrics = ParseCounters(line);
    p.metrics_fresh = true;
  } else if (line.starts_with("QUARANTINE ")) {
    const auto q = ParseCounters(line);
    auto get = [&](const char* k) { return q.contains(k) ? q.at(k) : uint64_t{0}; };
    ++t_.quarantined_requests;
    t_.quarantined_pages += get("pages");
    t_.quarantine_peak_pages = std::max(t_.quarantine_peak_pages, get("held_pages_now"));
    t_.quarantine_max_hold_ms =
        std::max(t_.quarantine_max_hold_ms, static_cast<int64_t>(get("held_ms")));
  } else if (line.starts_with("STALE ")) {
    ++t_.stale_writes;
    Problem(p.name() +
            (line.starts_with("STALE prefix_page=")
                 ? " found a write into a page of a decode prefix (its own cache, never handed "
                   "to pdlib): "
                 : " found a write into memory it had taken back: ") +
            line.substr(6));
  } else if (line.starts_with("KEPT ")) {
    const auto k = ParseCounters(line);
    if (k.contains("pages")) t_.verified_kept_pages += k.at("pages");
  } else if (line.starts_with("ERROR ")) {
    ++t_.harness_errors;
    Note(p.name() + ": " + line);
  }
}

void Topology::HandleRoomLine(Proc& p, const std::string& line, Clock::time_point now) {
  std::istringstream in(line.substr(5));
  uint64_t id = 0;
  std::string kind, rest;
  in >> id >> kind;
  std::getline(in >> std::ws, rest);
  auto it = rooms_.find(id);
  if (it == rooms_.end() || !p.rooms.erase(id)) {
    ++t_.harness_errors;
    Note(p.name() + " reported a room it does not hold: " + line);
    return;
  }
  Room& r = it->second;
  Outcome& side = p.prefill ? r.p : r.d;
  side.at = now;
  side.detail = rest;
  if (kind == "Success") {
    side.kind = Outcome::kSuccess;
    const auto c = ParseCounters(rest);
    if (c.contains("bytes")) side.bytes = c.at("bytes");
    if (c.contains("prefix_pages")) side.prefix_pages = c.at("prefix_pages");
  } else if (kind == "BadBytes") {
    side.kind = Outcome::kBadBytes;
    Problem("room " + std::to_string(id) +
            (p.prefill ? " was told the wrong decode prefix on " + p.name() + ": "
             : rest.starts_with("kept_page=")
                 ? " failed on " + p.name() +
                       " with a page InvalidPages() left out holding "
                       "wrong bytes: "
                 : " reached Success on " + p.name() + " with wrong bytes: ") +
            rest);
  } else {
    side.kind = Outcome::kFailed;
    if (o_.verbose) Note(p.name() + ": room " + std::to_string(id) + " failed: " + rest);
  }
  MaybeSettle(r);
}

void Topology::MaybeSettle(Room& r) {
  if (r.settled || r.p.kind == Outcome::kPending || r.d.kind == Outcome::kPending) return;
  r.settled = true;
  ++settled_;
  // How long after the first fault that hit its processes during its life the room ended.
  const auto end = std::max(r.p.at, r.d.at);
  auto first = Clock::time_point::max();
  for (size_t slot : {r.prefill, r.decode}) {
    const auto& f = procs_[slot].faults;
    auto it = std::upper_bound(f.begin(), f.end(), r.issued);
    if (it != f.end() && *it <= end) first = std::min(first, *it);
  }
  if (first != Clock::time_point::max()) {
    t_.max_fault_to_terminal_ms = std::max(t_.max_fault_to_terminal_ms, Ms(end - first));
  }
}

void Topology::ReapChildren() {
  const auto now = Clock::now();
  for (size_t i = 0; i < procs_.size(); ++i) {
    Proc& p = procs_[i];
    if (!p.child) continue;
    auto status = p.child->Reap();
    if (!status) continue;
    // Read what it printed before it went.
    std::vector<std::string> lines;
    p.child->ReadLines(&lines);
    for (const auto& line : lines) HandleLine(i, line);
    if (p.quitting) {
      if (*status != 0) {
        ++t_.unclean_exits;
        Problem(p.name() + " exited with status " + std::to_string(*status) + " after QUIT; log " +
                LogPath(p) + ":\n" + TailOfFile(LogPath(p), 1500));
      }
      p.child.reset();
      p.state = Proc::State::kDown;
      continue;
    }
    if (IsKnownUcxAbort(TailOfFile(LogPath(p), 16384))) {
      ++t_.ucx_known_aborts;
      Note(p.name() + " aborted inside UCX 1.13 (openucx/ucx#8175); log " + LogPath(p));
      Lose(p, "aborted inside UCX", now);
    } else {
      ++t_.crashes;
      Problem(p.name() + " generation " + std::to_string(p.generation) +
              " died on its own with status " + std::to_string(*status) + "; log " + LogPath(p) +
              ":\n" + TailOfFile(LogPath(p), 1500));
      Lose(p, "crashed", now);
    }
    p.restart_at = now + milliseconds(200);
  }
}

// The process of slot `p` is gone: its side of every room it held is over.
void Topology::Lose(Proc& p, const std::string& how, Clock::time_point now) {
  for (uint64_t id : p.rooms) {
    Room& r = rooms_.at(id);
    Outcome& side = p.prefill ? r.p : r.d;
    side.kind = Outcome::kLost;
    side.detail = p.name() + " " + how;
    side.at = now;
    MaybeSettle(r);
  }
  p.rooms.clear();
  p.child.reset();
  p.state = Proc::State::kDown;
  p.last_event = now;
  p.faults.push_back(now);
  OpenProcessWindow(p, now, how == "killed" ? "SIGKILL of" : "loss of");  // until READY
}

void Topology::RunTimers(Clock::time_point now) {
  for (size_t i = 0; i < procs_.size(); ++i) {
    Proc& p = procs_[i];
    // With etcd a process started while its host is cut off fails KVManager::Create after
    // connect_timeout (documented): the supervisor that restarts it waits for the heal.
    const bool cut_off = o_.etcd && p.link && p.link->kind == FaultKind::kPartition;
    if (p.state == Proc::State::kStopped && now >= p.resume_at) {
      p.child->Signal(SIGCONT);
      p.state = Proc::State::kReady;
      p.last_event = now;
      CloseProcessWindow(p, now);
      Note(p.name() + " thawed (SIGCONT)");
    } else if (p.state == Proc::State::kDown && !p.child && now >= p.restart_at && !cut_off) {
      Spawn(i);
    } else if (p.state == Proc::State::kStarting && now - p.started_at > kStartTimeout) {
      ++t_.restart_failures;
      Problem(p.name() + " generation " + std::to_string(p.generation) + " not READY within " +
              std::to_string(kStartTimeout.count()) + " ms; log " + LogPath(p) + ":\n" +
              TailOfFile(LogPath(p), 1500));
      if (p.child) p.child->KillAndReap(milliseconds(5000));
      Lose(p, "never became ready", now);
      p.restart_at = now + milliseconds(500);
    }
  }
}

// --- requests -----------------------------------------------------------------------------------

bool Topology::CanTake(size_t slot) const {
  return procs_[slot].serving() && InFlight(slot) < o_.peer.concurrency;
}

void Topology::IssueRequests(Clock::time_point now) {
  while (issued_ < requests_) {
    if (o_.rate > 0) {
      const double due = std::chrono::duration<double>(now - phase_start_).count() * o_.rate;
      if (double(issued_) >= due) return;
    }
    // DP-style routing: prefill DP ranks take turns, decode is any that has room.
    size_t prefill = SIZE_MAX;
    for (size_t k = 0; k < prefills_ && prefill == SIZE_MAX; ++k) {
      const size_t cand = (seq_ + k) % prefills_;
      if (CanTake(cand)) prefill = cand;
    }
    std::vector<size_t> decodes;
    for (size_t i = prefills_; i < procs_.size(); ++i) {
      if (CanTake(i)) decodes.push_back(i);
    }
    if (prefill == SIZE_MAX || decodes.empty()) return;
    const size_t decode = decodes[rng_() % decodes.size()];
    Issue(prefill, decode, false, now);
    ++issued_;
  }
}

void Topology::Issue(size_t prefill, size_t decode, bool probe, Clock::time_point now) {
  // room % prefill DP size is the prefill DP rank decode asks the bootstrap server for.
  const uint64_t id = room_base_ + seq_++ * prefills_ + prefill;
  Room r;
  r.id = id;
  r.prefill = prefill;
  r.decode = decode;
  r.prefill_generation = procs_[prefill].generation;
  r.decode_generation = procs_[decode].generation;
  r.issued = now;
  r.probe = probe;
  rooms_[id] = std::move(r);
  for (size_t slot : {prefill, decode}) {
    procs_[slot].rooms.insert(id);
    procs_[slot].child->Send("START " + std::to_string(id));
  }
}

bool Topology::AllSettledOrHung() const {
  for (const auto& [id, r] : rooms_) {
    if (!r.settled && !r.hung) return false;
  }
  return true;
}

void Topology::CheckHung(Clock::time_point now) {
  if (settled_ == rooms_.size()) return;
  for (auto& [id, r] : rooms_) {
    if (r.settled || r.hung) continue;
    const auto from =
        std::max({r.issued, procs_[r.prefill].last_event, procs_[r.decode].last_event});
    if (now - from <= milliseconds(bound_)) continue;
    r.hung = true;
    ++t_.hung;
    auto side = [&](const Outcome& o, size_t slot) {
      return procs_[slot].name() + (o.kind == Outcome::kPending ? " still pending" : " done");
    };
    Problem("room " + std::to_string(id) + " not terminal " + std::to_string(Ms(now - from)) +
            " ms after " + (from == r.issued ? "its start" : "the last fault event") + " (" +
            side(r.p, r.prefill) + ", " + side(r.d, r.decode) + ")");
  }
}

// --- output -------------------------------------------------------------------------------------

// With the wall-clock time of day, as the processes' log lines have it, to line them up.
void Topology::Note(const std::string& line) {
  if (!o_.verbose) return;
  if (progress_shown_) std::fprintf(stderr, "\n");
  progress_shown_ = false;
  const auto now = std::chrono::system_clock::now();
  const std::time_t seconds = std::chrono::system_clock::to_time_t(now);
  std::tm local{};
  ::localtime_r(&seconds, &local);
  const auto ms = std::chrono::duration_cast<milliseconds>(now.time_since_epoch()).count() % 1000;
  std::fprintf(stderr, "pdlib-chaos %s %02d:%02d:%02d.%03d: %s\n", name_.c_str(), local.tm_hour,
               local.tm_min, local.tm_sec, int(ms), line.c_str());
}

void Topology::Problem(const std::string& line) {
  if (t_.problems.size() < kMaxProblems) t_.problems.push_back(name_ + ": " + line);
  if (progress_shown_) std::fprintf(stderr, "\n");
  progress_shown_ = false;
  std::fprintf(stderr, "pdlib-chaos %s: PROBLEM: %s\n", name_.c_str(), line.c_str());
}

// A progress line on stderr: rewritten in place on a terminal, every 2 s otherwise.
void Topology::ShowProgress(bool force) {
  static const bool tty = ::isatty(STDERR_FILENO) != 0;
  const auto now = Clock::now();
  if (!force && now - last_progress_ < (tty ? milliseconds(250) : milliseconds(2000))) return;
  last_progress_ = now;
  std::fprintf(stderr, "%spdlib-chaos %s: %llu/%llu started, %zu over, %llu faults, %llu hung%s",
               tty ? "\r" : "", name_.c_str(), static_cast<unsigned long long>(issued_),
               static_cast<unsigned long long>(requests_), settled_,
               static_cast<unsigned long long>(t_.faults), static_cast<unsigned long long>(t_.hung),
               tty ? "   " : "\n");
  progress_shown_ = tty;
}

}  // namespace internal

int64_t DerivedHangBound(const PeerConfig& peer) {
  // Pull: a room prefill published that no decode rank reads (decode lost before its
  // TransferInfo, or frozen: no heartbeat) lives until its lease runs out.
  const int64_t lease =
      peer.direction == pdlib::TransferDirection::kPull ? peer.pull_lease_ms : int64_t{0};
  return peer.bootstrap_ms + peer.waiting_ms + peer.transfer_ms + peer.liveness_ms + lease + 2000;
}

int64_t DerivedSettle(const PeerConfig& peer) { return peer.liveness_ms; }

Tally RunTopology(const ChaosOptions& options, const std::string& name, int prefills, int decodes,
                  uint64_t requests, uint64_t room_base, std::string* error) {
  internal::Topology topology(options, name, prefills, decodes, requests, room_base);
  return topology.Run(error);
}

}  // namespace pdlib_chaos
