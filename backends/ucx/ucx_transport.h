// The UCX backend: the transport SPI (include/pdlib/spi/transport.h) on UCP one-sided puts.
//
// One worker per transport, in a UCP context shared with the KV pools and the other transports
// of the process that have the same UCX configuration (ucx_context.h). One progress thread per
// transport is the only thread that calls UCX with the worker, its endpoints, rkeys and memory
// handles: API calls from other threads hand work over through a command queue and wake the
// thread with an eventfd.
// The thread loops: run commands -> post puts (paced per endpoint by a window, put_window.h)
// -> ucp_worker_progress -> run completion callbacks -> busy-poll a little -> ucp_worker_arm ->
// epoll on the worker's fd and the wake fd.
//
// Keys and endpoints: RegisterMemory returns the packed rkey (ucp_rkey_pack) as the key blob;
// CreateTargetEndpoint returns the worker's address; Connect creates an endpoint to it with peer
// error handling (a dead peer fails its outstanding batches with kUnavailable, naming the UCX
// status); ImportRemoteRegion unpacks the rkey on that endpoint.
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
// Threads: every public method may be called from any thread, including from a completion
// callback (control calls made there run inline on the progress thread). Callbacks run on the
// progress thread, never while pdlib holds a lock.
#ifndef PDLIB_BACKENDS_UCX_UCX_TRANSPORT_H_
#define PDLIB_BACKENDS_UCX_UCX_TRANSPORT_H_

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <list>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backends/ucx/put_window.h"
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
  void Disconnect(spi::PeerId peer) override;
  // Progresses the worker until it finds nothing more to do (three idle rounds) or 50 ms pass:
  // emulated puts already in this worker's FIFOs and sockets are applied before it returns.
  void SettleIncoming() override;

  // The context this transport shares with KV pools and transports configured alike.
  const std::shared_ptr<UcxContext>& context() const { return context_; }

 private:
  using Clock = std::chrono::steady_clock;
  struct PeerState;

  // One write, resolved to addresses and handles when the batch is validated.
  struct ResolvedOp {
    const uint8_t* src;
    uint64_t dst;
    uint64_t length;
    ucp_mem_h memh;
    ucp_rkey_h rkey;
  };

  // One PostWrites call. Owned by its peer's `batches` list from acceptance to completion.
  struct Batch {
    uint64_t seq = 0;
    spi::PeerId peer_id = 0;
    PeerState* peer = nullptr;
    spi::WriteCallback done;
    std::vector<ResolvedOp> ops;
    size_t next_op = 0;  // posting cursor: op and offset of the next chunk
    uint64_t next_offset = 0;
    // UCX requests not yet completed, plus one while chunks remain to be posted. Only the
    // progress thread reads or writes it (UCX calls request callbacks from
    // ucp_worker_progress, on that thread), so it needs no atomic.
    uint32_t pending = 1;
    Status status;          // the first error
    bool orphaned = false;  // abandoned at a close deadline: only UCX's late callbacks remain
    std::list<std::unique_ptr<Batch>>::iterator self;
  };

  // Lives in each UCX request (ucp_params_t::request_size): what its completion is for. Written
  // right after ucp_put_nbx/flush returns the request; UCX calls the callback only later, from
  // ucp_worker_progress on the same thread.
  struct RequestContext {
    Batch* batch;
    uint64_t bytes;  // counted in the peer's window; 0 for a flush
  };
  static_assert(sizeof(RequestContext) <= kRequestContextBytes);

  enum class CloseState { kOpen, kFlushing, kClosing, kClosed };

  // The progress thread's view of one connection.
  struct PeerState {
    UcxTransport* transport = nullptr;
    spi::PeerId id = 0;
    UcpEp ep;
    std::vector<UcpRkeyPtr> rkeys;
    InflightWindow window{0};
    std::list<std::unique_ptr<Batch>> batches;  // outstanding, oldest first
    std::deque<Batch*> to_post;                 // batches with chunks still to post, in order
    Status failure;                             // why the peer is unusable (set once)
    bool ep_failed = false;      // UCX reported the endpoint failed (or it stalled): no flush
    bool disconnecting = false;  // Disconnect asked: erase once drained
    CloseState close_state = CloseState::kOpen;  // advanced by AdvanceClose once failure is set
    void* flush_request = nullptr;
    void* close_request = nullptr;
    Clock::time_point last_activity;
    Clock::time_point close_deadline;
    std::vector<std::promise<void>> on_erased;
  };

  // A registered local region, as PostWrites validates it.
  struct LocalRegionEntry {
    uintptr_t addr = 0;
    uint64_t length = 0;
    std::shared_ptr<UcpMemh> memh;
  };
  struct RemoteRegionEntry {
    uint64_t addr = 0;
    uint64_t length = 0;
    ucp_rkey_h rkey = nullptr;  // owned by the PeerState
  };
  // A connection, as PostWrites validates it.
  struct PeerEntry {
    std::vector<RemoteRegionEntry> regions;
    Status failure;  // non-OK once the endpoint failed: new batches are refused
  };

  // What the progress thread is handed: a batch, or a function to run there.
  struct Command {
    std::unique_ptr<Batch> batch;
    std::function<void()> fn;
  };

  UcxTransport(UcxOptions options, std::shared_ptr<UcxContext> context);
  Status Init();

  // Runs `fn` on the progress thread and returns its result (inline when already there).
  template <typename R>
  R RunOnProgressThread(const std::function<R()>& fn);
  bool Enqueue(Command command);
  void Wake();
  bool OnProgressThread() const { return std::this_thread::get_id() == progress_id_; }

  // Progress thread (ucx_progress.cc).
  void ProgressLoop();
  bool DrainCommands();
  void AcceptBatch(std::unique_ptr<Batch> batch);
  bool PostReady();
  bool PostChunks(PeerState& peer);
  void PostFlush(Batch& batch);
  void ReleaseRef(Batch& batch);
  void FailBatch(Batch& batch, const Status& status);
  void FailPeer(PeerState& peer, const Status& status);
  void AdvanceClose(PeerState& peer);
  void CloseEndpoint(PeerState& peer, bool force);
  bool ReapPeers(Clock::time_point now);
  void CheckStalls(Clock::time_point now);
  void ReapRetired();
  void OrphanBatches(PeerState& peer);
  void RunCompletions();
  void SleepUntilWoken(int timeout_ms);
  void Shutdown();
  static void OnRequestDone(void* request, ucs_status_t status, void* user_data);
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);

  const UcxOptions options_;
  std::shared_ptr<UcxContext> context_;
  UcpWorkerPtr worker_;
  std::vector<uint8_t> endpoint_blob_;  // magic + worker address
  int worker_fd_ = -1;                  // owned by the worker
  int wake_fd_ = -1;                    // eventfd, owned
  int epoll_fd_ = -1;                   // owned

  // Shared with API threads.
  Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool sleeping_ ABSL_GUARDED_BY(mu_) = false;  // the progress thread is (about to be) in epoll
  std::deque<Command> commands_ ABSL_GUARDED_BY(mu_);
  std::vector<std::optional<LocalRegionEntry>> local_regions_ ABSL_GUARDED_BY(mu_);  // by id
  std::unordered_map<spi::PeerId, PeerEntry> peers_ ABSL_GUARDED_BY(mu_);
  spi::PeerId next_peer_ ABSL_GUARDED_BY(mu_) = 1;
  spi::TargetId next_target_ ABSL_GUARDED_BY(mu_) = 1;
  std::set<spi::TargetId> targets_ ABSL_GUARDED_BY(mu_);

  // Progress thread only.
  std::unordered_map<spi::PeerId, std::unique_ptr<PeerState>> peer_states_;
  uint64_t last_seq_ = 0;                // seq of the last accepted batch
  std::set<uint64_t> outstanding_seqs_;  // seqs of batches not yet completed
  // Deregistered memory handles, unmapped once every batch accepted before (seq <= first) is done.
  std::vector<std::pair<uint64_t, std::shared_ptr<UcpMemh>>> retired_;
  std::vector<std::unique_ptr<Batch>> completed_;  // callbacks to run at the loop's safe point
  std::vector<std::pair<spi::WriteCallback, Status>> orphan_calls_;
  std::vector<std::promise<void>> erased_signals_;  // Disconnect waiters, after the callbacks
  std::vector<std::unique_ptr<Batch>> orphans_;     // kept until the worker is destroyed
  Clock::time_point now_;                           // taken once per loop iteration
  Clock::time_point next_stall_check_;

  std::thread progress_;
  std::thread::id progress_id_;
};

}  // namespace ucx

// Adds "ucx" to the backend registry (called from the generated RegisterBuiltinBackends()).
void RegisterUcxBackend();

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_UCX_UCX_TRANSPORT_H_
