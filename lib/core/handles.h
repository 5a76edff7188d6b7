// KVSender and KVReceiver over the protocol cores, shared by every control plane. A handle
// holds the core (keeping it alive) and its RoomState, so Poll() is one atomic load.
#ifndef PDLIB_LIB_CORE_HANDLES_H_
#define PDLIB_LIB_CORE_HANDLES_H_

#include <memory>

#include "lib/core/decode_core.h"
#include "lib/core/prefill_core.h"
#include "pdlib/kv_manager.h"

namespace pdlib {
inline namespace v1 {

// Handles: a shared_ptr to the core keeps it alive; the RoomState gives a lock-free Poll().
template <typename Base, typename Core>
class HandleBase : public Base {
 public:
  HandleBase(std::shared_ptr<Core> core, std::shared_ptr<RoomState> state)
      : core_(std::move(core)), state_(std::move(state)) {}
  ~HandleBase() override { core_->ReleaseRoom(state_->room(), state_.get()); }
  KVPoll Poll() const override { return state_->Poll(); }
  Status FailureReason() const override { return state_->FailureReason(); }
  uint64_t room() const override { return state_->room(); }
  void Abort(std::string_view reason) override { core_->AbortRoom(state_->room(), reason); }

 protected:
  std::shared_ptr<Core> core_;
  std::shared_ptr<RoomState> state_;
};

class CoreSender final : public HandleBase<KVSender, PrefillCore> {
 public:
  using HandleBase::HandleBase;
  Status Init(uint64_t num_kv_pages, std::optional<uint32_t> aux_index) override {
    return core_->InitRoom(state_->room(), num_kv_pages, aux_index);
  }
  Status Send(std::span<const int32_t> pages, bool is_last_chunk,
              std::span<const int32_t> state_indices) override {
    return core_->Send(state_->room(), pages, is_last_chunk, state_indices);
  }
};

class CoreReceiver final : public HandleBase<KVReceiver, DecodeCore> {
 public:
  using HandleBase::HandleBase;
  Status Init(std::span<const int32_t> pages, std::optional<uint32_t> aux_index,
              std::span<const int32_t> state_indices) override {
    return core_->InitRoom(state_->room(), pages, aux_index, state_indices);
  }
};

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CORE_HANDLES_H_
