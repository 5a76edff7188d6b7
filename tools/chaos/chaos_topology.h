// Internal to pdlib-chaos's driver (chaos_driver.h): one topology's run, its processes and rooms.
// The set-up, the loop and the requests are in chaos_driver.cc; the faults, their ends and what
// they touched in chaos_topology_faults.cc; the end of a run (quiesce, probes, leaks, the
// accounting) in chaos_topology_end.cc.
//
// Threads: one (the caller of RunTopology); gRPC's own threads serve the bootstrap server.
#ifndef PDLIB_TOOLS_CHAOS_CHAOS_TOPOLOGY_H_
#define PDLIB_TOOLS_CHAOS_CHAOS_TOPOLOGY_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "tools/chaos/chaos_accounting.h"
#include "tools/chaos/chaos_driver.h"
#include "tools/chaos/chaos_faults.h"
#include "tools/chaos/chaos_infra.h"
#include "tools/common/child_process.h"

namespace pdlib_chaos {
namespace internal {

using Clock = std::chrono::steady_clock;

// A child's READY (sanitizer builds start slowly), and QUIT to exit.
inline constexpr std::chrono::milliseconds kStartTimeout{30000};
inline constexpr std::chrono::milliseconds kQuitTimeout{15000};

inline int64_t Ms(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
}

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

// A link fault in effect on a slot's host.
struct LinkFault {
  FaultKind kind = FaultKind::kPartition;
  FaultParams params;
  Clock::time_point until{};
  size_t window = 0;  // its entry in Proc::windows
};

// One prefill or decode process slot, on a host of its own with --netns; a restart is a new
// generation in the same slot (and host).
struct Proc {
  enum class State { kStarting, kReady, kStopped, kDown };
  bool prefill = true;
  int index = 0;
  int generation = -1;
  std::unique_ptr<pdlib_tools::ChildProcess> child;
  State state = State::kDown;
  Clock::time_point started_at{}, resume_at{}, restart_at{};
  // The slot's last fault event (kill, freeze, thaw, restart, a link fault or its end, a
  // discovery fault or its end): the hang bound runs from here.
  Clock::time_point last_event{};
  std::vector<Clock::time_point> faults;  // when each kill, freeze, crash or link fault hit
  // When each fault of this slot was in effect (process and link faults): a request they did
  // not touch must succeed.
  std::vector<FaultWindow> windows;
  // The window of the fault that took the process down or froze it, ended at READY or SIGCONT.
  std::optional<size_t> open_window;
  std::optional<LinkFault> link;         // at most one at a time
  std::vector<Clock::time_point> heals;  // when each link fault on its host ended
  std::set<uint64_t> rooms;              // in flight here (this generation)
  std::map<std::string, uint64_t> metrics;
  uint64_t corruptions_before = 0;  // corruptions_injected of the earlier generations
  bool metrics_fresh = false;
  bool quitting = false;
  bool stacks_dumped = false;  // DumpStacks ran for this generation

  // Also the name of its host.
  std::string name() const { return (prefill ? "prefill" : "decode") + std::to_string(index); }
  // What a router sees: a frozen process still takes requests, a dead one does not.
  bool serving() const { return state == State::kReady || state == State::kStopped; }
};

class Topology {
 public:
  Topology(const ChaosOptions& o, std::string name, int prefills, int decodes, uint64_t requests,
           uint64_t room_base);
  Tally Run(std::string* error);

 private:
  // --- chaos_driver.cc: set-up, the loop, requests, output ---
  bool Setup(std::string* error);
  std::string LogPath(const Proc& p) const;
  void Spawn(size_t slot);
  void Teardown();
  void Step();
  void PollOnce(std::chrono::milliseconds timeout);
  void HandleLine(size_t slot, const std::string& line);
  void HandleRoomLine(Proc& p, const std::string& line, Clock::time_point now);
  void MaybeSettle(Room& r);
  void ReapChildren();
  void Lose(Proc& p, const std::string& how, Clock::time_point now);
  void RunTimers(Clock::time_point now);
  size_t InFlight(size_t slot) const { return procs_[slot].rooms.size(); }
  bool CanTake(size_t slot) const;
  void IssueRequests(Clock::time_point now);
  void Issue(size_t prefill, size_t decode, bool probe, Clock::time_point now);
  bool AllSettledOrHung() const;
  void CheckHung(Clock::time_point now);
  // --- chaos_topology_end.cc ---
  void Quiesce();
  void RunProbes();
  void DumpStacks(Proc& p);
  void CollectLeaks();
  void Finalize();
  // --- chaos_driver.cc ---
  void Note(const std::string& line);
  void Problem(const std::string& line);
  void ShowProgress(bool force);

  // --- chaos_topology_faults.cc ---
  Clock::duration NextFaultDelay();
  // The kinds that can be injected now (a target is free), from the options' list.
  std::vector<FaultKind> InjectableNow() const;
  void InjectFault(Clock::time_point now);
  void InjectProcessFault(FaultKind kind, Clock::time_point now);
  void InjectLinkFault(FaultKind kind, Clock::time_point now);
  void InjectDiscoveryFault(FaultKind kind, Clock::time_point now);
  // Ends the faults whose time has come (link faults, discovery faults).
  void RunFaultTimers(Clock::time_point now);
  void EndLinkFault(Proc& p, Clock::time_point now);
  // Ends every fault now (for the end of the run); true once the discovery is back.
  bool EndAllFaults(Clock::time_point now);
  // A fault event on every slot (discovery faults hit them all).
  void EventOnAll(Clock::time_point now);
  // Opens / closes the window of a process fault of slot `p`.
  void OpenProcessWindow(Proc& p, Clock::time_point now, const std::string& what);
  void CloseProcessWindow(Proc& p, Clock::time_point now);
  // The last moment any fault was in effect (for the probes: after it plus settle).
  Clock::time_point LastFaultEnd() const;
  // Whether any fault window of the room's slots or of the discovery overlaps its life.
  bool Touched(const Room& r, Clock::time_point finish) const;
  // Whether a link or discovery fault on the room's hosts ended before it started.
  bool AfterHeal(const Room& r) const;
  // "1234 ms after the partition of decode0 ended": the last fault on the room's processes,
  // hosts or discovery that ended before it started, or "no fault before it".
  std::string LastFaultBefore(const Room& r) const;

  const ChaosOptions& o_;
  const std::string name_;
  const uint64_t requests_;
  const uint64_t room_base_;
  const int64_t bound_;
  const Clock::duration settle_;
  std::mt19937_64 rng_;
  std::unique_ptr<ChaosInfra> infra_;
  std::vector<Proc> procs_;  // prefills first, then decodes
  size_t prefills_ = 0;
  std::map<uint64_t, Room> rooms_;
  uint64_t issued_ = 0;
  uint64_t seq_ = 0;
  size_t settled_ = 0;
  bool issuing_ = false;
  Clock::time_point phase_start_{}, next_fault_{}, last_progress_{};
  bool progress_shown_ = false;
  // Discovery faults: their windows (every slot's), and the one in effect.
  std::vector<FaultWindow> discovery_windows_;
  bool discovery_down_ = false;
  FaultKind discovery_kind_ = FaultKind::kBootstrapRestart;
  int etcd_member_ = -1;                   // the member down, or coming back
  bool etcd_relaunched_ = false;           // started again; waiting for it to serve
  Clock::time_point discovery_back_at_{};  // when to bring it back
  Clock::time_point next_discovery_check_{};
  Tally t_;
};

}  // namespace internal
}  // namespace pdlib_chaos

#endif  // PDLIB_TOOLS_CHAOS_CHAOS_TOPOLOGY_H_
