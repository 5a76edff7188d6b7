#include "pdlib/types.h"

namespace pdlib {
inline namespace v1 {

std::string_view KVPollName(KVPoll state) {
  switch (state) {
    case KVPoll::kFailed: return "Failed";
    case KVPoll::kBootstrapping: return "Bootstrapping";
    case KVPoll::kWaitingForInput: return "WaitingForInput";
    case KVPoll::kTransferring: return "Transferring";
    case KVPoll::kSuccess: return "Success";
  }
  return "Invalid";
}

std::string_view ModeName(Mode mode) {
  return mode == Mode::kPrefill ? "prefill" : mode == Mode::kDecode ? "decode" : "invalid";
}

std::string_view TransferDirectionName(TransferDirection direction) {
  return direction == TransferDirection::kPush   ? "push"
         : direction == TransferDirection::kPull ? "pull"
                                                 : "invalid";
}

std::string_view StateTypeName(StateType type) {
  switch (type) {
    case StateType::kNone: return "none";
    case StateType::kMamba: return "mamba";
    case StateType::kSwa: return "swa";
    case StateType::kNsa: return "nsa";
    case StateType::kMinimaxIndexK: return "minimax_index_k";
    case StateType::kSwaRing: return "swa_ring";
    case StateType::kC128State: return "c128_state";
  }
  return "invalid";
}

std::string_view MemoryKindName(MemoryKind kind) {
  return kind == MemoryKind::kHost ? "host" : kind == MemoryKind::kCuda ? "cuda" : "invalid";
}

std::string_view KVLayoutName(KVLayout layout) {
  return layout == KVLayout::kNHD ? "NHD" : layout == KVLayout::kHND ? "HND" : "invalid";
}

}  // namespace v1
}  // namespace pdlib
