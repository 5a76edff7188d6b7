#include "lib/core/validate.h"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "lib/control/security.h"
#include "lib/core/manager_common.h"

namespace pdlib {
inline namespace v1 {

uint64_t ItemCapacity(const BufferFamily& family) {
  if (family.empty()) return 0;
  uint64_t cap = std::numeric_limits<uint64_t>::max();
  for (size_t i = 0; i < family.size(); ++i) {
    if (family.item_lens[i] == 0) return 0;
    cap = std::min(cap, family.lens[i] / family.item_lens[i]);
  }
  return cap;
}

Status ValidateFamily(const BufferFamily& family, std::string_view what) {
  if (family.lens.size() != family.ptrs.size() || family.item_lens.size() != family.ptrs.size()) {
    return Status::InvalidArgument(
        absl::StrFormat("%s buffers: %d ptrs, %d lens and %d item_lens must have the same length",
                        what, family.ptrs.size(), family.lens.size(), family.item_lens.size()));
  }
  for (size_t i = 0; i < family.size(); ++i) {
    if (family.ptrs[i] == 0) {
      return Status::InvalidArgument(absl::StrFormat("%s buffer %d has a null pointer", what, i));
    }
    if (family.item_lens[i] == 0 || family.item_lens[i] > family.lens[i]) {
      return Status::InvalidArgument(
          absl::StrFormat("%s buffer %d: item_len %d must be in [1, len %d]", what, i,
                          family.item_lens[i], family.lens[i]));
    }
    if (family.ptrs[i] > std::numeric_limits<uint64_t>::max() - family.lens[i]) {
      return Status::InvalidArgument(
          absl::StrFormat("%s buffer %d: address + length overflows", what, i));
    }
  }
  return Status::OK();
}

std::vector<uint64_t> StateCapacities(const std::vector<StateFamily>& families) {
  std::vector<uint64_t> caps;
  for (const StateFamily& f : families) caps.push_back(ItemCapacity(f.buffers));
  return caps;
}

Status ValidateStateIndices(std::span<const uint64_t> caps, std::span<const int32_t> indices,
                            std::span<const uint32_t> counts, std::string_view side) {
  if (counts.empty()) {
    if (indices.empty()) return Status::OK();
    if (caps.size() != 1) {
      return Status::InvalidArgument(absl::StrFormat(
          "%d state indices without per-family counts, but %s has %d state families",
          indices.size(), side, caps.size()));
    }
    return ValidateIndices(indices, caps[0], "state", side);
  }
  if (counts.size() != caps.size()) {
    return Status::InvalidArgument(
        absl::StrFormat("state indices for %d families, but %s has %d state families",
                        counts.size(), side, caps.size()));
  }
  uint64_t at = 0;
  for (size_t f = 0; f < counts.size(); ++f) {
    if (counts[f] > indices.size() - at) {
      return Status::InvalidArgument(absl::StrFormat(
          "state counts add up to more than the %d state indices given", indices.size()));
    }
    const std::string what = absl::StrFormat("state family %d", f);
    if (Status s = ValidateIndices(indices.subspan(at, counts[f]), caps[f], what, side); !s.ok()) {
      return s;
    }
    at += counts[f];
  }
  if (at != indices.size()) {
    return Status::InvalidArgument(absl::StrFormat(
        "state counts add up to %d, but %d state indices were given", at, indices.size()));
  }
  return Status::OK();
}

Status CheckDecodePrefix(const ReceiveRequest& request, uint32_t page_size) {
  const uint64_t prefix = request.decode_prefix_len;
  if (page_size == 0 || prefix % page_size != 0) {
    return Status::InvalidArgument(absl::StrFormat(
        "decode_prefix_len %d is not a multiple of page_size %d (a decode prefix is whole pages)",
        prefix, page_size));
  }
  if (request.prompt_len == 0) return Status::OK();
  if (prefix > request.prompt_len) {
    return Status::OutOfRange(absl::StrFormat(
        "decode_prefix_len %d is longer than the prompt's %d tokens", prefix, request.prompt_len));
  }
  const uint64_t pages = (request.prompt_len - prefix + page_size - 1) / page_size;
  if (request.kv_page_indices.size() != pages) {
    return Status::InvalidArgument(absl::StrFormat(
        "%d kv pages given for tokens [%d, %d): expected %d pages of %d tokens",
        request.kv_page_indices.size(), prefix, request.prompt_len, pages, page_size));
  }
  return Status::OK();
}

StatusOr<uint64_t> PagesAfterPrefix(uint64_t prompt_len, uint64_t prefix, uint32_t page_size) {
  if (prefix > prompt_len) {
    return Status::OutOfRange(absl::StrFormat(
        "decode_prefix_len %d is longer than the prompt's %d tokens", prefix, prompt_len));
  }
  if (page_size == 0) return Status::InvalidArgument("page_size 0");
  return (prompt_len - prefix + page_size - 1) / page_size;
}

Status ValidateIndices(std::span<const int32_t> indices, uint64_t capacity, std::string_view what,
                       std::string_view side) {
  for (size_t i = 0; i < indices.size(); ++i) {
    int64_t idx = indices[i];
    if (idx < 0 || static_cast<uint64_t>(idx) >= capacity) {
      return Status::OutOfRange(absl::StrFormat(
          "%s index %d (position %d) out of range [0, %d) on %s", what, idx, i, capacity, side));
    }
  }
  return Status::OK();
}

namespace {

constexpr std::pair<std::string_view, int32_t> kElementTypes[] = {
    {"fp16", 2},     {"bf16", 2}, {"fp32", 4}, {"fp8_e4m3", 1},
    {"fp8_e5m2", 1}, {"int8", 1}, {"uint8", 1}};

Status ValidateElementType(std::string_view field, std::string_view name) {
  if (name.empty() || ElementTypeBytes(name) != 0) return Status::OK();
  std::string known;
  for (const auto& [n, bytes] : kElementTypes)
    known += (known.empty() ? "" : ", ") + std::string(n);
  return Status::InvalidArgument(absl::StrFormat(
      "fingerprint.%s '%s' is not an element type pdlib knows (%s, or empty)", field, name, known));
}

}  // namespace

std::vector<std::string> ElementTypeNames() {
  std::vector<std::string> names;
  for (const auto& [name, bytes] : kElementTypes) names.emplace_back(name);
  return names;
}

int32_t ElementTypeBytes(std::string_view name) {
  for (const auto& [n, bytes] : kElementTypes) {
    if (n == name) return bytes;
  }
  return 0;
}

Status ValidateFingerprint(const ModelFingerprint& fp) {
  if (Status s = ValidateElementType("kv_dtype", fp.kv_dtype); !s.ok()) return s;
  if (Status s = ValidateElementType("state_dtype", fp.state_dtype); !s.ok()) return s;
  if (!fp.kv_dtype.empty() && fp.dtype_bytes != 0 &&
      ElementTypeBytes(fp.kv_dtype) != fp.dtype_bytes) {
    return Status::InvalidArgument(
        absl::StrFormat("fingerprint.kv_dtype '%s' has %d-byte elements but dtype_bytes is %d",
                        fp.kv_dtype, ElementTypeBytes(fp.kv_dtype), fp.dtype_bytes));
  }
  return Status::OK();
}

Status ValidateKVArgs(const KVArgs& args) {
  if (Status s = ValidateFamily(args.kv, "kv"); !s.ok()) return s;
  if (Status s = ValidateFamily(args.aux, "aux"); !s.ok()) return s;
  if (args.kv.empty()) return Status::InvalidArgument("kv: at least one KV buffer is required");
  if (args.page_size == 0) return Status::InvalidArgument("page_size must be > 0");
  auto families = EffectiveStateFamilies(args);
  if (!families.ok()) return families.status();
  for (size_t f = 0; f < families->size(); ++f) {
    const StateFamily& fam = (*families)[f];
    const std::string what = absl::StrFormat("state family %d (%s)", f, StateTypeName(fam.type));
    if (fam.type == StateType::kNone || static_cast<int32_t>(fam.type) < 0 ||
        fam.type > StateType::kC128State) {
      return Status::InvalidArgument(absl::StrFormat("state family %d: type %d is not a state kind",
                                                     f, static_cast<int32_t>(fam.type)));
    }
    if (Status s = ValidateFamily(fam.buffers, what); !s.ok()) return s;
    if (!fam.dim_per_tensor.empty() && fam.dim_per_tensor.size() != fam.buffers.size()) {
      return Status::InvalidArgument(
          absl::StrFormat("%s: dim_per_tensor has %d entries for %d buffers", what,
                          fam.dim_per_tensor.size(), fam.buffers.size()));
    }
    if (fam.start < 0) {
      return Status::InvalidArgument(absl::StrFormat("%s: start %d", what, fam.start));
    }
  }
  const ParallelConfig& p = args.parallel;
  auto check_rank = [](const char* name, int32_t size, int32_t rank) -> Status {
    if (size < 1 || rank < 0 || rank >= size) {
      return Status::InvalidArgument(absl::StrFormat(
          "parallel.%s_rank %d must be in [0, %s_size %d)", name, rank, name, size));
    }
    return Status::OK();
  };
  if (Status s = check_rank("tp", p.tp_size, p.tp_rank); !s.ok()) return s;
  if (Status s = check_rank("dp", p.dp_size, p.dp_rank); !s.ok()) return s;
  if (Status s = check_rank("pp", p.pp_size, p.pp_rank); !s.ok()) return s;
  if (args.memory_kind != MemoryKind::kHost && args.memory_kind != MemoryKind::kCuda) {
    return Status::InvalidArgument("memory_kind must be host or cuda");
  }
  return ValidateFingerprint(args.fingerprint);
}

Status ValidateOptions(const KVManagerOptions& options) {
  if (options.mode != Mode::kPrefill && options.mode != Mode::kDecode) {
    return Status::InvalidArgument("mode must be prefill or decode");
  }
  if (options.backend.empty()) return Status::InvalidArgument("backend name is empty");
  if (options.transfer_workers < 1 || options.transfer_workers > 64) {
    return Status::InvalidArgument(
        absl::StrFormat("transfer_workers %d must be in [1, 64]", options.transfer_workers));
  }
  if (Status s = control::ValidateSecurity(
          {options.auth_secret, options.tls_cert_file, options.tls_key_file, options.tls_ca_file});
      !s.ok()) {
    return s;
  }
  if (!options.failure_injection_stages.empty()) {
    if (auto stages = ParseFailureStages(options.failure_injection_stages); !stages.ok()) {
      return stages.status();
    }
  }
  if (options.failure_injection_prob > 1.0) {
    return Status::InvalidArgument(absl::StrFormat(
        "failure_injection_prob %g must be in [0, 1] (negative: from the environment)",
        options.failure_injection_prob));
  }
  if (options.control_plane != ControlPlane::kGrpc &&
      options.control_plane != ControlPlane::kInProcess) {
    return Status::InvalidArgument("control_plane must be kGrpc or kInProcess");
  }
  if (options.mode == Mode::kPrefill && options.control_plane == ControlPlane::kGrpc &&
      options.bootstrap_port == 0 && !options.start_bootstrap_server) {
    return Status::InvalidArgument(
        "bootstrap_port 0 (a free port) needs start_bootstrap_server: a rank that registers "
        "with another's bootstrap server must be given its port");
  }
  if (options.direction != TransferDirection::kPush &&
      options.direction != TransferDirection::kPull) {
    return Status::InvalidArgument(absl::StrFormat("direction %d is neither push nor pull",
                                                   static_cast<int>(options.direction)));
  }
  if (options.checksum != KvChecksum::kOff && options.checksum != KvChecksum::kSampled &&
      options.checksum != KvChecksum::kAll) {
    return Status::InvalidArgument(absl::StrFormat("checksum %d is not off, sampled or all",
                                                   static_cast<int>(options.checksum)));
  }
  if (options.checksum == KvChecksum::kSampled && options.checksum_sample_every == 0) {
    return Status::InvalidArgument("checksum_sample_every must be >= 1 (1: every room)");
  }
  if (options.pull_lease < std::chrono::milliseconds(1000)) {
    return Status::InvalidArgument(
        absl::StrFormat("pull_lease %d ms must be >= 1000 ms", options.pull_lease.count()));
  }
  if (options.liveness_timeout < std::chrono::milliseconds(1000)) {
    return Status::InvalidArgument(absl::StrFormat("liveness_timeout %d ms must be >= 1000 ms",
                                                   options.liveness_timeout.count()));
  }
  for (auto [name, value] : {std::pair{"connect_timeout", options.connect_timeout},
                             std::pair{"bootstrap_timeout", options.bootstrap_timeout},
                             std::pair{"waiting_timeout", options.waiting_timeout},
                             std::pair{"transfer_timeout", options.transfer_timeout}}) {
    if (value.count() <= 0) {
      return Status::InvalidArgument(absl::StrFormat("%s must be > 0 ms", name));
    }
  }
  return ValidateKVArgs(options.args)
      .WithPrefix(ModeName(options.mode) == "prefill" ? "prefill KVArgs" : "decode KVArgs");
}

}  // namespace v1
}  // namespace pdlib
