// Who talks to whom (SPEC R5.4-R5.7): unit ownership under TP, the sender of each unit, the
// pairs, dummies and aux writers, and the validation of sides and topologies.
#include <algorithm>
#include <limits>

#include "absl/strings/str_format.h"
#include "lib/planner/planner.h"
#include "lib/planner/topology_internal.h"

namespace pdlib {
inline namespace v1 {
namespace planner {
namespace internal {

Holding HoldOf(uint64_t units, int32_t tp_size, int32_t tp_rank) {
  const uint64_t t = static_cast<uint64_t>(tp_size);
  const uint64_t r = static_cast<uint64_t>(tp_rank);
  if (units >= t) {
    const uint64_t per = units / t;
    return {r * per, per, 1, 0};
  }
  const uint64_t replicas = t / units;
  return {r / replicas, 1, replicas, r % replicas};
}

int32_t SenderOf(uint64_t units, int32_t prefill_tp, int32_t decode_tp, int32_t decode_rank,
                 uint64_t unit) {
  const uint64_t tp = static_cast<uint64_t>(prefill_tp);
  if (units >= tp) return static_cast<int32_t>(unit / (units / tp));
  // Replicated: the replica whose share of [0, 1) contains the decode rank's start.
  const uint64_t replicas = tp / units;
  const uint64_t lo = unit * replicas;
  const uint64_t want = static_cast<uint64_t>(decode_rank) * tp / static_cast<uint64_t>(decode_tp);
  return static_cast<int32_t>(std::clamp(want, lo, lo + replicas - 1));
}

UnitRange SentUnits(uint64_t units, int32_t prefill_tp, int32_t decode_tp, int32_t prefill_rank,
                    int32_t decode_rank) {
  const Holding p = HoldOf(units, prefill_tp, prefill_rank);
  const Holding d = HoldOf(units, decode_tp, decode_rank);
  const uint64_t lo = std::max(p.start, d.start);
  const uint64_t hi = std::min(p.start + p.count, d.start + d.count);
  if (lo >= hi) return {};
  // A replicated prefill unit is sent by one replica only; an unreplicated one by its holder.
  if (p.replicas > 1 && SenderOf(units, prefill_tp, decode_tp, decode_rank, lo) != prefill_rank) {
    return {};
  }
  return {lo, hi};
}

bool TpPairTalks(const Topology& t, int32_t prefill_rank, int32_t decode_rank) {
  for (uint64_t units : t.split_units) {
    if (!SentUnits(units, t.prefill_tp_size, t.decode_tp_size, prefill_rank, decode_rank).empty()) {
      return true;
    }
  }
  return false;
}

int32_t PrimarySenderTp(const Topology& t, int32_t decode_rank) {
  for (int32_t p = 0; p < t.prefill_tp_size; ++p) {
    if (TpPairTalks(t, p, decode_rank)) return p;
  }
  return -1;  // unreachable for a valid topology: the KV units always have a sender
}

int32_t DummyOwnerTp(const Topology& t, int32_t prefill_rank) {
  const uint64_t units = t.split_units.front();
  const uint64_t unit = HoldOf(units, t.prefill_tp_size, prefill_rank).start;
  const uint64_t tp = static_cast<uint64_t>(t.decode_tp_size);
  if (units >= tp) return static_cast<int32_t>(unit / (units / tp));
  const uint64_t replicas = tp / units;
  const uint64_t lo = unit * replicas;
  const uint64_t want =
      static_cast<uint64_t>(prefill_rank) * tp / static_cast<uint64_t>(t.prefill_tp_size);
  return static_cast<int32_t>(std::clamp(want, lo, lo + replicas - 1));
}

bool StagesTalk(const Topology& t, int32_t prefill_pp, int32_t decode_pp) {
  return t.decode_pp_size == 1 ? decode_pp == 0 : prefill_pp == decode_pp;
}

Status CheckUnits(uint64_t units, int32_t tp_size, const char* what, const char* side) {
  const uint64_t t = static_cast<uint64_t>(tp_size);
  if (units == 0) return Status::InvalidArgument(absl::StrFormat("%s: 0 units", what));
  if (units > kMaxUnits) {
    return Status::InvalidArgument(
        absl::StrFormat("%s: %d units exceed the supported %d", what, units, kMaxUnits));
  }
  if ((units >= t && units % t != 0) || (units < t && t % units != 0)) {
    return Status::InvalidArgument(absl::StrFormat(
        "%s: %d units cannot be split over %s TP size %d (one must divide the other)", what, units,
        side, tp_size));
  }
  return Status::OK();
}

uint64_t StateUnits(const StateBufferDesc& s, int32_t tp_size) {
  return s.split_units != 0 ? s.split_units
                            : s.item_bytes / s.rows * static_cast<uint64_t>(tp_size);
}

}  // namespace internal

using internal::kMaxRanks;

namespace {

Status CheckRank(const Topology& t, RankId rank, bool prefill) {
  const int32_t tp = prefill ? t.prefill_tp_size : t.decode_tp_size;
  const int32_t pp = prefill ? t.prefill_pp_size : t.decode_pp_size;
  if (rank.tp_rank < 0 || rank.tp_rank >= tp || rank.pp_rank < 0 || rank.pp_rank >= pp) {
    return Status::OutOfRange(absl::StrFormat("%s rank (tp %d, pp %d) outside TP %d x PP %d",
                                              prefill ? "prefill" : "decode", rank.tp_rank,
                                              rank.pp_rank, tp, pp));
  }
  return Status::OK();
}

// Prefill stages decode stage `decode_pp` receives from.
std::pair<int32_t, int32_t> PrefillStagesOf(const Topology& t, int32_t decode_pp) {
  if (t.decode_pp_size == 1) return {0, t.prefill_pp_size};
  return {decode_pp, decode_pp + 1};
}

int32_t DecodeStageOf(const Topology& t, int32_t prefill_pp) {
  return t.decode_pp_size == 1 ? 0 : prefill_pp;
}

}  // namespace

Status ValidateTopology(const Topology& t) {
  for (auto [v, name] : {std::pair{t.prefill_tp_size, "prefill TP size"},
                         std::pair{t.decode_tp_size, "decode TP size"},
                         std::pair{t.prefill_pp_size, "prefill PP size"},
                         std::pair{t.decode_pp_size, "decode PP size"}}) {
    if (v < 1 || v > kMaxRanks) {
      return Status::InvalidArgument(
          absl::StrFormat("%s %d out of range [1, %d]", name, v, kMaxRanks));
    }
  }
  if (t.decode_pp_size != t.prefill_pp_size && t.decode_pp_size != 1) {
    return Status::FailedPrecondition(absl::StrFormat(
        "pipeline mismatch: prefill PP %d, decode PP %d; decode PP must equal prefill PP or be 1 "
        "(SPEC R5.6)",
        t.prefill_pp_size, t.decode_pp_size));
  }
  if (t.split_units.empty()) {
    return Status::InvalidArgument("topology without split units (the KV heads come first)");
  }
  for (size_t i = 0; i < t.split_units.size(); ++i) {
    const char* what = i == 0 ? "kv heads" : "state split dimension";
    if (Status s = internal::CheckUnits(t.split_units[i], t.prefill_tp_size, what, "prefill");
        !s.ok()) {
      return s;
    }
    if (Status s = internal::CheckUnits(t.split_units[i], t.decode_tp_size, what, "decode");
        !s.ok()) {
      return s;
    }
  }
  return Status::OK();
}

StatusOr<Topology> MakeTopology(const SideLayout& decode, int32_t prefill_tp_size,
                                int32_t prefill_pp_size) {
  if (Status s = ValidateSideLayout(decode, "decode"); !s.ok()) return s;
  Topology t;
  t.prefill_tp_size = prefill_tp_size;
  t.prefill_pp_size = prefill_pp_size;
  t.decode_tp_size = decode.tp_size;
  t.decode_pp_size = decode.pp_size;
  t.split_units.push_back(decode.is_mla ? 1 : static_cast<uint64_t>(decode.total_kv_heads));
  std::vector<uint64_t> state_units;
  for (const StateBufferDesc& s : decode.state) {
    if (s.split_dim >= 0) state_units.push_back(internal::StateUnits(s, decode.tp_size));
  }
  std::sort(state_units.begin(), state_units.end());
  for (uint64_t u : state_units) {
    if (std::find(t.split_units.begin(), t.split_units.end(), u) == t.split_units.end()) {
      t.split_units.push_back(u);
    }
  }
  if (Status s = ValidateTopology(t); !s.ok()) return s;
  return t;
}

StatusOr<std::vector<RankId>> TargetsForPrefillRank(const Topology& t, RankId prefill) {
  if (Status s = ValidateTopology(t); !s.ok()) return s;
  if (Status s = CheckRank(t, prefill, true); !s.ok()) return s;
  std::vector<RankId> out;
  for (int32_t d = 0; d < t.decode_tp_size; ++d) {
    if (internal::TpPairTalks(t, prefill.tp_rank, d)) {
      out.push_back({d, DecodeStageOf(t, prefill.pp_rank)});
    }
  }
  return out;
}

StatusOr<std::vector<RankId>> ExpectedPrefillRanks(const Topology& t, RankId decode) {
  if (Status s = ValidateTopology(t); !s.ok()) return s;
  if (Status s = CheckRank(t, decode, false); !s.ok()) return s;
  std::vector<RankId> out;
  auto [first, last] = PrefillStagesOf(t, decode.pp_rank);
  for (int32_t pp = first; pp < last; ++pp) {
    for (int32_t p = 0; p < t.prefill_tp_size; ++p) {
      if (internal::TpPairTalks(t, p, decode.tp_rank)) out.push_back({p, pp});
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

StatusOr<std::vector<RankId>> DummyPrefillRanks(const Topology& t, RankId decode) {
  if (Status s = ValidateTopology(t); !s.ok()) return s;
  if (Status s = CheckRank(t, decode, false); !s.ok()) return s;
  std::vector<bool> has_target(t.prefill_tp_size, false);
  for (int32_t p = 0; p < t.prefill_tp_size; ++p) {
    for (int32_t d = 0; d < t.decode_tp_size && !has_target[p]; ++d) {
      has_target[p] = internal::TpPairTalks(t, p, d);
    }
  }
  std::vector<RankId> out;
  auto [first, last] = PrefillStagesOf(t, decode.pp_rank);
  for (int32_t pp = first; pp < last; ++pp) {
    for (int32_t p = 0; p < t.prefill_tp_size; ++p) {
      if (!has_target[p] && internal::DummyOwnerTp(t, p) == decode.tp_rank) {
        out.push_back({p, pp});
      }
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

StatusOr<RankId> DummyOwner(const Topology& t, RankId prefill) {
  auto targets = TargetsForPrefillRank(t, prefill);
  if (!targets.ok()) return targets.status();
  if (!targets->empty()) {
    return Status::FailedPrecondition(
        absl::StrFormat("prefill rank (tp %d, pp %d) writes to %d decode ranks; it is no dummy",
                        prefill.tp_rank, prefill.pp_rank, targets->size()));
  }
  return RankId{internal::DummyOwnerTp(t, prefill.tp_rank), DecodeStageOf(t, prefill.pp_rank)};
}

StatusOr<uint32_t> RequiredDstInfoNum(const Topology& t, RankId prefill) {
  auto targets = TargetsForPrefillRank(t, prefill);
  if (!targets.ok()) return targets.status();
  return static_cast<uint32_t>(std::max<size_t>(1, targets->size()));
}

StatusOr<RankId> AuxWriter(const Topology& t, RankId decode) {
  if (Status s = ValidateTopology(t); !s.ok()) return s;
  if (Status s = CheckRank(t, decode, false); !s.ok()) return s;
  const int32_t tp = internal::PrimarySenderTp(t, decode.tp_rank);
  if (tp < 0) return Status::Internal("no prefill rank sends to this decode rank");
  return RankId{tp, PrefillStagesOf(t, decode.pp_rank).second - 1};
}

StatusOr<int32_t> PrefillDpGroup(uint64_t room, int32_t prefill_dp_size) {
  if (prefill_dp_size < 1) {
    return Status::InvalidArgument(
        absl::StrFormat("prefill DP size %d must be at least 1", prefill_dp_size));
  }
  return static_cast<int32_t>(room % static_cast<uint64_t>(prefill_dp_size));
}

}  // namespace planner
}  // namespace v1
}  // namespace pdlib
