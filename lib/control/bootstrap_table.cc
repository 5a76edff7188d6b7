#include "lib/control/bootstrap_table.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"
#include "lib/base/log_internal.h"
#include "lib/base/mutex.h"
#include "lib/control/net_address.h"

namespace pdlib {
inline namespace v1 {
namespace control {

namespace {

constexpr size_t kMaxHostLength = 255;  // DNS name limit
// Each fingerprint string (model name, element types, ...): bounds what a peer makes us store.
constexpr size_t kMaxFingerprintText = 1024;

Status CheckSize(const char* field, int32_t size) {
  if (size < 1 || size > kMaxParallelSize) {
    return Status::InvalidArgument(
        absl::StrFormat("%s %d out of range [1, %d]", field, size, kMaxParallelSize));
  }
  return Status::OK();
}

Status CheckRank(const char* field, int32_t rank, const char* size_field, int32_t size) {
  if (rank < 0 || rank >= size) {
    return Status::InvalidArgument(absl::StrFormat("%s %d out of range [0, %d) given %s %d", field,
                                                   rank, size, size_field, size));
  }
  return Status::OK();
}

Status CheckNonNegative(const char* field, int32_t value) {
  if (value < 0) return Status::InvalidArgument(absl::StrFormat("%s %d is negative", field, value));
  return Status::OK();
}

Status CheckHost(const std::string& host) {
  if (host.empty()) return Status::InvalidArgument("host is empty");
  if (host.size() > kMaxHostLength) {
    return Status::InvalidArgument(
        absl::StrFormat("host of %d bytes is longer than %d bytes", host.size(), kMaxHostLength));
  }
  for (char c : host) {
    if (!absl::ascii_isgraph(static_cast<unsigned char>(c))) {
      return Status::InvalidArgument(absl::StrFormat(
          "host '%s' contains a space or control character", absl::CHexEscape(host)));
    }
  }
  // Decode connects to the registered host, so a wildcard bind address is useless there.
  if (host == "0.0.0.0" || host == "::" || host == "[::]") {
    return Status::InvalidArgument(absl::StrFormat(
        "host '%s' is a wildcard address; register an address decode can connect to", host));
  }
  return Status::OK();
}

}  // namespace

Status ValidateRankRegistration(const RankRegistration& reg) {
  const ParallelConfig& p = reg.parallel;
  for (Status s : {CheckSize("tp_size", p.tp_size), CheckSize("dp_size", p.dp_size),
                   CheckSize("pp_size", p.pp_size)}) {
    if (!s.ok()) return s;
  }
  const int64_t ranks = int64_t{p.tp_size} * p.dp_size * p.pp_size;
  if (ranks > kMaxDeploymentRanks) {
    return Status::InvalidArgument(
        absl::StrFormat("tp_size %d * dp_size %d * pp_size %d = %d ranks exceeds %d", p.tp_size,
                        p.dp_size, p.pp_size, ranks, kMaxDeploymentRanks));
  }
  for (Status s : {CheckRank("tp_rank", p.tp_rank, "tp_size", p.tp_size),
                   CheckRank("dp_rank", p.dp_rank, "dp_size", p.dp_size),
                   CheckRank("pp_rank", p.pp_rank, "pp_size", p.pp_size), CheckHost(reg.host)}) {
    if (!s.ok()) return s;
  }
  if (reg.port == 0 || reg.port > 65535) {
    return Status::InvalidArgument(absl::StrFormat("port %u out of range [1, 65535]", reg.port));
  }
  if (reg.page_size == 0) return Status::InvalidArgument("page_size 0 must be at least 1");
  const ModelFingerprint& fp = reg.fingerprint;
  for (Status s : {CheckNonNegative("fingerprint.num_layers", fp.num_layers),
                   CheckNonNegative("fingerprint.num_kv_heads", fp.num_kv_heads),
                   CheckNonNegative("fingerprint.head_dim", fp.head_dim),
                   CheckNonNegative("fingerprint.dtype_bytes", fp.dtype_bytes),
                   CheckNonNegative("fingerprint.layout_version", fp.layout_version)}) {
    if (!s.ok()) return s;
  }
  for (const auto& [field, text] :
       {std::pair{"model_name", &fp.model_name}, std::pair{"kv_dtype", &fp.kv_dtype},
        std::pair{"state_dtype", &fp.state_dtype}, std::pair{"page_layout", &fp.page_layout},
        std::pair{"engine_tag", &fp.engine_tag}, std::pair{"checksum", &fp.checksum}}) {
    if (text->size() > kMaxFingerprintText) {
      return Status::InvalidArgument(
          absl::StrFormat("fingerprint.%s of %d bytes is longer than %d bytes", field, text->size(),
                          kMaxFingerprintText));
    }
  }
  return Status::OK();
}

Status BootstrapTable::CheckAgainstLayout(const Layout& layout, const RankRegistration& reg) {
  const std::string who = absl::StrFormat("prefill rank %s at %s", RankIdString(reg.rank_id()),
                                          JoinHostPort(reg.host, reg.port));
  auto mismatch = [&](const char* field, int64_t got, int64_t want) {
    return Status::FailedPrecondition(absl::StrFormat(
        "%s reports %s %d but the deployment registered with this bootstrap server has %s %d "
        "(set by %s); every rank must agree, or all ranks must re-register",
        who, field, got, field, want, layout.set_by));
  };
  const ParallelConfig& p = reg.parallel;
  if (p.tp_size != layout.tp_size) return mismatch("tp_size", p.tp_size, layout.tp_size);
  if (p.dp_size != layout.dp_size) return mismatch("dp_size", p.dp_size, layout.dp_size);
  if (p.pp_size != layout.pp_size) return mismatch("pp_size", p.pp_size, layout.pp_size);
  if (reg.page_size != layout.page_size) {
    return mismatch("page_size", reg.page_size, layout.page_size);
  }
  const std::string diff = FingerprintDifference(reg.fingerprint, layout.fingerprint);
  if (!diff.empty()) {
    return Status::FailedPrecondition(absl::StrFormat(
        "%s has a model fingerprint that differs from the deployment's (set by %s): %s "
        "(this rank's value first)",
        who, layout.set_by, diff));
  }
  return Status::OK();
}

StatusOr<RegisterResult> BootstrapTable::Register(const RankRegistration& reg) {
  if (Status s = ValidateRankRegistration(reg); !s.ok()) return s;
  const RankId id = reg.rank_id();
  const std::string address = JoinHostPort(reg.host, reg.port);

  MutexLock lock(&mu_);
  const auto existing = ranks_.find(id);
  const bool replacing = existing != ranks_.end();
  const bool others_registered = ranks_.size() > (replacing ? 1u : 0u);
  if (others_registered) {
    if (Status s = CheckAgainstLayout(*layout_, reg); !s.ok()) {
      PDLIB_LOG(kWarning, "bootstrap: rejected registration: %s", s.message());
      return s;
    }
  } else {
    layout_ = Layout{reg.parallel.tp_size, reg.parallel.dp_size, reg.parallel.pp_size,
                     reg.page_size,        reg.fingerprint,      ""};
    layout_->set_by = absl::StrFormat("rank %s at %s", RankIdString(id), address);
  }

  Entry entry{reg.host, static_cast<uint16_t>(reg.port), next_registration_id_++};
  if (replacing) {
    PDLIB_LOG(kInfo, "bootstrap: prefill rank %s re-registered at %s (was %s)", RankIdString(id),
              address, JoinHostPort(existing->second.host, existing->second.port));
    existing->second = std::move(entry);
  } else {
    ranks_.emplace(id, std::move(entry));
    PDLIB_LOG(kInfo, "bootstrap: prefill rank %s registered at %s (%d of %d ranks)",
              RankIdString(id), address, ranks_.size(), layout_->ranks_expected());
  }
  RegisterResult result;
  result.ranks_registered = static_cast<int32_t>(ranks_.size());
  result.ranks_expected = layout_->ranks_expected();
  result.replaced = replacing;
  result.registration_id = next_registration_id_ - 1;
  return result;
}

StatusOr<bool> BootstrapTable::Unregister(const RankId& id, const std::string& host,
                                          uint32_t port) {
  for (Status s : {CheckNonNegative("dp_rank", id.dp_rank), CheckNonNegative("tp_rank", id.tp_rank),
                   CheckNonNegative("pp_rank", id.pp_rank)}) {
    if (!s.ok()) return s;
  }
  MutexLock lock(&mu_);
  const auto it = ranks_.find(id);
  if (it == ranks_.end() || it->second.host != host || it->second.port != port) return false;
  ranks_.erase(it);
  if (ranks_.empty()) layout_.reset();
  PDLIB_LOG(kInfo, "bootstrap: prefill rank %s at %s unregistered (%d ranks left)",
            RankIdString(id), JoinHostPort(host, port), ranks_.size());
  return true;
}

StatusOr<ParallelInfo> BootstrapTable::GetParallelInfo() const {
  MutexLock lock(&mu_);
  if (ranks_.empty()) {
    return Status::NotFound("no prefill rank has registered with this bootstrap server yet");
  }
  ParallelInfo info;
  info.tp_size = layout_->tp_size;
  info.dp_size = layout_->dp_size;
  info.pp_size = layout_->pp_size;
  info.page_size = layout_->page_size;
  info.fingerprint = layout_->fingerprint;
  info.ranks_registered = static_cast<int32_t>(ranks_.size());
  info.ranks_expected = layout_->ranks_expected();
  return info;
}

StatusOr<RankAddress> BootstrapTable::GetRankAddress(const RankId& id) const {
  for (Status s : {CheckNonNegative("dp_rank", id.dp_rank), CheckNonNegative("tp_rank", id.tp_rank),
                   CheckNonNegative("pp_rank", id.pp_rank)}) {
    if (!s.ok()) return s;
  }
  MutexLock lock(&mu_);
  if (ranks_.empty()) {
    return Status::NotFound(absl::StrFormat(
        "prefill rank %s is not registered: no prefill rank has registered with this bootstrap "
        "server yet",
        RankIdString(id)));
  }
  const Layout& layout = *layout_;
  auto out_of_range = [&](const char* field, int32_t rank, int32_t size) {
    return Status::InvalidArgument(absl::StrFormat(
        "%s %d out of range [0, %d) of the registered prefill deployment (tp_size %d, dp_size %d, "
        "pp_size %d)",
        field, rank, size, layout.tp_size, layout.dp_size, layout.pp_size));
  };
  if (id.dp_rank >= layout.dp_size) return out_of_range("dp_rank", id.dp_rank, layout.dp_size);
  if (id.tp_rank >= layout.tp_size) return out_of_range("tp_rank", id.tp_rank, layout.tp_size);
  if (id.pp_rank >= layout.pp_size) return out_of_range("pp_rank", id.pp_rank, layout.pp_size);
  const auto it = ranks_.find(id);
  if (it == ranks_.end()) {
    return Status::NotFound(absl::StrFormat(
        "prefill rank %s is not registered (%d of %d ranks are); it may not have started yet",
        RankIdString(id), ranks_.size(), layout.ranks_expected()));
  }
  return RankAddress{it->second.host, it->second.port, it->second.registration_id};
}

int32_t BootstrapTable::ranks_registered() const {
  MutexLock lock(&mu_);
  return static_cast<int32_t>(ranks_.size());
}

Status BootstrapTable::ReportRoomFailures(const std::vector<RoomFailure>& failures,
                                          absl::Time now) {
  if (failures.size() > kMaxRoomFailuresPerCall) {
    return Status::InvalidArgument(absl::StrFormat("%d room failures in one report (at most %d)",
                                                   failures.size(), kMaxRoomFailuresPerCall));
  }
  for (const RoomFailure& f : failures) {
    if (f.room == 0) return Status::InvalidArgument("room failure for room 0");
  }
  MutexLock lock(&failures_mu_);
  ExpireRoomFailures(now);
  const absl::Time expires = now + absl::Seconds(kRoomFailureTtlSeconds);
  for (const RoomFailure& f : failures) {
    if (failed_rooms_.contains(f.room)) continue;
    while (failed_rooms_.size() >= kMaxRoomFailuresKept && !failed_order_.empty()) {
      failed_rooms_.erase(failed_order_.front().second);
      failed_order_.pop_front();
    }
    failed_rooms_[f.room] = {f.reason.substr(0, kMaxRoomFailureReason), expires};
    failed_order_.emplace_back(expires, f.room);
  }
  return Status::OK();
}

StatusOr<std::vector<RoomFailure>> BootstrapTable::RoomFailures(const std::vector<uint64_t>& rooms,
                                                                absl::Time now) const {
  if (rooms.size() > kMaxRoomFailuresPerCall) {
    return Status::InvalidArgument(absl::StrFormat("%d rooms in one lookup (at most %d)",
                                                   rooms.size(), kMaxRoomFailuresPerCall));
  }
  std::vector<RoomFailure> out;
  MutexLock lock(&failures_mu_);
  for (uint64_t room : rooms) {
    auto it = failed_rooms_.find(room);
    if (it != failed_rooms_.end() && it->second.expires > now) {
      out.push_back({room, it->second.reason});
    }
  }
  return out;
}

void BootstrapTable::ExpireRoomFailures(absl::Time now) {
  while (!failed_order_.empty() && failed_order_.front().first <= now) {
    auto it = failed_rooms_.find(failed_order_.front().second);
    if (it != failed_rooms_.end() && it->second.expires <= now) failed_rooms_.erase(it);
    failed_order_.pop_front();
  }
}

}  // namespace control
}  // namespace v1
}  // namespace pdlib
