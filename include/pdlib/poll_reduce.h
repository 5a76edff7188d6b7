// PollAndAllReduce (SPEC R2.4): poll many handles and agree on the result across a group of
// ranks, so every TP rank of a prefill or decode instance sees the same state per request.
//
// The engine supplies the group (NCCL, Gloo, MPI, ...) by implementing ProcessGroup;
// InProcessGroup implements it for ranks that are threads of one process (tests, examples).
#ifndef PDLIB_POLL_REDUCE_H_
#define PDLIB_POLL_REDUCE_H_

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "pdlib/export.h"
#include "pdlib/kv_manager.h"
#include "pdlib/status.h"
#include "pdlib/types.h"

namespace pdlib {
inline namespace v1 {

// A collective over the ranks that must agree. Every member calls AllReduceMin with a vector of
// the same length; on return each holds the element-wise minimum. Thread contract: one call at
// a time per member object.
class PDLIB_EXPORT ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Status AllReduceMin(std::span<int32_t> values) = 0;
};

// Polls each handle, MIN-reduces the states across `group` (Failed = 0 wins) and returns them in
// handle order. A null group means a group of one. Every rank must pass the same number of
// handles, for the same requests in the same order.
PDLIB_EXPORT StatusOr<std::vector<KVPoll>> PollAndAllReduce(
    std::span<const KVPollable* const> handles, ProcessGroup* group);

// A ProcessGroup whose members are threads of one process. Create(n) returns the n members;
// hand one to each thread. Members must outlive every call on them.
class PDLIB_EXPORT InProcessGroup {
 public:
  static std::vector<std::unique_ptr<ProcessGroup>> Create(int size);
};

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_POLL_REDUCE_H_
