// Pieces both protocol cores share: memory registration with the transport, the timeout
// scanner, failure injection and metric counters.
#ifndef PDLIB_LIB_CORE_MANAGER_COMMON_H_
#define PDLIB_LIB_CORE_MANAGER_COMMON_H_

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "lib/base/mutex.h"
#include "lib/core/control_messages.h"
#include "lib/core/kv_digest.h"
#include "lib/core/room_table.h"
#include "pdlib/kv_manager.h"
#include "pdlib/spi/transport.h"

namespace pdlib {
inline namespace v1 {

// The transport regions of one BufferFamily, in buffer order.
struct RegisteredFamily {
  std::vector<spi::LocalRegionId> ids;
  std::vector<RegionDesc> descs;  // what a peer needs to write into them
};

// Every KV, aux and state buffer of one manager, registered once (DESIGN "Data plane").
struct RegisteredBuffers {
  RegisteredFamily kv, aux, state;
};

// KVManagerOptions::direction kPull with a backend that cannot read: refused with the backend
// named and what to do, before anything is registered.
Status CheckDirectionSupported(const spi::Transport& transport, const KVManagerOptions& options);
// KVManagerOptions::checksum with GPU pools and a backend that cannot digest GPU memory
// (capabilities().digests_cuda_memory): refused the same way.
Status CheckChecksumSupported(const spi::Transport& transport, const KVManagerOptions& options);
// The transport's options for `options`: its args' device and NICs, the backend options, the
// side, and where the KV pool lives (the NUMA node of the first KV buffer's memory for host
// pools, the PCI address of its GPU for CUDA pools), which backends use to pick rails by topology
// (lib/rails).
spi::TransportOptions TransportOptionsFor(const KVManagerOptions& options);
// The PCI address of the GPU that holds `addr` ("0000:3B:00.0", as the CUDA driver writes it),
// asked of the CUDA driver the process has already loaded (libcuda.so.1 opened with RTLD_NOLOAD:
// pdlib neither links nor loads CUDA for this); "" when no driver is loaded, or it does not know
// the pointer (not CUDA memory, cuInit not called).
std::string PciAddressOfCudaMemory(uint64_t addr);
StatusOr<RegisteredBuffers> RegisterBuffers(spi::Transport& transport, const KVArgs& args);
void DeregisterBuffers(spi::Transport& transport, const RegisteredBuffers& buffers);

// KV integrity (KVManagerOptions::checksum): the setting as the fingerprint carries it ("off",
// "all", "sampled/N"), whether `room` is digested (the same rooms on both sides), and where one
// side's registered buffers are, for the digest.
std::string ChecksumSetting(const KVManagerOptions& options);
bool ChecksumRoom(const KVManagerOptions& options, uint64_t room);
// `device_reader`: the transport whose DigestRanges reads KV and state pools in GPU memory
// (null: host pools); it must outlive the result.
DigestMemory DigestMemoryOf(const RegisteredBuffers& buffers, spi::Transport* device_reader);
// The item sizes of a peer's regions (addresses unused): decode's items as a sender places them.
DigestMemory DigestItemsOf(const std::vector<RegionDesc>& kv, const std::vector<RegionDesc>& aux,
                           const std::vector<RegionDesc>& state);

// The probability from options, or from PDLIB_TEST_FAILURE_PROB when the option is negative.
double ResolveFailureInjectionProb(const KVManagerOptions& options);

// Thread-safe coin for failure injection.
// The stages failure injection can strike (KVManagerOptions::failure_injection_stages).
enum class FailureStage : uint32_t {
  kBootstrap = 1u << 0,
  kRegister = 1u << 1,
  kTransferInfo = 1u << 2,
  kChunk = 1u << 3,
  kAux = 1u << 4,
  kState = 1u << 5,
  kStatus = 1u << 6,
  // Not a failure: one op of a KV batch moves the bytes one further on (push: prefill's write,
  // pull: decode's read), through the real transport, so the bytes that land are wrong (KV
  // integrity tests and pdlib-chaos). At most once a room per rank; counted in
  // metrics().corruptions_injected.
  kCorrupt = 1u << 7,
};
const char* FailureStageName(FailureStage stage);
// Parses a comma-separated stage list ("all": every stage); kInvalidArgument names a bad entry.
StatusOr<uint32_t> ParseFailureStages(std::string_view stages);
// The stage mask from options, or from PDLIB_TEST_FAILURE_STAGES when the option is empty.
uint32_t ResolveFailureStages(const KVManagerOptions& options);

class FailureInjector {
 public:
  FailureInjector(double prob, uint32_t stages) : prob_(prob), stages_(stages) {}
  bool enabled() const { return prob_ > 0 && stages_ != 0; }
  double prob() const { return prob_; }
  // True when a failure should be injected at `stage`.
  bool Roll(FailureStage stage);
  // The Status an injected failure at `stage` reports, naming the room and the stage.
  Status Injected(FailureStage stage, uint64_t room) const;

 private:
  double prob_;
  uint32_t stages_;
  Mutex mu_;
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_){std::random_device{}()};
};

// Failure injection stage `corrupt`: moves the longest op of `ops` (at least 2 bytes) one byte
// further on at its source, so its destination gets its neighbour's bytes (and its last byte
// stays as it was). `source_is_remote`: reads (the op's remote side is the source). False when
// no op can be shifted.
bool CorruptOneOp(std::vector<spi::WriteOp>* ops, bool source_is_remote);

// Counters behind KVManagerMetrics; relaxed atomics: metrics are statistics, not
// synchronisation.
struct MetricCounters {
  std::atomic<uint64_t> requests{0}, succeeded{0}, failed{0}, bootstrap_failed{0},
      transfer_failed{0};
  std::atomic<uint64_t> bytes{0}, pages{0}, batches{0};
  std::atomic<uint64_t> latency_us_sum{0};
  std::atomic<uint64_t> checksummed{0};            // rooms digested (KVManagerOptions::checksum)
  std::atomic<uint64_t> checksummed_in_flight{0};  // ... every cell by the transport's copy
  std::atomic<uint64_t> corrupted{0};              // failure injection stage `corrupt`

  void Add(std::atomic<uint64_t>& c, uint64_t n = 1) { c.fetch_add(n, std::memory_order_relaxed); }
  // Counts a room that just failed (call only for the Fail() that returned true).
  void CountFailure(const RoomState& room);
  // Counts a room that just succeeded (call only for the Advance(kSuccess) that returned true).
  void CountSuccess(const RoomState& room);
  void FillInto(KVManagerMetrics* m, const RoomTable& rooms) const;
  // Decode: a digested room whose bytes did not match, with the prefill ranks that wrote it.
  void CountChecksumMismatch(const std::vector<std::string>& peers);

 private:
  mutable Mutex causes_mu_;
  std::map<std::string, uint64_t> failed_by_cause_ ABSL_GUARDED_BY(causes_mu_);
  uint64_t checksum_mismatches_ ABSL_GUARDED_BY(causes_mu_) = 0;
  std::map<std::string, uint64_t> mismatches_by_peer_ ABSL_GUARDED_BY(causes_mu_);
};

// Chooses, when a room is created, whether its per-room info lines are logged, per
// KVManagerOptions::room_log_every (0: auto, 1: every room, N: id a multiple of N).
// Thread-safe; the auto budget per second is approximate under concurrent calls.
class RoomLogSampler {
 public:
  explicit RoomLogSampler(uint32_t every) : every_(every) {}
  // Nothing is counted while info is off: rooms created then are not logged.
  bool Sample(uint64_t room);
  // The decision at `now_second` (any monotonic count of seconds), for tests.
  bool SampleAt(uint64_t room, int64_t now_second);

 private:
  const uint32_t every_;
  std::atomic<int64_t> second_{-1};
  std::atomic<uint32_t> in_second_{0};  // rooms created in second_
};

// Rooms whose handle was destroyed in state Failed, waiting for KVManager::TakeReusableRooms()
// once their pages are reusable. Bounded: past kMax the oldest is dropped, with an ERROR log
// (an engine that destroys failed handles must call TakeReusableRooms). Thread-safe; its lock is
// a leaf (taken under the cores' locks, never the other way round).
class ReleasedRooms {
 public:
  static constexpr size_t kMax = size_t{1} << 16;
  explicit ReleasedRooms(const char* side) : side_(side) {}
  void Add(uint64_t room);
  std::vector<uint64_t> Take();

 private:
  const char* const side_;  // "prefill" or "decode", for the log line
  Mutex mu_;
  std::deque<uint64_t> rooms_ ABSL_GUARDED_BY(mu_);
};

// The deadline for the room's current state, per the manager's options; a non-OK status (with
// the reason to fail the room) when it has passed.
Status CheckRoomDeadline(const RoomState& room, const KVManagerOptions& options, absl::Time now);

// Runs `tick` every `period` on its own thread until destroyed.
class PeriodicThread {
 public:
  PeriodicThread(absl::Duration period, std::function<void()> tick);
  ~PeriodicThread();

 private:
  Mutex mu_;
  CondVar cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CORE_MANAGER_COMMON_H_
