// Batch and completion bookkeeping, the same for every backend: one PostWrites call is one
// batch; it completes when all its parts have (a part is whatever the wire completes on its own:
// a UCX request, the last work request of a QP, an acknowledgement), and the first error wins
// and fails it with its reason. Its callback runs exactly once, on the progress thread, at the
// loop's safe point (Completions::Run), never from inside a wire call.
//
// A backend's batch derives from BatchBase<itself> and adds what its wire needs (resolved ops,
// work-request plans). Progress thread only, no locks.
#ifndef PDLIB_BACKENDS_COMMON_BATCHES_H_
#define PDLIB_BACKENDS_COMMON_BATCHES_H_

#include <cstdint>
#include <future>
#include <list>
#include <memory>
#include <utility>
#include <vector>

#include "pdlib/spi/transport.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace toolkit {

template <typename Batch>
class BatchList;

template <typename Derived>
struct BatchBase {
  uint64_t seq = 0;  // acceptance order on the progress thread (BatchSequencer)
  spi::PeerId peer_id = 0;
  spi::WriteCallback done;
  // Parts not yet complete, plus one held by whoever is still adding parts (the acceptance or
  // posting reference). Progress thread only.
  uint32_t pending = 1;
  Status status;  // the first error; OK while none

  // Records `error` unless an earlier one was recorded: the first error wins.
  void Fail(const Status& error) {
    if (status.ok()) status = error;
  }
  void AddPart() { ++pending; }
  // One part (or the holding reference) done; true when it was the last.
  bool PartDone() { return --pending == 0; }

 private:
  friend class BatchList<Derived>;
  typename std::list<std::unique_ptr<Derived>>::iterator self_;
};

// A peer's outstanding batches, oldest first; owns them from acceptance until they complete.
template <typename Batch>
class BatchList {
 public:
  Batch& Add(std::unique_ptr<Batch> batch) {
    list_.push_back(std::move(batch));
    Batch& added = *list_.back();
    added.self_ = std::prev(list_.end());
    return added;
  }
  // Takes `batch` (which must be in this list) out, e.g. to hand it to Completions.
  std::unique_ptr<Batch> Remove(Batch& batch) {
    auto it = batch.self_;
    std::unique_ptr<Batch> owned = std::move(*it);
    list_.erase(it);
    return owned;
  }
  // Takes every batch out, oldest first.
  std::list<std::unique_ptr<Batch>> TakeAll() { return std::exchange(list_, {}); }

  bool empty() const { return list_.empty(); }
  size_t size() const { return list_.size(); }
  auto begin() { return list_.begin(); }
  auto end() { return list_.end(); }

 private:
  std::list<std::unique_ptr<Batch>> list_;
};

// Callbacks waiting for the loop's safe point, and the waiters to signal after them (Disconnect
// returns once the peer's callbacks have run).
template <typename Batch>
class Completions {
 public:
  void Add(std::unique_ptr<Batch> batch) { batches_.push_back(std::move(batch)); }
  // A callback whose batch is gone already (a backend that had to abandon it).
  void AddCall(spi::WriteCallback callback, Status status) {
    calls_.emplace_back(std::move(callback), std::move(status));
  }
  void AddSignal(std::promise<void> signal) { signals_.push_back(std::move(signal)); }
  bool empty() const { return batches_.empty() && calls_.empty() && signals_.empty(); }

  // Runs every callback, then every signal, until callbacks queue nothing more. Each batch is
  // destroyed before its callback runs, so what it holds (memory registrations) is released
  // before the callback may deregister or reuse memory.
  void Run() {
    while (!empty()) {
      std::vector<std::unique_ptr<Batch>> done = std::exchange(batches_, {});
      std::vector<std::pair<spi::WriteCallback, Status>> calls = std::exchange(calls_, {});
      for (auto& batch : done) {
        spi::WriteCallback callback = std::move(batch->done);
        Status status = std::move(batch->status);
        batch.reset();
        if (callback) callback(std::move(status));
      }
      for (auto& [callback, status] : calls) {
        if (callback) callback(std::move(status));
      }
      std::vector<std::promise<void>> signals = std::exchange(signals_, {});
      for (auto& signal : signals) signal.set_value();
    }
  }
  void Clear() {
    batches_.clear();
    calls_.clear();
  }

 private:
  std::vector<std::unique_ptr<Batch>> batches_;
  std::vector<std::pair<spi::WriteCallback, Status>> calls_;
  std::vector<std::promise<void>> signals_;
};

}  // namespace toolkit
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_COMMON_BATCHES_H_
