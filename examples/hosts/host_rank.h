// HostRank: one rank of a Host (host.h): its share of the model (kernels/parallel.h), pdlib
// KVManager (registering that share, sharding.h), metadata buffers, page allocator and
// scheduler.
//
// Owned by the Host. Create on any thread; afterwards exactly one thread at a time (the rank's
// thread, handed over through the Host's step barrier) calls Step and FailAll. The destructor
// drops the scheduler (and so every pdlib handle) before the manager, as pdlib requires.
#ifndef PDLIB_EXAMPLES_HOSTS_HOST_RANK_H_
#define PDLIB_EXAMPLES_HOSTS_HOST_RANK_H_

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "examples/hosts/host.h"
#include "examples/hosts/sharding.h"
#include "examples/scheduler/engine.h"
#include "pdlib/poll_reduce.h"
#include "pdlib_kernels/parallel.h"
#include "pdlib_kernels/weights.h"

namespace pdlib::hosts {

// What one rank reports after a step.
struct RankStepOutput {
  std::vector<Status> added;  // AddRequest's answer per request of the batch, in order
  Status step;                // Step()'s: a host-level fault when not OK
  std::vector<sched::FinishedRequest> finished;
  struct Token {
    uint64_t room = 0;
    int32_t index = 0;
    int32_t token = 0;
  };
  std::vector<Token> tokens;  // decode: tokens produced this step, in order
  bool idle = true;           // the scheduler holds no request
  bool forwarded = false;     // this step ran a forward pass
  int32_t running = 0;        // requests holding KV pages
  int32_t queued = 0;         // requests accepted, not yet holding pages

  void Clear();
};

struct RankPlacement {
  int32_t tp_rank = 0;
  int32_t pp_rank = 0;
  ProcessGroup* group = nullptr;  // all the host's ranks; null for one rank
  // The rank's member of the host's model group (kernels::CreateInProcessModelComms); required
  // with more than one rank. The rank aborts it when its model fails, so no other rank waits
  // forever in a collective.
  kernels::ModelComm* comm = nullptr;
  BootstrapAddress bootstrap;    // prefill: the bootstrap server to register with
  bool start_bootstrap = false;  // prefill: run the bootstrap server in this rank's manager
};

class HostRank {
 public:
  static StatusOr<std::unique_ptr<HostRank>> Create(const HostOptions& options,
                                                    const kernels::ModelWeights& weights,
                                                    const RankPlacement& placement);
  ~HostRank();
  HostRank(const HostRank&) = delete;
  HostRank& operator=(const HostRank&) = delete;

  // Adds `batch` in order, runs one scheduler step and reports.
  void Step(std::span<const sched::Request> batch, RankStepOutput* out);
  // Fails every live request with `why` and reports them.
  void FailAll(const Status& why, RankStepOutput* out);

  // Bytes of one request's recurrent state over the whole model (0 without state).
  uint64_t state_bytes() const;

 private:
  struct Rep;
  explicit HostRank(std::unique_ptr<Rep> rep);
  void Report(RankStepOutput* out);
  std::unique_ptr<Rep> rep_;
};

// The model a HostOptions::model names; kInvalidArgument listing the known names otherwise.
StatusOr<kernels::ModelConfig> ModelConfigByName(const std::string& name);

}  // namespace pdlib::hosts

#endif  // PDLIB_EXAMPLES_HOSTS_HOST_RANK_H_
