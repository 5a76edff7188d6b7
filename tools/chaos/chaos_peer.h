// The prefill and decode processes of pdlib-chaos: one KVManager each, driven by the chaos
// driver over a line protocol on stdin/stdout, as an engine would drive it (pages and metadata
// slots handed out per request and freed when the request is over).
//
// Commands (stdin, one per line):
//   START <room>   create the room's sender (prefill) or receiver (decode) and run it to the end
//   METRICS        print one METRICS line
//   QUIT           destroy every handle, then the manager; print BYE; exit 0
// Lines printed (stdout, flushed each):
//   READY port=<control port, 0 on decode>
//   ROOM <room> Success OK bytes=<n> prefix_pages=<p>
//                                       decode: n bytes of KV, state and aux checked (0
//                                       unverified); p: pages of the request's decode prefix
//   ROOM <room> Success OK              prefill
//   ROOM <room> Failed <reason>         the handle's FailureReason(), or why it was refused
//   KEPT room=<room> pages=<n>          decode, pull, before a failed room's ROOM line: n pages
//                                       InvalidPages() left out (an engine may keep them) hold
//                                       every byte of their tokens
//   ROOM <room> BadBytes kept_page=...  decode, pull: a failed room's page that InvalidPages()
//                                       left out does not hold its tokens' bytes
//   ROOM <room> BadBytes <first wrong>  decode: Success, but the bytes are not the request's;
//                                       prefill: decode_prefix_len() or PagesAfterPrefix() was
//                                       not what the room's decode holds (the room is aborted)
//   STALE page=<p> buffer=<b> offset=<o> buffers=<n> ... | STALE pool=<kind> item=<i> ... |
//   STALE aux_slot=<s> field=<f> ...    decode: a KV page, state item (mamba slot, swa page) or
//                                       metadata slot that the engine had taken back (the
//                                       request was over) was written to; found when it is
//                                       handed out again and at every METRICS
//   STALE prefix_page=<p> room=<r> ...  decode: a page of a request's decode prefix (decode's
//                                       own cache, never handed to pdlib) was written to; found
//                                       when the request is released and at every METRICS
//   METRICS live_rooms=<n> connections=<n> ... (KVManagerMetrics, and what the peer holds)
//   ERROR <message>
//   BYE
// End of stdin counts as QUIT. The process dies with its parent (PR_SET_PDEATHSIG) and exits
// with status 3 after max_seconds, so a lost driver never leaves it behind.
#ifndef PDLIB_TOOLS_CHAOS_CHAOS_PEER_H_
#define PDLIB_TOOLS_CHAOS_CHAOS_PEER_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "pdlib/kv_args.h"
#include "pdlib/types.h"

namespace pdlib_chaos {

struct PeerConfig {
  pdlib::Mode mode = pdlib::Mode::kPrefill;
  // Where the KVManager listens (with --netns: the host's address on eth0).
  std::string listen_host = "127.0.0.1";
  // The deployment's bootstrap address: the driver's bootstrap server, or with etcd only the
  // deployment's name.
  std::string bootstrap_host = "127.0.0.1";
  uint16_t bootstrap_port = 0;
  // Discovery through etcd at these client endpoints ("host:port") instead of the bootstrap
  // server; empty: the bootstrap server.
  std::vector<std::string> etcd_endpoints;
  int32_t dp_size = 1;  // prefill: the deployment's DP size and this rank's DP rank
  int32_t dp_rank = 0;
  std::string backend = "ucx";
  std::map<std::string, std::string> backend_options;
  // Which way KV moves (KVManagerOptions::direction, the same on every peer). In pull prefill
  // publishes every page of the prompt (PublishedPages), some rooms before decode's
  // TransferInfo, and decode reads those after its prefix; pull_lease_ms is
  // KVManagerOptions::pull_lease.
  pdlib::TransferDirection direction = pdlib::TransferDirection::kPush;
  int64_t pull_lease_ms = 3000;
  bool verify = true;  // decode: check every byte of every Success (needs a byte-moving backend)
  // Negative controls of the byte check (prefill): spoil one KV byte / one aux value of about
  // one room in N (chosen by a hash of the room id); 0: never.
  uint64_t corrupt_kv_one_in = 0;
  uint64_t corrupt_aux_one_in = 0;
  // Negative control of the free-memory canary (decode): after about one room in N is over, one
  // byte of a page it gave back is overwritten, as a stale write would.
  uint64_t corrupt_free_one_in = 0;
  // Negative controls of the prefix and state checks: prefill spoils one state byte of about one
  // room in N (bad bytes); decode overwrites a byte of its own prefix pages of about one room in
  // N that has a prefix (a stale write); prefill ignores decode's prefix in about one room in N,
  // sending the same number of pages from the start of the prompt (bad bytes when it has one).
  // In pull, where prefill publishes every page whatever the prefix, the last one lays out its
  // pages as a decode that ignored its prefix would read them: published page i holds position
  // i - prefix (bad bytes when it has one).
  uint64_t corrupt_state_one_in = 0;
  // KV integrity: KVManagerOptions::checksum on every peer, and pdlib's failure injection stage
  // `corrupt` striking about one KV batch in N (0: never; prefill's writes in push, decode's
  // reads in pull), which the checksum must catch.
  pdlib::KvChecksum checksum = pdlib::KvChecksum::kOff;
  uint64_t corrupt_in_flight_one_in = 0;
  uint64_t corrupt_prefix_one_in = 0;
  uint64_t ignore_prefix_one_in = 0;
  // Decode prefix reuse: the share of requests whose decode holds a prefix of the prompt
  // (RequestShape::prefix_pages), in [0, 1].
  double prefix_share = 0.5;
  // State families of the model (KVArgs::state_families, in this order), each a buffer per
  // layer in a pool of its own: kMamba and kC128State one slot per request, kSwa the window's
  // pages (RequestShape::swa_prefill / swa_decode). Empty: no state.
  std::vector<pdlib::StateType> state_families = {pdlib::StateType::kMamba, pdlib::StateType::kSwa};
  size_t concurrency = 16;  // rooms in flight at most (sizes the page pool and the slots)
  size_t layers = 2;        // each with a K and a V buffer
  size_t item_bytes = 4096;
  size_t max_pages = 8;
  size_t max_chunks = 3;
  // Prefill: the forward pass each request waits for before its chunks go, uniform in
  // [0, 2 x prefill_ms] per request (spread over its chunks), so that faults find rooms in
  // every state.
  int64_t prefill_ms = 100;
  int64_t liveness_ms = 1000;
  int64_t connect_ms = 2000;
  int64_t bootstrap_ms = 3000;
  int64_t waiting_ms = 3000;
  int64_t transfer_ms = 3000;
  int64_t max_seconds = 900;
};

// The command line that makes a child process run `config` (parsed back by pdlib-chaos's main).
std::vector<std::string> PeerArgs(const PeerConfig& config);

// Runs the process until QUIT, end of stdin or max_seconds. Returns its exit status.
int RunPeer(const PeerConfig& config);

}  // namespace pdlib_chaos

#endif  // PDLIB_TOOLS_CHAOS_CHAOS_PEER_H_
