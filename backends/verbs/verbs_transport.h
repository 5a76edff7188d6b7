// The verbs backend: the transport SPI (include/pdlib/spi/transport.h) directly on libibverbs,
// RDMA WRITE over RC queue pairs, for engines that want RDMA without UCX.
//
// Devices (verbs_device.h): one or more, each with its PD, completion channel and CQ. Every
// registered region gets an MR on each device; its key blob carries the rkey per device.
//
// Connections: the target (decode) creates one RC QP per device of its own in
// CreateTargetEndpoint and ships their addresses in the endpoint blob; the initiator (prefill)
// creates one QP per target QP (pair k on its device k mod #devices), connects them at once and
// returns their addresses in the reply blob, with which CompleteTargetEndpoint connects the
// target's ends (RC QPs are connected from both ends). Each device is a rail: the writes (reads)
// of a batch are striped over the pairs by bytes: whole writes, kStripeBytes per pair in turn
// (StripeOverPairs, verbs_wr.h), each batch starting one pair further: a request's bytes use
// every device (rail) alike.
//
// Data path: PostWrites validates every op, resolves it to addresses and keys, and plans its
// work requests (verbs_wr.h: SGE lists within max_sge, messages within max_msg_sz) on the
// calling thread; the progress thread posts them in chains, within each QP's send-queue depth
// and each CQ's capacity, signalling selectively (the last request of a batch always), polls the
// CQs 64 completions at a time, and sleeps on the completion channels when idle, re-polling after
// arming so that no completion is missed. A batch completes (OK) when the signalled last request
// of each of its QPs completes: RC completes a QP's requests in order, and a completed RDMA WRITE
// is in the target's memory.
//
// Failures: a work completion with an error (peer gone: retries exhausted; bad key; ...) fails
// every outstanding batch of that peer with kUnavailable naming the completion status (e.g.
// "transport retry counter exceeded"); the peer's QPs are moved to the error state, drained and
// destroyed, and new batches to it are refused with the same reason. New connections (the core
// reconnects when the peer registers again) get new QPs.
//
// Reads (PostReads, pull: capabilities().reads): RDMA READ work requests, planned like writes
// (the SGE list is the local destination, within max_sge_rd) and paced within each QP's read
// depth as well as its send queue (verbs_wr.h). The target's MRs and QPs allow remote reads;
// each QP gets the device's responder resources (max_qp_rd_atom, sent in the blobs) and an
// initiator depth of the device's max_qp_init_rd_atom bounded by the peer's responder resources.
// A read batch completes when its last READ of each QP has: the bytes are then in our memory.
// FenceTarget stops reads too: a responder QP in the error state answers no read request.
//
// Fences (capabilities().fences): FenceTarget moves every QP of the target endpoint to the error
// state with ibv_modify_qp before it returns. A responder QP in the error state drops every
// incoming request, so no write of that initiator (queued, in flight or posted later) lands (rxe
// may still finish the one packet its responder is executing at that instant); the initiator
// gets no ACKs and its writes fail with "transport retry counter exceeded" once
// verbs.retry_cnt retries of verbs.timeout have passed (Soft-RoCE treats retry_cnt 7 as
// "retry forever", so 7 is used as 6 on rxe devices). The fenced endpoint keeps its QPs until
// CloseTargetEndpoint; CompleteTargetEndpoint on it is refused.
//
// Threads: every public method may be called from any thread, also from a completion callback
// (Disconnect there does not wait). One progress thread per transport
// (backends/common/progress_thread.h) is the only one that posts to the initiator QPs and polls
// the CQs; callbacks run on it, never under a pdlib lock. Batches, completions and the API-side
// tables are the toolkit's (backends/common/).
#ifndef PDLIB_BACKENDS_VERBS_VERBS_TRANSPORT_H_
#define PDLIB_BACKENDS_VERBS_VERBS_TRANSPORT_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backends/common/batches.h"
#include "backends/common/progress_thread.h"
#include "backends/common/tables.h"
#include "backends/verbs/verbs_device.h"
#include "backends/verbs/verbs_options.h"
#include "backends/verbs/verbs_wr.h"
#include "lib/base/mutex.h"
#include "pdlib/spi/transport.h"

namespace pdlib {
inline namespace v1 {
namespace verbs {

// Owned by whoever created it (the KVManager); see the file comment for threads.
class VerbsTransport final : public spi::Transport {
 public:
  static StatusOr<std::unique_ptr<VerbsTransport>> Create(const spi::TransportOptions& options);
  ~VerbsTransport() override;
  VerbsTransport(const VerbsTransport&) = delete;
  VerbsTransport& operator=(const VerbsTransport&) = delete;

  std::string_view name() const override { return "verbs"; }
  spi::TransportCapabilities capabilities() const override;

  StatusOr<spi::LocalRegionId> RegisterMemory(const spi::MemoryRegion& region,
                                              spi::Blob* key_blob) override;
  Status DeregisterMemory(spi::LocalRegionId region) override;
  StatusOr<spi::TargetEndpoint> CreateTargetEndpoint() override;
  Status CompleteTargetEndpoint(spi::TargetId target, const spi::Blob& reply) override;
  void CloseTargetEndpoint(spi::TargetId target) override;
  Status FenceTarget(spi::TargetId target) override;
  StatusOr<spi::Connection> Connect(const spi::Blob& target_endpoint) override;
  StatusOr<spi::RemoteRegionId> ImportRemoteRegion(spi::PeerId peer,
                                                   const spi::RemoteRegion& region) override;
  Status PostWrites(spi::PeerId peer, std::span<const spi::WriteOp> ops,
                    spi::WriteCallback done) override;
  // RDMA READ, planned and paced like writes, within each QP's read depth (verbs_wr.h).
  Status PostReads(spi::PeerId peer, std::span<const spi::ReadOp> ops,
                   spi::ReadCallback done) override;
  Status PeerStatus(spi::PeerId peer) override {
    MutexLock lock(&mu_);
    return peers_.Health(peer);
  }
  void Disconnect(spi::PeerId peer) override;

  // "rxe0:1" per device in use, for logs and tests.
  std::vector<std::string> device_labels() const;
  // The limits writes are planned with on device `index`.
  WrLimits limits(size_t index) const { return devices_[index]->limits; }

 private:
  using Clock = std::chrono::steady_clock;
  struct PeerState;

  // A registered region's MRs, one per device. Batches hold a reference, so an MR outlives
  // every request that uses it even when the region is deregistered meanwhile.
  struct RegionMrs {
    std::vector<MrPtr> mrs;
  };
  struct LocalRegion {
    uint64_t addr = 0;
    uint64_t length = 0;
    std::vector<uint32_t> lkeys;  // by device
    std::shared_ptr<RegionMrs> mrs;
  };
  struct RemoteRegionEntry {
    uint64_t addr = 0;
    uint64_t length = 0;
    std::vector<uint32_t> rkeys;  // by pair (= by the target's device)
  };
  // A connection, as PostWrites validates it.
  struct PeerEntry {
    std::vector<size_t> pair_device;  // local device of each pair
    std::vector<size_t> live_pairs;   // the pairs with a QP (a rail down at Connect has none)
    std::vector<RemoteRegionEntry> regions;
    Status failure;  // non-OK once a QP failed: new batches are refused with it
  };
  // The target's half of one connection.
  struct TargetEntry {
    std::vector<QpPtr> qps;  // one per device, in device order (null: its port was down)
    std::vector<uint32_t> psns;
    bool connected = false;
    bool fenced = false;  // every QP is in the error state (FenceTarget)
  };

  // One PostWrites call. Owned by its peer's `batches` list from acceptance to completion. Its
  // parts (`pending`) are the pairs with unfinished requests, plus one while it is accepted.
  struct Batch : toolkit::BatchBase<Batch> {
    bool reads = false;                               // RDMA READs (PostReads), else WRITEs
    std::vector<WrPlan> plans;                        // by pair
    std::vector<size_t> next_wr;                      // posting cursor, by pair
    std::vector<std::shared_ptr<RegionMrs>> regions;  // keeps the MRs used alive
  };

  // One RC QP of a peer, as the progress thread drives it.
  struct PairState {
    uint32_t uid = 0;  // in the upper bits of every wr_id (see WrId)
    size_t index = 0;  // in the peer's pairs (and the batches' plans)
    size_t device = 0;
    QpPtr qp;
    SendQueueBudget budget{1, 1};
    std::deque<Batch*> to_post;                          // batches with requests left to post here
    std::deque<std::pair<uint64_t, Batch*>> batch_ends;  // (seq of a batch's last request, batch)
    bool errored = false;  // moved to the error state: drained, then destroyed
    bool dead = false;     // this rail failed alone (FailPair): nothing more is posted on it
    Clock::time_point last_progress;  // last completion, or the post that made it busy
    // The rail's standby QP, connected with the primary and idle until the rail fails: then it
    // is probed (a 1-byte RDMA READ) every verbs.rail_retry_ms while the local port is ACTIVE,
    // and an answered probe makes it the pair's QP (the rail rejoins). A failed probe resets it
    // towards the same peer QP from the same PSN, so the peer sees at most a repeated READ.
    QpPtr standby;
    QpAddress standby_remote;
    uint32_t standby_psn = 0;
    uint32_t probe_uid = 0;      // the standby's wr_id uid; the seq bits carry probe_gen
    uint64_t probe_gen = 0;      // completions of older probes are stale
    bool probing = false;        // a probe is posted and not completed
    bool probe_reset = false;    // the standby must be reset before the next probe
    Clock::time_point probe_at;  // the next probe, while dead with a standby
    Clock::time_point probe_sent;
    Clock::time_point dead_since;
    std::vector<Batch*> dead_batches;  // failed with this rail: their parts here end on its flush
  };
  struct PeerState {
    spi::PeerId id = 0;
    std::vector<std::unique_ptr<PairState>> pairs;
    toolkit::BatchList<Batch> batches;  // outstanding, oldest first
    Status failure;
    bool disconnecting = false;
    Clock::time_point drain_deadline;
    std::vector<std::promise<void>> on_erased;
  };

  VerbsTransport(VerbsOptions options, std::vector<std::unique_ptr<Device>> devices);
  Status Init();
  Status Post(spi::PeerId peer, std::span<const spi::WriteOp> ops, spi::WriteCallback done,
              toolkit::OpKind kind);
  uint32_t RandomPsn();

  // Progress thread (verbs_progress.cc).
  void ProgressLoop();
  bool DrainCommands();
  void AcceptBatch(std::unique_ptr<Batch> batch);
  bool PostReady();
  bool PostPair(PeerState& peer, PairState& pair);
  bool PollCqs();
  void HandleCompletion(const ibv_wc& wc);
  void ReleaseRef(Batch& batch, PeerState& peer);
  void FailPeer(PeerState& peer, const Status& status);
  void FailPair(PeerState& peer, PairState& pair, const Status& status);
  void CheckStalledPairs();
  // Dead pairs with a standby: probe it when due, give up on an unanswered probe.
  void CheckRejoins();
  void OnProbeCompletion(PeerState& peer, PairState& pair, const ibv_wc& wc, uint64_t seq);
  // The standby answered: it becomes the pair's QP and the rail rejoins the stripe.
  void Rejoin(PeerState& peer, PairState& pair);
  void ReleaseDeadPair(PeerState& peer, PairState& pair);
  void ErrorQp(PairState& pair);
  bool ReapPeers(Clock::time_point now);
  void HandleAsyncEvents();
  void RunCompletions();
  void Sleep();
  void Shutdown();

  // A batch's bytes go to one pair for this long before the next pair takes over (whole writes).
  static constexpr uint64_t kStripeBytes = uint64_t{256} << 10;

  const VerbsOptions options_;
  const std::vector<std::unique_ptr<Device>> devices_;
  std::atomic<size_t> next_stripe_{0};  // the pair the next batch starts on

  // Shared with API threads.
  Mutex mu_;
  toolkit::LocalRegions<LocalRegion> local_regions_ ABSL_GUARDED_BY(mu_){"verbs"};
  // By device: until when new connections leave that rail out (FailPair, verbs.rail_retry_ms).
  std::vector<Clock::time_point> rail_retry_at_ ABSL_GUARDED_BY(mu_);
  toolkit::PeerTable<PeerEntry> peers_ ABSL_GUARDED_BY(mu_){"verbs"};
  std::mt19937 psn_rng_ ABSL_GUARDED_BY(mu_);

  // Target endpoints: QP setup is slow (system calls), so it has its own lock.
  Mutex targets_mu_;
  toolkit::TargetTable<TargetEntry> targets_ ABSL_GUARDED_BY(targets_mu_){"verbs"};

  // Progress thread only.
  std::unordered_map<spi::PeerId, std::unique_ptr<PeerState>> peer_states_;
  // Pair uid -> its peer and index there; a uid leaves before its QP is destroyed, so a stale
  // completion finds nothing.
  std::unordered_map<uint32_t, std::pair<spi::PeerId, size_t>> pair_owner_;
  std::vector<ibv_send_wr> wr_scratch_;  // the chain being posted
  std::vector<ibv_sge> sge_scratch_;
  uint32_t next_pair_uid_ = 1;
  uint64_t last_seq_ = 0;
  std::vector<uint64_t> device_outstanding_;  // requests posted and not retired, by device
  // By device: where a probe READ lands (8 bytes, never read), registered for local writes.
  std::vector<uint64_t> probe_landing_;
  std::vector<MrPtr> probe_mrs_;
  // Callbacks and Disconnect waiters, run at the loop's safe point.
  toolkit::Completions<Batch> completions_;
  Clock::time_point now_;
  Clock::time_point next_async_check_;

  toolkit::ProgressThread<Batch> progress_{"verbs"};
};

}  // namespace verbs

// Adds "verbs" to the backend registry (called from the generated RegisterBuiltinBackends()).
void RegisterVerbsBackend();

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_VERBS_VERBS_TRANSPORT_H_
