// PrefillCore: the prefill side of the protocol, independent of how control messages travel.
// It accepts decode connections (OnRegister), collects TransferInfos per room, turns each sent
// chunk into one batch of one-sided writes, and after the last chunk writes aux then state and
// reports Status to every decode rank involved.
//
// Threads: On* methods are called by the control plane's threads, the Sender* methods by engine
// threads, completions by the transport's progress thread; a small worker pool builds and posts
// write batches. No lock is held while calling into a link or the transport.
//
// Files, one idea each: prefill_core.cc (lifecycle, rooms, timeouts, metrics), prefill_peers.cc
// (decode connections and draining), prefill_intake.cc (TransferInfo and Abort), prefill_writes.cc
// (Send, the write workers, completions); prefill_types.h holds the per-peer and per-room state.
#ifndef PDLIB_LIB_CORE_PREFILL_CORE_H_
#define PDLIB_LIB_CORE_PREFILL_CORE_H_

#include <atomic>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "lib/base/mutex.h"
#include "lib/core/control_messages.h"
#include "lib/core/manager_common.h"
#include "lib/core/room_table.h"
#include "lib/planner/planner.h"

namespace pdlib {
inline namespace v1 {

class PrefillCore : public PrefillHandler, public std::enable_shared_from_this<PrefillCore> {
 public:
  static StatusOr<std::shared_ptr<PrefillCore>> Create(const KVManagerOptions& options,
                                                       std::unique_ptr<spi::Transport> transport);
  ~PrefillCore() override;
  // Stops intake, fails every live room, joins the workers, releases registrations.
  void Shutdown();

  const KVManagerOptions& options() const { return options_; }
  // This manager instance, random per core (RegisterAckMsg::instance).
  uint64_t instance() const { return instance_; }

  // Control plane, decode -> prefill.
  RegisterAckMsg OnRegister(const RegisterMsg& msg, std::shared_ptr<DecodeLink> link) override;
  void OnTransferInfo(const TransferInfoMsg& msg) override;
  void OnAbort(uint64_t room, uint64_t session, const std::string& reason) override;
  // The connection to `session` broke: its rooms fail, its transport peer is dropped.
  void OnDecodeGone(uint64_t session, const DecodeLink* link, const Status& reason) override;
  // Pull (prefill_pull.cc).
  void OnPullConnect(const PullConnectMsg& msg) override;
  void OnReadsDone(const ReadsDoneMsg& msg) override;
  void OnHeartbeat(const HeartbeatMsg& msg) override;

  // Engine side (KVSender).
  StatusOr<std::shared_ptr<RoomState>> CreateRoom(uint64_t room);
  Status InitRoom(uint64_t room, uint64_t num_kv_pages, std::optional<uint32_t> aux_index);
  // KVSender::SendLayers; Send is SendLayers with every layer (num_layers()).
  Status SendLayers(uint64_t room, std::span<const int32_t> pages, int32_t layers_done, bool last,
                    const StateIndices& state);
  // KVSender::decode_prefix_len: decode's prefix once every TransferInfo of the room is in.
  std::optional<uint64_t> DecodePrefix(uint64_t room) const;
  uint32_t page_size() const { return options_.args.page_size; }
  int32_t num_layers() const { return layout_.engine_layers(); }
  void AbortRoom(uint64_t room, std::string_view reason);
  void ReleaseRoom(uint64_t room, const RoomState* state);

  KVManagerMetrics metrics() const;
  // Rooms whose sender was destroyed in state Failed, once their source pages are reusable
  // (each once; see ReleasedRooms).
  std::vector<uint64_t> TakeReusableRooms();
  // Rooms that failed while no decode rank was bound to them (a refused pairing, an engine
  // abort before decode came), with their reasons, each once: the manager relays them through
  // the deployment's directory, so that a decode rank bound elsewhere learns them at once.
  struct UnboundFailure {
    uint64_t room;
    std::string reason;
  };
  std::vector<UnboundFailure> TakeUnboundFailures();
  // TransferInfos held for senders not created yet (for tests and leak checks).
  size_t early_info_count() const;
  size_t early_info_bytes() const;

 private:
  struct Peer;
  struct Room;
  struct DrainingPeer;
  struct Chunk {
    std::shared_ptr<Room> room;
    std::vector<int32_t> src_pages;
    size_t dst_offset = 0;    // index into the TransferInfo's dst pages
    bool last = false;        // the request's last chunk, and these are its last layers
    int32_t layer_begin = 0;  // the KV layers [layer_begin, layer_end) of the chunk
    int32_t layer_end = 0;
  };

  PrefillCore(const KVManagerOptions& options, std::unique_ptr<spi::Transport> transport);
  void WorkerLoop();
  bool WorkReady() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); }
  void ProcessChunk(const Chunk& chunk);
  // Maps planned writes (buffer indices) onto this rank's and `peer`'s transport regions.
  std::vector<spi::WriteOp> ToWriteOps(const Peer& peer,
                                       std::span<const planner::PlannedWrite> writes);
  void OnBatchDone(const std::shared_ptr<Room>& room, uint64_t bytes, uint64_t pages, Status s);
  // KV integrity: adds what `writes` move to the decode rank of room->infos[info] (whose
  // request's pages are `dst_pages`) to the room's digest for it, then releases the batch count
  // ProcessChunk held for it.
  void DigestWrites(const std::shared_ptr<Room>& room, const Peer& peer, size_t info,
                    std::span<const int32_t> dst_pages,
                    std::span<const planner::PlannedWrite> writes);
  // KV integrity with send digests: one batch's writes (each inside one of decode's items), the
  // CRCs the transport computed as it sent them, and the request it belongs to.
  struct SentDigest {
    std::vector<planner::PlannedWrite> writes;
    std::vector<uint32_t> crcs;
    std::vector<int32_t> dst_pages;  // every page of the decode rank's request
    size_t info = 0;                 // its entry in room->infos
  };
  // Adds what `writes` move to the decode rank of room->infos[info] (its request's pages
  // `dst_pages`) to the room's digest for it: from the source, or from the CRCs the transport
  // took as it sent them (`sent`, one per write; AddWritesToDigest).
  Status MergeDigest(const std::shared_ptr<Room>& room, const Peer& peer, size_t info,
                     std::span<const int32_t> dst_pages,
                     std::span<const planner::PlannedWrite> writes, std::span<const uint32_t> sent);
  // KV integrity: adds the aux/state writes of the tail to `digest` (with the positions of
  // decode's state lists they cover).
  Status DigestTail(const Peer& peer, const TransferInfoMsg& info, const planner::TailInput& tail,
                    std::span<const planner::PlannedWrite> writes, KvDigest* digest) const;
  // KV integrity, pull: sets msg->digest to what the reader behind `peer` (its request `info`)
  // reads of the published chunk `msg`.
  Status DigestOffer(const Peer& peer, const TransferInfoMsg& info, ReadReadyMsg* msg) const;
  // The all-zero digest of the decode rank behind `peer` for the request `info`.
  KvDigest EmptyDigestFor(const Peer& peer, const TransferInfoMsg& info) const;
  void Finalize(const std::shared_ptr<Room>& room);
  void FinalizeTail(const std::shared_ptr<Room>& room);
  void FailRoom(const std::shared_ptr<Room>& room, Status reason);
  // Once `room` is terminal with no write batch in flight (chunks and aux/state), marks its
  // pages reusable and, if it failed, tells every decode session it wrote to that it drained.
  void MaybeDrained(const std::shared_ptr<Room>& room);
  // One aux/state batch of `room` (or Finalize's own hold on it) is over.
  void TailDone(const std::shared_ptr<Room>& room);
  // Tells decode `session` that `rooms` are drained: on its live link, or in the RegisterAck of
  // its next connection.
  void SendDrained(uint64_t session, std::vector<uint64_t> rooms);
  void SendStatusToDecode(const std::shared_ptr<Room>& room, const Status& status);
  void CheckTimeouts();
  void DrainPeers(absl::Time now);
  // Push: decode sessions whose transport connection failed (Transport::PeerStatus) while their
  // control stream is up are closed and retired, so that decode connects again.
  void ReplaceFailedPeers();
  // A decode connection ended (or was replaced): fails its rooms and drops its transport peer,
  // at once when nothing is in flight to it, else once that is over (DrainingPeer).
  void RetirePeer(const std::shared_ptr<Peer>& peer, const Status& reason);
  // transport_->Disconnect, unless Shutdown destroyed the transport already.
  void DisconnectPeer(spi::PeerId peer);
  std::shared_ptr<Room> FindRoom(uint64_t room) const;
  // A live room, or a failed one whose sender is gone but whose pages are still held.
  std::shared_ptr<Room> FindRoomOrLingering(uint64_t room) const;

  // Pull (prefill_pull.cc).
  bool pull() const { return options_.direction == TransferDirection::kPull; }
  // Sends every reader the chunks published since its last ReadReady.
  void PublishPending(const std::shared_ptr<Room>& room);
  // Success once every TransferInfo is in, the last chunk is published and every reader
  // reported its reads done.
  void MaybePullSuccess(const std::shared_ptr<Room>& room);
  // The reader slots of a TransferInfo about to be appended to room->infos, and the checks that
  // pair it with what was published before it came; not OK: refuse it. Holding room.mu.
  Status AddReader(Room& room, const TransferInfoMsg& info, bool reads);
  // A reader's reads are over (ReadsDone, or its session is gone): false if they were already.
  // Holding room.mu.
  bool CloseReader(Room& room, size_t reader, bool ok);
  // Lease expiry and overdue readers of failed rooms; `rooms` are live and lingering rooms.
  void CheckLeases(absl::Time now, const std::vector<std::shared_ptr<Room>>& rooms);
  // Pull's RetirePeer: the session's rooms fail, its reads are over (fenced where the transport
  // can), its endpoint is closed.
  void RetireReader(const std::shared_ptr<Peer>& peer, const Status& reason);
  // Pull's OnRegister half: an endpoint for decode to read through, and prefill described.
  Status AcceptReader(const RegisterMsg& msg, Peer* peer, RegisterAckMsg* ack);

  const KVManagerOptions options_;
  const uint64_t instance_;
  // Control-plane threads (Register, a stream's end, the reaper) use the transport under
  // transport_mu_, which Shutdown holds to destroy it; the data path (workers, completions) is
  // stopped before that and needs no lock.
  Mutex transport_mu_;
  std::unique_ptr<spi::Transport> transport_;
  planner::SideLayout layout_;  // this rank, as the planner sees it
  RegisteredBuffers local_;
  DigestMemory digest_src_;           // local_, for KV digests
  bool send_digests_ = false;         // the transport digests host pools as it sends them
  std::vector<uint64_t> state_caps_;  // per state family: items every buffer of it holds
  FailureInjector injector_;
  RoomTable rooms_;
  MetricCounters counters_;

  mutable Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Room>> room_data_ ABSL_GUARDED_BY(mu_);
  // TransferInfos that arrived before the engine created the sender, with their arrival time:
  // dropped after bootstrap_timeout (the decode side has timed out by then too) and when their
  // decode session goes away.
  struct EarlyInfos {
    absl::Time arrived;
    std::vector<TransferInfoMsg> infos;
    size_t bytes = 0;  // EarlyInfoBytes of `infos`
  };
  using EarlyInfoMap = absl::flat_hash_map<uint64_t, EarlyInfos>;
  EarlyInfoMap early_infos_ ABSL_GUARDED_BY(mu_);
  // Its own lock: FailRoom may run under others.
  mutable Mutex unbound_mu_;
  std::deque<UnboundFailure> unbound_failures_ ABSL_GUARDED_BY(unbound_mu_);  // at most 4096
  size_t early_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // over every entry of early_infos_
  // What one held TransferInfo costs in memory, roughly.
  static size_t EarlyInfoBytes(const TransferInfoMsg& msg);
  void EraseEarlyInfos(EarlyInfoMap::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rooms a connected decode aborted before the engine created their sender: CreateSender fails
  // them at once instead of letting them wait for bootstrap_timeout. Same bounds and expiry.
  struct EarlyAbort {
    absl::Time arrived;
    Status reason;
  };
  absl::flat_hash_map<uint64_t, EarlyAbort> early_aborts_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::shared_ptr<Peer>> peers_ ABSL_GUARDED_BY(mu_);
  std::vector<DrainingPeer> draining_ ABSL_GUARDED_BY(mu_);
  // Drained rooms of decode sessions that are not connected now, for their next RegisterAck.
  absl::flat_hash_map<uint64_t, std::vector<uint64_t>> pending_drained_ ABSL_GUARDED_BY(mu_);
  size_t pending_drained_count_ ABSL_GUARDED_BY(mu_) = 0;
  ReleasedRooms released_{"prefill"};
  RoomLogSampler room_log_{options_.room_log_every};
  // Failed rooms whose sender is destroyed but whose writes are still in flight, by room id.
  absl::flat_hash_map<uint64_t, std::shared_ptr<Room>> lingering_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> undrained_{0};  // failed rooms with writes still in flight
  std::deque<Chunk> queue_ ABSL_GUARDED_BY(mu_);
  CondVar work_cv_;  // signalled when queue_ grows or stopping_ is set

  std::vector<std::thread> workers_;
  std::unique_ptr<PeriodicThread> reaper_;
};

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CORE_PREFILL_CORE_H_
