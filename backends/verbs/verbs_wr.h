// How the verbs backend turns a batch of writes (or reads) into RDMA WRITE (RDMA READ) work
// requests, and how it paces them on a QP's send queue. Pure arithmetic on addresses and keys: no
// verbs call, no thread, so the limits, the chaining and the signalling cadence are unit-tested on
// any host.
//
// Work requests: an RDMA WRITE lands in one contiguous remote range but may gather its source
// from up to max_sge local pieces, and carries at most max_message_bytes. PlanWrites merges
// consecutive writes whose remote ranges follow each other (same rkey) into one request, joins
// local pieces that follow each other into one SGE, starts a new request when the SGE list or
// the message is full, and splits a write longer than a message.
//
// Reads are planned the same way: an RDMA READ takes one contiguous remote range and scatters it
// into up to max_sge_rd local pieces (the SGE list is the destination).
//
// Read depth: a QP may have at most max_rd_atomic RDMA READs outstanding (the initiator depth
// set at RTS, at most the device's max_qp_init_rd_atom and the peer's responder resources,
// max_dest_rd_atomic). SendQueueBudget counts reads apart and the poster stops at that depth
// (ReadDepth); a read that fills it is signalled, so that its completion frees the depth.
//
// Send queue: each request takes a slot of its QP's send queue until a completion retires it.
// Only signalled requests produce a completion (on success), and RC completes a QP's requests in
// order, so one signalled completion retires every request posted before it. SendQueueBudget
// signals every signal_every-th request, any request that fills the queue, and any request the
// poster names (the last of each batch, whose completion is the batch's, and the last before the
// poster stops to wait for room), so that whoever waits always has a completion coming.
#ifndef PDLIB_BACKENDS_VERBS_VERBS_WR_H_
#define PDLIB_BACKENDS_VERBS_VERBS_WR_H_

#include <cstdint>
#include <deque>
#include <span>
#include <vector>

#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace verbs {

// One write, resolved to what the NIC sees: local address and lkey, remote address and rkey.
struct WriteSegment {
  uint64_t local_addr = 0;
  uint32_t lkey = 0;
  uint64_t remote_addr = 0;
  uint32_t rkey = 0;
  uint64_t length = 0;
};

struct WrLimits {
  uint32_t max_sge = 1;
  uint64_t max_message_bytes = 1;  // at most 2^32 - 1: an SGE's length is 32 bits
};

// An scatter-gather entry as ibv_sge has it.
struct Sge {
  uint64_t addr = 0;
  uint32_t length = 0;
  uint32_t lkey = 0;
  friend bool operator==(const Sge&, const Sge&) = default;
};

// One RDMA WRITE: sges[first_sge, first_sge + num_sge) of the plan, to remote_addr.
struct PlannedWr {
  uint64_t remote_addr = 0;
  uint32_t rkey = 0;
  uint64_t length = 0;
  uint32_t first_sge = 0;
  uint32_t num_sge = 0;
};

struct WrPlan {
  std::vector<Sge> sges;
  std::vector<PlannedWr> wrs;
};

// The limits to plan with: the device's, lowered by the options where they ask (0: keep).
// Errors when a device reports a limit that makes writes impossible.
StatusOr<WrLimits> EffectiveLimits(uint32_t device_max_sge, uint64_t device_max_message,
                                   uint32_t option_max_sge, uint64_t option_max_message);

// The RDMA READs a QP may have outstanding: the local device's initiator depth
// (max_qp_init_rd_atom) and the peer QP's responder resources, whichever is smaller, at least 1.
uint32_t ReadDepth(uint32_t device_initiator_depth, uint32_t peer_responder_resources);

// Striping over several devices (issue #31): which QP pair each op of a batch goes on. Whole
// ops (a page is never split between rails), consecutive ops together until a stripe holds
// `stripe_bytes`, the stripes dealt round-robin over `pairs` starting at pair `first` (the
// transport moves `first` on per batch, so small batches spread too). Ops of length 0 get
// kNoPair. `pairs` >= 1.
inline constexpr size_t kNoPair = SIZE_MAX;
std::vector<size_t> StripeOverPairs(std::span<const uint64_t> lengths, size_t pairs,
                                    uint64_t stripe_bytes, size_t first);

// Appends the requests for `writes` (in order; empty ones are skipped) to *plan. Requests already
// in *plan are never extended, so plans of separate calls stay separate.
void PlanWrites(std::span<const WriteSegment> writes, const WrLimits& limits, WrPlan* plan);

// Send-queue slots of one QP and which requests are signalled. Owned by the progress thread.
class SendQueueBudget {
 public:
  // depth >= 1; signal_every is clamped to [1, depth]; read_depth (>= 1) bounds the RDMA READs
  // outstanding among them.
  SendQueueBudget(uint32_t depth, uint32_t signal_every, uint32_t read_depth = UINT32_MAX);

  struct Posted {
    uint64_t seq;  // 1, 2, ...: the request's number on this QP
    bool signalled;
  };

  // Slots free now.
  uint32_t room() const { return depth_ - static_cast<uint32_t>(posted_ - retired_); }
  // RDMA READs that may still be posted now.
  uint32_t read_room() const { return read_depth_ - static_cast<uint32_t>(reads_.size()); }
  // Records one request about to be posted (room() must be > 0, and read_room() for a read);
  // `must_signal` forces a completion for it. A read that fills the read depth is signalled.
  Posted Post(bool must_signal, bool read = false);
  // A completion for request `seq` arrived: it and every earlier request are retired. Returns the
  // slots freed (0 for a stale or repeated sequence number).
  uint32_t Retire(uint64_t seq);

  uint64_t last_posted() const { return posted_; }
  uint64_t outstanding() const { return posted_ - retired_; }
  uint32_t depth() const { return depth_; }
  uint32_t signal_every() const { return signal_every_; }
  uint32_t read_depth() const { return read_depth_; }
  uint64_t reads_outstanding() const { return reads_.size(); }

 private:
  uint32_t depth_;
  uint32_t signal_every_;
  uint32_t read_depth_;
  std::deque<uint64_t> reads_;  // sequence numbers of the reads posted and not retired
  uint64_t posted_ = 0;
  uint64_t retired_ = 0;
  uint32_t since_signal_ = 0;  // unsignalled requests posted since the last signalled one
};

}  // namespace verbs
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_VERBS_VERBS_WR_H_
