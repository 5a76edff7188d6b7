// Unit ownership arithmetic shared by the planner's files (not part of its API).
#ifndef PDLIB_LIB_PLANNER_TOPOLOGY_INTERNAL_H_
#define PDLIB_LIB_PLANNER_TOPOLOGY_INTERNAL_H_

#include <cstdint>

#include "lib/planner/planner.h"

namespace pdlib {
inline namespace v1 {
namespace planner {
namespace internal {

// Bounds that keep every product below 2^64 (and loops over ranks short).
inline constexpr int32_t kMaxRanks = 4096;
inline constexpr uint64_t kMaxUnits = uint64_t{1} << 40;

// The units one rank holds: [start, start + count), replicated on `replicas` ranks of which
// this one is number `replica`.
struct Holding {
  uint64_t start = 0;
  uint64_t count = 0;
  uint64_t replicas = 1;
  uint64_t replica = 0;
};
Holding HoldOf(uint64_t units, int32_t tp_size, int32_t tp_rank);

// The prefill TP rank that sends `unit` to decode TP rank `decode_rank`, which holds it.
int32_t SenderOf(uint64_t units, int32_t prefill_tp, int32_t decode_tp, int32_t decode_rank,
                 uint64_t unit);

struct UnitRange {
  uint64_t lo = 0;
  uint64_t hi = 0;
  bool empty() const { return lo >= hi; }
};
// The units prefill rank p sends to decode rank d (contiguous; empty when none).
UnitRange SentUnits(uint64_t units, int32_t prefill_tp, int32_t decode_tp, int32_t prefill_rank,
                    int32_t decode_rank);

// True when the TP ranks talk in any split group (PP is checked separately).
bool TpPairTalks(const Topology& t, int32_t prefill_rank, int32_t decode_rank);
// The lowest prefill TP rank that talks to `decode_rank`: writes aux and replicated state.
int32_t PrimarySenderTp(const Topology& t, int32_t decode_rank);
// The decode TP rank that sends dummy `prefill_rank` its TransferInfo.
int32_t DummyOwnerTp(const Topology& t, int32_t prefill_rank);
bool StagesTalk(const Topology& t, int32_t prefill_pp, int32_t decode_pp);

// Checks that `units` can be split over `tp_size` ranks.
Status CheckUnits(uint64_t units, int32_t tp_size, const char* what, const char* side);
// The split units of a TP-split state buffer on a side of TP size `tp_size`.
uint64_t StateUnits(const StateBufferDesc& s, int32_t tp_size);

}  // namespace internal
}  // namespace planner
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_PLANNER_TOPOLOGY_INTERNAL_H_
