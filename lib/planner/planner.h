// The transfer planner (DESIGN "planner", SPEC R5): pure functions from both sides' buffer
// layouts, their parallel configuration and a chunk's page indices to the list of one-sided
// writes that move the chunk, plus the decisions which prefill rank talks to which decode rank.
// No I/O, no threads, no locks; every function may be called from any thread. The only memory a
// plan call touches is the caller's PlanOutput, whose vectors are reused from call to call.
//
// Vocabulary
// - A *unit* is one slice of a TP-split dimension in the whole model: a KV head, or one step of a
//   state tensor's split dimension. A dimension of U units is split over T ranks as engines do:
//   U >= T: rank r holds units [r*U/T, (r+1)*U/T); U < T (GQA, MLA): rank r holds unit
//   r / (T/U), replicated on T/U ranks. U % T == 0 or T % U == 0 is required.
// - An *item* is what one index addresses: a KV page, an aux slot row, a state slot. A TP-split
//   item is laid out [rows][units held][unit bytes]:
//     KV NHD ([token][head][dim]):  rows = page_size, unit bytes = head bytes
//     KV HND ([head][token][dim]):  rows = 1,         unit bytes = page_size * head bytes
//     MLA:                          one unit (the latent), replicated on every rank
//     state, split_dim >= 0:        rows = product of the item dims before split_dim
//   so a unit slice is `rows` pieces per item, one piece when rows == 1.
// - The prefill rank that sends unit u to decode rank d (d holds u): u's only holder when it is
//   not replicated; otherwise, among u's replicas, the one whose share of the TP range
//   [0, 1) contains d's start d / Td (clamped to the replicas). So TP 1:1 stays 1:1, MLA and GQA
//   replicas split the decode ranks between them, and every pair that talks has overlapping TP
//   shares.
//
// Decisions (SPEC R5.4-R5.8)
// - Pairs: prefill rank p writes to decode rank d when p sends d at least one unit of the KV
//   heads or of any TP-split state tensor (Topology::split_units). Decode waits for a status from
//   exactly those prefill ranks (ExpectedPrefillRanks); prefill p waits for TransferInfo from
//   exactly those decode ranks (TargetsForPrefillRank; its count is the required_dst_info_num).
// - Dummies (GQA replicas, MLA): a prefill rank with no target at all still has to learn about
//   each room and end terminal. One decode rank, its DummyOwner (the decode rank that holds the
//   prefill rank's first KV unit and whose share contains the prefill rank's start), sends it a
//   TransferInfo with is_dummy = true and required_dst_info_num = 1. A dummy writes nothing;
//   decode does not wait for its status (it may arrive and is ignored).
// - Aux and replicated state (state_dim_per_tensor == -1) are written once per decode rank, by
//   its primary sender: the lowest expected prefill TP rank. Aux comes from the last prefill PP
//   stage the decode rank talks to (decode PP 1: the last stage; PP equal: its own stage);
//   replicated state from every stage that owns state buffers.
// - PP (R5.6): decode PP == prefill PP pairs equal stages, whose layer and state ranges must be
//   identical. Decode PP 1 receives from every stage: prefill local layer i is global layer
//   start_layer + i, which is decode local layer start_layer + i; state buffers map the same way
//   through state_start. Anything else is rejected (FailedPrecondition).
// - DP (R5.7): the prefill DP group of a room is room % prefill_dp_size (PrefillDpGroup).
// - Chunks (R5.2): a non-last chunk holds whole pages only; the last one may end in a partial
//   page, which is sent whole; aux and state follow the last chunk (PlanTailWrites).
// - Layer-wise streaming: a chunk may be planned a range of prefill-local layers at a time
//   (ChunkPages::layer_begin/layer_end); the ranges of one chunk together plan exactly the
//   writes of the whole chunk, since every write lies inside one layer's buffer.
// - Coalescing (R5.3): consecutive items whose bytes are contiguous on both sides become one
//   write: runs of (src, dst) pages when the slice is the whole item on both sides, otherwise one
//   write per piece (an HND head slice: one per page; an NHD head slice: page_size per page).
// - Validation: MakePairPlan checks both shapes once per connection; the plan calls check every
//   index of a chunk against every buffer of both sides and that no decode index repeats inside
//   the chunk, so no planned write leaves its region. Two checks span more than one chunk or
//   pair and are the caller's: a request's decode indices are distinct across chunks
//   (CheckDistinct on the TransferInfo), and every decode layer and state buffer comes from
//   exactly one prefill stage (CheckStageCoverage).
#ifndef PDLIB_LIB_PLANNER_PLANNER_H_
#define PDLIB_LIB_PLANNER_PLANNER_H_

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "pdlib/kv_args.h"
#include "pdlib/status.h"
#include "pdlib/types.h"

namespace pdlib {
inline namespace v1 {
namespace planner {

// ---------------------------------------------------------------------------------------------
// Inputs

// One registered buffer: `buffer_bytes` long, addressed in items of `item_bytes`.
struct BufferDesc {
  uint64_t item_bytes = 0;
  uint64_t buffer_bytes = 0;
};

// One hybrid-model state buffer (SPEC R5.8). See the file comment for the item layout.
struct StateBufferDesc {
  uint64_t item_bytes = 0;
  uint64_t buffer_bytes = 0;
  // StateFamily::dim_per_tensor: the item dimension split across TP ranks; -1: every TP rank
  // holds the whole item (one rank sends it).
  int32_t split_dim = -1;
  // Product of the item's dimensions before split_dim (1 when split_dim is 0, the usual case:
  // mamba conv state [conv_dim/tp][kernel-1], temporal state [heads/tp][head_dim][state]).
  uint64_t rows = 1;
  // Extent of the split dimension across all TP ranks of the model. 0: unknown, treat each byte
  // of a row as a unit (rows split evenly by bytes, no replication): item_bytes / rows * tp_size.
  uint64_t split_units = 0;
};

// One state family of a side (KVArgs::state_families): its kind, and which of SideLayout::state
// are its buffers.
struct StateFamilySpan {
  StateType type = StateType::kNone;
  int32_t start = 0;   // model-wide index, within the family, of this stage's first buffer
  uint32_t first = 0;  // position of its first buffer in SideLayout::state
  uint32_t count = 0;  // its buffers on this side
  friend bool operator==(const StateFamilySpan&, const StateFamilySpan&) = default;
};

// One rank's buffers and place in the deployment: what KVArgs (own side) or the Register
// message (decode side, as prefill sees it) says. SideLayoutFromKVArgs fills it from KVArgs.
struct SideLayout {
  int32_t tp_size = 1;
  int32_t tp_rank = 0;
  int32_t pp_size = 1;
  int32_t pp_rank = 0;

  int32_t total_layers = 0;    // KV layers of the whole model (ModelFingerprint::num_layers)
  int32_t start_layer = 0;     // first KV layer of this rank's PP stage
  int32_t total_kv_heads = 0;  // model's KV heads before TP sharding (ignored for MLA)
  int32_t kv_heads = 0;        // KV heads this rank holds: max(1, total / tp_size)
  uint32_t page_size = 1;      // tokens per page
  KVLayout layout = KVLayout::kHND;
  bool is_mla = false;

  // Non-MLA: K of each local layer, then V of each local layer (2 * num_layers buffers).
  // MLA: one buffer per local layer.
  std::vector<BufferDesc> kv;
  std::vector<BufferDesc> aux;

  // State: every family's buffers, family after family. state_families says which are whose;
  // empty: the one-family shorthand (state_type, state_start, all of `state`), or no state when
  // state_type is kNone and `state` is empty. Families() gives the effective list either way.
  StateType state_type = StateType::kNone;
  int32_t state_start = 0;  // shorthand: model-wide index of this stage's first state buffer
  std::vector<StateBufferDesc> state;
  std::vector<StateFamilySpan> state_families;
  std::vector<StateFamilySpan> Families() const {
    if (!state_families.empty()) return state_families;
    if (state_type == StateType::kNone && state.empty()) return {};
    return {{state_type, state_start, 0, static_cast<uint32_t>(state.size())}};
  }

  // KVArgs without kv_head_num (and not MLA): each buffer is planned whole, as MLA latents are;
  // the buffers are still K of each layer, then V of each layer (see LayerOf).
  bool opaque_kv = false;

  // Local KV layers, derived from the kv buffer count.
  int32_t num_layers() const { return static_cast<int32_t>(is_mla ? kv.size() : kv.size() / 2); }
  // The engine's local layers (layer-wise streaming counts these): num_layers(), except that
  // opaque K/V buffers pair up again.
  int32_t engine_layers() const {
    return opaque_kv && kv.size() % 2 == 0 ? static_cast<int32_t>(kv.size() / 2) : num_layers();
  }
  // The engine layer of planner layer `i` (i < num_layers()).
  int32_t LayerOf(int32_t i) const { return i % std::max(1, engine_layers()); }
};

// Fills a SideLayout from a rank's KVArgs: parallel sizes and ranks, fingerprint layers (PP 1
// without a fingerprint: the local layers) and heads, kv_head_num, page size, layout, MLA,
// buffers (lens and item_lens), prefill_start_layer as start_layer, and every state family
// (EffectiveStateFamilies: dim_per_tensor as split_dim, item_rows / split_units when given, else 1
// and 0, and start).
StatusOr<SideLayout> SideLayoutFromKVArgs(const KVArgs& args);

// Checks one side on its own; `side` ("prefill", "decode") names it in messages.
Status ValidateSideLayout(const SideLayout& layout, const char* side);

// ---------------------------------------------------------------------------------------------
// Who talks to whom

struct RankId {
  int32_t tp_rank = 0;
  int32_t pp_rank = 0;
  friend bool operator==(const RankId&, const RankId&) = default;
  friend auto operator<=>(const RankId&, const RankId&) = default;
};

// Everything the pairing decisions depend on. Both sides derive the same value: decode from its
// own layout and the prefill parallel sizes it learns from the bootstrap server (MakeTopology);
// prefill inside MakePairPlan from the Register message. With equal PP each stage has its own
// (its state tensors); decode PP 1 holds every tensor and has one.
struct Topology {
  int32_t prefill_tp_size = 1;
  int32_t decode_tp_size = 1;
  int32_t prefill_pp_size = 1;
  int32_t decode_pp_size = 1;
  // Units of every TP-split dimension of the model: [0] is the KV heads (1 for MLA), then the
  // distinct split_units of the TP-split state tensors, ascending.
  std::vector<uint64_t> split_units;
  friend bool operator==(const Topology&, const Topology&) = default;
};

Status ValidateTopology(const Topology& topology);

// The topology as the decode rank with layout `decode` sees it.
StatusOr<Topology> MakeTopology(const SideLayout& decode, int32_t prefill_tp_size,
                                int32_t prefill_pp_size);

// Decode ranks prefill rank `prefill` writes to, sorted. Empty: `prefill` is a dummy.
StatusOr<std::vector<RankId>> TargetsForPrefillRank(const Topology& topology, RankId prefill);

// Prefill ranks decode rank `decode` must hear Success from, sorted (R5.4).
StatusOr<std::vector<RankId>> ExpectedPrefillRanks(const Topology& topology, RankId decode);

// Prefill ranks with no target whose dummy TransferInfo `decode` sends (R5.5), sorted.
StatusOr<std::vector<RankId>> DummyPrefillRanks(const Topology& topology, RankId decode);

// The decode rank that sends dummy prefill rank `prefill` its TransferInfo; kFailedPrecondition
// when `prefill` is not a dummy.
StatusOr<RankId> DummyOwner(const Topology& topology, RankId prefill);

// How many TransferInfos prefill rank `prefill` collects per room: its target count, or 1 (the
// dummy) when it has none. Decode puts this in every TransferInfo it sends to `prefill`.
StatusOr<uint32_t> RequiredDstInfoNum(const Topology& topology, RankId prefill);

// The prefill rank that writes aux to decode rank `decode`.
StatusOr<RankId> AuxWriter(const Topology& topology, RankId decode);

// The prefill DP group that serves `room` (R5.7).
StatusOr<int32_t> PrefillDpGroup(uint64_t room, int32_t prefill_dp_size);

// ---------------------------------------------------------------------------------------------
// Per-connection plan

enum class RegionKind : uint8_t { kKv = 0, kAux = 1, kState = 2 };
const char* RegionKindName(RegionKind kind);

// One planned one-sided write. Buffer indices are positions in the SideLayout's kv/aux/state
// vectors (local: prefill; remote: decode); the caller maps them to transport region ids.
struct PlannedWrite {
  RegionKind kind = RegionKind::kKv;
  uint32_t local_buffer = 0;
  uint64_t local_offset = 0;
  uint32_t remote_buffer = 0;
  uint64_t remote_offset = 0;
  uint64_t length = 0;
  friend bool operator==(const PlannedWrite&, const PlannedWrite&) = default;
};

// Where one unit slice sits inside an item on both sides: `pieces` pieces of `piece_bytes`,
// the first at *_offset, the next ones *_stride further.
struct SliceGeometry {
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t src_stride = 0;
  uint64_t dst_stride = 0;
  uint64_t piece_bytes = 0;
  uint64_t pieces = 0;
  bool whole_item = false;  // one piece == the whole item on both sides: runs merge
};

// One prefill buffer mapped onto one decode buffer, with its slice.
struct BufferMap {
  uint32_t src_buffer = 0;
  uint32_t dst_buffer = 0;
  uint64_t src_item_bytes = 0;
  uint64_t dst_item_bytes = 0;
  uint64_t src_buffer_bytes = 0;
  uint64_t dst_buffer_bytes = 0;
  SliceGeometry slice;
  // KV maps: the prefill-local layer the buffer belongs to (layer-wise streaming plans a range
  // of layers). 0 for aux and state.
  int32_t layer = 0;
  // State maps: the state family (position in Families()). 0 otherwise.
  int32_t family = 0;
};

// How many items every buffer of a family holds on one side, and which buffer limits it.
struct Capacity {
  uint64_t items = 0;
  uint32_t limiting_buffer = 0;
  bool any = false;  // the family has buffers
};

// What one prefill rank writes to one decode rank, computed once per connection (at Register)
// by MakePairPlan. Plain data: copy it, keep it next to the connection.
struct PairPlan {
  RankId prefill;
  RankId decode;
  bool active = false;      // prefill writes to this decode rank (it is an expected sender)
  bool writes_aux = false;  // this pair carries the aux slot
  uint32_t page_size = 1;
  int32_t prefill_layers = 0;    // the prefill rank's local KV layers (ChunkPages layer ranges)
  std::vector<BufferMap> kv;     // buffers with something to send, layer-major (K, V) order
  std::vector<BufferMap> aux;    // empty unless writes_aux
  std::vector<BufferMap> state;  // state buffers this pair sends (slices or whole items), by family
  Capacity src_kv, dst_kv, src_aux, dst_aux;
  // Per state family (both sides declare the same kinds in the same order): its kind and the
  // items every buffer of the family holds on each side.
  struct Family {
    StateType type = StateType::kNone;
    Capacity src, dst;
  };
  std::vector<Family> state_families;
  Topology topology;
};

// Validates both layouts and their compatibility (page size, heads, head bytes, layers, MLA,
// layout, aux and state shapes, PP pairing) and computes what `prefill` writes to `decode`.
// A valid pair that talks to nobody yields active == false and plans no writes.
StatusOr<PairPlan> MakePairPlan(const SideLayout& prefill, const SideLayout& decode);

// What one prefill PP stage holds; the RegisterAck carries it to decode.
struct StageExtent {
  int32_t pp_rank = 0;
  int32_t start_layer = 0;
  int32_t num_layers = 0;
  // Per state family (Families() order): the model-wide index of the stage's first buffer of the
  // family, and how many it holds.
  struct States {
    int32_t start = 0;
    int32_t count = 0;
  };
  std::vector<States> states;
};
StageExtent ExtentOf(const SideLayout& prefill);

// Decode, once it knows every prefill stage it receives from (decode PP 1: all of them; equal
// PP: its own): every decode layer and state buffer comes from exactly one stage. A pair plan
// sees one stage only and cannot tell that a layer is nobody's.
Status CheckStageCoverage(const SideLayout& decode, std::span<const StageExtent> stages);

// ---------------------------------------------------------------------------------------------
// Per-chunk plan

// The KV pages of one chunk. dst_pages are the decode rank's pages for the same positions of
// the request (the slice of its TransferInfo::dst_kv_pages the chunk covers).
struct ChunkPages {
  std::span<const int32_t> src_pages;
  std::span<const int32_t> dst_pages;
  bool is_last = false;
  // Tokens the chunk covers, when known: a non-last chunk must be whole pages (R5.2) and the
  // page count must match. -1: not checked.
  int64_t num_tokens = -1;
  // Layer-wise streaming: only the prefill-local KV layers [layer_begin, layer_end) are planned
  // (the layers the engine announced since the last call). layer_end -1: through the last one.
  // Every index is validated whatever the range.
  int32_t layer_begin = 0;
  int32_t layer_end = -1;
};

// What follows the last chunk: the aux slot, then the state indices (R5.8).
struct TailInput {
  int64_t src_aux = -1;  // -1: no aux slot
  int64_t dst_aux = -1;
  // State indices of every family, the lists one after another; *_counts[f] is family f's
  // length (empty: one family holds them all). How the two sides' lists of one family pair up
  // depends on its kind (AlignStateLists).
  std::span<const int32_t> src_state;
  std::span<const int32_t> dst_state;
  std::span<const uint32_t> src_state_counts;
  std::span<const uint32_t> dst_state_counts;
  // KV pages the request sends (after decode's prefix) when known: full-sequence kinds (nsa,
  // minimax_index_k) send one index per page, window kinds (swa) at most one more than that.
  // -1: not checked.
  int64_t request_pages = -1;
};

// How a family's two index lists pair up (SGLang's Mooncake backend, see the README): the
// positions [src_begin, src_begin + count) of prefill's list go to [dst_begin, dst_begin + count)
// of decode's. kInvalidArgument, naming the kind and both lengths, when the lists cannot pair.
struct StatePairing {
  size_t src_begin = 0;
  size_t dst_begin = 0;
  size_t count = 0;
};
StatusOr<StatePairing> AlignStateLists(StateType type, size_t src_len, size_t dst_len,
                                       int64_t request_pages);

struct ChunkInput {
  ChunkPages pages;
  TailInput tail;  // used when pages.is_last
};

// A contiguous run of `count` indices copied from src_start.. to dst_start.. .
struct IndexRun {
  int32_t src_start = 0;
  int32_t dst_start = 0;
  int32_t count = 0;
};

// Output and scratch of the plan calls; reuse one per worker so that planning does not allocate
// once its vectors have grown.
struct PlanOutput {
  std::vector<PlannedWrite> writes;
  uint64_t bytes = 0;  // sum of write lengths
  // Scratch.
  std::vector<IndexRun> runs;
  std::vector<IndexRun> sorted;
};

// Appends the KV writes of one chunk (every layer, R5.3, or the chunk's layer range) to
// out->writes, layer by layer. Validates the chunk, the layer range and every index; on error
// out->writes is cleared and nothing is planned.
Status PlanKvWrites(const PairPlan& plan, const ChunkPages& chunk, PlanOutput* out);

// Appends the aux write(s), then the state writes, that follow the last chunk.
Status PlanTailWrites(const PairPlan& plan, const TailInput& tail, PlanOutput* out);

// Clears out, then plans the chunk's KV writes and, for the last chunk, the tail.
Status PlanChunkWrites(const PairPlan& plan, const ChunkInput& chunk, PlanOutput* out);

// Checks that no index appears twice (a TransferInfo's dst pages, state indices); `what` and
// `side` name them in the message. Uses *scratch.
Status CheckDistinct(std::span<const int32_t> indices, const char* what, const char* side,
                     std::vector<int32_t>* scratch);

}  // namespace planner
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_PLANNER_PLANNER_H_
