// DecodeCore: the decode side of the protocol. Connects to prefill ranks (once per rank, cached,
// purged when the link breaks), registers its buffers once per connection, sends TransferInfo
// per request, and collects Status from every prefill rank that writes to it. On success it
// checks the aux slot's bootstrap_room (SPEC R4.4) before reporting Success.
//
// Threads: engine threads call the room methods; the control plane calls OnStatus and
// OnPrefillGone. No lock is held while calling into a link.
//
// Files: decode_core.cc (connections, rooms, status, timeouts, metrics), decode_quarantine.cc
// (page reuse: quarantine, Drained, fencing's release); decode_types.h holds the per-room state.
#ifndef PDLIB_LIB_CORE_DECODE_CORE_H_
#define PDLIB_LIB_CORE_DECODE_CORE_H_

#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "lib/base/mutex.h"
#include "lib/core/control_messages.h"
#include "lib/core/manager_common.h"
#include "lib/core/room_table.h"
#include "lib/core/transfer_layout.h"
#include "pdlib/kv_manager.h"

namespace pdlib {
inline namespace v1 {

// A prefill rank a room is bound to: its connection key and its part in the room.
struct BoundPrefill {
  std::string key;
  PrefillTarget target;
};

class DecodeCore : public DecodeHandler, public std::enable_shared_from_this<DecodeCore> {
 public:
  static StatusOr<std::shared_ptr<DecodeCore>> Create(const KVManagerOptions& options,
                                                      std::unique_ptr<spi::Transport> transport,
                                                      uint64_t session);
  ~DecodeCore() override;
  void Shutdown();

  uint64_t session() const { return session_; }
  const KVManagerOptions& options() const { return options_; }
  // This rank as the planner sees it.
  const planner::SideLayout& layout() const { return layout_; }

  // Connects to the prefill rank named `key` unless already connected. `make_link` opens the
  // control link (called without locks held).
  Status EnsureConnected(const std::string& key,
                         const std::function<StatusOr<std::shared_ptr<PrefillLink>>()>& make_link);

  bool IsConnected(const std::string& key) const;
  // Every decode layer and state buffer comes from exactly one prefill stage among the
  // connected ranks `prefills` (SPEC R5.6). Call once all of them are connected.
  Status CheckStageCoverage(const std::vector<BoundPrefill>& prefills) const;
  // kFailed for a room that is not live.
  KVPoll RoomPoll(uint64_t room) const;
  // Whether `room` is live, at least `min_age` old and still waiting for prefill:
  // Bootstrapping, WaitingForInput, or Transferring with no byte moved (what a refusal relayed
  // by the directory may end).
  bool RoomAwaitingPrefill(uint64_t room, absl::Duration min_age) const;

  // Engine side (KVReceiver).
  StatusOr<std::shared_ptr<RoomState>> CreateRoom(uint64_t room);
  // Binds `room` to the prefill ranks `prefills` (already connected) and moves it to
  // WaitingForInput.
  void BindRoom(uint64_t room, std::vector<BoundPrefill> prefills);
  // Fails `room` with `reason`; tell_prefill: also tell the prefill ranks it is bound to (as an
  // abort), which drain it and so free its pages.
  void FailRoomWith(uint64_t room, Status reason, bool tell_prefill = false);
  Status InitRoom(uint64_t room, const ReceiveRequest& request);
  void AbortRoom(uint64_t room, std::string_view reason);
  void ReleaseRoom(uint64_t room, const RoomState* state);

  // Control plane, prefill -> decode.
  void OnStatus(const TransferStatusMsg& msg) override;
  // The link to prefill rank `key` broke: every room bound to it fails, the connection is
  // purged so the next request reconnects. A transport that fences cuts that prefill off first,
  // which ends the quarantine of every room whose pages went out over this connection.
  void OnPrefillGone(const std::string& key, const Status& reason) override;
  // Prefill rank `key` (instance msg.instance) has nothing in flight for msg.rooms.
  void OnDrained(const std::string& key, const RoomsDrainedMsg& msg) override;
  // Pull (decode_pull.cc): plans the chunk's reads with the connection's plan (the planner's
  // writes, reversed) and posts them as one batch.
  void OnReadReady(const std::string& key, const ReadReadyMsg& msg) override;
  // KVReceiver::InvalidPages.
  std::vector<int32_t> InvalidPages(uint64_t room, const RoomState* state) const;
  // The prefill manager at `key` is gone for good: `instance` (the in-process control plane,
  // which saw its core shut down), or, with nullopt, every instance but the one connected now
  // (the manager found nothing listening at the address).
  void OnPrefillExited(const std::string& key, std::optional<uint64_t> instance);
  // Prefill addresses that quarantined rooms wait on and that have no live connection: the
  // manager probes them (reconnects, or finds nothing listening there).
  std::vector<std::string> KeysAwaitingPrefill() const;
  // Rooms whose receiver was destroyed in state Failed, once their pages are reusable (each
  // once; see ReleasedRooms).
  std::vector<uint64_t> TakeReusableRooms();

  KVManagerMetrics metrics() const;

 private:
  struct Room;
  // Pull: what this rank reads from one prefill rank through: its transport connection, the
  // plan (what that rank's pages hold for this one: the planner's writes, reversed into reads),
  // prefill's regions as imported. Immutable once connected.
  struct ReadSource {
    spi::PeerId peer = 0;
    planner::PairPlan plan;
    std::vector<spi::RemoteRegionId> kv, aux, state;
    absl::Duration heartbeat_every;
  };
  struct Connection {
    std::shared_ptr<PrefillLink> link;
    spi::TargetId target = 0;                  // push
    std::shared_ptr<const ReadSource> source;  // pull
    absl::Time next_heartbeat;
    planner::StageExtent stage;  // what that prefill rank's PP stage holds
    uint64_t gen = 0;            // connections to any key are numbered in order
    uint64_t instance = 0;       // the prefill manager instance its RegisterAck named
  };
  // Why a quarantine ended (metrics).
  enum class Release { kDrained, kFenced, kGone };
  struct Exposure;

  DecodeCore(const KVManagerOptions& options, std::unique_ptr<spi::Transport> transport,
             uint64_t session);
  std::shared_ptr<Room> FindRoom(uint64_t room) const;
  // Sends the room's TransferInfo to every prefill rank bound to it.
  void SendTransferInfo(const std::shared_ptr<Room>& room);
  void FailRoom(const std::shared_ptr<Room>& room, Status reason, bool tell_prefill);
  Status CheckAuxRoom(const Room& room) const;
  // KV integrity: a digested room's bytes as they landed against what its writers moved;
  // DATA_LOSS naming what differs (and its pages marked invalid) on a mismatch.
  Status CheckDigest(Room& room);
  // Landing digests: asks the transport to digest the room's cells as it copies them (when it
  // can, capabilities().digests_landings, host pools); ends the watch without its result.
  void WatchLandings(Room& room);
  void DropLandings(Room& room);
  void CheckTimeouts();
  // A room that just failed: reusable at once when no exposure is open, else quarantined.
  void EnterQuarantine(const std::shared_ptr<Room>& room);
  // Closes every open exposure (of live and quarantined rooms) that `match` selects and ends
  // the quarantine of rooms left with none.
  void ClearExposures(const std::function<bool(uint64_t room, const Exposure&)>& match,
                      Release why);
  void WarnLongQuarantines(absl::Time now);
  // Sends an Abort, over the live connection to `key`, for every quarantined room still
  // waiting on `instance` there.
  void ResendAborts(const std::string& key, uint64_t instance);
  bool pull() const { return options_.direction == TransferDirection::kPull; }
  // Pull: Connect to prefill's endpoint (ack.source), import its regions, plan, and send the
  // Connect reply. On error nothing is left connected.
  StatusOr<std::shared_ptr<const ReadSource>> ConnectReadSource(const RegisterAckMsg& ack,
                                                                PrefillLink& link);
  // One read batch of `room` from prefills[source] is over.
  void OnReadBatchDone(const std::shared_ptr<Room>& room, size_t source, uint64_t dst_begin,
                       uint64_t dst_end, uint32_t layers, uint64_t bytes, Status status);
  // Sends ReadsDone to every prefill rank of `room` that published to it and whose reads are
  // all over, once (the room's success or failure decides what it says).
  void SendReadsDone(const std::shared_ptr<Room>& room);
  // A terminal room whose reads are all over: its pages are reusable unless a push exposure
  // still holds them.
  void ReleaseReadHold(const std::shared_ptr<Room>& room);
  void SendHeartbeats(absl::Time now);
  // Pull: connections whose transport peer failed (Transport::PeerStatus) while the control
  // stream is up are dropped as if the prefill rank were gone; the next request connects again.
  void DropFailedSources();
  const KVManagerOptions options_;
  const uint64_t session_;
  planner::SideLayout layout_;
  // Control-plane threads use the transport under transport_mu_ where they may race with
  // Shutdown, which destroys it under the same lock.
  Mutex transport_mu_;
  std::unique_ptr<spi::Transport> transport_;
  RegisteredBuffers local_;
  DigestMemory digest_mine_;          // local_, for KV digests
  bool landings_ = false;             // the transport digests what it copies (WatchLandings)
  std::vector<uint64_t> state_caps_;  // per state family: items every buffer of it holds
  FailureInjector injector_;
  int32_t aux_room_buffer_ = -1;  // aux buffer holding bootstrap_room; -1: no check
  RoomTable rooms_;
  MetricCounters counters_;

  mutable Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Room>> room_data_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Connection> connections_ ABSL_GUARDED_BY(mu_);
  uint64_t next_gen_ ABSL_GUARDED_BY(mu_) = 1;
  // Failed rooms whose pages are not reusable yet (handles may be gone), by Room address.
  absl::flat_hash_map<const Room*, std::shared_ptr<Room>> quarantine_ ABSL_GUARDED_BY(mu_);
  // Rooms that failed because their connection to a prefill rank ended (OnPrefillGone): that rank
  // may still wait for their TransferInfo, which the closed stream may have lost. Sent as Aborts
  // on the next connection to that rank (ResendAborts), then forgotten. Bounded per rank.
  absl::flat_hash_map<std::string, std::vector<std::pair<uint64_t, std::string>>> owed_aborts_
      ABSL_GUARDED_BY(mu_);
  ReleasedRooms released_{"decode"};
  RoomLogSampler room_log_{options_.room_log_every};
  uint64_t max_hold_ms_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t released_by_[3] ABSL_GUARDED_BY(mu_) = {0, 0, 0};
  uint64_t fenced_connections_ ABSL_GUARDED_BY(mu_) = 0;
  // Serialise connection set-up per prefill rank, so two receivers (or a receiver and the
  // quarantine prober) do not connect to one rank twice, and a frozen rank holds up only itself.
  absl::flat_hash_map<std::string, std::shared_ptr<Mutex>> connect_mus_ ABSL_GUARDED_BY(mu_);

  std::unique_ptr<PeriodicThread> reaper_;
};

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CORE_DECODE_CORE_H_
