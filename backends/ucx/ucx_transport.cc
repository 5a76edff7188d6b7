// The UCX transport's API side: setup, blobs, validation and hand-over to the progress thread
// (whose side lives in ucx_progress.cc).
#include "backends/ucx/ucx_transport.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "lib/base/kv_pool_allocators.h"
#include "lib/base/log_internal.h"
#include "lib/base/tsan.h"
#include "lib/registry/builtin_registration.h"

namespace pdlib {
inline namespace v1 {
namespace ucx {
namespace {

// Blobs start with a magic and a version, so a blob from another backend or another pdlib
// version is refused with a clear message instead of being handed to UCX.
constexpr uint32_t kEndpointMagic = 0x45554450;  // "PDUE"
constexpr uint32_t kKeyMagic = 0x4b554450;       // "PDUK"
// Version 2: the endpoint blob carries the target id and data path, the key blob a flags word.
// Version 3: the key blob also carries the region's id for "am" read requests.
// Version 4: "am" read requests name many ranges per message (AmReadBatchHeader).
// Version 5: the endpoint blob carries one worker address per rail (ucx.rails).
constexpr uint32_t kBlobVersion = 6;
constexpr size_t kBlobHeader = 8;
// Endpoint payload: target id (8), flags (4), rail count (4), then each rail's worker address
// as its length (4) and its bytes.
constexpr size_t kEndpointPrefix = 16;
constexpr uint32_t kEndpointAm = 1;  // the target takes "am" messages
// Key payload: flags (4), "am" region id (4; 0 for a direct region), packed rkey.
constexpr size_t kKeyPrefix = 8;
constexpr uint32_t kKeyDirect = 1;  // write this region with puts (a peer can map it)
// How long a fence, and a deregistration, wait for read replies that point into the memory
// (UcxTransport::WaitForReplies). A reader that takes its replies drains them in milliseconds;
// the fence's wait holds up the prefill core that retires a reader.
constexpr auto kFenceReplyGrace = std::chrono::milliseconds(500);
constexpr auto kDeregisterReplyGrace = std::chrono::seconds(2);
// How long a closed target's worker stays: the refusals of messages still arriving, and the
// replies already queued, get out meanwhile.
constexpr auto kTargetLinger = std::chrono::seconds(1);

spi::Blob MakeBlob(uint32_t magic, const void* payload, size_t size) {
  spi::Blob blob(kBlobHeader + size);
  std::memcpy(blob.data(), &magic, 4);
  std::memcpy(blob.data() + 4, &kBlobVersion, 4);
  if (size > 0) std::memcpy(blob.data() + kBlobHeader, payload, size);
  return blob;
}

// The payload of a blob made by MakeBlob(magic, ...), or an error naming what is wrong.
StatusOr<std::span<const uint8_t>> BlobPayload(const spi::Blob& blob, uint32_t magic,
                                               const char* what) {
  uint32_t got_magic = 0, version = 0;
  if (blob.size() <= kBlobHeader) {
    return Status::InvalidArgument(std::string("ucx: ") + what + " blob of " +
                                   std::to_string(blob.size()) + " bytes is too short");
  }
  std::memcpy(&got_magic, blob.data(), 4);
  std::memcpy(&version, blob.data() + 4, 4);
  if (got_magic != magic) {
    return Status::InvalidArgument(std::string("ucx: blob is not a ucx ") + what +
                                   " (made by another backend?)");
  }
  if (version != kBlobVersion) {
    return Status::InvalidArgument(std::string("ucx: ") + what + " blob has version " +
                                   std::to_string(version) + ", this pdlib reads version " +
                                   std::to_string(kBlobVersion));
  }
  return std::span<const uint8_t>(blob.data() + kBlobHeader, blob.size() - kBlobHeader);
}

}  // namespace

UcxTransport::UcxTransport(UcxOptions options, std::shared_ptr<UcxContext> context)
    : options_(std::move(options)), context_(std::move(context)) {}

StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create(const spi::TransportOptions& options) {
  auto parsed = ParseUcxOptions(options, [](const char* name) { return std::getenv(name); });
  if (!parsed.ok()) return parsed.status();
#ifdef PDLIB_TSAN
  // UCX's memory hooks (libucm, installed when libucs loads unless UCX_MEM_EVENTS=n) patch
  // madvise in libc; glibc calls it while a thread exits, after TSan dropped the thread's state,
  // and the hook's pthread lock then crashes the process. Only the environment can turn them
  // off in time; pdlib_add_test sets it for tests in TSan builds.
  if (std::getenv("UCX_MEM_EVENTS") == nullptr) {
    PDLIB_LOG(kWarning,
              "ucx: ThreadSanitizer build without UCX_MEM_EVENTS=n in the environment: "
              "threads may crash when they exit");
  }
#endif

  auto context = AcquireUcxContext(*parsed);
  if (!context.ok()) return context.status();
  std::vector<std::shared_ptr<UcxContext>> rails = {*context};
  for (size_t r = 1; r < parsed->rails.size(); ++r) {
    auto rail = AcquireUcxContext(RailOptions(*parsed, r));
    if (!rail.ok()) {
      return rail.status().WithPrefix("ucx: rail " + std::to_string(r) + " (" + parsed->rails[r] +
                                      ")");
    }
    rails.push_back(*rail);
  }
  std::unique_ptr<UcxTransport> transport(new UcxTransport(std::move(*parsed), *context));
  transport->rail_contexts_ = std::move(rails);
  Status init = transport->Init();
  if (!init.ok()) return init;
  return transport;
}

Status UcxTransport::Init() {
  am_target_ = options_.data_path == DataPath::kAm ||
               (options_.data_path == DataPath::kAuto && !context_->rdma_transport);
  // Workers come with connections (MakeWorker); the epoll set starts with the wake fd alone.
  if (Status s = progress_.Open({}); !s.ok()) return s;
  progress_.Start([this] { ProgressLoop(); });
  return Status::OK();
}

StatusOr<std::unique_ptr<UcxTransport::ConnWorker>> UcxTransport::MakeWorker(spi::TargetId target,
                                                                             uint32_t rail) {
  auto w = std::make_unique<ConnWorker>();
  w->transport = this;
  w->target = target;
  w->rail = rail;
  ucp_worker_params_t params{};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  params.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread touches the worker
  ucp_worker_h raw_worker = nullptr;
  ucs_status_t st = ucp_worker_create(rail_contexts_.at(rail)->handle.get(), &params, &raw_worker);
  if (st != UCS_OK) return Status::Internal("ucx: ucp_worker_create failed: " + UcsStatusName(st));
  w->worker.reset(raw_worker);

  ucp_address_t* address = nullptr;
  size_t address_length = 0;
  st = ucp_worker_get_address(raw_worker, &address, &address_length);
  if (st != UCS_OK) {
    return Status::Internal("ucx: ucp_worker_get_address failed: " + UcsStatusName(st));
  }
  UcpWorkerAddress owned_address(raw_worker, address, address_length);
  w->address.assign(owned_address.data(), owned_address.data() + owned_address.size());
  for (auto [id, cb] :
       {std::pair{kAmPutId, &UcxTransport::OnAmPut}, std::pair{kAmAckId, &UcxTransport::OnAmAck},
        std::pair{kAmReadId, &UcxTransport::OnAmRead},
        std::pair{kAmReadReplyId, &UcxTransport::OnAmReadReply},
        std::pair{kAmCloseId, &UcxTransport::OnAmClose},
        std::pair{kAmClosedId, &UcxTransport::OnAmClosed},
        std::pair{kAmAbandonId, &UcxTransport::OnAmAbandon},
        std::pair{kAmAbandonedId, &UcxTransport::OnAmAbandoned},
        std::pair{kAmProbeId, &UcxTransport::OnAmProbe},
        std::pair{kAmProbeAckId, &UcxTransport::OnAmProbeAck}}) {
    ucp_am_handler_param_t am{};
    am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                    UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    am.id = id;
    am.flags = UCP_AM_FLAG_WHOLE_MSG;
    am.cb = cb;
    am.arg = w.get();
    st = ucp_worker_set_am_recv_handler(raw_worker, &am);
    if (st != UCS_OK) {
      return Status::Internal("ucx: ucp_worker_set_am_recv_handler failed: " + UcsStatusName(st));
    }
  }
  st = ucp_worker_get_efd(raw_worker, &w->fd);
  if (st != UCS_OK) {
    return Status::Internal("ucx: ucp_worker_get_efd failed: " + UcsStatusName(st));
  }
  if (Status s = progress_.Watch(w->fd); !s.ok()) return s;
  workers_.push_back(w.get());
  return w;
}

void UcxTransport::DestroyWorker(std::unique_ptr<ConnWorker> worker) {
  if (!worker) return;
  std::erase(workers_, worker.get());
  progress_.Unwatch(worker->fd);
  worker->worker.reset();  // completes its outstanding sends (their callbacks run here)
}

UcxTransport::~UcxTransport() {
  progress_.Stop();  // completes every outstanding batch with kCancelled first (Shutdown)
  // Teardown order: UCX objects that hang off the worker, the worker, then the mappings; the
  // context goes when the last allocation made through it does.
  peer_states_.clear();  // each with its worker
  progress_.ClearCommands();
  {
    MutexLock lock(&mu_);
    peers_.Clear();
    local_regions_.Clear();
  }
  retired_.clear();
  target_workers_.clear();
  closed_targets_.clear();
  workers_.clear();
  orphans_.clear();
}

spi::TransportCapabilities UcxTransport::capabilities() const {
  spi::TransportCapabilities caps;
  caps.moves_bytes = true;
  caps.needs_reply = false;  // UCX wires both ends up from the initiator's ucp_ep_create
  caps.supports_cuda_memory = context_->cuda_supported;
  caps.max_writes_per_batch = 0;
  caps.max_write_bytes = 0;  // split into ucx.chunk_bytes puts here
  // On the "am" path the handler refuses a fenced connection's writes and read requests alike;
  // a region peers access directly (puts, gets) cannot be fenced, in push or pull.
  caps.fences = am_target_ && direct_regions_.load() == 0;
  caps.reads = true;             // "am" read requests or gets; chunked and paced like writes
  caps.digests_landings = true;  // where the am path copies (WatchLandings refuses elsewhere)
  caps.digests_sends = true;     // host memory, any path (each piece just before its send)
  return caps;
}

StatusOr<uint64_t> UcxTransport::WatchLandings(std::span<const spi::DigestRange> cells) {
  {
    // Only memory the am path writes: the handler's copies are what gets digested.
    MutexLock lock(&mu_);
    for (const spi::DigestRange& c : cells) {
      if (c.length == 0) return Status::InvalidArgument("ucx: WatchLandings: an empty cell");
      const LocalRegionEntry* r = local_regions_.Holding(c.addr, c.length);
      if (r == nullptr || r->direct || !am_target_) {
        return Status::FailedPrecondition(
            "ucx: WatchLandings: a cell outside the memory the am path writes (a direct region, "
            "or not registered, or no am path here)");
      }
    }
  }
  // Everything that allocates or sorts happens before the lock: the progress thread takes it for
  // every chunk it copies while a watch is out.
  std::vector<std::pair<uint64_t, uint64_t>> sorted;  // (start, end)
  sorted.reserve(cells.size());
  for (const spi::DigestRange& c : cells) sorted.emplace_back(c.addr, c.addr + c.length);
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i].first < sorted[i - 1].second) {
      return Status::InvalidArgument("ucx: WatchLandings: overlapping cells");
    }
  }
  const uint64_t id = last_landing_watch_.fetch_add(1, std::memory_order_relaxed) + 1;
  LandingWatch stored;
  stored.digests.assign(cells.size(), {});  // its buffer stays put when the watch is moved
  stored.starts.reserve(cells.size());
  std::map<uint64_t, LandingCell> staged;
  for (size_t i = 0; i < cells.size(); ++i) {
    stored.starts.push_back(cells[i].addr);
    staged.emplace_hint(staged.end(), cells[i].addr,
                        LandingCell{cells[i].addr + cells[i].length, id, &stored.digests[i]});
  }
  MutexLock lock(&landing_mu_);
  for (const auto& [start, end] : sorted) {
    auto other = landing_cells_.lower_bound(start);
    if ((other != landing_cells_.end() && other->first < end) ||
        (other != landing_cells_.begin() && std::prev(other)->second.end > start)) {
      return Status::FailedPrecondition("ucx: WatchLandings: a cell another watch holds");
    }
  }
  landing_cells_.merge(staged);  // relinks the nodes: no allocation under the lock
  landing_watches_.emplace(id, std::move(stored));
  landing_watch_count_.fetch_add(1, std::memory_order_relaxed);
  return id;
}

StatusOr<std::vector<spi::LandingDigest>> UcxTransport::TakeLandings(uint64_t watch) {
  std::vector<std::map<uint64_t, LandingCell>::node_type> freed;  // destroyed after the lock
  MutexLock lock(&landing_mu_);
  auto it = landing_watches_.find(watch);
  if (it == landing_watches_.end()) {
    return Status::NotFound("ucx: no landing watch " + std::to_string(watch));
  }
  std::vector<spi::LandingDigest> digests = std::move(it->second.digests);
  freed.reserve(it->second.starts.size());
  EraseLandingWatch(watch, &freed);
  return digests;
}

void UcxTransport::DropLandings(uint64_t watch) {
  std::vector<std::map<uint64_t, LandingCell>::node_type> freed;  // destroyed after the lock
  MutexLock lock(&landing_mu_);
  EraseLandingWatch(watch, &freed);
}

StatusOr<spi::LocalRegionId> UcxTransport::RegisterMemory(const spi::MemoryRegion& region,
                                                          spi::Blob* key_blob) {
  if (region.addr == nullptr || region.length == 0) {
    return Status::InvalidArgument("ucx: cannot register an empty region");
  }
  if (region.kind == MemoryKind::kCuda && !context_->cuda_supported) {
    return Status::FailedPrecondition(
        "ucx: cannot register CUDA memory: this UCX reports no CUDA support (ucx_info -d lists "
        "no cuda_copy/cuda_ipc transport); install a CUDA-enabled UCX");
  }
  const auto addr = reinterpret_cast<uintptr_t>(region.addr);
  if (addr + region.length < addr) return Status::InvalidArgument("ucx: region wraps around");

  // A range inside a KV pool that UCX allocated reuses that mapping (ucx_context.h).
  std::shared_ptr<UcpMemh> memh = context_->FindAllocation(addr, region.length);
  if (!memh && InForeignUcxPool(*context_, addr, region.length)) {
    PDLIB_LOG(kWarning,
              "ucx: registering %d bytes at %p inside a KV pool allocated with other backend "
              "options than this transport's: UCX maps it again, and shared-memory puts into it "
              "are emulated (pass the manager's backend_options and mode to AllocateKVPool)",
              region.length, region.addr);
  }
  const bool direct = IsDirectRegion(region, memh != nullptr);
  uint32_t am_region = 0;
  using Result = StatusOr<std::pair<std::shared_ptr<UcpMemh>, spi::Blob>>;
  Result mapped = progress_.Run<Result>([&]() -> Result {
    ucp_context_h ctx = context_->handle.get();
    std::shared_ptr<UcpMemh> handle = memh;
    if (!handle) {
      ucp_mem_map_params_t params{};
      params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                          UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
      params.address = const_cast<void*>(region.addr);
      params.length = region.length;
      params.memory_type =
          region.kind == MemoryKind::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
      ucp_mem_h raw = nullptr;
      ucs_status_t st = ucp_mem_map(ctx, &params, &raw);
      if (st != UCS_OK) {
        return Status::Internal("ucx: ucp_mem_map of " + std::to_string(region.length) +
                                " bytes failed: " + UcsStatusName(st));
      }
      handle = std::make_shared<UcpMemh>(ctx, raw);
    }
    void* packed = nullptr;
    size_t packed_size = 0;
    ucs_status_t st = ucp_rkey_pack(ctx, handle->get(), &packed, &packed_size);
    if (st != UCS_OK) return Status::Internal("ucx: ucp_rkey_pack failed: " + UcsStatusName(st));
    UcpRkeyBufferPtr owned(packed);
    std::vector<uint8_t> payload(kKeyPrefix + packed_size);
    const uint32_t flags = direct ? kKeyDirect : 0;
    if (!direct) {
      am_region = ++last_am_region_;
      am_regions_.push_back(AmRegion{am_region, addr, region.length});
    }
    std::memcpy(payload.data(), &flags, sizeof(flags));
    std::memcpy(payload.data() + 4, &am_region, sizeof(am_region));
    std::memcpy(payload.data() + kKeyPrefix, packed, packed_size);
    return std::make_pair(std::move(handle), MakeBlob(kKeyMagic, payload.data(), payload.size()));
  });
  if (!mapped.ok()) return mapped.status();
  if (key_blob != nullptr) *key_blob = std::move(mapped->second);
  if (direct) ++direct_regions_;
  MutexLock lock(&mu_);
  return local_regions_.Add(LocalRegionEntry{addr, region.length, std::move(mapped->first), direct,
                                             am_region, region.kind == MemoryKind::kCuda});
}

Status UcxTransport::DeregisterMemory(spi::LocalRegionId region) {
  std::shared_ptr<UcpMemh> memh;
  LocalRegionEntry entry;
  {
    MutexLock lock(&mu_);
    auto removed = local_regions_.Remove(region);
    if (!removed.ok()) return removed.status();
    entry = std::move(*removed);
    memh = std::move(entry.memh);
  }
  if (entry.direct) --direct_regions_;
  // Batches accepted before this point may still use the mapping: it retires behind them.
  // "am" messages and read requests for the region are refused from now on; replies already
  // handed to UCX point into it, and are waited for (bounded).
  Status removed = progress_.Run<Status>([&] {
    std::erase_if(am_regions_, [&](const AmRegion& r) { return r.id == entry.am_region; });
    retired_.emplace_back(last_seq_, std::move(memh));
    ReapRetired();
    return Status::OK();
  });
  if (!removed.ok() || entry.am_region == 0) return removed;
  const uint32_t id = entry.am_region;
  if (uint64_t left = WaitForReplies(
          [&] {
            auto it = replies_by_region_.find(id);
            return it == replies_by_region_.end() ? uint64_t{0} : it->second;
          },
          kDeregisterReplyGrace);
      left > 0) {
    PDLIB_LOG(kError,
              "ucx: deregistered a region with %d read replies from it still queued after %d ms "
              "(a reader that does not take them): UCX may read it until they end; free it only "
              "after the transport is destroyed",
              left, static_cast<int>(kDeregisterReplyGrace / std::chrono::milliseconds(1)));
  }
  return Status::OK();
}

StatusOr<spi::TargetEndpoint> UcxTransport::CreateTargetEndpoint() {
  // A worker for this connection alone (see ucx_transport.h); UCX creates the target's half of
  // the connection itself when the initiator connects to its address. The id travels in the
  // blob: "am" messages name it, and the worker refuses any other.
  spi::TargetId id = 0;
  {
    MutexLock lock(&mu_);
    id = targets_.Add(TargetEntry{});
  }
  // One worker per rail; the blob lists their addresses in rail order.
  auto addresses = progress_.Run<StatusOr<std::vector<std::vector<uint8_t>>>>(
      [&]() -> StatusOr<std::vector<std::vector<uint8_t>>> {
        RailWorkers workers;
        std::vector<std::vector<uint8_t>> out;
        for (uint32_t r = 0; r < rail_count(); ++r) {
          auto worker = MakeWorker(id, r);
          if (!worker.ok()) {
            for (auto& w : workers) DestroyWorker(std::move(w));
            return worker.status();
          }
          out.push_back((*worker)->address);
          workers.push_back(std::move(*worker));
        }
        target_workers_.emplace(id, std::move(workers));
        if (am_target_) am_targets_.emplace(id, AmTarget{});
        return out;
      });
  if (!addresses.ok()) {
    MutexLock lock(&mu_);
    targets_.Take(id);
    return addresses.status();
  }
  std::vector<uint8_t> payload(kEndpointPrefix);
  const uint32_t flags = am_target_ ? kEndpointAm : 0;
  const auto rails = static_cast<uint32_t>(addresses->size());
  std::memcpy(payload.data(), &id, sizeof(id));
  std::memcpy(payload.data() + 8, &flags, sizeof(flags));
  std::memcpy(payload.data() + 12, &rails, sizeof(rails));
  for (const std::vector<uint8_t>& address : *addresses) {
    const auto length = static_cast<uint32_t>(address.size());
    const size_t at = payload.size();
    payload.resize(at + 4 + address.size());
    std::memcpy(payload.data() + at, &length, 4);
    std::memcpy(payload.data() + at + 4, address.data(), address.size());
  }
  return spi::TargetEndpoint{id, MakeBlob(kEndpointMagic, payload.data(), payload.size())};
}

void UcxTransport::CloseTargetEndpoint(spi::TargetId target) {
  {
    MutexLock lock(&mu_);
    if (!targets_.Take(target)) return;
  }
  // From now on its "am" messages are refused; UCX's own emulated puts cannot be. The worker
  // lingers a little, so that those refusals (and replies already queued) reach the initiator,
  // and then goes, with whatever a dead initiator left in its receive FIFO.
  progress_
      .Run<Status>([&] {
        am_targets_.erase(target);
        if (auto it = target_workers_.find(target); it != target_workers_.end()) {  // every rail
          closed_targets_.emplace_back(Clock::now() + kTargetLinger, std::move(it->second));
          target_workers_.erase(it);
        }
        return Status::OK();
      })
      .IgnoreError();
}

Status UcxTransport::FenceTarget(spi::TargetId target) {
  if (!am_target_) {
    return Status::Unimplemented(
        "ucx: cannot fence a peer on the 'put' data path (ucx.data_path; an RDMA transport "
        "selects it by default): UCX cannot refuse one peer's writes");
  }
  if (int direct = direct_regions_.load(); direct > 0) {
    return Status::FailedPrecondition(
        "ucx: cannot fence a peer: " + std::to_string(direct) +
        " registered regions are written or read directly by peers (a KV pool UCX allocated "
        "over posix/sysv shared memory, xpmem, or CUDA memory)");
  }
  Status fenced = progress_.Run<Status>([&]() -> Status {
    auto it = am_targets_.find(target);
    if (it == am_targets_.end()) {
      return Status::NotFound("ucx: target " + std::to_string(target) +
                              " is not open (never created, or closed)");
    }
    it->second.fenced = true;
    it->second.batches.clear();
    return Status::OK();
  });
  if (!fenced.ok()) return fenced;
  // Read replies sent before the fence point into the regions: the fence holds once they ended.
  const uint64_t left = WaitForReplies(
      [&] {
        auto it = replies_by_target_.find(target);
        return it == replies_by_target_.end() ? uint64_t{0} : it->second;
      },
      kFenceReplyGrace);
  if (left > 0) {
    return Status::Unavailable(
        "ucx: target " + std::to_string(target) + " is cut off, but " + std::to_string(left) +
        " read replies sent before are still queued after " +
        std::to_string(kFenceReplyGrace / std::chrono::milliseconds(1)) +
        " ms (the reader does not take them): they may still read its memory");
  }
  return Status::OK();
}

bool UcxTransport::IsDirectRegion(const spi::MemoryRegion& region, bool ucx_allocated) const {
  if (!am_target_) return true;
  if (region.kind != MemoryKind::kHost) return true;  // never memcpy'd by the handler
  if (context_->xpmem) return true;
  return ucx_allocated && context_->shm_mapping;
}

StatusOr<spi::Connection> UcxTransport::Connect(const spi::Blob& target_endpoint) {
  auto payload = BlobPayload(target_endpoint, kEndpointMagic, "endpoint");
  if (!payload.ok()) return payload.status();
  if (payload->size() <= kEndpointPrefix) {
    return Status::InvalidArgument("ucx: endpoint blob of " +
                                   std::to_string(target_endpoint.size()) + " bytes is too short");
  }
  uint64_t target = 0;
  uint32_t flags = 0;
  std::memcpy(&target, payload->data(), sizeof(target));
  std::memcpy(&flags, payload->data() + 8, sizeof(flags));
  const bool am = (flags & kEndpointAm) != 0;
  uint32_t rails = 0;
  std::memcpy(&rails, payload->data() + 12, sizeof(rails));
  if (rails == 0 || rails > kMaxRails) {
    return Status::InvalidArgument("ucx: endpoint blob names " + std::to_string(rails) +
                                   " rails (1 to " + std::to_string(kMaxRails) + ")");
  }
  // UCX wants the addresses mutable.
  std::vector<std::vector<uint8_t>> addresses;
  size_t at = kEndpointPrefix;
  for (uint32_t r = 0; r < rails; ++r) {
    uint32_t length = 0;
    if (payload->size() - at < 4) {
      return Status::InvalidArgument("ucx: endpoint blob ends inside rail " + std::to_string(r));
    }
    std::memcpy(&length, payload->data() + at, 4);
    at += 4;
    if (length == 0 || payload->size() - at < length) {
      return Status::InvalidArgument("ucx: endpoint blob's rail " + std::to_string(r) +
                                     " address of " + std::to_string(length) +
                                     " bytes does not fit");
    }
    addresses.emplace_back(payload->begin() + at, payload->begin() + at + length);
    at += length;
  }
  if (at != payload->size()) {
    return Status::InvalidArgument("ucx: endpoint blob has " +
                                   std::to_string(payload->size() - at) +
                                   " bytes after its last rail");
  }

  auto connected = progress_.Run<StatusOr<spi::PeerId>>([&]() -> StatusOr<spi::PeerId> {
    auto state = std::make_unique<PeerState>();
    auto undo = [&] {
      for (auto& lane : state->lanes) {
        lane->ep = UcpEp();  // closes it (progressing its worker) before the worker goes
        DestroyWorker(std::move(lane->worker));
      }
    };
    {
      MutexLock lock(&mu_);
      state->id = peers_.NextId();
    }
    state->transport = this;
    state->target = target;
    state->am = am;
    // Rail r connects to the target's rail r; with different rail counts, the fewer are used.
    const size_t rails = std::min(rail_count(), addresses.size());
    for (uint32_t r = 0; r < rails; ++r) {
      auto lane = std::make_unique<Lane>();
      lane->peer = state.get();
      lane->rail = r;
      lane->window = toolkit::InflightWindow(options_.max_inflight_bytes);
      lane->read_window = toolkit::InflightWindow(options_.max_inflight_read_bytes);
      lane->remote_address = addresses[r];
      lane->last_progress = Clock::now();
      auto worker = MakeWorker(0, r);
      if (!worker.ok()) {
        undo();
        return worker.status();
      }
      lane->worker = std::move(*worker);
      ucp_ep_params_t params{};
      params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                          UCP_EP_PARAM_FIELD_ERR_HANDLER;
      params.address = reinterpret_cast<const ucp_address_t*>(addresses[r].data());
      params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      params.err_handler.cb = &UcxTransport::OnEndpointError;
      params.err_handler.arg = lane.get();
      ucp_ep_h ep = nullptr;
      ucs_status_t st = ucp_ep_create(lane->worker->worker.get(), &params, &ep);
      if (st != UCS_OK) {
        DestroyWorker(std::move(lane->worker));
        undo();
        return Status::Unavailable(
            "ucx: cannot create an endpoint to the peer's worker" +
            (rails > 1 ? " on rail " + std::to_string(r) + " (" + options_.rails[r] + ")"
                       : std::string()) +
            ": " + UcsStatusName(st));
      }
      lane->ep = UcpEp(lane->worker->worker.get(), ep);
      state->lanes.push_back(std::move(lane));
    }
    spi::PeerId id = state->id;
    peer_states_.emplace(id, std::move(state));
    MutexLock lock(&mu_);
    peers_.Add(id, PeerEntry{am, {}, Status()});
    return id;
  });
  if (!connected.ok()) return connected.status();
  return spi::Connection{*connected, {}};
}

StatusOr<spi::RemoteRegionId> UcxTransport::ImportRemoteRegion(spi::PeerId peer,
                                                               const spi::RemoteRegion& region) {
  auto blob = BlobPayload(region.key, kKeyMagic, "remote key");
  if (!blob.ok()) return blob.status();
  if (blob->size() <= kKeyPrefix) {
    return Status::InvalidArgument("ucx: remote key blob of " + std::to_string(region.key.size()) +
                                   " bytes is too short");
  }
  uint32_t key_flags = 0, am_region = 0;
  std::memcpy(&key_flags, blob->data(), sizeof(key_flags));
  std::memcpy(&am_region, blob->data() + 4, sizeof(am_region));
  const std::span<const uint8_t> payload = blob->subspan(kKeyPrefix);
  if (Status s = toolkit::CheckRemoteRegion("ucx", region); !s.ok()) return s;
  {
    MutexLock lock(&mu_);
    if (auto entry = peers_.ForImport(peer); !entry.ok()) return entry.status();
  }
  auto unpacked = progress_.Run<StatusOr<ucp_rkey_h>>([&]() -> StatusOr<ucp_rkey_h> {
    auto it = peer_states_.find(peer);
    if (it == peer_states_.end()) {
      return Status::NotFound("ucx: peer " + std::to_string(peer) + " is disconnected");
    }
    if (!it->second->failure.ok()) return it->second->failure;
    ucp_rkey_h rkey = nullptr;
    // Puts and gets go on rail 0, whose context (the main one) made the target's keys too.
    ucs_status_t st = ucp_ep_rkey_unpack(it->second->lanes[0]->ep.get(), payload.data(), &rkey);
    if (st != UCS_OK) {
      return Status::InvalidArgument("ucx: the peer's remote key cannot be unpacked: " +
                                     UcsStatusName(st));
    }
    it->second->rkeys.emplace_back(rkey);
    return rkey;
  });
  if (!unpacked.ok()) return unpacked.status();
  MutexLock lock(&mu_);
  PeerEntry* entry = peers_.Find(peer);  // the rkey belongs to the peer's state and goes with it
  if (entry == nullptr) return Status::NotFound("ucx: peer " + std::to_string(peer) + " left");
  entry->regions.push_back(RemoteRegionEntry{region.addr, region.length, *unpacked,
                                             (key_flags & kKeyDirect) != 0, am_region});
  return static_cast<spi::RemoteRegionId>(entry->regions.size() - 1);
}

Status UcxTransport::PostWrites(spi::PeerId peer, std::span<const spi::WriteOp> ops,
                                spi::WriteCallback done) {
  return Post(peer, ops, std::move(done), toolkit::OpKind::kWrite);
}

Status UcxTransport::PostWritesDigested(spi::PeerId peer, std::span<const spi::WriteOp> ops,
                                        std::span<uint32_t> crcs, spi::WriteCallback done) {
  if (crcs.size() != ops.size()) {
    return Status::InvalidArgument("ucx: PostWritesDigested with " + std::to_string(crcs.size()) +
                                   " CRCs for " + std::to_string(ops.size()) + " writes");
  }
  return Post(peer, ops, std::move(done), toolkit::OpKind::kWrite, crcs);
}

Status UcxTransport::PostReads(spi::PeerId peer, std::span<const spi::ReadOp> ops,
                               spi::ReadCallback done) {
  return Post(peer, ops, std::move(done), toolkit::OpKind::kRead);
}

Status UcxTransport::Post(spi::PeerId peer, std::span<const spi::WriteOp> ops,
                          spi::WriteCallback done, toolkit::OpKind kind, std::span<uint32_t> crcs) {
  const bool reads = kind == toolkit::OpKind::kRead;
  for (uint32_t& crc : crcs) crc = 0;
  auto batch = std::make_unique<Batch>();
  batch->peer_id = peer;
  batch->done = std::move(done);
  batch->reads = reads;
  batch->ops.reserve(ops.size());
  {
    MutexLock lock(&mu_);
    auto found = peers_.ForWrites(peer);
    if (!found.ok()) return found.status();
    const PeerEntry& entry = **found;
    uint64_t am_messages = 0;
    for (size_t i = 0; i < ops.size(); ++i) {
      const spi::WriteOp& op = ops[i];
      auto resolved = peers_.ResolveWrite(peer, entry, local_regions_, i, op, kind);
      if (!resolved.ok()) return resolved.status();
      const LocalRegionEntry& local = *resolved->first;
      const RemoteRegionEntry& remote = *resolved->second;
      // The target's choice: its messages (writes) or read requests, else puts or gets.
      const bool am = entry.am && !remote.direct && (!reads || remote.am_region != 0);
      if (!crcs.empty() && local.cuda) {
        return Status::InvalidArgument("ucx: PostWritesDigested: write " + std::to_string(i) +
                                       " reads CUDA memory, which the CPU does not digest");
      }
      if (op.length == 0) continue;
      if (am && !reads) {
        am_messages += (op.length + options_.am_chunk_bytes - 1) / options_.am_chunk_bytes;
      } else if (!reads) {
        batch->has_puts = true;
      }
      batch->ops.push_back(ResolvedOp{reinterpret_cast<uint8_t*>(local.addr) + op.local_offset,
                                      remote.addr + op.remote_offset, op.length, local.memh->get(),
                                      remote.rkey, am, remote.am_region,
                                      crcs.empty() ? nullptr : &crcs[i]});
    }
    if (am_messages > UINT32_MAX) {
      return Status::InvalidArgument("ucx: a batch of " + std::to_string(am_messages) +
                                     " messages is too large (ucx.am_chunk_bytes)");
    }
    batch->am_messages = static_cast<uint32_t>(am_messages);
    batch->am_headers.reserve(am_messages);
    // Under mu_: a Disconnect of the peer (which takes mu_ first) is queued after it.
    if (!progress_.Enqueue({std::move(batch), {}})) {
      return Status::Cancelled("ucx: the transport is shutting down");
    }
  }
  return Status::OK();
}

void UcxTransport::SettleIncoming() {
  progress_
      .Run<Status>([this] {
        const auto deadline = Clock::now() + std::chrono::milliseconds(50);
        for (int idle = 0; idle < 3 && Clock::now() < deadline;) {
          idle = ProgressWorkers() ? 0 : idle + 1;
        }
        return Status::OK();
      })
      .IgnoreError();
}

void UcxTransport::Disconnect(spi::PeerId peer) {
  {
    MutexLock lock(&mu_);
    if (!peers_.Erase(peer)) return;
  }
  std::promise<void> erased;
  std::future<void> erased_future = erased.get_future();
  auto start = [this, peer, &erased] {
    auto it = peer_states_.find(peer);
    if (it == peer_states_.end()) {
      erased.set_value();
      return;
    }
    PeerState& state = *it->second;
    state.disconnecting = true;
    state.on_erased.push_back(std::move(erased));
    FailPeer(state, Status::Cancelled("ucx: peer " + std::to_string(peer) + " disconnected"));
  };
  if (progress_.OnThread()) {  // from a completion callback: cannot wait for ourselves
    start();
    return;
  }
  if (!progress_.Post(start)) return;  // shutting down: the destructor cancels all
  erased_future.wait();
}

}  // namespace ucx

void RegisterUcxBackend() {
  internal::RegisterBuiltinTransport(
      "ucx",
      [](const spi::TransportOptions& options) -> StatusOr<std::unique_ptr<spi::Transport>> {
        auto transport = ucx::UcxTransport::Create(options);
        if (!transport.ok()) return transport.status();
        return std::unique_ptr<spi::Transport>(std::move(*transport));
      })
      .IgnoreError();  // only fails if "ucx" is registered twice, which the call_once prevents
  internal::RegisterKVPoolAllocator("ucx", &ucx::AllocateUcxPoolFor);
}

}  // namespace v1
}  // namespace pdlib
