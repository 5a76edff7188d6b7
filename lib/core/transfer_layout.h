// The glue between the protocol cores and the planner (lib/planner): each side's planner view
// of its own KVArgs and of the peer's Register message, and which prefill ranks a decode rank
// talks to. Pure functions.
//
// Opaque KV: a rank whose KVArgs leave kv_head_num at 0 (and is not MLA) hands pdlib pages it
// does not look inside, in any number of buffers. The planner then sees each buffer as an MLA
// layer (one unit per page, held by every TP rank), so pages move whole, 1:1 between equal TP
// ranks. Different TP sizes and pipeline stages need kv_head_num on both sides.
#ifndef PDLIB_LIB_CORE_TRANSFER_LAYOUT_H_
#define PDLIB_LIB_CORE_TRANSFER_LAYOUT_H_

#include <cstdint>
#include <span>
#include <vector>

#include "lib/core/control_messages.h"
#include "lib/core/manager_common.h"
#include "lib/planner/planner.h"
#include "pdlib/kv_args.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {

// This rank's layout as the planner sees it, validated; `side` names it in errors.
StatusOr<planner::SideLayout> PlannerLayout(const KVArgs& args, const char* side);

// The decode rank's layout as prefill learns it from its Register message, validated; in pull
// also prefill's, as decode learns it from RegisterAckMsg::source (`side` names it in errors).
StatusOr<planner::SideLayout> PlannerLayout(const RegisterMsg& msg, const char* side = "decode");

// Fills the layout fields of a Register message from decode's KVArgs and its planner layout
// (PlannerLayout(args)): the state families and every state buffer's shape.
void FillRegisterLayout(const KVArgs& args, const planner::SideLayout& layout, RegisterMsg* msg);

// What a Register message says of this rank (its identity, layout and regions): decode's
// Register, and in pull prefill's RegisterAck.source. `layout` is PlannerLayout(options.args).
RegisterMsg DescribeRank(const KVManagerOptions& options, const planner::SideLayout& layout,
                         const RegisteredBuffers& local, std::string transport, uint64_t session,
                         spi::Blob endpoint);

// Fills a RegisterAck's stage extent from prefill's layout.
void FillAckExtent(const planner::SideLayout& prefill, RegisterAckMsg* ack);

// The stage extent a RegisterAck reports (decode's CheckStageCoverage input).
planner::StageExtent StageExtentOf(const RegisterAckMsg& ack);

// The transport regions of one side's KV, aux and state buffers, by buffer index.
struct RegionIds {
  std::span<const uint32_t> kv, aux, state;
};

// Pull: the planner's writes (prefill -> decode) as decode's reads. Every write becomes one read
// of the same bytes with the roles reversed: decode's buffer (the write's remote side) is the
// read's local region, prefill's (the write's local side) its remote region. The plan's buffer
// indices come from layouts validated against these very lists.
void AppendReads(std::span<const planner::PlannedWrite> writes, const RegionIds& decode,
                 const RegionIds& prefill, std::vector<spi::ReadOp>* out);

// Pull: what decode reads of one published chunk (`msg`) for its request `info`, as the plan's
// writes (prefill -> decode) into out->writes: the chunk's pages after decode's prefix, and after
// the last chunk's last layers the aux row and the state slots. Decode posts them reversed;
// prefill digests them (KV integrity), so both sides plan the same bytes. OutOfRange for a chunk
// outside the request or its layers; `*dst_begin`, `*dst_end` get the request pages (after the
// prefix) the chunk covers and `*final` whether it ends the room; `tail` (optional) the tail it
// planned. The tail's spans point into `info` and `msg`.
Status PlanPublishedChunk(const planner::PairPlan& plan, const TransferInfoMsg& info,
                          const ReadReadyMsg& msg, planner::PlanOutput* out, uint64_t* dst_begin,
                          uint64_t* dst_end, bool* final, planner::TailInput* tail = nullptr);

// Checks that both sides agree on MLA and on opaque KV, which needs equal TP sizes.
Status CheckOpaqueCompatible(int32_t prefill_kv_head_num, int32_t prefill_tp, bool prefill_mla,
                             int32_t decode_kv_head_num, int32_t decode_tp, bool decode_mla);

// One prefill rank a decode rank sends TransferInfos to.
struct PrefillTarget {
  planner::RankId rank;
  bool dummy = false;  // writes nothing; decode does not wait for its status (R5.5)
  uint32_t required_dst_info_num = 1;
};

// Every prefill rank (of one DP group) that decode rank `decode` talks to for each room: the
// expected senders, then the dummies it owns. Fails with a clear error for a pairing the
// planner rejects (PP mismatch, TP sizes that do not divide, opaque KV with different TP).
StatusOr<std::vector<PrefillTarget>> PrefillTargetsFor(const planner::SideLayout& decode,
                                                       int32_t decode_kv_head_num,
                                                       bool decode_is_mla, int32_t prefill_tp_size,
                                                       int32_t prefill_pp_size);

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CORE_TRANSFER_LAYOUT_H_
