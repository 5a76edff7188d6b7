// BootstrapTable: the bootstrap server's state and rules, with no I/O, so that every rule is
// unit-tested without a network (bootstrap_table_test.cc). BootstrapServer's handlers only
// convert messages and call it.
//
// Rules (SPEC R6.1):
// - Only a valid registration is stored (ValidateRankRegistration).
// - The first rank to register fixes the deployment's parallel sizes, page size and
//   fingerprint; a later rank that disagrees is rejected with FAILED_PRECONDITION naming both
//   values. When the registering rank is the only one registered (e.g. a one-rank deployment
//   restarted with a new layout), its registration sets the layout afresh.
// - Registering a rank that is already registered replaces its address (a restarted rank).
//
// Thread-safe: every method may be called from any thread.
#ifndef PDLIB_LIB_CONTROL_BOOTSTRAP_TABLE_H_
#define PDLIB_LIB_CONTROL_BOOTSTRAP_TABLE_H_

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "lib/base/mutex.h"
#include "lib/control/bootstrap_types.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace control {

// Bounds that keep tp_size * dp_size * pp_size far from overflow.
inline constexpr int32_t kMaxParallelSize = 65536;
inline constexpr int64_t kMaxDeploymentRanks = int64_t{1} << 20;

// INVALID_ARGUMENT naming the first bad field and its value; OK otherwise.
Status ValidateRankRegistration(const RankRegistration& reg);

class BootstrapTable {
 public:
  BootstrapTable() = default;
  BootstrapTable(const BootstrapTable&) = delete;
  BootstrapTable& operator=(const BootstrapTable&) = delete;

  StatusOr<RegisterResult> Register(const RankRegistration& reg) ABSL_LOCKS_EXCLUDED(mu_);

  // Removes `id` when it is registered at exactly host:port; returns whether it did. A rank
  // registered at another address (a restarted successor) is left alone.
  StatusOr<bool> Unregister(const RankId& id, const std::string& host, uint32_t port)
      ABSL_LOCKS_EXCLUDED(mu_);

  // NOT_FOUND while no rank is registered.
  StatusOr<ParallelInfo> GetParallelInfo() const ABSL_LOCKS_EXCLUDED(mu_);

  // INVALID_ARGUMENT for a negative rank or one outside the registered sizes; NOT_FOUND when
  // the rank has not registered.
  StatusOr<RankAddress> GetRankAddress(const RankId& id) const ABSL_LOCKS_EXCLUDED(mu_);

  int32_t ranks_registered() const ABSL_LOCKS_EXCLUDED(mu_);

  // The room-failure relay. Report: INVALID_ARGUMENT for more than kMaxRoomFailuresPerCall
  // rooms or a room 0 (nothing stored then); reasons are cut to kMaxRoomFailureReason bytes.
  // Kept kRoomFailureTtlSeconds, at most kMaxRoomFailuresKept (the oldest go first); a room
  // reported again keeps its first reason. Lookup: the failed ones among `rooms` (at most
  // kMaxRoomFailuresPerCall, else INVALID_ARGUMENT).
  Status ReportRoomFailures(const std::vector<RoomFailure>& failures, absl::Time now)
      ABSL_LOCKS_EXCLUDED(mu_);
  StatusOr<std::vector<RoomFailure>> RoomFailures(const std::vector<uint64_t>& rooms,
                                                  absl::Time now) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // The layout every rank of the deployment must agree on, and who set it (for messages).
  struct Layout {
    int32_t tp_size = 0;
    int32_t dp_size = 0;
    int32_t pp_size = 0;
    uint32_t page_size = 0;
    ModelFingerprint fingerprint;
    std::string set_by;  // "rank (dp 0, tp 0, pp 0) at 10.0.0.1:7000"

    int32_t ranks_expected() const { return tp_size * dp_size * pp_size; }
  };
  struct Entry {
    std::string host;
    uint16_t port = 0;
    uint64_t registration_id = 0;
  };

  static Status CheckAgainstLayout(const Layout& layout, const RankRegistration& reg);

  mutable Mutex mu_;
  std::optional<Layout> layout_ ABSL_GUARDED_BY(mu_);  // set while any rank is registered
  absl::flat_hash_map<RankId, Entry> ranks_ ABSL_GUARDED_BY(mu_);
  uint64_t next_registration_id_ ABSL_GUARDED_BY(mu_) = 1;

  struct FailedRoom {
    std::string reason;
    absl::Time expires;
  };
  void ExpireRoomFailures(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(failures_mu_);
  mutable Mutex failures_mu_;
  absl::flat_hash_map<uint64_t, FailedRoom> failed_rooms_ ABSL_GUARDED_BY(failures_mu_);
  std::deque<std::pair<absl::Time, uint64_t>> failed_order_ ABSL_GUARDED_BY(failures_mu_);
};

}  // namespace control
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CONTROL_BOOTSTRAP_TABLE_H_
