// The control-plane messages between decode and prefill (SPEC R6.3, DESIGN "Control plane") as
// plain structs, and the two link interfaces the protocol cores talk through. The in-process hub
// implements the links with direct calls; the gRPC control plane implements them with one
// bidirectional stream per (decode rank, prefill rank) pair.
#ifndef PDLIB_LIB_CORE_CONTROL_MESSAGES_H_
#define PDLIB_LIB_CORE_CONTROL_MESSAGES_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lib/core/kv_digest.h"
#include "pdlib/kv_args.h"
#include "pdlib/spi/transport.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {

// One registered buffer of the decode side, as prefill needs it to write.
struct RegionDesc {
  uint64_t addr = 0;
  uint64_t length = 0;
  uint64_t item_len = 0;
  spi::Blob key;
};

// One state family of a side: its kind, the model-wide index (within the family) of the side's
// first buffer of it, and how many of the side's state buffers (in order) are its.
struct StateFamilyExtent {
  StateType type = StateType::kNone;
  int32_t start = 0;
  int32_t count = 0;
  friend bool operator==(const StateFamilyExtent&, const StateFamilyExtent&) = default;
};

// decode -> prefill, once per connection. In pull the same message describes prefill to decode
// (RegisterAckMsg::source): `session` is then prefill's instance, `endpoint` prefill's target
// endpoint, the regions prefill's, which decode reads.
struct RegisterMsg {
  uint64_t session = 0;  // identifies the decode manager's end of this connection
  TransferDirection direction = TransferDirection::kPush;  // must equal prefill's
  ModelFingerprint fingerprint;
  uint32_t page_size = 0;
  ParallelConfig parallel;
  std::string transport;
  spi::Blob endpoint;
  std::vector<RegionDesc> kv, aux, state;  // state: every family's buffers, family by family
  std::vector<StateFamilyExtent> state_families;
  // What prefill's planner needs beyond the regions (M:N TP, MLA, PP, state splits): the
  // KVArgs fields of the same names.
  int32_t kv_head_num = 0;  // 0: opaque pages, equal TP only
  KVLayout kv_layout = KVLayout::kHND;
  bool is_mla = false;
  int32_t start_layer = 0;
  // Per state buffer (all families): StateFamily::dim_per_tensor, item_rows, split_units.
  std::vector<int32_t> state_dim_per_tensor;
  std::vector<uint64_t> state_item_rows;
  std::vector<uint64_t> state_split_units;
};

// prefill -> decode, the answer to RegisterMsg.
struct RegisterAckMsg {
  Status status;  // not OK: the connection is refused, with the reason
  spi::Blob reply;
  int32_t prefill_tp_rank = 0;
  int32_t prefill_pp_rank = 0;
  // What this prefill PP stage holds, so decode can check that its stages cover every layer
  // and state buffer exactly once.
  int32_t start_layer = 0;
  int32_t num_layers = 0;
  std::vector<StateFamilyExtent> state_families;  // per family: start and count of this stage
  // This prefill manager instance (random per PrefillCore): a decode that reconnects to the
  // same address and sees another instance knows the old one, and its writes, are gone.
  uint64_t instance = 0;
  // Rooms of this decode session that failed while it was not connected and whose writes from
  // this instance are all over (see RoomsDrainedMsg).
  std::vector<uint64_t> drained_rooms;
  // Pull only: prefill described as decode's planner and transport need it (its layout, its
  // regions with their keys, its target endpoint for decode's Connect), and its lease, which
  // decode's heartbeats renew every third of.
  std::optional<RegisterMsg> source;
  uint32_t lease_ms = 0;
};

// decode -> prefill, pull only, once right after the RegisterAck: the reply blob of decode's
// Connect to prefill's endpoint (for CompleteTargetEndpoint; empty when !needs_reply). Sent
// before any TransferInfo of the connection, so prefill has completed its endpoint before it
// publishes anything decode could read.
struct PullConnectMsg {
  uint64_t session = 0;
  spi::Blob reply;
};

// prefill -> decode, pull only: one published chunk of a room that decode may read now. Sent to
// every decode rank that reads from this prefill rank, in the order the engine sent the chunks,
// once that rank's TransferInfo is in.
struct ReadReadyMsg {
  uint64_t room = 0;
  int32_t prefill_tp_rank = 0;
  int32_t prefill_pp_rank = 0;
  // Prefill's pages of the chunk; src_pages[k] holds the prompt's page src_offset + k (prompt
  // positions: in pull prefill publishes every page, decode skips its prefix).
  std::vector<int32_t> src_pages;
  uint64_t src_offset = 0;
  bool last = false;        // the request's last chunk
  int32_t layer_begin = 0;  // the KV layers [layer_begin, layer_end) of this prefill rank
  int32_t layer_end = 0;
  // With the last chunk's last layers (last && layer_end == the rank's layers): prefill's
  // metadata slot and state indices (flat; per-family counts, empty: one family), read after
  // the KV.
  std::optional<uint32_t> aux_index;
  std::vector<int32_t> state_indices;
  std::vector<uint32_t> state_counts;
  // KV integrity (KVManagerOptions::checksum), for a digested room: what this chunk offers this
  // reader (its reads as decode plans them), decode XORs them.
  std::optional<KvDigest> digest;
};

// decode -> prefill, pull only: decode's reads of `room` from this prefill rank are over, none
// can still be executed: OK when every byte of its part was read, else why not. Sent once per
// room and prefill rank that published to it (also for a room decode failed or no longer
// knows), so that prefill frees its pages only when no read of them can come.
struct ReadsDoneMsg {
  uint64_t room = 0;
  uint64_t session = 0;
  Status status;
};

// decode -> prefill, pull only, every third of the lease: these rooms have a live receiver here
// (waiting for memory, or reading): keep their pages.
struct HeartbeatMsg {
  uint64_t session = 0;
  std::vector<uint64_t> rooms;
};

// decode -> prefill, per request.
struct TransferInfoMsg {
  uint64_t room = 0;
  uint64_t session = 0;
  std::vector<int32_t> dst_kv_pages;
  std::optional<uint32_t> aux_index;
  // Every state family's indices, family by family; dst_state_counts[f] is family f's length
  // (one entry per decode state family; empty when decode has none).
  std::vector<int32_t> dst_state_indices;
  std::vector<uint32_t> dst_state_counts;
  uint32_t required_dst_info_num = 1;
  bool is_dummy = false;
  // Tokens at the start of the prompt decode already holds (page-aligned): prefill sends the
  // pages after them, dst_kv_pages[k] receiving the k-th.
  uint64_t decode_prefix_len = 0;
};

// prefill -> decode, once per request per prefill rank.
struct TransferStatusMsg {
  uint64_t room = 0;
  int32_t prefill_tp_rank = 0;
  int32_t prefill_pp_rank = 0;
  Status status;  // OK: every byte of the room is in decode memory
  // KV integrity, push, a digested room's success: what this rank wrote to that decode rank.
  std::optional<KvDigest> digest;
};

// prefill -> decode: these failed rooms have no write from prefill manager `instance` in
// flight, and it will post none: decode may hand their pages out again (the quarantine rule in
// include/pdlib/kv_manager.h). Sent once a failed room's last batch has completed.
struct RoomsDrainedMsg {
  uint64_t instance = 0;
  int32_t prefill_tp_rank = 0;
  int32_t prefill_pp_rank = 0;
  std::vector<uint64_t> rooms;
};

// How a prefill core reaches one connected decode manager. (The pull-only methods of the four
// interfaces below have empty defaults so that a test double of a push peer needs none of them.)
class DecodeLink {
 public:
  virtual ~DecodeLink() = default;
  virtual void SendStatus(const TransferStatusMsg& msg) = 0;
  virtual void SendDrained(const RoomsDrainedMsg& msg) = 0;
  virtual void SendReadReady(const ReadReadyMsg& msg) { (void)msg; }
  // Ends this connection from the prefill side, telling decode `reason`: decode drops it (as if
  // the stream broke) and registers again for its next request. Used when the session's transport
  // connection failed while the stream is up. OnDecodeGone still follows for it.
  virtual void Close(const Status& reason) = 0;
};

// What the control plane delivers to the prefill side (PrefillCore implements it). Called on the
// control plane's threads; implementations validate, record and return quickly.
class PrefillHandler {
 public:
  virtual ~PrefillHandler() = default;
  // `link` answers this decode session; it stays valid until OnDecodeGone for it.
  virtual RegisterAckMsg OnRegister(const RegisterMsg& msg, std::shared_ptr<DecodeLink> link) = 0;
  virtual void OnTransferInfo(const TransferInfoMsg& msg) = 0;
  virtual void OnAbort(uint64_t room, uint64_t session, const std::string& reason) = 0;
  // Pull only.
  virtual void OnPullConnect(const PullConnectMsg& msg) { (void)msg; }
  virtual void OnReadsDone(const ReadsDoneMsg& msg) { (void)msg; }
  virtual void OnHeartbeat(const HeartbeatMsg& msg) { (void)msg; }
  // The connection behind `link` broke or closed. A newer connection of the same session (a
  // reconnect) is not affected.
  virtual void OnDecodeGone(uint64_t session, const DecodeLink* link, const Status& reason) = 0;
};

// What the control plane delivers to the decode side (DecodeCore implements it).
class DecodeHandler {
 public:
  virtual ~DecodeHandler() = default;
  virtual void OnStatus(const TransferStatusMsg& msg) = 0;
  // The connection to prefill rank `key` broke.
  virtual void OnPrefillGone(const std::string& key, const Status& reason) = 0;
  // Prefill rank `key` (the instance the message names) drained the rooms listed.
  virtual void OnDrained(const std::string& key, const RoomsDrainedMsg& msg) = 0;
  // Pull only: prefill rank `key` published a chunk of msg.room.
  virtual void OnReadReady(const std::string& key, const ReadReadyMsg& msg) {
    (void)key;
    (void)msg;
  }
};

// How a decode core reaches one prefill rank.
class PrefillLink {
 public:
  virtual ~PrefillLink() = default;
  // Synchronous in the in-process hub; the gRPC link completes it from the stream.
  virtual RegisterAckMsg Register(const RegisterMsg& msg) = 0;
  virtual void SendTransferInfo(const TransferInfoMsg& msg) = 0;
  virtual void SendAbort(uint64_t room, uint64_t session, const std::string& reason) = 0;
  // Pull only.
  virtual void SendPullConnect(const PullConnectMsg& msg) { (void)msg; }
  virtual void SendReadsDone(const ReadsDoneMsg& msg) { (void)msg; }
  virtual void SendHeartbeat(const HeartbeatMsg& msg) { (void)msg; }
  // Ends the connection without reporting it back (shutdown, purge). Idempotent.
  virtual void Close() {}
  // True once the connection is known broken (its OnPrefillGone may already have been
  // delivered, e.g. while Register() was still returning).
  virtual bool Broken() const { return false; }
};

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CORE_CONTROL_MESSAGES_H_
