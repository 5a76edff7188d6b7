// Plain C++ forms of the bootstrap protocol's data (lib/proto/pdlib.proto, service Bootstrap),
// so that the code using BootstrapClient or BootstrapTable never touches protobuf types.
#ifndef PDLIB_LIB_CONTROL_BOOTSTRAP_TYPES_H_
#define PDLIB_LIB_CONTROL_BOOTSTRAP_TYPES_H_

#include <cstdint>
#include <string>
#include <utility>

#include "pdlib/kv_args.h"

namespace pdlib {
inline namespace v1 {
namespace control {

// One prefill rank's place in its deployment.
struct RankId {
  int32_t dp_rank = 0;
  int32_t tp_rank = 0;
  int32_t pp_rank = 0;

  friend bool operator==(const RankId&, const RankId&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const RankId& id) {
    return H::combine(std::move(h), id.dp_rank, id.tp_rank, id.pp_rank);
  }
};

// "(dp 0, tp 1, pp 0)", the way log lines and error messages name a rank.
std::string RankIdString(const RankId& id);

// What a prefill rank tells the bootstrap server about itself.
struct RankRegistration {
  ParallelConfig parallel;  // this rank's position and the deployment's sizes
  std::string host;         // where its Peer service is reachable (not a wildcard)
  uint32_t port = 0;        // [1, 65535]; wider than uint16_t so that bad input can be named
  uint32_t page_size = 0;   // tokens per KV page
  ModelFingerprint fingerprint;

  RankId rank_id() const { return {parallel.dp_rank, parallel.tp_rank, parallel.pp_rank}; }
};

// The bootstrap server's answer to a registration.
struct RegisterResult {
  int32_t ranks_registered = 0;  // this one included
  int32_t ranks_expected = 0;    // tp_size * dp_size * pp_size
  bool replaced = false;         // an earlier registration of the same rank was replaced
  uint64_t registration_id = 0;  // grows with every accepted registration on one server
};

// The prefill deployment's layout as decode sees it.
struct ParallelInfo {
  int32_t tp_size = 0;
  int32_t dp_size = 0;
  int32_t pp_size = 0;
  uint32_t page_size = 0;
  ModelFingerprint fingerprint;
  int32_t ranks_registered = 0;
  int32_t ranks_expected = 0;
};

// Where one prefill rank's Peer service listens.
struct RankAddress {
  std::string host;
  uint16_t port = 0;
  uint64_t registration_id = 0;  // changes when the rank re-registers (e.g. restarted)
};

// A room a prefill rank failed before any decode rank was bound to it (a refused pairing, an
// engine abort): decode ranks bound elsewhere learn it from the deployment's directory.
struct RoomFailure {
  uint64_t room = 0;
  std::string reason;
};
// Bounds of the room-failure relay: rooms per call, bytes of a reason, entries kept, and how
// long one is kept.
inline constexpr size_t kMaxRoomFailuresPerCall = 4096;
inline constexpr size_t kMaxRoomFailureReason = 1024;
inline constexpr size_t kMaxRoomFailuresKept = 65536;
inline constexpr int64_t kRoomFailureTtlSeconds = 600;

// Equal when every numeric field matches and the model names match or either is empty
// (names are free-form and optional; see pdlib::ModelFingerprint).
bool FingerprintsMatch(const ModelFingerprint& a, const ModelFingerprint& b);

// "num_layers 32 vs 40, head_dim 128 vs 64": every field on which a and b disagree (empty when
// they match), `a`'s value first.
std::string FingerprintDifference(const ModelFingerprint& a, const ModelFingerprint& b);

// "{num_layers 32, num_kv_heads 8, head_dim 128, dtype_bytes 2, layout_version 1, model 'x'}"
std::string FingerprintString(const ModelFingerprint& fp);

}  // namespace control
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CONTROL_BOOTSTRAP_TYPES_H_
