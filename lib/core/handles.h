// KVSender and KVReceiver over the protocol cores, shared by every control plane. A handle
// holds the core (keeping it alive) and its RoomState, so Poll() is one atomic load.
#ifndef PDLIB_LIB_CORE_HANDLES_H_
#define PDLIB_LIB_CORE_HANDLES_H_

#include <memory>

#include "absl/strings/str_format.h"
#include "lib/core/decode_core.h"
#include "lib/core/prefill_core.h"
#include "lib/core/validate.h"
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
  bool PagesReusable() const override { return state_->PagesReusable(); }
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
    return core_->SendLayers(state_->room(), pages, core_->num_layers(), is_last_chunk,
                             {state_indices, {}});
  }
  Status SendStates(std::span<const int32_t> pages, bool is_last_chunk,
                    const StateIndices& state) override {
    return core_->SendLayers(state_->room(), pages, core_->num_layers(), is_last_chunk, state);
  }
  Status SendLayers(std::span<const int32_t> pages, int32_t layers_done, bool is_last_chunk,
                    std::span<const int32_t> state_indices) override {
    return core_->SendLayers(state_->room(), pages, layers_done, is_last_chunk,
                             {state_indices, {}});
  }
  Status SendLayersStates(std::span<const int32_t> pages, int32_t layers_done, bool is_last_chunk,
                          const StateIndices& state) override {
    return core_->SendLayers(state_->room(), pages, layers_done, is_last_chunk, state);
  }
  std::optional<uint64_t> decode_prefix_len() const override {
    return core_->DecodePrefix(state_->room());
  }
  StatusOr<uint64_t> PagesAfterPrefix(uint64_t prompt_len) const override {
    // Pull publishes every page of the prompt (decode reads those after its prefix).
    if (core_->options().direction == TransferDirection::kPull) {
      return pdlib::PagesAfterPrefix(prompt_len, 0, core_->page_size());
    }
    const std::optional<uint64_t> prefix = decode_prefix_len();
    if (!prefix) {
      return Status::FailedPrecondition(absl::StrFormat(
          "room %d: decode's prefix is known once the sender reaches WaitingForInput (now %s)",
          state_->room(), KVPollName(state_->Poll())));
    }
    auto pages = pdlib::PagesAfterPrefix(prompt_len, *prefix, core_->page_size());
    if (!pages.ok()) return pages.status().WithPrefix(absl::StrFormat("room %d", state_->room()));
    return pages;
  }
  int32_t num_layers() const override { return core_->num_layers(); }
};

class CoreReceiver final : public HandleBase<KVReceiver, DecodeCore> {
 public:
  using HandleBase::HandleBase;
  using KVReceiver::Init;
  Status Init(const ReceiveRequest& request) override {
    return core_->InitRoom(state_->room(), request);
  }
  std::vector<int32_t> InvalidPages() const override {
    return core_->InvalidPages(state_->room(), state_.get());
  }
};

// What every prefill KVManager does the same way, whatever carries its control messages.
class PrefillManagerBase : public KVManager {
 public:
  Mode mode() const override { return Mode::kPrefill; }
  StatusOr<std::unique_ptr<KVSender>> CreateSender(uint64_t room) override {
    auto state = core_->CreateRoom(room);
    if (!state.ok()) return state.status();
    return std::unique_ptr<KVSender>(std::make_unique<CoreSender>(core_, std::move(*state)));
  }
  StatusOr<std::unique_ptr<KVReceiver>> CreateReceiver(const BootstrapAddress&, uint64_t,
                                                       std::optional<int32_t>) override {
    return Status::FailedPrecondition("CreateReceiver() called on a prefill manager");
  }
  KVManagerMetrics metrics() const override { return core_->metrics(); }
  std::vector<uint64_t> TakeReusableRooms() override { return core_->TakeReusableRooms(); }

 protected:
  std::shared_ptr<PrefillCore> core_;
};

// The decode counterpart; subclasses implement CreateReceiver (bootstrapping differs).
class DecodeManagerBase : public KVManager {
 public:
  Mode mode() const override { return Mode::kDecode; }
  StatusOr<std::unique_ptr<KVSender>> CreateSender(uint64_t) override {
    return Status::FailedPrecondition("CreateSender() called on a decode manager");
  }
  KVManagerMetrics metrics() const override { return core_->metrics(); }
  std::vector<uint64_t> TakeReusableRooms() override { return core_->TakeReusableRooms(); }

 protected:
  explicit DecodeManagerBase(std::shared_ptr<DecodeCore> core) : core_(std::move(core)) {}
  const std::shared_ptr<DecodeCore> core_;
};

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CORE_HANDLES_H_
