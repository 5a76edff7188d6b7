// The state PrefillCore keeps per decode connection and per room, shared by the files that
// implement it: prefill_core.cc (lifecycle, rooms, timeouts, metrics), prefill_peers.cc (decode
// connections: Register, loss, draining), prefill_intake.cc (TransferInfo and Abort from decode,
// early arrivals), prefill_writes.cc (Send, the write workers, completions, the tail).
#ifndef PDLIB_LIB_CORE_PREFILL_TYPES_H_
#define PDLIB_LIB_CORE_PREFILL_TYPES_H_

#include <memory>
#include <optional>
#include <vector>

#include "lib/core/prefill_core.h"

namespace pdlib {
inline namespace v1 {

// Whether prefill's state lists (`src`, per-family `src_counts`) pair up with decode's in `info`
// family by family, by each kind's rule (planner::AlignStateLists).
Status CheckStatePairing(const std::vector<planner::StateFamilySpan>& families,
                         const TransferInfoMsg& info, std::span<const int32_t> src,
                         std::span<const uint32_t> src_counts, uint32_t page_size);

// One connected decode manager.
struct PrefillCore::Peer {
  uint64_t session = 0;
  spi::PeerId peer = 0;
  RegisterMsg reg;
  planner::PairPlan plan;              // what this prefill rank writes to that decode rank
  uint32_t required_dst_info_num = 1;  // TransferInfos per room, when the plan is active
  std::vector<spi::RemoteRegionId> kv, aux, state;  // push: decode's regions
  spi::TargetId target = 0;  // pull: this rank's endpoint that decode reads through
  std::shared_ptr<DecodeLink> link;
  DigestMemory digest_items;  // decode's item sizes, for KV digests
};

// Pull: one chunk announcement the engine made (Send, or SendLayers' new layers), published to
// every reader in this order. `offset` is the prompt page pages[0] holds.
struct PublishedChunk {
  std::vector<int32_t> pages;
  uint64_t offset = 0;
  bool last = false;
  int32_t layer_begin = 0;
  int32_t layer_end = 0;
};

// Everything prefill tracks for one live request.
struct PrefillCore::Room {
  explicit Room(std::shared_ptr<RoomState> s) : state(std::move(s)) {}
  const std::shared_ptr<RoomState> state;
  Mutex mu;
  std::optional<uint64_t> num_kv_pages ABSL_GUARDED_BY(mu);
  std::optional<uint32_t> aux_index ABSL_GUARDED_BY(mu);
  // One TransferInfo per decode rank this room writes to, each with its connection.
  std::vector<TransferInfoMsg> infos ABSL_GUARDED_BY(mu);
  std::vector<std::shared_ptr<Peer>> peers ABSL_GUARDED_BY(mu);
  // KV integrity: whether this room is digested (KVManagerOptions::checksum), and per entry of
  // `infos` what this rank moved to that decode rank so far (push: sent with the success).
  bool digested = false;
  std::vector<KvDigest> digests ABSL_GUARDED_BY(mu);
  // Some KV batch of it was digested by the core's own pass over the source, not by the
  // transport as it sent it (Transport::PostWritesDigested).
  std::atomic<bool> digested_by_core{false};
  std::atomic<bool> corrupted{false};  // failure injection `corrupt` struck it (once a room)
  size_t pages_queued ABSL_GUARDED_BY(mu) = 0;
  bool last_queued ABSL_GUARDED_BY(mu) = false;
  // Layer-wise streaming: the chunk whose layers are being announced (SendLayers), while
  // 0 < open_layers < the rank's KV layers; its pages were counted in pages_queued when it
  // opened, at TransferInfo offset open_dst_offset.
  std::vector<int32_t> open_pages ABSL_GUARDED_BY(mu);
  int32_t open_layers ABSL_GUARDED_BY(mu) = 0;
  bool open_last ABSL_GUARDED_BY(mu) = false;
  size_t open_dst_offset ABSL_GUARDED_BY(mu) = 0;
  int outstanding ABSL_GUARDED_BY(mu) = 0;  // chunk batches posted, not yet complete
  bool finalizing ABSL_GUARDED_BY(mu) = false;
  std::vector<int32_t> state_src ABSL_GUARDED_BY(mu);
  std::vector<uint32_t> state_src_counts ABSL_GUARDED_BY(mu);  // per family; empty: one family
  bool status_sent ABSL_GUARDED_BY(mu) = false;
  // Set when a decode rank of this room went away while chunk batches were in flight: the room
  // fails with the transport's completion error if one comes, else with this once they are done.
  std::optional<Status> peer_gone ABSL_GUARDED_BY(mu);
  // aux/state batches in flight, plus one while Finalize is deciding what to post.
  int tail_outstanding ABSL_GUARDED_BY(mu) = 0;
  // Pull (KVManagerOptions::direction): what the engine published, and per TransferInfo
  // (parallel to `infos`) how much of it went to that reader, whether its reads may still run
  // (published to it, no ReadsDone yet) and whether they all succeeded. Published pages are held
  // until lease_until (set by the first publication, renewed by TransferInfo and heartbeats);
  // readers_deadline bounds the wait for the ReadsDone of a failed room's readers.
  Mutex publish_mu;  // taken before mu: keeps each reader's ReadReady messages in order
  std::vector<PublishedChunk> published ABSL_GUARDED_BY(mu);
  std::vector<size_t> sent_to ABSL_GUARDED_BY(mu);
  std::vector<uint8_t> reads_open ABSL_GUARDED_BY(mu);
  std::vector<uint8_t> reads_ok ABSL_GUARDED_BY(mu);
  int open_readers ABSL_GUARDED_BY(mu) = 0;
  std::optional<absl::Time> lease_until ABSL_GUARDED_BY(mu);
  std::optional<absl::Time> readers_deadline ABSL_GUARDED_BY(mu);
  bool drained ABSL_GUARDED_BY(mu) = false;   // terminal, nothing in flight: pages reusable
  bool released ABSL_GUARDED_BY(mu) = false;  // the sender was destroyed before that
};

// A decode connection that ended while KV writes to it were in flight. Its transport peer stays
// up until those writes complete (a dead peer makes them fail with the transport's own error,
// e.g. an RDMA work-completion status) or `deadline` passes, so that the rooms report the cause
// rather than only "stream ended".
struct PrefillCore::DrainingPeer {
  std::shared_ptr<Peer> peer;
  absl::Time deadline;
  Status reason;
  std::vector<std::shared_ptr<Room>> rooms;
};

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_CORE_PREFILL_TYPES_H_
