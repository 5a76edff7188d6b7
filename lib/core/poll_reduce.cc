#include "pdlib/poll_reduce.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <string>

namespace pdlib {
inline namespace v1 {
namespace {

// State shared by the members of one InProcessGroup: a reusable barrier that accumulates the
// element-wise minimum. Generation counting lets the group be reused call after call.
struct SharedReduce {
  explicit SharedReduce(int size) : size(size) {}
  const int size;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  std::vector<int32_t> accum;
  std::vector<int32_t> result;
  bool length_mismatch = false;
  bool result_mismatch = false;
};

class InProcessMember final : public ProcessGroup {
 public:
  InProcessMember(std::shared_ptr<SharedReduce> shared, int rank)
      : shared_(std::move(shared)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return shared_->size; }

  Status AllReduceMin(std::span<int32_t> values) override {
    SharedReduce& s = *shared_;
    std::unique_lock lock(s.mu);
    uint64_t gen = s.generation;
    if (s.arrived == 0) {
      s.accum.assign(values.begin(), values.end());
      s.length_mismatch = false;
    } else if (s.accum.size() != values.size()) {
      s.length_mismatch = true;
    } else {
      for (size_t i = 0; i < values.size(); ++i) s.accum[i] = std::min(s.accum[i], values[i]);
    }
    if (++s.arrived == s.size) {
      s.result.swap(s.accum);
      s.result_mismatch = s.length_mismatch;
      s.arrived = 0;
      ++s.generation;
      s.cv.notify_all();
    } else {
      s.cv.wait(lock, [&] { return s.generation != gen; });
    }
    if (s.result_mismatch || s.result.size() != values.size()) {
      return Status::InvalidArgument("AllReduceMin: ranks passed vectors of different lengths");
    }
    std::copy(s.result.begin(), s.result.end(), values.begin());
    return Status::OK();
  }

 private:
  std::shared_ptr<SharedReduce> shared_;
  int rank_;
};

}  // namespace

StatusOr<std::vector<KVPoll>> PollAndAllReduce(std::span<const KVPollable* const> handles,
                                               ProcessGroup* group) {
  std::vector<int32_t> values(handles.size());
  for (size_t i = 0; i < handles.size(); ++i) {
    if (handles[i] == nullptr) {
      return Status::InvalidArgument("PollAndAllReduce: handle " + std::to_string(i) + " is null");
    }
    values[i] = static_cast<int32_t>(handles[i]->Poll());
  }
  if (group != nullptr && group->size() > 1) {
    Status s = group->AllReduceMin(values);
    if (!s.ok()) return s;
  }
  std::vector<KVPoll> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    int32_t v = values[i];
    if (v < static_cast<int32_t>(KVPoll::kFailed) || v > static_cast<int32_t>(KVPoll::kSuccess)) {
      return Status::DataLoss("PollAndAllReduce: group returned invalid state " +
                              std::to_string(v));
    }
    out[i] = static_cast<KVPoll>(v);
  }
  return out;
}

std::vector<std::unique_ptr<ProcessGroup>> InProcessGroup::Create(int size) {
  std::vector<std::unique_ptr<ProcessGroup>> members;
  if (size <= 0) return members;
  auto shared = std::make_shared<SharedReduce>(size);
  for (int r = 0; r < size; ++r) members.push_back(std::make_unique<InProcessMember>(shared, r));
  return members;
}

}  // namespace v1
}  // namespace pdlib
