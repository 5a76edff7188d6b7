#include "examples/hosts/colocated.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <utility>

namespace pdlib::hosts {
namespace {

class ColocatedReceiver final : public KVReceiver {
 public:
  ColocatedReceiver(uint64_t room, std::vector<int32_t> prompt, kernels::Model* model,
                    MetadataBuffers* metadata, int32_t chunk_tokens, kernels::ModelComm* comm)
      : room_(room),
        prompt_(std::move(prompt)),
        model_(model),
        metadata_(metadata),
        chunk_tokens_(chunk_tokens),
        comm_(comm) {}

  // Release/acquire: Poll() may be called from any thread (KVPollable's contract) and must see
  // the reason written before the state.
  KVPoll Poll() const override { return state_.load(std::memory_order_acquire); }
  Status FailureReason() const override {
    return Poll() == KVPoll::kFailed ? reason_ : Status::OK();
  }
  uint64_t room() const override { return room_; }
  // The colocated "prefill" runs inline in Init(): once the request is over nothing touches
  // its pages.
  bool PagesReusable() const override { return IsTerminal(Poll()); }

  using KVReceiver::Init;
  Status Init(const ReceiveRequest& request) override {
    const std::span<const int32_t> pages = request.kv_page_indices;
    const std::optional<uint32_t> aux = request.aux_index;
    const std::span<const int32_t> state = request.state.indices;
    if (request.decode_prefix_len != 0) {
      // The colocated prefill computes the whole prompt into the pages it is given.
      return Status::InvalidArgument("room " + std::to_string(room_) +
                                     ": the colocated transport takes no decode prefix (it "
                                     "recomputes the prompt into every page)");
    }
    if (Poll() != KVPoll::kWaitingForInput) {
      return Status::FailedPrecondition("room " + std::to_string(room_) +
                                        ": Init called twice or after the request ended");
    }
    if (!aux) {
      Fail(Status::InvalidArgument("room " + std::to_string(room_) +
                                   ": colocated prefill needs a metadata slot"));
      return Status::OK();
    }
    Status s = Prefill(pages, *aux, state.empty() ? -1 : state[0]);
    if (!s.ok()) {
      // The other ranks may be waiting in a collective this rank left.
      if (comm_ != nullptr) comm_->Abort(s);
      Fail(s.WithPrefix("room " + std::to_string(room_) + ": colocated prefill"));
      return Status::OK();
    }
    state_.store(KVPoll::kSuccess, std::memory_order_release);
    return Status::OK();
  }

  void Abort(std::string_view reason) override {
    if (IsTerminal(Poll())) return;
    Fail(Status::Aborted(reason));
  }

 private:
  // The prompt's forward in chunks (the result does not depend on the chunking: kernels/README),
  // then the metadata slot as prefill would have written it.
  Status Prefill(std::span<const int32_t> pages, uint32_t slot, int32_t state_slot) {
    const int32_t len = static_cast<int32_t>(prompt_.size());
    kernels::ForwardResult last;
    for (int32_t pos = 0; pos < len; pos += chunk_tokens_) {
      const int32_t n = std::min(chunk_tokens_, len - pos);
      const kernels::SequenceChunk chunk{
          .tokens = std::span(prompt_).subspan(static_cast<size_t>(pos), static_cast<size_t>(n)),
          .start_pos = pos,
          .page_table = pages,
          .state_slot = state_slot};
      kernels::ForwardOptions options;
      options.top_k = 5;
      if (Status s = model_->Prefill(chunk, options, &last); !s.ok()) return s;
    }
    for (int f = 0; f < kMetadataFieldCount; ++f) {
      std::span<std::byte> row = metadata_->Row(static_cast<MetadataField>(f), slot);
      std::memset(row.data(), 0, row.size());
    }
    metadata_->output_ids(slot)[0] = last.token;
    metadata_->output_token_logprobs_val(slot)[0] = last.logprob;
    metadata_->output_token_logprobs_idx(slot)[0] = last.token;
    const size_t top =
        std::min(last.top_ids.size(), metadata_->output_top_logprobs_idx(slot).size());
    for (size_t i = 0; i < top; ++i) {
      metadata_->output_top_logprobs_idx(slot)[i] = last.top_ids[i];
      metadata_->output_top_logprobs_val(slot)[i] = last.top_logprobs[i];
    }
    metadata_->bootstrap_room(slot)[0] = room_;
    return Status::OK();
  }

  void Fail(Status why) {
    reason_ = std::move(why);
    state_.store(KVPoll::kFailed, std::memory_order_release);
  }

  const uint64_t room_;
  const std::vector<int32_t> prompt_;
  kernels::Model* const model_;
  MetadataBuffers* const metadata_;
  const int32_t chunk_tokens_;
  kernels::ModelComm* const comm_;
  Status reason_;  // written before state_ becomes kFailed, never after
  // Connected at once: there is no prefill host to find.
  std::atomic<KVPoll> state_{KVPoll::kWaitingForInput};
};

}  // namespace

StatusOr<std::unique_ptr<KVReceiver>> ColocatedTransport::CreateReceiver(
    const BootstrapAddress& /*bootstrap*/, uint64_t room,
    std::optional<int32_t> /*prefill_dp_rank*/) {
  auto it = prompts_.find(room);
  if (it == prompts_.end()) {
    return Status::Internal("room " + std::to_string(room) +
                            ": colocated receiver created without its prompt");
  }
  std::vector<int32_t> prompt = std::move(it->second);
  prompts_.erase(it);
  return std::unique_ptr<KVReceiver>(
      new ColocatedReceiver(room, std::move(prompt), model_, metadata_, chunk_tokens_, comm_));
}

}  // namespace pdlib::hosts
