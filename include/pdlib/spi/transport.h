// The transport SPI: what a data-plane backend implements (SPEC R8.2). A backend only registers
// memory, connects to peers from opaque blobs, posts batches of one-sided writes (and, where it
// can, reads) and reports their completion; the protocol, validation and state machine live in
// pdlib's core.
//
// The side that posts is the "initiator"; the side whose memory is accessed is the "target".
// Push (KVManagerOptions::direction kPush): prefill initiates writes into decode's memory. Pull
// (kPull, capabilities().reads): decode initiates reads of prefill's memory, prefill is the
// target. The calls are the same either way:
//   target:    RegisterMemory(...) -> key blob per region
//              CreateTargetEndpoint() -> {target id, endpoint blob}   -- sent in Register
//   initiator: Connect(endpoint blob) -> {peer id, reply blob}        -- reply in RegisterAck
//              ImportRemoteRegion(peer, {addr, len, key blob}) -> remote region id
//   target:    CompleteTargetEndpoint(target id, reply blob)  (transports that connect both
//              ends, e.g. RC QPs; capabilities().needs_reply says whether it matters)
//   initiator: PostWrites(peer, ops, callback) ... callback(Status) once per batch
//              PostReads(peer, ops, callback)  (capabilities().reads): the same, data flowing
//              from the target's memory into the initiator's
//   target:    FenceTarget(target id)  (transports with capabilities().fences): after it
//              returns OK, nothing that initiator posted, before or after, lands in our memory
//
// Threads: every method may be called from any thread. A backend owns one progress thread and
// calls completion callbacks on it; callbacks must not block and must not destroy the
// transport. Destroying the transport completes every outstanding batch with kCancelled first.
//
// Out-of-tree backends implement Transport, check kTransportSpiVersion, and register a factory
// with RegisterTransport() before creating a KVManager that names them.
#ifndef PDLIB_SPI_TRANSPORT_H_
#define PDLIB_SPI_TRANSPORT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pdlib/export.h"
#include "pdlib/status.h"
#include "pdlib/types.h"

namespace pdlib {
inline namespace v1 {
namespace spi {

// Bumped whenever a declaration in this file changes incompatibly.
inline constexpr uint32_t kTransportSpiVersion = 6;

using Blob = std::vector<uint8_t>;
using LocalRegionId = uint32_t;
using RemoteRegionId = uint32_t;
using PeerId = uint64_t;    // an initiator's connection to one target
using TargetId = uint64_t;  // a target's half of one connection

struct TransportCapabilities {
  bool moves_bytes = true;   // false only for the fake backend
  bool needs_reply = false;  // CompleteTargetEndpoint must be called with the reply blob
  bool supports_cuda_memory = false;
  // FenceTarget works: the target can cut an initiator off so that no write it posted, however
  // late it is executed, reaches the target's memory (verbs: the QPs go to the error state). A
  // transport whose writes the initiator performs itself (e.g. a shared-memory mapping) cannot.
  bool fences = false;
  // PostReads works: one-sided reads of a target's registered memory (SPI version 3). A manager
  // in pull (KVManagerOptions::direction) refuses a backend without it at Create.
  bool reads = false;
  // DigestRanges works on kCuda memory this transport registered (SPI version 5): the KV
  // integrity digest (KVManagerOptions::checksum) of GPU pools is computed by the transport, on
  // the device. A manager refuses checksums with CUDA pools on a transport without it.
  bool digests_cuda_memory = false;
  // WatchLandings works (SPI version 5): where the transport's own code copies the bytes into
  // this process's memory (UCX's am path: the handler's copy of each chunk, pushed or read), it
  // digests them as it copies, so decode's KV digest needs no second pass over the pages.
  bool digests_landings = false;
  // PostWritesDigested works (SPI version 6): the transport digests the source bytes of each
  // write as it hands them to the wire (UCX: each piece right after handing it over, while the
  // send's own copy has it in cache), so prefill's KV digest needs no pass of its own over the
  // pages.
  bool digests_sends = false;
  // Limits, for reads as for writes:
  uint32_t max_writes_per_batch = 0;  // 0: unlimited (the core splits larger batches)
  uint64_t max_write_bytes = 0;       // 0: unlimited (the core splits longer ops)
};

struct MemoryRegion {
  const void* addr = nullptr;
  uint64_t length = 0;
  MemoryKind kind = MemoryKind::kHost;
  int32_t device_id = 0;
};

// A region of the peer's memory as the peer described it.
struct RemoteRegion {
  uint64_t addr = 0;
  uint64_t length = 0;
  Blob key;  // the key blob the peer's RegisterMemory returned
};

// One one-sided operation between local region + local_offset and remote region +
// remote_offset, `length` bytes. As a write (PostWrites) the bytes go from local to remote; as a
// read (PostReads) from remote to local. The core has bounds-checked every op; backends check
// again cheaply.
struct WriteOp {
  LocalRegionId local_region = 0;
  uint64_t local_offset = 0;
  RemoteRegionId remote_region = 0;
  uint64_t remote_offset = 0;
  uint64_t length = 0;
};
using ReadOp = WriteOp;

// One range of this process's memory for DigestRanges: the raw CRC32C (zero initial register, no
// final inversion) of `length` bytes at `addr`, followed by `zeros_after` zero bytes that are not
// read (pdlib's KV digest, docs/reliability.md "KV integrity").
struct DigestRange {
  uint64_t addr = 0;
  uint64_t length = 0;
  uint64_t zeros_after = 0;
};

// What the transport copied into one watched cell (WatchLandings): the XOR of the raw CRC32C of
// each byte range it wrote there, each placed in the cell (followed by the cell's bytes after
// it as zeros), and how many bytes it wrote. With every byte written exactly once, `crc` is the
// raw CRC32C of the cell's contents and `bytes` its length.
struct LandingDigest {
  uint32_t crc = 0;
  uint64_t bytes = 0;
};

struct Connection {
  PeerId peer = 0;
  Blob reply;  // for the target's CompleteTargetEndpoint; empty when !needs_reply
};

struct TargetEndpoint {
  TargetId id = 0;
  Blob blob;
};

// Called exactly once per batch: OK when every write of the batch is visible in the target's
// memory, otherwise the first error (kUnavailable for a dead peer, with the backend's reason).
// Either way it is called only once no write of the batch can still be executed by this
// process: the core tells the target side that a room is drained on the strength of it.
using WriteCallback = std::function<void(Status)>;
// The same for reads: OK when every read of the batch is in the initiator's memory; called only
// once no read of the batch can still land there (the core hands the pages back on it).
using ReadCallback = WriteCallback;

class PDLIB_EXPORT Transport {
 public:
  virtual ~Transport() = default;

  virtual std::string_view name() const = 0;
  virtual TransportCapabilities capabilities() const = 0;

  // Registers `region` for one-sided access; fills *key_blob with what a peer needs to write
  // into it (empty for initiator-only use is fine).
  virtual StatusOr<LocalRegionId> RegisterMemory(const MemoryRegion& region, Blob* key_blob) = 0;
  virtual Status DeregisterMemory(LocalRegionId region) = 0;

  // Target side: a new endpoint for one initiator.
  virtual StatusOr<TargetEndpoint> CreateTargetEndpoint() = 0;
  // Target side: finishes a connection that needs the initiator's reply. Default: nothing to do.
  virtual Status CompleteTargetEndpoint(TargetId target, const Blob& reply) { return Status(); }
  virtual void CloseTargetEndpoint(TargetId target) = 0;
  // Target side: returns once every write this process has received so far and that its own
  // software still has to apply (e.g. UCX's emulated puts queued in a shared-memory FIFO or a
  // socket) has been applied. The core calls it before it declares pages reusable because a
  // prefill drained or is gone. Default: nothing to do (the NIC or the initiator applies writes).
  virtual void SettleIncoming() {}
  // Target side: cuts the initiator of `target` off. When this returns OK no write that
  // initiator posted (earlier, in flight, or later) lands in this process's memory; the
  // endpoint stays allocated until CloseTargetEndpoint. Default: kUnimplemented (fences false).
  virtual Status FenceTarget(TargetId target) {
    return Status::Unimplemented(std::string(name()) + ": this transport cannot fence a peer");
  }

  // Initiator side.
  virtual StatusOr<Connection> Connect(const Blob& target_endpoint) = 0;
  virtual StatusOr<RemoteRegionId> ImportRemoteRegion(PeerId peer, const RemoteRegion& region) = 0;
  // Posts every op of `ops` as one batch. On a non-OK return the callback is never called.
  virtual Status PostWrites(PeerId peer, std::span<const WriteOp> ops, WriteCallback done) = 0;
  // PostWrites, and crcs[i] = the raw CRC32C (zero initial register, no final inversion) of
  // ops[i]'s `length` source bytes as the transport read them to send them
  // (capabilities().digests_sends), each set before `done` is called with OK; `crcs` (one per
  // op) must stay valid until `done` has been called. The local regions must be host memory.
  // Default: kUnimplemented.
  virtual Status PostWritesDigested(PeerId peer, std::span<const WriteOp> ops,
                                    std::span<uint32_t> crcs, WriteCallback done) {
    (void)peer;
    (void)ops;
    (void)crcs;
    (void)done;
    return Status::Unimplemented(std::string(name()) + ": this transport does not digest sends");
  }
  // Posts every op of `ops` as one batch of reads (remote -> local). Same rules as PostWrites.
  // Default: kUnimplemented (capabilities().reads false).
  virtual Status PostReads(PeerId peer, std::span<const ReadOp> ops, ReadCallback done) {
    (void)peer;
    (void)ops;
    (void)done;
    return Status::Unimplemented(std::string(name()) + ": this transport cannot read");
  }
  // OK while batches can still be posted to `peer`; once its connection failed (a dead QP, a
  // failed endpoint, a target process gone), the reason, which PostWrites/PostReads would refuse
  // with too. A failed peer never recovers: the core disconnects it and connects again (with a
  // fresh endpoint from the target) even when the control stream to that side is still up.
  // kNotFound for a peer that is not connected. Default: OK (a backend whose peers never fail).
  virtual Status PeerStatus(PeerId peer) {
    (void)peer;
    return Status::OK();
  }
  // Outstanding batches to `peer` complete with kCancelled; its remote regions are dropped.
  virtual void Disconnect(PeerId peer) = 0;
  // crcs[i] = the raw CRC32C of ranges[i] (DigestRange), for ranges inside kCuda regions this
  // transport registered (capabilities().digests_cuda_memory); returns once every value is
  // there. Called by the core of a manager with checksums on, from its own threads, while the
  // transport may move other bytes. Default: kUnimplemented.
  virtual Status DigestRanges(std::span<const DigestRange> ranges, std::span<uint32_t> crcs) {
    (void)ranges;
    (void)crcs;
    return Status::Unimplemented(std::string(name()) + ": this transport cannot digest memory");
  }
  // Starts digesting what the transport copies into `cells` (addresses of this process's
  // memory, zeros_after unused; disjoint from each other and from every other watch's cells)
  // from now on (capabilities().digests_landings). kFailedPrecondition when a cell lies in
  // memory the transport does not copy into itself (it would be written without being
  // digested). Returns the watch's id.
  virtual StatusOr<uint64_t> WatchLandings(std::span<const DigestRange> cells) {
    (void)cells;
    return Status::Unimplemented(std::string(name()) + ": this transport does not digest landings");
  }
  // Ends watch `watch` and returns one LandingDigest per cell, in WatchLandings' order;
  // kNotFound for a watch that is not there.
  virtual StatusOr<std::vector<LandingDigest>> TakeLandings(uint64_t watch) {
    (void)watch;
    return Status::Unimplemented(std::string(name()) + ": this transport does not digest landings");
  }
  // Ends watch `watch` without its result (a room that failed or went away); no-op if not there.
  virtual void DropLandings(uint64_t watch) { (void)watch; }
};

struct TransportOptions {
  int32_t device_id = 0;
  std::vector<std::string> nic_names;
  std::map<std::string, std::string> options;  // KVManagerOptions::backend_options
  // The manager's side. Push: prefill only initiates, decode is only a target; pull: the other
  // way round (see `direction`). nullopt: both (tests).
  std::optional<Mode> mode;
  TransferDirection direction = TransferDirection::kPush;
  // Where the KV pool lives, for backends that pick their NICs (rails) by topology when
  // nic_names is empty (lib/rails): the NUMA node of host memory (-1: unknown), or the PCI address
  // of the device that holds it ("0000:03:00.0"; empty: host memory or unknown).
  int32_t memory_numa_node = -1;
  std::string memory_pci_address{};
};

using TransportFactory =
    std::function<StatusOr<std::unique_ptr<Transport>>(const TransportOptions& options)>;

// Registers a backend under `name` (kAlreadyExists if taken). Thread-safe.
PDLIB_EXPORT Status RegisterTransport(std::string_view name, TransportFactory factory,
                                      uint32_t spi_version = kTransportSpiVersion);

// Creates the backend registered under `name`; kNotFound lists the known names.
PDLIB_EXPORT StatusOr<std::unique_ptr<Transport>> CreateTransport(std::string_view name,
                                                                  const TransportOptions& options);

}  // namespace spi
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_SPI_TRANSPORT_H_
