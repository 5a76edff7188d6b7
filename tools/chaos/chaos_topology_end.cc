// The end of one topology's run (chaos_topology.h): every fault ended and the processes
// quiesced, one probe per (prefill, decode) pair, what each process still holds, and the
// accounting of every request.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "tools/chaos/chaos_accounting.h"
#include "tools/chaos/chaos_topology.h"

namespace pdlib_chaos {
namespace internal {

using std::chrono::milliseconds;

// Every fault ended, every process thawed or restarted and READY, every room over (or hung),
// and the after-effects of the last fault given their time (settle), so that the probes run on
// a healed system.
void Topology::Quiesce() {
  const auto now = Clock::now();
  for (Proc& p : procs_) {
    if (p.state == Proc::State::kStopped) p.resume_at = now;
    if (p.state == Proc::State::kDown) p.restart_at = std::min(p.restart_at, now);
  }
  const auto deadline = now + kStartTimeout + milliseconds(bound_);
  bool healed = false;
  while (Clock::now() < deadline) {
    if (!healed) healed = EndAllFaults(Clock::now());
    const bool ready = std::all_of(procs_.begin(), procs_.end(),
                                   [](const Proc& p) { return p.state == Proc::State::kReady; });
    if (healed && ready && AllSettledOrHung() && Clock::now() >= LastFaultEnd() + settle_) break;
    Step();
  }
  if (!healed) Problem("the discovery did not come back before the probes");
}

// One request per (prefill, decode) pair, with no faults: the processes that were restarted
// must serve, and no connection may be stale.
void Topology::RunProbes() {
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
    if (r.p.kind == Outcome::kSuccess && r.d.kind == Outcome::kSuccess) {
      // A restart late in the run may leave only the probes to show the new process serves.
      if (r.prefill_generation > 0 || r.decode_generation > 0) ++t_.succeeded_after_restart;
      continue;
    }
    if (r.d.kind == Outcome::kFailed &&
        r.d.detail.find("KV checksum mismatch") != std::string::npos) {
      // --corrupt_in_flight_one_in struck the probe and the checksum caught it: the pair moved
      // its bytes and checked them.
      ++t_.corruptions_caught;
      continue;
    }
    ++t_.probes_failed;
    Problem("probe room " + std::to_string(id) + " " + procs_[r.prefill].name() + " -> " +
            procs_[r.decode].name() + " did not succeed: prefill " + r.p.detail + "; decode " +
            r.d.detail);
    for (size_t slot : {r.prefill, r.decode}) DumpStacks(procs_[slot]);
  }
}

// A failed probe between live processes means one of them is stuck: every thread's stack,
// taken with gdb (when installed) into the log directory, says where.
void Topology::DumpStacks(Proc& p) {
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
void Topology::CollectLeaks() {
  const size_t decodes = procs_.size() - prefills_;
  // After the probes each process talks to every process of the other side once.
  auto leaks_of = [&](const Proc& p) {
    return Leftovers(p.metrics, p.prefill ? decodes : prefills_);
  };
  // Quarantined pages come back once their prefill drained: after its wait for writes in
  // flight (liveness), the transport's close of the old connection (UCX: up to 2 s of flush),
  // decode's reconnect (connect timeout) and the next probe.
  const auto deadline = Clock::now() + milliseconds(o_.peer.bootstrap_ms + 2 * o_.peer.liveness_ms +
                                                    o_.peer.connect_ms + 6000);
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

void Topology::Finalize() {
  for (const Proc& p : procs_) {
    t_.corruptions_injected += p.corruptions_before;
    if (auto it = p.metrics.find("corruptions_injected"); it != p.metrics.end()) {
      t_.corruptions_injected += it->second;
    }
  }
  for (const auto& [id, r] : rooms_) {
    if (r.probe) continue;
    ++t_.requests;
    const std::string reason = FailureCategory(r.p, r.d, r.settled);
    // A request no fault touched (nor the after-effects of one) must succeed.
    const bool touched = !r.settled || Touched(r, std::max(r.p.at, r.d.at));
    if (!touched) {
      ++t_.untouched_requests;
      if (AfterHeal(r)) ++t_.requests_after_heal;
    }
    if (reason == "BAD_BYTES") ++t_.bad_bytes;
    // A room pdlib's failure injection corrupted in flight, caught by the KV checksum.
    const bool caught = r.d.kind == Outcome::kFailed &&
                        r.d.detail.find("KV checksum mismatch") != std::string::npos;
    if (caught) ++t_.corruptions_caught;
    if (!reason.empty()) {
      ++t_.failed;
      ++t_.failure_reasons[reason];
      if (!touched && reason != "BAD_BYTES" && !caught) {
        ++t_.failed_untouched;
        Problem("room " + std::to_string(id) + " " + procs_[r.prefill].name() + " -> " +
                procs_[r.decode].name() + " failed though no fault touched it (" +
                LastFaultBefore(r) + "): prefill " + r.p.detail + "; decode " + r.d.detail);
      }
      continue;
    }
    // Decode has the request's bytes; prefill succeeded too or was killed after writing them.
    ++t_.succeeded;
    if (r.d.bytes > 0) {
      ++t_.verified_requests;
      t_.verified_bytes += r.d.bytes;
      if (r.d.prefix_pages > 0) ++t_.verified_prefix_requests;
    }
    if (r.prefill_generation > 0 || r.decode_generation > 0) ++t_.succeeded_after_restart;
  }
}

}  // namespace internal
}  // namespace pdlib_chaos
