#include "lib/core/manager_common.h"

#include <dlfcn.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "lib/base/log_internal.h"

namespace pdlib {
inline namespace v1 {
namespace {

Status RegisterFamily(spi::Transport& transport, const BufferFamily& family, MemoryKind kind,
                      int32_t device, const char* what, RegisteredFamily* out) {
  for (size_t i = 0; i < family.size(); ++i) {
    spi::MemoryRegion region{reinterpret_cast<const void*>(family.ptrs[i]), family.lens[i], kind,
                             device};
    RegionDesc desc{family.ptrs[i], family.lens[i], family.item_lens[i], {}};
    auto id = transport.RegisterMemory(region, &desc.key);
    if (!id.ok()) {
      return id.status().WithPrefix(
          absl::StrFormat("registering %s buffer %d (%d bytes)", what, i, family.lens[i]));
    }
    out->ids.push_back(*id);
    out->descs.push_back(std::move(desc));
  }
  return Status::OK();
}

}  // namespace

namespace {

// The NUMA node holding the page at `addr` (get_mempolicy with MPOL_F_NODE | MPOL_F_ADDR, which
// faults the page in: the pool's memory is about to be registered anyway), or -1.
int NumaNodeOf(uint64_t addr) {
#if defined(SYS_get_mempolicy)
  constexpr unsigned long kMpolFNode = 1, kMpolFAddr = 2;  // numaif.h
  int node = -1;
  if (addr != 0 && ::syscall(SYS_get_mempolicy, &node, nullptr, 0UL, reinterpret_cast<void*>(addr),
                             kMpolFNode | kMpolFAddr) == 0) {
    return node;
  }
#else
  (void)addr;
#endif
  return -1;
}

}  // namespace

std::string PciAddressOfCudaMemory(uint64_t addr) {
  if (addr == 0) return "";
  // RTLD_NOLOAD: only a driver the process already loaded (the engine's), never a new one.
  void* driver = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (driver == nullptr) return "";
  // The driver API's C signatures (cuda.h), with its enums and handles as the ints they are.
  using PointerGetAttribute = int (*)(void* data, int attribute, unsigned long long ptr);
  using DeviceGetPciBusId = int (*)(char* bus_id, int len, int device);
  constexpr int kPointerAttributeDeviceOrdinal = 9;  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
  auto get_attribute =
      reinterpret_cast<PointerGetAttribute>(::dlsym(driver, "cuPointerGetAttribute"));
  auto get_bus_id = reinterpret_cast<DeviceGetPciBusId>(::dlsym(driver, "cuDeviceGetPCIBusId"));
  std::string address;
  int ordinal = -1;
  if (get_attribute != nullptr && get_bus_id != nullptr &&
      get_attribute(&ordinal, kPointerAttributeDeviceOrdinal, addr) == 0 && ordinal >= 0) {
    char bus_id[64] = {};
    if (get_bus_id(bus_id, sizeof(bus_id) - 1, ordinal) == 0) address = bus_id;
  }
  ::dlclose(driver);
  return address;
}

spi::TransportOptions TransportOptionsFor(const KVManagerOptions& options) {
  spi::TransportOptions t{options.args.device_id, options.args.nic_names, options.backend_options,
                          options.mode, options.direction};
  if (options.args.kv.ptrs.empty()) return t;
  if (options.args.memory_kind == MemoryKind::kHost) {
    t.memory_numa_node = NumaNodeOf(options.args.kv.ptrs.front());
  } else if (options.args.memory_kind == MemoryKind::kCuda) {
    // "" where the CUDA driver is not loaded or cannot say: the backends then rank NICs without
    // the GPU's place (nic_names names them exactly).
    t.memory_pci_address = PciAddressOfCudaMemory(options.args.kv.ptrs.front());
  }
  return t;
}

Status CheckDirectionSupported(const spi::Transport& transport, const KVManagerOptions& options) {
  if (options.direction != TransferDirection::kPull || transport.capabilities().reads) {
    return Status::OK();
  }
  return Status::FailedPrecondition(absl::StrFormat(
      "backend '%s' cannot read a peer's memory (capabilities().reads is false), so it cannot "
      "serve direction pull: use direction push, or a backend that reads (fake, ucx, verbs, "
      "cuda_ipc)",
      std::string(transport.name())));
}

Status CheckChecksumSupported(const spi::Transport& transport, const KVManagerOptions& options) {
  if (options.checksum == KvChecksum::kOff || options.args.memory_kind == MemoryKind::kHost ||
      transport.capabilities().digests_cuda_memory) {
    return Status::OK();
  }
  return Status::FailedPrecondition(absl::StrFormat(
      "checksum with KV pools in %s memory: backend '%s' cannot digest GPU memory "
      "(capabilities().digests_cuda_memory is false); use backend cuda_ipc, or checksum off "
      "(docs/reliability.md \"KV integrity\")",
      std::string(MemoryKindName(options.args.memory_kind)), std::string(transport.name())));
}

StatusOr<RegisteredBuffers> RegisterBuffers(spi::Transport& transport, const KVArgs& args) {
  // A GPU pool with a backend that cannot reach GPU memory: refused before anything is
  // registered, with what to do about it (the backend's own RegisterMemory would say less).
  if (args.memory_kind == MemoryKind::kCuda && !transport.capabilities().supports_cuda_memory) {
    return Status::FailedPrecondition(absl::StrFormat(
        "backend '%s' cannot reach KV pools in %s memory (KVArgs::memory_kind, device %d): "
        "use a backend that can (cuda_ipc on one node; ucx when UCX was built with CUDA; verbs "
        "with GPUDirect RDMA), or pools in host memory",
        std::string(transport.name()), std::string(MemoryKindName(args.memory_kind)),
        args.device_id));
  }
  RegisteredBuffers out;
  Status s = RegisterFamily(transport, args.kv, args.memory_kind, args.device_id, "kv", &out.kv);
  // Metadata lives in host memory (MetadataBuffers); state follows the KV memory kind.
  if (s.ok()) s = RegisterFamily(transport, args.aux, MemoryKind::kHost, 0, "aux", &out.aux);
  auto families = EffectiveStateFamilies(args);
  if (s.ok() && !families.ok()) s = families.status();
  for (size_t f = 0; s.ok() && f < families->size(); ++f) {
    const std::string what =
        absl::StrFormat("state family %d (%s)", f, StateTypeName((*families)[f].type));
    s = RegisterFamily(transport, (*families)[f].buffers, args.memory_kind, args.device_id,
                       what.c_str(), &out.state);
  }
  if (!s.ok()) {
    DeregisterBuffers(transport, out);
    return s;
  }
  return out;
}

void DeregisterBuffers(spi::Transport& transport, const RegisteredBuffers& buffers) {
  for (const RegisteredFamily* f : {&buffers.kv, &buffers.aux, &buffers.state}) {
    for (spi::LocalRegionId id : f->ids) {
      Status s = transport.DeregisterMemory(id);
      if (!s.ok()) PDLIB_LOG(kWarning, "deregistering region %d: %s", id, s.ToString());
    }
  }
}

bool CorruptOneOp(std::vector<spi::WriteOp>* ops, bool source_is_remote) {
  spi::WriteOp* longest = nullptr;
  for (spi::WriteOp& op : *ops) {
    if (op.length >= 2 && (!longest || op.length > longest->length)) longest = &op;
  }
  if (!longest) return false;
  (source_is_remote ? longest->remote_offset : longest->local_offset) += 1;
  longest->length -= 1;
  return true;
}

std::string ChecksumSetting(const KVManagerOptions& options) {
  switch (options.checksum) {
    case KvChecksum::kOff: return "off";
    case KvChecksum::kAll: return "all";
    case KvChecksum::kSampled:
      return options.checksum_sample_every <= 1
                 ? "all"
                 : absl::StrFormat("sampled/%d", options.checksum_sample_every);
  }
  return "off";
}

bool ChecksumRoom(const KVManagerOptions& options, uint64_t room) {
  if (options.checksum == KvChecksum::kAll) return true;
  if (options.checksum != KvChecksum::kSampled) return false;
  if (options.checksum_sample_every <= 1) return true;
  // A hash of the id, not the id: engines number rooms in patterns (DP groups by room % dp).
  uint64_t z = room + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return z % options.checksum_sample_every == 0;
}

DigestMemory DigestMemoryOf(const RegisteredBuffers& buffers, spi::Transport* device_reader) {
  DigestMemory m;
  if (device_reader != nullptr) {
    m.device_crcs = [device_reader](std::span<const spi::DigestRange> ranges,
                                    std::span<uint32_t> crcs) {
      return device_reader->DigestRanges(ranges, crcs);
    };
  }
  for (auto [descs, addr, item] : {std::tuple{&buffers.kv.descs, &m.kv, &m.kv_item},
                                   std::tuple{&buffers.aux.descs, &m.aux, &m.aux_item},
                                   std::tuple{&buffers.state.descs, &m.state, &m.state_item}}) {
    for (const RegionDesc& d : *descs) {
      addr->push_back(d.addr);
      item->push_back(d.item_len);
    }
  }
  return m;
}

DigestMemory DigestItemsOf(const std::vector<RegionDesc>& kv, const std::vector<RegionDesc>& aux,
                           const std::vector<RegionDesc>& state) {
  DigestMemory m;
  for (const RegionDesc& d : kv) m.kv_item.push_back(d.item_len);
  for (const RegionDesc& d : aux) m.aux_item.push_back(d.item_len);
  for (const RegionDesc& d : state) m.state_item.push_back(d.item_len);
  return m;
}

double ResolveFailureInjectionProb(const KVManagerOptions& options) {
  if (options.failure_injection_prob >= 0) return options.failure_injection_prob;
  const char* env = std::getenv("PDLIB_TEST_FAILURE_PROB");
  if (env == nullptr || *env == '\0') return 0;
  double p = 0;
  if (!absl::SimpleAtod(env, &p) || p < 0 || p > 1) {
    PDLIB_LOG(kWarning, "ignoring PDLIB_TEST_FAILURE_PROB=%s (want a number in [0, 1])", env);
    return 0;
  }
  return p;
}

namespace {
constexpr std::pair<FailureStage, const char*> kStageNames[] = {
    {FailureStage::kBootstrap, "bootstrap"},
    {FailureStage::kRegister, "register"},
    {FailureStage::kTransferInfo, "transfer_info"},
    {FailureStage::kChunk, "chunk"},
    {FailureStage::kAux, "aux"},
    {FailureStage::kState, "state"},
    {FailureStage::kStatus, "status"},
    {FailureStage::kCorrupt, "corrupt"},
};
}  // namespace

const char* FailureStageName(FailureStage stage) {
  for (auto [s, name] : kStageNames) {
    if (s == stage) return name;
  }
  return "unknown";
}

StatusOr<uint32_t> ParseFailureStages(std::string_view stages) {
  uint32_t mask = 0;
  for (absl::string_view part : absl::StrSplit(absl::string_view(stages.data(), stages.size()), ',',
                                               absl::SkipWhitespace())) {
    part = absl::StripAsciiWhitespace(part);
    if (part == "all") {
      // Every stage that fails a request; `corrupt` (wrong bytes, not a failure) only by name.
      for (auto [s, name] : kStageNames) {
        if (s != FailureStage::kCorrupt) mask |= static_cast<uint32_t>(s);
      }
      continue;
    }
    bool found = false;
    for (auto [s, name] : kStageNames) {
      if (part == name) {
        mask |= static_cast<uint32_t>(s);
        found = true;
      }
    }
    if (!found) {
      return Status::InvalidArgument(absl::StrFormat(
          "failure injection stage '%s' is not one of bootstrap, register, transfer_info, chunk, "
          "aux, state, status, corrupt, all",
          part));
    }
  }
  return mask;
}

uint32_t ResolveFailureStages(const KVManagerOptions& options) {
  std::string_view stages = options.failure_injection_stages;
  if (stages.empty()) {
    const char* env = std::getenv("PDLIB_TEST_FAILURE_STAGES");
    stages = env != nullptr ? env : "";
  }
  if (stages.empty()) return static_cast<uint32_t>(FailureStage::kChunk);
  auto mask = ParseFailureStages(stages);
  if (!mask.ok()) {
    // Options were validated at Create; only the environment can be wrong here.
    PDLIB_LOG(kWarning, "ignoring PDLIB_TEST_FAILURE_STAGES: %s", mask.status().ToString());
    return static_cast<uint32_t>(FailureStage::kChunk);
  }
  return *mask;
}

Status FailureInjector::Injected(FailureStage stage, uint64_t room) const {
  return Status::Internal(absl::StrFormat("room %d: injected failure at stage %s (probability %g)",
                                          room, FailureStageName(stage), prob_));
}

bool FailureInjector::Roll(FailureStage stage) {
  if (prob_ <= 0 || (stages_ & static_cast<uint32_t>(stage)) == 0) return false;
  MutexLock lock(&mu_);
  return std::uniform_real_distribution<double>(0, 1)(rng_) < prob_;
}

void MetricCounters::CountFailure(const RoomState& room) {
  Add(failed);
  Add(room.failed_from() == KVPoll::kBootstrapping ? bootstrap_failed : transfer_failed);
  std::string cause(StatusCodeName(room.FailureReason().code()));
  MutexLock lock(&causes_mu_);
  ++failed_by_cause_[cause];
}

void MetricCounters::CountSuccess(const RoomState& room) {
  Add(succeeded);
  Add(latency_us_sum,
      static_cast<uint64_t>(absl::ToInt64Microseconds(absl::Now() - room.created())));
}

void MetricCounters::CountChecksumMismatch(const std::vector<std::string>& peers) {
  MutexLock lock(&causes_mu_);
  ++checksum_mismatches_;
  for (const std::string& p : peers) {
    // Bounded: a deployment has a few hundred prefill ranks, not thousands of names.
    if (mismatches_by_peer_.size() < 1024 || mismatches_by_peer_.count(p)) ++mismatches_by_peer_[p];
  }
}

void MetricCounters::FillInto(KVManagerMetrics* m, const RoomTable& rooms) const {
  auto get = [](const std::atomic<uint64_t>& c) { return c.load(std::memory_order_relaxed); };
  m->rooms_succeeded = get(succeeded);
  m->rooms_failed = get(failed);
  m->bootstrap_failed_reqs = get(bootstrap_failed);
  m->transfer_failed_reqs = get(transfer_failed);
  m->bytes_transferred = get(bytes);
  m->pages_transferred = get(pages);
  m->write_batches = get(batches);
  m->requests_total = get(requests);
  m->transfer_latency_us_sum = get(latency_us_sum);
  m->transfer_latency_count = m->rooms_succeeded;
  m->rooms_checksummed = get(checksummed);
  m->rooms_checksummed_in_flight = get(checksummed_in_flight);
  m->corruptions_injected = get(corrupted);
  {
    MutexLock lock(&causes_mu_);
    m->failed_by_cause = failed_by_cause_;
    m->checksum_mismatches = checksum_mismatches_;
    m->checksum_mismatches_by_peer = mismatches_by_peer_;
  }
  m->live_rooms = 0;
  m->bootstrap_queue_size = 0;
  m->transfer_queue_size = 0;
  for (const auto& room : rooms.Snapshot()) {
    ++m->live_rooms;
    KVPoll s = room->Poll();
    if (s == KVPoll::kBootstrapping) ++m->bootstrap_queue_size;
    if (s == KVPoll::kWaitingForInput || s == KVPoll::kTransferring) ++m->transfer_queue_size;
  }
}

Status CheckRoomDeadline(const RoomState& room, const KVManagerOptions& options, absl::Time now) {
  const KVPoll state = room.Poll();
  switch (state) {
    case KVPoll::kBootstrapping:
    case KVPoll::kWaitingForInput: {
      const bool boot = state == KVPoll::kBootstrapping;
      const auto limit = boot ? options.bootstrap_timeout : options.waiting_timeout;
      if (now - room.state_since() <= absl::FromChrono(limit)) return Status::OK();
      return Status::DeadlineExceeded(absl::StrFormat(
          "room %d: timed out after %d ms in state %s (%s)", room.room(), limit.count(),
          KVPollName(state), boot ? "bootstrap_timeout" : "waiting_timeout"));
    }
    case KVPoll::kTransferring:
      if (!room.transfer_started()) {
        // Decode's TransferInfo is out and no byte has moved: the other side has not started
        // (a busy prefill), which is waiting, not a transfer.
        if (now - room.state_since() <= absl::FromChrono(options.waiting_timeout)) {
          return Status::OK();
        }
        return Status::DeadlineExceeded(absl::StrFormat(
            "room %d: timed out after %d ms in state Transferring waiting for the transfer to "
            "start (waiting_timeout)",
            room.room(), options.waiting_timeout.count()));
      }
      if (now - room.last_progress() <= absl::FromChrono(options.transfer_timeout)) {
        return Status::OK();
      }
      return Status::DeadlineExceeded(
          absl::StrFormat("room %d: no transfer progress for %d ms in state Transferring "
                          "(transfer_timeout)",
                          room.room(), options.transfer_timeout.count()));
    default: return Status::OK();
  }
}

PeriodicThread::PeriodicThread(absl::Duration period, std::function<void()> tick) {
  thread_ = std::thread([this, period, tick = std::move(tick)] {
    auto wait = absl::ToChronoMicroseconds(period);
    while (true) {
      {
        MutexLock lock(&mu_);
        if (!stop_) cv_.WaitFor(&mu_, wait);
        if (stop_) return;
      }
      tick();
    }
  });
}

PeriodicThread::~PeriodicThread() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  thread_.join();
}

bool RoomLogSampler::Sample(uint64_t room) {
  if (!internal::LogEnabled(LogLevel::kInfo)) return false;
  if (every_ != 0) return SampleAt(room, 0);
  return SampleAt(room, absl::GetCurrentTimeNanos() / 1'000'000'000);
}

bool RoomLogSampler::SampleAt(uint64_t room, int64_t now_second) {
  if (every_ != 0) return room % every_ == 0;
  if (room % KVManagerOptions::kRoomLogAutoEvery == 0) return true;
  int64_t seen = second_.load(std::memory_order_relaxed);
  if (seen != now_second && second_.compare_exchange_strong(seen, now_second)) {
    in_second_.store(0, std::memory_order_relaxed);
  }
  return in_second_.fetch_add(1, std::memory_order_relaxed) <
         KVManagerOptions::kRoomLogAutoPerSecond;
}

void ReleasedRooms::Add(uint64_t room) {
  MutexLock lock(&mu_);
  if (rooms_.size() >= kMax) {
    PDLIB_LOG(kError,
              "%s: %d released rooms wait for TakeReusableRooms(); dropping the oldest (an engine "
              "that destroys failed handles must call it)",
              side_, rooms_.size());
    rooms_.pop_front();
  }
  rooms_.push_back(room);
}

std::vector<uint64_t> ReleasedRooms::Take() {
  MutexLock lock(&mu_);
  std::vector<uint64_t> out(rooms_.begin(), rooms_.end());
  rooms_.clear();
  return out;
}

}  // namespace v1
}  // namespace pdlib
