// KVArgs and KVManagerOptions: everything an engine tells pdlib when it creates a KVManager.
//
// Plain structs with documented defaults; fill them once per rank at start-up. pdlib validates
// them in KVManager::Create and reports the first bad field by name.
#ifndef PDLIB_KV_ARGS_H_
#define PDLIB_KV_ARGS_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "pdlib/status.h"
#include "pdlib/types.h"

namespace pdlib {
inline namespace v1 {

// One family of registered buffers (KV, aux or state). Entry i describes buffer i: its base
// address, its length in bytes, and the size of one item (a page for KV, a slot row for aux, a
// state slot for state). An index handed to pdlib for this family is valid when
// (index + 1) * item_lens[i] <= lens[i] for every buffer i.
struct BufferFamily {
  std::vector<uint64_t> ptrs;
  std::vector<uint64_t> lens;
  std::vector<uint64_t> item_lens;

  size_t size() const { return ptrs.size(); }
  bool empty() const { return ptrs.empty(); }
};

// One family of per-request state buffers of a hybrid model (SPEC R5.8): a kind, its buffers
// and how they split across TP ranks. A model may carry several at once (DeepSeek-V4: swa,
// swa_ring and c128_state; a DSA model with a draft model: two nsa families); each request then
// hands one index list per family, in KVArgs::state_families order.
struct StateFamily {
  StateType type = StateType::kNone;
  BufferFamily buffers;
  // Per buffer, the item dimension split across TP ranks (-1: not split; every TP rank holds the
  // whole item and one of them sends it). Empty: none is split.
  std::vector<int32_t> dim_per_tensor;
  // Optional, per buffer, for a split dimension other than 0 or a split that replicates:
  // item_rows[i] is the product of the item's dimensions before the split dimension (1 for
  // dimension 0), split_units[i] the split dimension's extent across all TP ranks of the model
  // (0: unknown, every byte of a row is a unit). Empty: 1 and 0 for every buffer.
  std::vector<uint64_t> item_rows;
  std::vector<uint64_t> split_units;
  // Model-wide index, within this family, of this PP stage's first buffer (0 for PP size 1): with
  // prefill PP > 1 and decode PP 1, decode's buffer start + i of the family receives stage buffer
  // i.
  int32_t start = 0;
};

// How one side of the deployment is parallelised, and where this rank sits in it.
struct ParallelConfig {
  int32_t tp_size = 1;  // tensor parallel ranks per DP group
  int32_t tp_rank = 0;
  int32_t dp_size = 1;  // data parallel groups; prefill's group for a room is room % dp_size
  int32_t dp_rank = 0;
  int32_t pp_size = 1;  // pipeline stages
  int32_t pp_rank = 0;
};

// Describes the model's KV shape so that two sides that would corrupt each other's memory
// refuse to connect (SPEC R6.4). A decode rank whose fingerprint differs from its prefill's is
// refused when it registers, with both values named; prefill ranks of one deployment must agree
// with each other the same way.
//
// Compared exactly: every field below, except model_name (compared only when both sides set
// it, for engines that name the same weights differently). "" is a value: a side that states
// kv_dtype "bf16" and one that leaves it empty are refused, since one of them cannot tell.
// What may differ between the sides is everything outside the fingerprint: TP/PP sizes and
// ranks, pool sizes, page indices, backends' options (the planner maps one layout onto the
// other; SPEC R5).
struct ModelFingerprint {
  int32_t num_layers = 0;      // total layers of the model (not this PP stage's share)
  int32_t num_kv_heads = 0;    // total KV heads before TP sharding
  int32_t head_dim = 0;        // elements per head
  int32_t dtype_bytes = 0;     // bytes per KV element (2 for bf16/fp16, 1 for fp8)
  int32_t layout_version = 1;  // the engine's own KV layout version (bump when it changes)
  std::string model_name;      // free-form, compared verbatim when both sides set it
  // Element type of the KV cache and of the state buffers by name: one of ElementTypeNames()
  // ("fp16", "bf16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8", "uint8"), or "" (not stated). A
  // name whose size disagrees with dtype_bytes (when that is set) is refused at Create().
  std::string kv_dtype{};
  std::string state_dtype{};
  // The attention backend's page layout, e.g. "nhd" or "hnd" (free-form).
  std::string page_layout{};
  // Anything else the engine wants both sides to agree on, e.g. "sglang-0.4.6/flashinfer".
  std::string engine_tag{};
  // pdlib's wire protocol version. pdlib sends its own (PDLIB_WIRE_VERSION) whatever this
  // holds; on a received fingerprint it is the peer's.
  int32_t wire_version = PDLIB_WIRE_VERSION;
  // The KV checksum setting ("off", "all", "sampled/64"): pdlib fills it from
  // KVManagerOptions::checksum whatever this holds, so two sides that disagree are refused at
  // registration, naming both.
  std::string checksum{};
};

// The element type names ModelFingerprint::kv_dtype and state_dtype accept, and their sizes in
// bytes (0 for a name that is not one of them).
PDLIB_EXPORT std::vector<std::string> ElementTypeNames();
PDLIB_EXPORT int32_t ElementTypeBytes(std::string_view name);

// The buffers and shapes of one rank (SPEC R3.1).
struct KVArgs {
  // One entry per layer and per K/V buffer, in the order the engine registers them
  // (for a non-MLA model: all K buffers of this PP stage's layers, then all V buffers).
  BufferFamily kv;
  // MetadataBuffers::Describe() fills this: one entry per metadata field (SPEC R4.1).
  BufferFamily aux;
  // Which aux buffer's row starts with the request's bootstrap_room as a uint64, checked by
  // decode after every transfer (SPEC R4.4). kAuxRoomBufferAuto: the bootstrap_room field when
  // `aux` has the MetadataBuffers layout (10 buffers), otherwise no check. -1: no check.
  static constexpr int32_t kAuxRoomBufferAuto = -2;
  int32_t aux_room_buffer = kAuxRoomBufferAuto;
  // Hybrid-model state. Several families: fill state_families (one entry per family, each
  // request then passes one index list per family, in this order). One family: either one entry
  // there, or the shorthand below (state, state_type, state_dim_per_tensor, state_item_rows,
  // state_split_units, state_start), which means exactly the StateFamily of those fields. Both
  // at once is an error at Create(). The two sides must declare the same kinds in the same order.
  std::vector<StateFamily> state_families;
  // The one-family shorthand: state buffers (mamba/SWA/NSA/...); empty when state_type is kNone.
  BufferFamily state;
  StateType state_type = StateType::kNone;
  // For each state buffer, the dimension along which it is split across TP ranks (-1: not
  // split; every TP rank holds the whole item and one of them sends it). Empty: none is split.
  std::vector<int32_t> state_dim_per_tensor;
  // Optional, per state buffer, for a split dimension other than 0 or a split that replicates:
  // state_item_rows[i] is the product of the item's dimensions before the split dimension (1 for
  // dimension 0), state_split_units[i] the split dimension's extent across all TP ranks of the
  // model (0: unknown, every byte of a row is a unit). Empty: 1 and 0 for every buffer.
  std::vector<uint64_t> state_item_rows;
  std::vector<uint64_t> state_split_units;
  // Model-wide index of this PP stage's first state buffer (0 for PP size 1): with prefill PP > 1
  // and decode PP 1, decode's state buffer state_start + i receives stage buffer i.
  int32_t state_start = 0;

  uint32_t page_size = 1;  // tokens per KV page
  // KV heads held by this rank (after TP sharding): max(1, fingerprint.num_kv_heads / tp_size).
  // Needed when prefill and decode TP differ (SPEC R5.4: heads are sliced per page). 0: the KV
  // pages are opaque to pdlib and moved whole, which requires equal TP on both sides.
  int32_t kv_head_num = 0;
  // How a KV page is laid out: kNHD [token][head][dim] or kHND [head][token][dim]. Matters only
  // when TP differs; both sides must agree.
  KVLayout kv_layout = KVLayout::kHND;
  bool is_mla = false;  // compressed latent KV without a head dimension (SPEC R5.5)

  ParallelConfig parallel;
  // First model layer owned by this rank's PP stage (0 for PP size 1). Despite the name, decode
  // ranks with PP > 1 set it too.
  int32_t prefill_start_layer = 0;

  int32_t device_id = 0;  // CUDA device when memory_kind is kCuda
  MemoryKind memory_kind = MemoryKind::kHost;
  std::vector<std::string> nic_names;  // e.g. {"mlx5_0", "mlx5_1"}; empty: backend's choice

  ModelFingerprint fingerprint;
};

// The state families `args` declares: state_families, or the one family of the shorthand
// fields (state_type ... state_start), or none. kInvalidArgument when both are set.
PDLIB_EXPORT StatusOr<std::vector<StateFamily>> EffectiveStateFamilies(const KVArgs& args);

// KVManagerOptions::checksum.
enum class KvChecksum : int32_t {
  kOff = 0,
  kSampled = 1,  // 1 room in checksum_sample_every
  kAll = 2,
};

// How control messages travel between managers.
enum class ControlPlane : int32_t {
  // gRPC over TCP: a bootstrap server per prefill deployment and one stream per
  // (decode rank, prefill rank) pair. What every deployment uses.
  kGrpc = 0,
  // Direct calls between managers of one process, found by bootstrap address. For tests and
  // single-process set-ups; no sockets.
  kInProcess = 1,
};

// How prefill ranks are found (gRPC control plane).
enum class Discovery : int32_t {
  // The bootstrap server (pdlib-bootstrap, or start_bootstrap_server on one prefill rank) at
  // the bootstrap address. The default: nothing else to run.
  kBootstrapServer = 0,
  // An etcd v3 cluster (etcd_endpoints): no bootstrap server, no single process that every
  // deployment depends on.
  kEtcd = 1,
};

// Options of one KVManager. Defaults are what a production deployment should start from.
struct KVManagerOptions {
  Mode mode = Mode::kPrefill;
  KVArgs args;
  ControlPlane control_plane = ControlPlane::kGrpc;

  // Name of the transport backend: "fake", "ucx", "verbs", or one registered out of tree.
  std::string backend = "fake";
  // Backend-specific settings, documented by each backend (e.g. {"ucx.tls", "shm"}).
  std::map<std::string, std::string> backend_options;

  // Prefill: where this rank's control service listens (port 0 picks a free one).
  std::string listen_host = "127.0.0.1";
  uint16_t listen_port = 0;
  // Prefill: the bootstrap server this rank registers with.
  std::string bootstrap_host = "127.0.0.1";
  uint16_t bootstrap_port = 8998;
  // Prefill: run the bootstrap server inside this manager, on bootstrap_host:bootstrap_port
  // (typically on one rank of the deployment; pdlib-bootstrap is the standalone alternative).
  // With bootstrap_port 0 it binds a free port: KVManager::bootstrap_endpoint() names it (give
  // that to the other ranks and to decode). Port 0 needs start_bootstrap_server (gRPC).
  bool start_bootstrap_server = false;

  // A silent peer (frozen process, cut network) is declared dead after this long and every
  // request bound to it fails (SPEC R7.2); a peer that exits is noticed at once. >= 1000 ms.
  std::chrono::milliseconds liveness_timeout{5000};
  // Decode: bootstrap queries and connection set-up to a prefill rank give up after this long.
  std::chrono::milliseconds connect_timeout{5000};

  // A room's clocks (SPEC R7.1); each failure is kDeadlineExceeded with a reason naming the clock
  // and the state. They follow what is happening, not the room's age:
  //   bootstrap_timeout  Bootstrapping for longer than this (the two sides never paired).
  //   waiting_timeout    WaitingForInput for longer than this (prefill: the engine has not sent;
  //                      decode: not Init()ed), or Transferring with no byte moved yet for longer
  //                      than this after entering it (decode's TransferInfo is out, prefill has
  //                      not started: a busy prefill is waiting, not transferring).
  //   transfer_timeout   Transferring with no progress for longer than this once the transfer
  //                      started: progress is a chunk handed over or a write batch done on
  //                      prefill, reads posted or a read batch done on decode in pull. A long
  //                      transfer that keeps moving never times out.
  // Decode in push sees no bytes move (prefill writes them), so its room waits by
  // waiting_timeout until prefill reports Success or a failure; prefill's transfer_timeout and
  // liveness_timeout (a dead or silent peer) bound the transfer itself. A pull room on prefill
  // lives by pull_lease instead.
  std::chrono::milliseconds bootstrap_timeout{30000};
  std::chrono::milliseconds waiting_timeout{300000};
  std::chrono::milliseconds transfer_timeout{60000};

  // Decode: a failed request's pages stay quarantined (KVPollable::PagesReusable() false) until
  // every prefill rank that could write them has drained, been fenced or is known gone. One held
  // longer than this is logged at ERROR, naming the prefill rank, and again every period after;
  // it is never released by time alone (see "Page reuse" in kv_manager.h).
  std::chrono::milliseconds quarantine_warn_after{30000};

  // Control-plane security (gRPC control plane). auth_secret: when set, every control-plane call
  // carries it and every pdlib server (peer, bootstrap) refuses calls without it
  // (UNAUTHENTICATED); all managers and pdlib-bootstrap of a deployment share it. Without TLS it
  // travels in clear: it keeps out stray peers, not eavesdroppers.
  std::string auth_secret;
  // TLS (PEM files): servers present tls_cert_file/tls_key_file; clients verify the server with
  // tls_ca_file (prefill is a client of its bootstrap server too, so it needs all three). A
  // client with a certificate presents it and a server with tls_ca_file verifies it. All empty:
  // plaintext.
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_ca_file;
  // Which way KV moves; both sides of a deployment must agree (a decode whose direction
  // differs is refused at registration, naming both). kPush (default): prefill writes into the
  // pages decode's Init() names. kPull: decode reads prefill's pages (vLLM's model; a prefill
  // that must not wait for decode memory): prefill's Send()/SendLayers() may come before
  // decode's TransferInfo and publish the pages, which prefill keeps until every decode rank
  // that reads them reports its reads done (the sender's Success and PagesReusable()), or until
  // pull_lease passes without word from decode. With a decode prefix, prefill publishes every
  // page of the prompt and decode reads only those after its prefix. The backend must say
  // capabilities().reads, else Create fails naming it.
  TransferDirection direction = TransferDirection::kPush;
  // Prefill, pull: a room's lease. It starts when the sender is created and is renewed by each
  // publication (Send/SendLayers), by decode's TransferInfo and by decode's heartbeats (every
  // third of it, for every room with a live receiver there, waiting for memory or reading).
  // When it runs out the room fails on both sides with the reason (what was missing) and the
  // pages are freed. A pull room has no other timeout on prefill (bootstrap_timeout and the
  // others apply to push). >= 1000 ms.
  std::chrono::milliseconds pull_lease{30000};
  // KV integrity (SPEC R12.3, docs/reliability.md "KV integrity"): a digest (CRC32C) of what each
  // transfer moves, computed where the bytes leave (push: prefill's source pages as it writes them;
  // pull: prefill's published pages for each reader) and compared with decode's pass over what
  // landed before Success. It covers the KV pages after decode's prefix, the aux row and the state
  // slots, each decode rank exactly the bytes it received. A mismatch fails the room
  // (DATA_LOSS, naming the layers and request pages that differ), reports those pages invalid
  // and counts in metrics().checksum_mismatches. kOff (default); kSampled: rooms whose id
  // hashes to 1 in checksum_sample_every (the same rooms on both sides); kAll: every room. Both
  // sides must agree: the setting is part of the fingerprint. Host memory only for now
  // (MemoryKind::kCuda with a checksum is refused at Create()).
  KvChecksum checksum = KvChecksum::kOff;
  uint32_t checksum_sample_every = 64;
  // Threads that turn queued chunks into write batches (prefill).
  int32_t transfer_workers = 2;
  // Which rooms get their per-room log lines at info level (SPEC R10.3: created,
  // bound/registered, transferred; a failure is a warning and always logged). Nothing is
  // formatted when info is off (the default level is warning).
  //   0 (auto): every room while this manager creates at most kRoomLogAutoPerSecond rooms in a
  //     second; past that, for the rest of that second, only rooms whose id is a multiple of
  //     kRoomLogAutoEvery. At a serving engine's rates every room is logged; at 50k rooms/s
  //     the lines cost little, and the sampled rooms are the same on prefill and decode.
  //   1: every room, at any rate.
  //   N > 1: rooms whose id is a multiple of N, the same rooms on prefill and decode.
  // A room is chosen when it is created: all of its lines are logged, or none.
  uint32_t room_log_every = 0;
  static constexpr uint32_t kRoomLogAutoPerSecond = 1000;
  static constexpr uint32_t kRoomLogAutoEvery = 64;

  // Probability in [0, 1] that a transfer is failed on purpose, to exercise failure paths
  // (SPEC R7.3). Negative: read PDLIB_TEST_FAILURE_PROB from the environment (unset: 0).
  double failure_injection_prob = -1.0;
  // Where injected failures strike, comma-separated (each stage rolls the dice on its own):
  //   bootstrap      decode, when a request is bound to its prefill ranks
  //   register       prefill refuses a decode connection
  //   transfer_info  prefill rejects a request's TransferInfo
  //   chunk          prefill fails a chunk instead of writing it
  //   aux, state     prefill fails the aux / state writes after the last chunk
  //   status         prefill fails a request whose bytes are written instead of reporting it
  //   corrupt        not a failure: one op of a KV batch moves its bytes shifted by one (push:
  //                  prefill's write, pull: decode's read), so wrong bytes land; with a
  //                  checksum the room fails DATA_LOSS, without one it succeeds wrong. Not in
  //                  "all"; counted in metrics().corruptions_injected
  // Empty: read PDLIB_TEST_FAILURE_STAGES from the environment; unset or empty there: "chunk".
  // "all" names every stage but corrupt. An unknown name is an error naming it.
  std::string failure_injection_stages;

  // Where prefill ranks publish their addresses and decode finds them (gRPC control plane).
  // See Discovery and the etcd_* options below.
  Discovery discovery = Discovery::kBootstrapServer;
  // Discovery::kEtcd: the etcd cluster's client endpoints, "host:port" each (at least one; a
  // call that finds one member unreachable tries the next). The bootstrap address still names
  // the deployment (prefill: bootstrap_host:bootstrap_port; decode: the request's
  // BootstrapAddress), but no server runs there: prefill ranks put their registration under
  //   <etcd_prefix>/<host:port>/rank/<dp>/<tp>/<pp>
  // with a lease whose TTL is liveness_timeout (rounded up to whole seconds), keep it alive,
  // and revoke it on clean shutdown; decode reads the deployment from there and watches the
  // prefix, so that a rank whose lease expired (it died) or that registered anew (it moved)
  // drops decode's cached lookup at once. Create fails when no endpoint answers within
  // connect_timeout.
  std::vector<std::string> etcd_endpoints;
  std::string etcd_prefix = "/pdlib";  // non-empty, starts with '/', no trailing '/'
  // etcd authentication (etcd's own users, `etcdctl user add`); both empty: none.
  std::string etcd_username;
  std::string etcd_password;
  // TLS to etcd (PEM files; all empty: plaintext): the CA that verifies etcd's certificate,
  // and a client certificate and key when etcd requires one (--client-cert-auth).
  std::string etcd_tls_ca_file;
  std::string etcd_tls_cert_file;
  std::string etcd_tls_key_file;
};

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_KV_ARGS_H_
