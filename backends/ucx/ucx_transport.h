// The UCX backend: the transport SPI (include/pdlib/spi/transport.h) on UCP one-sided puts.
//
// One UCP worker per connection: each Connect (the initiator's half) and each
// CreateTargetEndpoint (the target's half) gets a worker of its own, in a UCP context shared
// with the KV pools and the other transports of the process that have the same UCX
// configuration (ucx_context.h). Why not one worker for all: UCX's shared-memory transports
// (posix/sysv) give a worker one receive FIFO that every sender writes into, a slot claimed
// first and filled after; a sender killed between the two leaves a slot that never fills, and
// the worker then receives nothing more from anyone (measured: 8 of 60 senders killed mid-send
// with UCX 1.13; a decode whose prefill was killed mid-reply never completed another read).
// With a worker per connection, a dead peer blocks only its own connection's worker, which
// goes with the connection. The cost: a worker's receive buffers (about 4 MiB with shm at UCX's
// defaults, 0.1 MiB with tcp) and its creation (5 ms with shm) per connection.
// One progress thread per transport (backends/common/progress_thread.h) is the only thread
// that calls UCX with the workers, their endpoints, rkeys and memory handles: API calls from
// other threads hand work over through its command queue and wake it with its eventfd.
// The thread loops: run commands -> post puts (paced per endpoint by a window,
// backends/common/inflight_window.h) -> ucp_worker_progress on every worker -> run completion
// callbacks -> busy-poll a little -> ucp_worker_arm each -> epoll on the workers' fds and the
// wake fd. Batches, completions and the API-side tables are the toolkit's (backends/common/).
//
// Keys and endpoints: RegisterMemory returns the packed rkey (ucp_rkey_pack) as the key blob;
// CreateTargetEndpoint returns the address of the worker it creates for that connection;
// Connect creates a worker and an endpoint from it to that address with peer error handling (a
// dead peer fails its outstanding batches with kUnavailable, naming the UCX status);
// ImportRemoteRegion unpacks the rkey on that endpoint. CloseTargetEndpoint refuses the
// connection's messages at once and destroys its worker after kTargetLinger.
// With ucx.rails, "worker" above means one worker per rail (each from that rail's context) and
// the blob lists one address per rail; a connection's lanes stripe its "am" traffic
// (backends/ucx/README.md, "Rails").
//
// A batch is one ucp_put_nbx per chunk of each write, then one flush (ucp_ep_flush_nbx, or
// ucp_worker_flush_nbx with ucx.flush=worker): a put's completion only means the local buffer
// may be reused, while the flush completes when every earlier put is visible in the target's
// memory, which is what the SPI's callback promises.
//
// UCX 1.13 behaviour this design answers (measured on Debian's 1.13.1, see the issue note):
// - puts into memory UCX did not allocate are emulated with active messages that the target's
//   progress thread copies into place: the target transport must keep progressing (it does, on
//   its own thread), and a target that handles such a put arriving on an endpoint it has marked
//   failed aborts the process, so healthy endpoints are flushed before they are closed;
// - with every put of a large transfer posted at once throughput collapses: hence the window;
// - an armed worker is not woken when a peer frees room in a shared-memory FIFO or a socket, so
//   the thread polls (yielding the core) while writes are outstanding instead of sleeping.
//
// Data paths (ucx.data_path, ucx_options.h). A target (decode) chooses per process and says so
// in its endpoint blob, and per region in its key blobs:
// - "put": ucp_put_nbx, as above. Where UCX has no RMA lane (tcp; shared memory into memory UCX
//   did not allocate) UCX emulates the put with its own active messages, which the target
//   applies without any check and which it cannot refuse for one peer.
// - "am": pdlib's own active messages. Each chunk is one eager message (ucp_am_send_nbx, at most
//   ucx.am_chunk_bytes) whose header names the target id, the batch and the destination; the
//   target's handler (on its progress thread) checks that the target is open and not fenced and
//   that the destination lies in memory it registered, copies the data, and acknowledges the
//   batch on the reply endpoint once it has applied all of the batch's messages (they carry the
//   count, so order does not matter). The initiator completes the batch on that ack. A fence is
//   a flag the handler checks: after FenceTarget returns, nothing from that initiator is applied
//   (capabilities().fences). A failed or closed reply endpoint only loses an ack; it cannot
//   abort the process as UCX's emulated put does. Closing such a connection (Disconnect, the
//   destructor) first sends a close message that the target answers after cutting the connection
//   off as a fence does: once the answer is in, no message of ours can land any more, so the
//   batches end only then (a target that does not answer within kCutGrace, frozen or gone, is
//   closed anyway, with a warning).
// Reads (PostReads, pull) follow the target's choice too (ucx_am_read.h has the wire):
// - "am", for regions the target did not mark direct: each chunk of a read (at most
//   ucx.chunk_bytes, paced by a read window, ucx.max_inflight_read_bytes: bytes requested and
//   not yet answered) is one range, naming the target's region id (from its key blob), the
//   address, the length and a cookie; one request message carries a batch's ranges posted
//   together (up to kMaxAmReadRanges, 16 MiB). The target's handler checks that the connection is
//   open and not fenced and that each range lies inside its region and sends the bytes back,
//   from the region itself, in reply messages of at most ucx.am_chunk_bytes (or one refusal).
//   UCX may read the region until such a send completes: FenceTarget waits (kFenceReplyGrace)
//   for the connection's replies still in flight and says so when some remain, and
//   DeregisterMemory waits (kDeregisterReplyGrace) for the region's. A reply that cannot be sent is
//   dropped and logged, never fatal: UCX's own emulated gets abort the target when the reader dies
//   mid-read ("ucp_get_req_handler ... Endpoint timeout"). The initiator copies a reply into
//   place only while its request is live, its batch and its connection healthy, and the range
//   inside the request; the batch completes when every byte has arrived. A fence (the same flag
//   as for writes) makes the target refuse every later request, so a target in pull fences.
// - otherwise ("put" path; direct regions: shm into UCX-allocated memory, where the initiator
//   memcpys from its mapping; xpmem; CUDA memory): one ucp_get_nbx per chunk (ucx.chunk_bytes).
//   A get's completion means its bytes are in the initiator's memory, so such a batch needs no
//   flush. UCX answers these gets without a check pdlib could add, so a target with direct
//   regions, or on the put path, cannot fence its readers.
// Regions a peer writes directly (a UCX-allocated pool over posix/sysv: the peer memcpys into
// its mapping; any memory with xpmem; CUDA memory) always take puts, and a target holding such a
// region does not claim to fence.
//
// Threads: every public method may be called from any thread, including from a completion
// callback (control calls made there run inline on the progress thread). Callbacks run on the
// progress thread, never while pdlib holds a lock.
#ifndef PDLIB_BACKENDS_UCX_UCX_TRANSPORT_H_
#define PDLIB_BACKENDS_UCX_UCX_TRANSPORT_H_

#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "backends/common/batches.h"
#include "backends/common/inflight_window.h"
#include "backends/common/progress_thread.h"
#include "backends/common/tables.h"
#include "backends/ucx/ucx_am_read.h"
#include "backends/ucx/ucx_context.h"
#include "backends/ucx/ucx_handles.h"
#include "backends/ucx/ucx_options.h"
#include "lib/base/mutex.h"
#include "pdlib/spi/transport.h"

namespace pdlib {
inline namespace v1 {
namespace ucx {

// Owned by whoever created it (the KVManager); see the file comment for threads.
class UcxTransport final : public spi::Transport {
 public:
  static StatusOr<std::unique_ptr<UcxTransport>> Create(const spi::TransportOptions& options);
  ~UcxTransport() override;
  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;

  std::string_view name() const override { return "ucx"; }
  spi::TransportCapabilities capabilities() const override;

  StatusOr<spi::LocalRegionId> RegisterMemory(const spi::MemoryRegion& region,
                                              spi::Blob* key_blob) override;
  Status DeregisterMemory(spi::LocalRegionId region) override;
  StatusOr<spi::TargetEndpoint> CreateTargetEndpoint() override;
  void CloseTargetEndpoint(spi::TargetId target) override;
  StatusOr<spi::Connection> Connect(const spi::Blob& target_endpoint) override;
  StatusOr<spi::RemoteRegionId> ImportRemoteRegion(spi::PeerId peer,
                                                   const spi::RemoteRegion& region) override;
  Status PostWrites(spi::PeerId peer, std::span<const spi::WriteOp> ops,
                    spi::WriteCallback done) override;
  // Send digests: each piece's source bytes are digested on the progress thread right after the
  // piece is handed to UCX (an am message or a put), whose copy has just brought them into cache.
  Status PostWritesDigested(spi::PeerId peer, std::span<const spi::WriteOp> ops,
                            std::span<uint32_t> crcs, spi::WriteCallback done) override;
  // pdlib read requests on the "am" path, else ucp_get_nbx per chunk ("Reads" above).
  Status PostReads(spi::PeerId peer, std::span<const spi::ReadOp> ops,
                   spi::ReadCallback done) override;
  Status PeerStatus(spi::PeerId peer) override {
    MutexLock lock(&mu_);
    return peers_.Health(peer);
  }
  void Disconnect(spi::PeerId peer) override;
  // Landing digests (KV integrity without a second pass): the handler's copies on the "am" path
  // (pushed chunks on decode, read replies in pull) are digested as they are made, into the
  // watched cells they fall in. Cells must lie in memory the am path writes (not a direct
  // region): otherwise kFailedPrecondition, and the core reads the pages instead.
  StatusOr<uint64_t> WatchLandings(std::span<const spi::DigestRange> cells) override;
  StatusOr<std::vector<spi::LandingDigest>> TakeLandings(uint64_t watch) override;
  void DropLandings(uint64_t watch) override;
  // Progresses the worker until it finds nothing more to do (three idle rounds) or 50 ms pass:
  // emulated puts already in this worker's FIFOs and sockets are applied before it returns.
  void SettleIncoming() override;
  // "am" data path only, and only while no region is written directly (see the file comment).
  Status FenceTarget(spi::TargetId target) override;

  // The context this transport shares with KV pools and transports configured alike.
  const std::shared_ptr<UcxContext>& context() const { return context_; }

 private:
  using Clock = std::chrono::steady_clock;
  struct PeerState;

  // One write or read, resolved to addresses and handles when the batch is validated.
  struct ResolvedOp {
    uint8_t* local;   // a write's source, a read's destination
    uint64_t remote;  // in the target's memory
    uint64_t length;
    ucp_mem_h memh;
    ucp_rkey_h rkey;
    bool am;             // sent as pdlib active messages (or read requests), else puts (gets)
    uint32_t am_region;  // the target's region id, for read requests
    uint32_t* crc;       // PostWritesDigested: the op's CRC, continued piece by piece as sent
  };
  // Send digests: continues op.crc over [offset, offset + length) of the op's source, the piece
  // about to be sent (pieces of an op are sent once each, in order).
  static void DigestSend(const ResolvedOp& op, uint64_t offset, uint64_t length);

  // Active message ids on pdlib's own workers, and the magics that open their headers.
  static constexpr unsigned kAmPutId = 1;
  static constexpr unsigned kAmAckId = 2;
  static constexpr unsigned kAmReadId =
      3;  // AmReadBatchHeader + AmReadRange[], initiator -> target
  static constexpr unsigned kAmReadReplyId = 4;  // AmReadReply + bytes, target -> initiator
  static constexpr unsigned kAmCloseId = 5;      // AmCloseHeader, initiator -> target
  static constexpr unsigned kAmClosedId = 6;     // AmCloseHeader echoed, target -> initiator
  // ucx.rails (AmRailHeader): a rail gone down, and a rail probed.
  static constexpr unsigned kAmAbandonId = 7;          // + batch seqs, initiator -> target
  static constexpr unsigned kAmAbandonedId = 8;        // echoed, target -> initiator
  static constexpr unsigned kAmProbeId = 9;            // initiator -> target, on the probed rail
  static constexpr unsigned kAmProbeAckId = 10;        // echoed, target -> initiator, the same rail
  static constexpr uint32_t kAmPutMagic = 0x50414450;  // "PDAP"
  static constexpr uint32_t kAmAckMagic = 0x41414450;  // "PDAA"
  static constexpr uint32_t kAmCloseMagic = 0x43414450;      // "PDAC"
  static constexpr uint32_t kAmClosedMagic = 0x45414450;     // "PDAE"
  static constexpr uint32_t kAmAbandonMagic = 0x42414450;    // "PDAB"
  static constexpr uint32_t kAmAbandonedMagic = 0x46414450;  // "PDAF"
  static constexpr uint32_t kAmProbeMagic = 0x52414450;      // "PDAR"
  static constexpr uint32_t kAmProbeAckMagic = 0x4b414450;   // "PDAK"
  // Batches of one target whose messages are partly applied; more is a misbehaving initiator.
  static constexpr size_t kMaxAmBatchesPerTarget = size_t{1} << 16;

  // The header of one "am" data message (host byte order: UCX itself assumes both ends share
  // one architecture). Every message of a batch carries the batch's message count.
  struct AmPutHeader {
    uint32_t magic;
    uint32_t messages;
    uint64_t target;
    uint64_t batch;
    uint64_t dst;
  };
  static_assert(sizeof(AmPutHeader) == 32);
  // The target's answer once it applied (or refused) all of a batch's messages.
  struct AmAckHeader {
    uint32_t magic;
    uint32_t status;  // AmStatus
    uint64_t batch;
  };
  static_assert(sizeof(AmAckHeader) == 16);
  enum AmStatus : uint32_t { kAmOk = 0, kAmCut = 1, kAmBadAddress = 2, kAmBadMessage = 3 };
  // An initiator closing a connection on the "am" path: the target cuts the connection off (as a
  // fence does) and echoes the header. Once the echo is in, no message of the initiator can still
  // be applied, whatever order the target handled them in.
  struct AmCloseHeader {
    uint32_t magic;
    uint32_t reserved;
    uint64_t target;  // the target's id for the connection
    uint64_t peer;    // the initiator's id for it, echoed
  };
  static_assert(sizeof(AmCloseHeader) == 24);
  // A rail of a connection going down or coming back (ucx.rails; backends/ucx/README.md, "A rail
  // that dies"). kAmAbandon: the initiator gave up the batches whose seqs follow the header (they
  // had messages on the dead rail); the target forgets their progress and drops every later
  // message of theirs, from any rail, then echoes the header (kAmAbandoned): once the echo is in,
  // nothing of those batches can land any more, so they may fail. kAmProbe: sent on a rail's
  // fresh endpoint (or on a quiet one), echoed on the same rail (kAmProbeAck): the rail works.
  struct AmRailHeader {
    uint32_t magic;
    uint32_t rail;
    uint64_t target;  // the target's id for the connection
    uint64_t peer;    // the initiator's id for it, echoed
    uint64_t token;   // kAmAbandon: which abandonment the echo answers; a probe's number
  };
  static_assert(sizeof(AmRailHeader) == 32);

  // One PostWrites call. Owned by its peer's `batches` list from acceptance to completion. Its
  // parts (`pending`) are the UCX requests not yet completed, plus one while chunks remain to be
  // posted, plus one while an ack is awaited. Only the progress thread touches them (UCX calls
  // request callbacks from ucp_worker_progress, on that thread), so they need no atomic.
  struct Batch : toolkit::BatchBase<Batch> {
    PeerState* peer = nullptr;
    std::vector<ResolvedOp> ops;
    size_t next_op = 0;  // posting cursor: op and offset of the next chunk
    uint64_t next_offset = 0;
    bool orphaned = false;     // abandoned at a close deadline: only UCX's late callbacks remain
    bool reads = false;        // a PostReads batch: every op is a get
    bool has_puts = false;     // some op travels as puts: a flush ends the batch
    uint32_t am_messages = 0;  // "am" messages in the batch
    std::vector<AmPutHeader> am_headers;  // one per message sent; reserved, so never moved
    bool awaiting_ack = false;            // holds a reference until the target's ack
    // "am" read requests: ranges posted and not yet sent (read_open), and one header and its
    // ranges per message sent, kept until the batch is done (deques never move them).
    std::vector<AmReadRange> read_open;
    uint64_t read_open_bytes = 0;
    std::deque<AmReadBatchHeader> read_headers;
    std::deque<std::vector<AmReadRange>> read_messages;
    // ucx.rails: the rail its "am" ops go to, and the bytes posted there since it moved (a
    // batch moves, between whole ops, every kRailStripeBytes; the first op picks).
    uint32_t rail = 0;
    uint64_t rail_bytes = UINT64_MAX;
    uint8_t lanes_used = 0;  // bit r: a message of the batch went on rail r
  };

  // Lives in each UCX request (ucp_params_t::request_size): what its completion is for. Written
  // right after ucp_put_nbx/flush returns the request; UCX calls the callback only later, from
  // ucp_worker_progress on the same thread.
  struct RequestContext {
    Batch* batch;
    uint64_t bytes : 56;  // counted in the lane's window; 0 for a flush or a read request
    uint64_t rail : 8;    // the lane it went on
  };
  static_assert(sizeof(RequestContext) <= kRequestContextBytes);

  // kCutting: on the "am" path, the close message is sent and its echo awaited (AmCloseHeader).
  enum class CloseState { kOpen, kCutting, kFlushing, kClosing, kClosed };

  // One connection's worker (see the top of this file), with what its handlers need: the
  // handlers' argument. A target's worker serves only that target: a message naming another
  // target id is refused.
  struct ConnWorker {
    UcxTransport* transport = nullptr;
    spi::TargetId target = 0;  // the target endpoint it serves; 0 for an initiator's worker
    uint32_t rail = 0;
    UcpWorkerPtr worker;
    int fd = -1;  // owned by the worker
    std::vector<uint8_t> address;
  };

  struct PeerState;
  // One rail of a connection (ucx.rails; a single lane without them): its worker, its endpoint
  // to the target's worker of the same rail, and the windows that pace what is posted on it.
  // Lane 0 also carries puts, gets, flushes and the close message; the others "am" traffic only.
  struct Lane {
    PeerState* peer = nullptr;  // the endpoint error handler's argument is the lane
    uint32_t rail = 0;
    std::unique_ptr<ConnWorker> worker;  // declared before the endpoint: destroyed after it
    UcpEp ep;
    toolkit::InflightWindow window{0};
    toolkit::InflightWindow read_window{0};  // "am" read requests: bytes not yet answered
    void* close_request = nullptr;
    // A rail that dies (LaneDown; backends/ucx/README.md, "A rail that dies").
    std::vector<uint8_t> remote_address;  // the target's worker on this rail, to come back to
    Clock::time_point last_progress;      // a send completed or a message arrived on it
    uint64_t probe_sent = 0;              // the number of the probe out (0: none)
    Clock::time_point probe_deadline;
    bool down = false;   // out of the stripe until a probe on a fresh endpoint comes back
    bool reset = false;  // down, and its old worker not yet torn down (ServiceLanes)
    Clock::time_point down_since;
    Clock::time_point next_probe;
    std::string down_reason;
  };

  // The progress thread's view of one connection.
  struct PeerState {
    UcxTransport* transport = nullptr;
    spi::PeerId id = 0;
    uint64_t target = 0;  // the target's id for this connection (from its endpoint blob)
    bool am = false;      // the target takes "am" messages for regions it did not mark direct
    // Declared before the rkeys: destroyed after them.
    std::vector<std::unique_ptr<Lane>> lanes;
    std::vector<UcpRkeyPtr> rkeys;
    toolkit::BatchList<Batch> batches;  // outstanding, oldest first
    std::deque<Batch*> to_post;         // batches with chunks still to post, in order
    Status failure;                     // why the peer is unusable (set once)
    bool ep_failed = false;      // UCX reported the endpoint failed (or it stalled): no flush
    bool disconnecting = false;  // Disconnect asked: erase once drained
    CloseState close_state = CloseState::kOpen;  // advanced by AdvanceClose once failure is set
    bool cut = false;  // the target echoed our close message: nothing of ours lands any more
    void* flush_request = nullptr;
    Clock::time_point last_activity;
    Clock::time_point close_deadline;
    Clock::time_point cut_deadline;  // kCutting: when to stop waiting for the target's echo
    std::vector<std::promise<void>> on_erased;
    size_t am_reads = 0;  // entries of am_reads_ for this peer
    // Batches given up with a dead rail: sent in a kAmAbandon message, their echo awaited.
    struct Abandonment {
      uint64_t token = 0;
      uint32_t rail = 0;
      std::vector<uint64_t> seqs;
      bool sent = false;
      Clock::time_point deadline;
    };
    std::vector<Abandonment> abandonments;
  };

  // A registered local region, as PostWrites validates it.
  struct LocalRegionEntry {
    uintptr_t addr = 0;
    uint64_t length = 0;
    std::shared_ptr<UcpMemh> memh;
    bool direct = false;     // peers write it with puts (see IsDirectRegion)
    uint32_t am_region = 0;  // its AmRegion id (0 when direct)
    bool cuda = false;       // registered as kCuda (never digested by the CPU)
  };
  struct RemoteRegionEntry {
    uint64_t addr = 0;
    uint64_t length = 0;
    ucp_rkey_h rkey = nullptr;  // owned by the PeerState
    bool direct = false;        // the target asks for puts into this region
    uint32_t am_region = 0;     // the target's id for it (read requests name it)
  };
  // A connection, as PostWrites validates it.
  struct PeerEntry {
    bool am = false;
    std::vector<RemoteRegionEntry> regions;
    Status failure;  // non-OK once the endpoint failed: new batches are refused
  };

  // An open target endpoint; "am" targets keep their fence on the progress thread (AmTarget).
  struct TargetEntry {};

  UcxTransport(UcxOptions options, std::shared_ptr<UcxContext> context);
  Status Init();
  Status Post(spi::PeerId peer, std::span<const spi::WriteOp> ops, spi::WriteCallback done,
              toolkit::OpKind kind, std::span<uint32_t> crcs = {});

  // Progress thread (ucx_progress.cc).
  void ProgressLoop();
  bool DrainCommands();
  void AcceptBatch(std::unique_ptr<Batch> batch);
  bool PostReady();
  bool PostChunks(PeerState& peer);
  bool SendReadRequests(PeerState& peer, Batch& batch);
  bool SendReadRequests(PeerState& peer, Batch& batch, uint32_t rail);
  void PostFlush(Batch& batch);
  void ReleaseRef(Batch& batch);
  void FailPeer(PeerState& peer, const Status& status);
  void AdvanceClose(PeerState& peer);
  bool SendClose(PeerState& peer);
  void StartFlush(PeerState& peer);
  void CloseEndpoint(PeerState& peer, bool force);
  bool ReapPeers(Clock::time_point now);
  void CheckStalls(Clock::time_point now);
  // ucx.rails: lane `rail` of `peer` is down (a stall, an endpoint error, a failed send): marks
  // it and the batches that used it; may run inside UCX callbacks. Rail 0, or the last live
  // rail, fails the whole connection instead.
  void LaneDown(PeerState& peer, uint32_t rail, const std::string& why, bool stalled);
  // The loop's side of LaneDown and of coming back: abandons, tears down, probes, fails over.
  bool ServiceLanes(Clock::time_point now);
  // Whether a failure on `rail` is that rail's alone (LaneDown), not the connection's: rails,
  // the "am" path, not rail 0, another rail up, and the connection healthy.
  bool RailsMayFail(const PeerState& peer, uint32_t rail) const;
  // Per-rail stalls (ucx.rail_stall_ms): probes quiet rails, downs silent ones.
  void CheckRailStalls(Clock::time_point now);
  void ResetLane(Lane& lane);
  void ProbeLane(PeerState& peer, Lane& lane);
  void FailOverReads(PeerState& peer, uint32_t rail);
  bool SendProbe(PeerState& peer, Lane& lane);
  // "rail 1 (eth1)"
  std::string RailName(uint32_t rail) const;
  // The first lane that is not down: control messages go there.
  Lane* ControlLane(PeerState& peer);
  static ucs_status_t OnAmAbandon(void* arg, const void* header, size_t header_length, void* data,
                                  size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnAmAbandoned(void* arg, const void* header, size_t header_length, void* data,
                                    size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnAmProbe(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnAmProbeAck(void* arg, const void* header, size_t header_length, void* data,
                                   size_t length, const ucp_am_recv_param_t* param);
  // The peer and lane a message arriving on `via` (an initiator's worker) belongs to, or null.
  Lane* LaneOf(const ConnWorker* via, uint64_t peer);
  void ReapRetired();
  void OrphanBatches(PeerState& peer);
  void RunCompletions();
  void SleepUntilWoken(int timeout_ms);
  void Shutdown();
  static void OnRequestDone(void* request, ucs_status_t status, void* user_data);
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  // "am" data path (progress thread, inside ucp_worker_progress).
  static ucs_status_t OnAmPut(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnAmAck(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  AmStatus ApplyAmPut(const AmPutHeader& header, const void* data, size_t length, bool* batch_done);
  void SendAmAck(ucp_ep_h reply_ep, uint64_t batch, AmStatus status);
  static ucs_status_t OnAmClose(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnAmClosed(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param);
  void ReleaseAck(Batch& batch);
  // "am" reads: the target's side (OnAmRead, AnswerAmRead, SendAmReadReply) and the
  // initiator's (OnAmReadReply, FinishAmRead, DropAmReads).
  static ucs_status_t OnAmRead(void* arg, const void* header, size_t header_length, void* data,
                               size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnAmReadReply(void* arg, const void* header, size_t header_length, void* data,
                                    size_t length, const ucp_am_recv_param_t* param);
  void AnswerAmRead(ucp_ep_h reply_ep, const AmReadRequest& request);
  // Bytes of a reply: sent from the region itself (`data` points into region `region` and
  // stays readable until UCX completes the send), for connection `target`.
  struct ReplySource {
    spi::TargetId target = 0;
    uint32_t region = 0;
  };
  void ReplySent(const ReplySource& source);
  void NoteReplyFailure(ucs_status_t status);
  // Off the progress thread: waits until `count` (run on the progress thread) is 0, at most
  // `grace`; the count left.
  uint64_t WaitForReplies(const std::function<uint64_t()>& count, Clock::duration grace);
  void SendAmReadReply(ucp_ep_h reply_ep, const ReplySource& source, uint64_t cookie,
                       uint64_t offset, AmStatus status, const uint8_t* data, size_t length);
  void FinishAmRead(uint64_t cookie);
  void DropAmReads(PeerState& peer);
  // Whether a region of this kind at this address is written with puts even on the "am" path.
  bool IsDirectRegion(const spi::MemoryRegion& region, bool ucx_allocated) const;
  // Progress thread: a worker with pdlib's handlers, watched by the loop / unwatched and
  // destroyed (UCX completes the worker's outstanding sends, with their callbacks, meanwhile).
  StatusOr<std::unique_ptr<ConnWorker>> MakeWorker(spi::TargetId target, uint32_t rail);
  void DestroyWorker(std::unique_ptr<ConnWorker> worker);
  // ucp_worker_progress on every worker; whether any made progress.
  bool ProgressWorkers();
  // Destroys the workers of closed targets whose linger is over (all of them with `all`).
  bool ReapClosedTargets(Clock::time_point now, bool all);
  // The lane a batch's "am" op at its cursor goes on (ucx.rails), moving the batch to the rail
  // with the most room every kRailStripeBytes; false when a pending read request message could
  // not be sent first.
  bool PickRail(PeerState& peer, Batch& batch, bool read_request);
  size_t rail_count() const { return std::max<size_t>(1, options_.rails.size()); }

  const UcxOptions options_;
  std::shared_ptr<UcxContext> context_;
  // Rail r's context (ucx.rails); [0] is context_.
  std::vector<std::shared_ptr<UcxContext>> rail_contexts_;
  bool am_target_ = false;  // this process takes "am" messages as a target (ucx.data_path)

  // Shared with API threads. A batch is queued to the progress thread under mu_, so that it
  // cannot pass a Disconnect of its peer.
  Mutex mu_;
  toolkit::LocalRegions<LocalRegionEntry> local_regions_ ABSL_GUARDED_BY(mu_){"ucx"};
  toolkit::PeerTable<PeerEntry> peers_ ABSL_GUARDED_BY(mu_){"ucx"};
  toolkit::TargetTable<TargetEntry> targets_ ABSL_GUARDED_BY(mu_){"ucx"};
  std::atomic<int> direct_regions_{0};  // registered regions peers write with puts

  // Progress thread only.
  // "am" targets: open connections, and how far each batch of theirs got.
  struct AmBatchProgress {
    uint32_t expected = 0;
    uint32_t received = 0;
    AmStatus status = kAmOk;
  };
  struct AmTarget {
    bool fenced = false;
    std::unordered_map<uint64_t, AmBatchProgress> batches;
    // Batches the initiator gave up with a dead rail (kAmAbandon): their messages are dropped.
    std::unordered_set<uint64_t> abandoned;
  };
  std::unordered_map<spi::TargetId, AmTarget> am_targets_;
  // Every worker, for the loop: those of peer_states_, target_workers_ and closed_targets_.
  std::vector<ConnWorker*> workers_;
  // A target's workers, one per rail.
  using RailWorkers = std::vector<std::unique_ptr<ConnWorker>>;
  std::unordered_map<spi::TargetId, RailWorkers> target_workers_;
  // Closed targets' workers, destroyed at the time given (kTargetLinger after the close).
  std::vector<std::pair<Clock::time_point, RailWorkers>> closed_targets_;
  std::vector<AmRegion> am_regions_;  // host memory "am" messages may write and read (not direct)
  // Landing digests: the watched cells by first address, and each watch's results (the cells
  // point into them), under landing_mu_ (a leaf lock: the handler takes it per chunk while a
  // watch is out; WatchLandings and TakeLandings never wait for the progress thread).
  Mutex landing_mu_;
  std::atomic<size_t> landing_watch_count_{0};
  struct LandingCell {
    uint64_t end = 0;
    uint64_t watch = 0;
    spi::LandingDigest* digest = nullptr;
  };
  std::map<uint64_t, LandingCell> landing_cells_ ABSL_GUARDED_BY(landing_mu_);
  struct LandingWatch {
    std::vector<uint64_t> starts;  // its cells' first addresses, in WatchLandings order
    std::vector<spi::LandingDigest> digests;
  };
  std::unordered_map<uint64_t, LandingWatch> landing_watches_ ABSL_GUARDED_BY(landing_mu_);
  std::atomic<uint64_t> last_landing_watch_{0};
  // The handler's copy of `length` bytes to `dst`, and the digest of what it wrote into the
  // watched cells it overlaps (cells found before the copy, CRCs of the message's bytes computed
  // without the lock).
  // The digests wait in landed_pending_ (progress thread only) until the next chunk's lock hold,
  // or FoldLanded before a batch is acknowledged or completed.
  void CopyLanding(uint8_t* dst, const void* data, uint64_t length);
  void FoldLanded();
  void FoldLandedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(landing_mu_);
  struct LandedPiece {
    uint64_t cell = 0, watch = 0;
    uint64_t offset = 0, bytes = 0;  // where in the chunk, how long
    uint64_t zeros_after = 0;        // the cell's bytes after the piece
    uint32_t crc = 0;                // set by the copy
  };
  std::vector<LandedPiece> landed_pending_;
  // Unlinks a watch's cells into `freed` (freed by the caller once the lock is released).
  void EraseLandingWatch(uint64_t watch,
                         std::vector<std::map<uint64_t, LandingCell>::node_type>* freed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(landing_mu_);
  uint32_t last_am_region_ = 0;
  // Initiator: "am" read requests sent and not fully answered, by cookie (never reused, so a
  // late reply to a finished or dropped request finds nothing and is dropped).
  struct AmRead {
    Batch* batch;
    PeerState* peer;
    uint32_t rail;  // the lane its request went on (and its replies come back on)
    uint8_t* dst;
    uint64_t length;
    uint64_t received;
  };
  std::unordered_map<uint64_t, AmRead> am_reads_;
  uint64_t last_read_cookie_ = 0;
  uint64_t last_rail_token_ = 0;    // kAmAbandon and kAmProbe numbers
  bool rail_service_ = false;       // a lane is down or an abandonment is out: ServiceLanes runs
  uint64_t am_reply_failures_ = 0;  // target: replies UCX could not send (logged, dropped)
  // Target: replies UCX has not sent yet. The loop polls while there are any, as it does while
  // batches are outstanding: UCX does not wake an armed worker when a socket drains.
  uint64_t am_replies_in_flight_ = 0;
  // The same replies by connection and by region: they point into the region (no copy), so a
  // fence and a deregistration wait for theirs (WaitForReplies).
  std::unordered_map<spi::TargetId, uint64_t> replies_by_target_;
  std::unordered_map<uint32_t, uint64_t> replies_by_region_;
  std::unordered_map<uint64_t, Batch*> awaiting_ack_;  // by batch seq
  std::unordered_map<spi::PeerId, std::unique_ptr<PeerState>> peer_states_;
  uint64_t last_seq_ = 0;                // seq of the last accepted batch
  std::set<uint64_t> outstanding_seqs_;  // seqs of batches not yet completed
  // Deregistered memory handles, unmapped once every batch accepted before (seq <= first) is done.
  std::vector<std::pair<uint64_t, std::shared_ptr<UcpMemh>>> retired_;
  // Callbacks (also of orphaned batches) and Disconnect waiters, run at the loop's safe point.
  toolkit::Completions<Batch> completions_;
  std::vector<std::unique_ptr<Batch>> orphans_;  // kept until the worker is destroyed
  Clock::time_point now_;                        // taken once per loop iteration
  Clock::time_point next_stall_check_;

  toolkit::ProgressThread<Batch> progress_{"ucx"};
};

}  // namespace ucx

// Adds "ucx" to the backend registry (called from the generated RegisterBuiltinBackends()).
void RegisterUcxBackend();

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_UCX_UCX_TRANSPORT_H_
