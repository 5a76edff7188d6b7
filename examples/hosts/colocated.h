// ColocatedTransport: the ReceiverFactory of a decode host in colocated mode (pd-decode
// --colocated), the no-transfer baseline that pd-demo compares a disaggregated run against.
//
// Its receiver does in-process what prefill + pdlib do across hosts: at KVReceiver::Init it runs
// the prompt's prefill forward on the host's own model into the pages (and state slot) the decode
// scheduler pre-allocated, in chunks of `chunk_tokens`, writes the first token and the request's
// bootstrap_room into the metadata slot, and reports Success. The decode scheduler then goes on
// exactly as after a transfer, so both modes share every line of the decode path and their
// tokens must be identical.
//
// With TP/PP, every rank of the host runs its own ColocatedTransport over its share of the model;
// the ranks create and Init their receivers in the same order (lockstep), so their prefill
// forwards meet in the model's collectives. A failed prefill aborts the rank's ModelComm.
//
// Owned by the decode rank; the model and metadata buffers must outlive it and every receiver.
// Not thread-safe: the rank's scheduler thread calls everything (Poll included).
#ifndef PDLIB_EXAMPLES_HOSTS_COLOCATED_H_
#define PDLIB_EXAMPLES_HOSTS_COLOCATED_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "examples/scheduler/engine.h"
#include "pdlib/metadata_buffers.h"
#include "pdlib_kernels/model.h"

namespace pdlib::hosts {

class ColocatedTransport final : public sched::ReceiverFactory {
 public:
  // `comm`: the rank's member of the model's group, or null for one rank.
  ColocatedTransport(kernels::Model* model, MetadataBuffers* metadata, int32_t chunk_tokens,
                     kernels::ModelComm* comm = nullptr)
      : model_(model), metadata_(metadata), chunk_tokens_(chunk_tokens), comm_(comm) {}

  // Tells the factory the prompt of `room`, whose receiver the scheduler is about to create
  // (CreateReceiver is not given the prompt).
  void Expect(uint64_t room, std::vector<int32_t> prompt) { prompts_[room] = std::move(prompt); }
  // Forgets an expected prompt whose request was refused before its receiver was created.
  void Forget(uint64_t room) { prompts_.erase(room); }

  StatusOr<std::unique_ptr<KVReceiver>> CreateReceiver(
      const BootstrapAddress& bootstrap, uint64_t room,
      std::optional<int32_t> prefill_dp_rank) override;

 private:
  kernels::Model* model_;
  MetadataBuffers* metadata_;
  int32_t chunk_tokens_;
  kernels::ModelComm* comm_;
  std::map<uint64_t, std::vector<int32_t>> prompts_;
};

}  // namespace pdlib::hosts

#endif  // PDLIB_EXAMPLES_HOSTS_COLOCATED_H_
