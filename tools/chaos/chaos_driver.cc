#include "tools/chaos/chaos_driver.h"

#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "lib/control/bootstrap_server.h"
#include "tools/chaos/chaos_accounting.h"
#include "tools/common/child_process.h"

namespace pdlib_chaos {
namespace {

using Clock = std::chrono::steady_clock;
using pdlib_tools::ChildOptions;
using pdlib_tools::ChildProcess;
using pdlib_tools::TailOfFile;
using std::chrono::milliseconds;

constexpr milliseconds kStartTimeout{30000};  // a child's READY (sanitizer builds start slowly)
constexpr milliseconds kQuitTimeout{15000};   // QUIT to exit
constexpr size_t kMaxProblems = 20;           // lines of detail kept per topology

int64_t Ms(Clock::duration d) { return std::chrono::duration_cast<milliseconds>(d).count(); }

struct Room {
  uint64_t id = 0;
  size_t prefill = 0, decode = 0;  // process slots
  int prefill_generation = 0, decode_generation = 0;
  Clock::time_point issued{};
  Outcome p, d;
  bool probe = false;
  bool settled = false;  // both sides terminal
  bool hung = false;
};

// One prefill or decode process slot; a restart is a new generation in the same slot.
struct Proc {
  enum class State { kStarting, kReady, kStopped, kDown };
  bool prefill = true;
  int index = 0;
  int generation = -1;
  std::unique_ptr<ChildProcess> child;
  State state = State::kDown;
  Clock::time_point started_at{}, resume_at{}, restart_at{};
  // The slot's last fault event (kill, freeze, thaw, restart): the hang bound runs from here.
  Clock::time_point last_event{};
  std::vector<Clock::time_point> faults;  // when each kill, freeze or crash hit the slot
  std::set<uint64_t> rooms;               // in flight here (this generation)
  std::map<std::string, uint64_t> metrics;
  bool metrics_fresh = false;
  bool quitting = false;
  bool stacks_dumped = false;  // DumpStacks ran for this generation

  std::string name() const { return (prefill ? "prefill" : "decode") + std::to_string(index); }
  // What a router sees: a frozen process still takes requests, a dead one does not.
  bool serving() const { return state == State::kReady || state == State::kStopped; }
};

class Topology {
 public:
  Topology(const ChaosOptions& o, std::string name, int prefills, int decodes, uint64_t requests,
           uint64_t room_base)
      : o_(o),
        name_(std::move(name)),
        requests_(requests),
        room_base_(room_base),
        bound_(o.hang_bound_ms > 0 ? o.hang_bound_ms : DerivedHangBound(o.peer)),
        rng_(o.seed ^ room_base) {
    for (int i = 0; i < prefills + decodes; ++i) {
      Proc p;
      p.prefill = i < prefills;
      p.index = p.prefill ? i : i - prefills;
      procs_.push_back(std::move(p));
    }
    prefills_ = size_t(prefills);
    t_.hang_bound_ms = bound_;
  }

  Tally Run(std::string* error) {
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

 private:
  // --- setup and teardown -----------------------------------------------------------------

  bool Setup(std::string* error) {
    pdlib::control::BootstrapServerOptions bo;
    bo.host = "127.0.0.1";
    bo.port = 0;
    auto server = pdlib::control::BootstrapServer::Start(bo);
    if (!server.ok()) {
      *error = "bootstrap server: " + server.status().ToString();
      return false;
    }
    bootstrap_ = std::move(*server);
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

  std::string LogPath(const Proc& p) const {
    return o_.log_dir + "/" + name_ + "-" + p.name() + "." + std::to_string(p.generation) + ".log";
  }

  void Spawn(size_t slot) {
    Proc& p = procs_[slot];
    ++p.generation;
    p.stacks_dumped = false;
    PeerConfig c = o_.peer;
    c.mode = p.prefill ? pdlib::Mode::kPrefill : pdlib::Mode::kDecode;
    c.bootstrap_port = uint16_t(bootstrap_->port());
    c.dp_size = p.prefill ? int32_t(prefills_) : 1;
    c.dp_rank = p.prefill ? p.index : 0;
    p.child = std::make_unique<ChildProcess>(
        ChildOptions{.self_name = "pdlib-chaos",
                     .args = PeerArgs(c),
                     .stderr_mode = ChildOptions::Stderr::kAppendToFile,
                     .stderr_path = LogPath(p)});
    p.state = Proc::State::kStarting;
    p.started_at = Clock::now();
    p.metrics.clear();
    p.metrics_fresh = false;
    if (!p.child->started()) Note(p.name() + ": " + p.child->error());
  }

  // Asks every process to quit and waits for them; a process that does not exit 0 in time is
  // an unclean exit (a hang or a crash on shutdown).
  void Teardown() {
    for (Proc& p : procs_) {
      if (!p.child) continue;
      if (p.state == Proc::State::kStopped) p.child->Signal(SIGCONT);
      p.quitting = true;
      p.child->Send("QUIT");
    }
    const auto deadline = Clock::now() + kQuitTimeout;
    while (std::any_of(procs_.begin(), procs_.end(),
                       [](const Proc& p) { return p.child != nullptr; })) {
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
    bootstrap_.reset();
  }

  // --- the loop -------------------------------------------------------------------------------

  void Step() {
    const auto now = Clock::now();
    if (issuing_) {
      IssueRequests(now);
      if (issued_ < requests_ && now >= next_fault_) {
        InjectFault(now);
        next_fault_ = now + NextFaultDelay();
      }
    }
    RunTimers(now);
    PollOnce(milliseconds(5));
    ReapChildren();
    CheckHung(Clock::now());
    ShowProgress(false);
  }

  void PollOnce(milliseconds timeout) {
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

  void HandleLine(size_t slot, const std::string& line) {
    Proc& p = procs_[slot];
    const auto now = Clock::now();
    if (line.starts_with("READY")) {
      if (p.state != Proc::State::kStarting) return;
      p.state = Proc::State::kReady;
      if (p.generation > 0) {
        p.last_event = now;
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
      Problem(p.name() + " found a write into memory it had taken back: " + line.substr(6));
    } else if (line.starts_with("ERROR ")) {
      ++t_.harness_errors;
      Note(p.name() + ": " + line);
    }
  }

  void HandleRoomLine(Proc& p, const std::string& line, Clock::time_point now) {
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
      if (const auto c = ParseCounters(rest); c.contains("bytes")) side.bytes = c.at("bytes");
    } else if (kind == "BadBytes") {
      side.kind = Outcome::kBadBytes;
      Problem("room " + std::to_string(id) + " reached Success on " + p.name() +
              " with wrong bytes: " + rest);
    } else {
      side.kind = Outcome::kFailed;
      if (o_.verbose) Note(p.name() + ": room " + std::to_string(id) + " failed: " + rest);
    }
    MaybeSettle(r);
  }

  void MaybeSettle(Room& r) {
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

  void ReapChildren() {
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
          Problem(p.name() + " exited with status " + std::to_string(*status) +
                  " after QUIT; log " + LogPath(p) + ":\n" + TailOfFile(LogPath(p), 1500));
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
  void Lose(Proc& p, const std::string& how, Clock::time_point now) {
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
  }

  void RunTimers(Clock::time_point now) {
    for (size_t i = 0; i < procs_.size(); ++i) {
      Proc& p = procs_[i];
      if (p.state == Proc::State::kStopped && now >= p.resume_at) {
        p.child->Signal(SIGCONT);
        p.state = Proc::State::kReady;
        p.last_event = now;
        Note(p.name() + " thawed (SIGCONT)");
      } else if (p.state == Proc::State::kDown && !p.child && now >= p.restart_at) {
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

  // --- requests -------------------------------------------------------------------------------

  size_t InFlight(size_t slot) const { return procs_[slot].rooms.size(); }

  bool CanTake(size_t slot) const {
    return procs_[slot].serving() && InFlight(slot) < o_.peer.concurrency;
  }

  void IssueRequests(Clock::time_point now) {
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

  void Issue(size_t prefill, size_t decode, bool probe, Clock::time_point now) {
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

  bool AllSettledOrHung() const {
    for (const auto& [id, r] : rooms_) {
      if (!r.settled && !r.hung) return false;
    }
    return true;
  }

  void CheckHung(Clock::time_point now) {
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

  // --- faults ---------------------------------------------------------------------------------

  Clock::duration NextFaultDelay() {
    std::uniform_real_distribution<double> f(0.5, 1.5);
    return milliseconds(int64_t(double(o_.fault_interval_ms) * f(rng_)));
  }

  void InjectFault(Clock::time_point now) {
    std::vector<size_t> targets;
    for (size_t i = 0; i < procs_.size(); ++i) {
      if (procs_[i].state == Proc::State::kReady) targets.push_back(i);
    }
    if (targets.empty() || (!o_.kill_faults && !o_.stop_faults)) return;
    const size_t slot = targets[rng_() % targets.size()];
    Proc& p = procs_[slot];
    const bool kill = o_.kill_faults && (!o_.stop_faults || rng_() % 2 == 0);
    const std::string kind =
        std::string(kill ? "kill_" : "stop_") + (p.prefill ? "prefill" : "decode");
    ++t_.faults;
    ++t_.faults_by_kind[kind];
    if (kill) {
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
      std::uniform_int_distribution<int> delay(50, 500);
      p.restart_at = now + milliseconds(delay(rng_));
      Note("fault: SIGKILL " + p.name() + " with " + std::to_string(held) + " rooms in flight");
    } else {
      p.child->Signal(SIGSTOP);
      p.state = Proc::State::kStopped;
      p.last_event = now;
      p.faults.push_back(now);
      std::uniform_real_distribution<double> f(0.5, 1.5);
      p.resume_at = now + milliseconds(int64_t(double(o_.stop_ms) * f(rng_)));
      Note("fault: SIGSTOP " + p.name() + " for " + std::to_string(Ms(p.resume_at - now)) +
           " ms with " + std::to_string(p.rooms.size()) + " rooms in flight");
    }
  }

  // --- the end --------------------------------------------------------------------------------

  // Every process thawed or restarted and READY, every room over (or hung).
  void Quiesce() {
    const auto now = Clock::now();
    for (Proc& p : procs_) {
      if (p.state == Proc::State::kStopped) p.resume_at = now;
      if (p.state == Proc::State::kDown) p.restart_at = std::min(p.restart_at, now);
    }
    const auto deadline = now + kStartTimeout + milliseconds(bound_);
    while (Clock::now() < deadline) {
      const bool ready = std::all_of(procs_.begin(), procs_.end(),
                                     [](const Proc& p) { return p.state == Proc::State::kReady; });
      if (ready && AllSettledOrHung()) break;
      Step();
    }
  }

  // One request per (prefill, decode) pair, with no faults: the processes that were restarted
  // must serve, and no connection may be stale.
  void RunProbes() {
    std::vector<uint64_t> ids;
    for (size_t p = 0; p < prefills_; ++p) {
      for (size_t d = prefills_; d < procs_.size(); ++d) {
        if (!procs_[p].serving() || !procs_[d].serving()) {
          ++t_.probes;
          ++t_.probes_failed;
          Problem("probe " + procs_[p].name() + " -> " + procs_[d].name() +
                  " not run: a process is down");
          continue;
        }
        ids.push_back(room_base_ + seq_ * prefills_ + p);
        Issue(p, d, true, Clock::now());
      }
    }
    const auto deadline = Clock::now() + milliseconds(bound_) + milliseconds(1000);
    while (Clock::now() < deadline && !AllSettledOrHung()) Step();
    for (uint64_t id : ids) {
      const Room& r = rooms_.at(id);
      ++t_.probes;
      if (r.p.kind == Outcome::kSuccess && r.d.kind == Outcome::kSuccess) continue;
      ++t_.probes_failed;
      Problem("probe room " + std::to_string(id) + " " + procs_[r.prefill].name() + " -> " +
              procs_[r.decode].name() + " did not succeed: prefill " + r.p.detail + "; decode " +
              r.d.detail);
      for (size_t slot : {r.prefill, r.decode}) DumpStacks(procs_[slot]);
    }
  }

  // A failed probe between live processes means one of them is stuck: every thread's stack,
  // taken with gdb (when installed) into the log directory, says where.
  void DumpStacks(Proc& p) {
    if (!p.child || p.stacks_dumped || ::access("/usr/bin/gdb", X_OK) != 0) return;
    const std::string out = LogPath(p) + ".stacks.txt";
    const std::string cmd = "timeout 60 /usr/bin/gdb -p " + std::to_string(p.child->pid()) +
                            " -batch -ex 'thread apply all bt' > '" + out + "' 2>&1";
    if (std::system(cmd.c_str()) == 0) {
      Problem(p.name() + ": every thread's stack is in " + out);
    }
    p.stacks_dumped = true;
  }

  // What each process still holds once nothing is in flight. Asked until clean or until the
  // longest pdlib timeout that could still be running down has passed.
  void CollectLeaks() {
    const size_t decodes = procs_.size() - prefills_;
    // After the probes each process talks to every process of the other side once.
    auto leaks_of = [&](const Proc& p) {
      return Leftovers(p.metrics, p.prefill ? decodes : prefills_);
    };
    // Quarantined pages come back once their prefill drained: after its wait for writes in
    // flight (liveness), the transport's close of the old connection (UCX: up to 2 s of flush),
    // decode's reconnect (connect timeout) and the next probe.
    const auto deadline =
        Clock::now() +
        milliseconds(o_.peer.bootstrap_ms + 2 * o_.peer.liveness_ms + o_.peer.connect_ms + 6000);
    std::map<size_t, std::map<std::string, uint64_t>> leaks;
    while (true) {
      for (Proc& p : procs_) {
        p.metrics_fresh = false;
        if (p.child) p.child->Send("METRICS");
      }
      const auto asked = Clock::now();
      while (Clock::now() - asked < kQuitTimeout &&
             std::any_of(procs_.begin(), procs_.end(),
                         [](const Proc& p) { return p.child && !p.metrics_fresh; })) {
        PollOnce(milliseconds(10));
      }
      leaks.clear();
      uint64_t total = 0;
      for (size_t i = 0; i < procs_.size(); ++i) {
        if (!procs_[i].metrics_fresh) continue;
        leaks[i] = leaks_of(procs_[i]);
        for (const auto& [k, v] : leaks[i]) total += v;
      }
      if (total == 0 || Clock::now() > deadline) break;
      PollOnce(milliseconds(300));
    }
    for (size_t i = 0; i < procs_.size(); ++i) {
      if (!procs_[i].metrics_fresh) {
        Problem(procs_[i].name() + " did not answer METRICS");
        ++t_.leaked;
        ++t_.leaked_by_kind["unanswered"];
        continue;
      }
      std::string what;
      for (const auto& [k, v] : leaks[i]) {
        if (v == 0) continue;
        t_.leaked += v;
        t_.leaked_by_kind[k] += v;
        what += " " + k + "=" + std::to_string(v);
      }
      if (!what.empty()) Problem(procs_[i].name() + " still holds" + what);
    }
  }

  void Finalize() {
    for (const auto& [id, r] : rooms_) {
      if (r.probe) continue;
      ++t_.requests;
      const std::string reason = FailureCategory(r.p, r.d, r.settled);
      if (reason == "BAD_BYTES") ++t_.bad_bytes;
      if (!reason.empty()) {
        ++t_.failed;
        ++t_.failure_reasons[reason];
        continue;
      }
      // Decode has the request's bytes; prefill succeeded too or was killed after writing them.
      ++t_.succeeded;
      if (r.d.bytes > 0) {
        ++t_.verified_requests;
        t_.verified_bytes += r.d.bytes;
      }
      if (r.prefill_generation > 0 || r.decode_generation > 0) ++t_.succeeded_after_restart;
    }
  }

  // --- output ---------------------------------------------------------------------------------

  void Note(const std::string& line) {
    if (!o_.verbose) return;
    if (progress_shown_) std::fprintf(stderr, "\n");
    progress_shown_ = false;
    std::fprintf(stderr, "pdlib-chaos %s: %s\n", name_.c_str(), line.c_str());
  }

  void Problem(const std::string& line) {
    if (t_.problems.size() < kMaxProblems) t_.problems.push_back(name_ + ": " + line);
    if (progress_shown_) std::fprintf(stderr, "\n");
    progress_shown_ = false;
    std::fprintf(stderr, "pdlib-chaos %s: PROBLEM: %s\n", name_.c_str(), line.c_str());
  }

  // A progress line on stderr: rewritten in place on a terminal, every 2 s otherwise.
  void ShowProgress(bool force) {
    static const bool tty = ::isatty(STDERR_FILENO) != 0;
    const auto now = Clock::now();
    if (!force && now - last_progress_ < (tty ? milliseconds(250) : milliseconds(2000))) return;
    last_progress_ = now;
    std::fprintf(stderr, "%spdlib-chaos %s: %llu/%llu started, %zu over, %llu faults, %llu hung%s",
                 tty ? "\r" : "", name_.c_str(), static_cast<unsigned long long>(issued_),
                 static_cast<unsigned long long>(requests_), settled_,
                 static_cast<unsigned long long>(t_.faults),
                 static_cast<unsigned long long>(t_.hung), tty ? "   " : "\n");
    progress_shown_ = tty;
  }

  const ChaosOptions& o_;
  const std::string name_;
  const uint64_t requests_;
  const uint64_t room_base_;
  const int64_t bound_;
  std::mt19937_64 rng_;
  std::unique_ptr<pdlib::control::BootstrapServer> bootstrap_;
  std::vector<Proc> procs_;  // prefills first, then decodes
  size_t prefills_ = 0;
  std::map<uint64_t, Room> rooms_;
  uint64_t issued_ = 0;
  uint64_t seq_ = 0;
  size_t settled_ = 0;
  bool issuing_ = false;
  Clock::time_point phase_start_{}, next_fault_{}, last_progress_{};
  bool progress_shown_ = false;
  Tally t_;
};

}  // namespace

int64_t DerivedHangBound(const PeerConfig& peer) {
  return peer.bootstrap_ms + peer.waiting_ms + peer.transfer_ms + peer.liveness_ms + 2000;
}

Tally RunTopology(const ChaosOptions& options, const std::string& name, int prefills, int decodes,
                  uint64_t requests, uint64_t room_base, std::string* error) {
  Topology topology(options, name, prefills, decodes, requests, room_base);
  return topology.Run(error);
}

}  // namespace pdlib_chaos
