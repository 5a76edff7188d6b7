// KVManager, KVSender and KVReceiver: the per-rank object and the per-request handles an engine
// drives (SPEC §1).
//
// Ownership: the engine owns the KVManager (created by KVManager::Create) and every handle it
// creates; handles must be destroyed before their manager. Destroying a handle that is not yet
// terminal aborts its request and releases everything held for it.
//
// Threads: every method may be called from any thread. Poll() is wait-free (one atomic load)
// so engines can call it every scheduler step. Background threads owned by the manager do all
// the network work; no call here blocks on the network.
//
// Page reuse (the rule an engine relies on). Once PagesReusable() of a receiver is true, or
// its room has come out of KVManager::TakeReusableRooms(), no write from any prefill for that
// room can land in the pages, metadata slot and state slots handed to its Init(), on any
// backend, whatever the prefill processes do afterwards (pause, resume, crash, restart). Until
// then the engine must not give them to another request. On Success it is true at once. After
// Failed (failure, Abort, a destroyed handle) it becomes true when, for every prefill rank the
// request's pages were sent to:
//   - that rank reported that it drained the room (no write in flight, none to come), or
//   - the connection was fenced (transports with capabilities().fences, e.g. verbs: the QPs go
//     to the error state, so late writes are dropped by the NIC; ucx on its "am" data path:
//     decode's handler drops the connection's messages), or
//   - that prefill manager is known gone: another instance answers at its address, or nothing
//     listens there any more.
// Where the connection cannot be fenced, a paused prefill therefore holds the pages
// (quarantine) until it resumes and drains, or dies.
// KVManagerMetrics counts quarantined pages; one held longer than
// KVManagerOptions::quarantine_warn_after is logged at ERROR with the prefill rank named. It is
// never released by time alone. A sender's PagesReusable() says the same of its source pages:
// pdlib reads none of them any more.
// Pull (KVManagerOptions::direction kPull): nothing writes into decode's pages but decode's own
// reads, so a failed receiver's pages are reusable once every read batch it posted has
// completed (none of its reads can land after that); a sender's once every decode rank it
// published to has reported its reads over, or its connection is gone (or, for one that stays
// silent, liveness_timeout after the failure, a late read then landing only in that failed
// request's pages on decode).
#ifndef PDLIB_KV_MANAGER_H_
#define PDLIB_KV_MANAGER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "pdlib/export.h"
#include "pdlib/kv_args.h"
#include "pdlib/status.h"
#include "pdlib/types.h"

namespace pdlib {
inline namespace v1 {

// Anything whose transfer state can be polled; PollAndAllReduce takes these.
class PDLIB_EXPORT KVPollable {
 public:
  virtual ~KVPollable() = default;
  // Wait-free: the current state, never moving backwards (SPEC R2.2, R2.3).
  virtual KVPoll Poll() const = 0;
  // OK unless Poll() is kFailed; then the reason, e.g. (ToString()) "DEADLINE_EXCEEDED: room 7:
  // timed out after 30000 ms in state Bootstrapping (bootstrap_timeout)".
  virtual Status FailureReason() const = 0;
  // The request's bootstrap_room.
  virtual uint64_t room() const = 0;
  // Wait-free: true once pdlib will neither write (decode) nor read (prefill) the pages handed
  // to this request again, so the engine may reuse them ("Page reuse" above). False while the
  // request is live; true at once after Success; after Failed, once every peer that could still
  // touch them has drained, been fenced or is known gone. Never goes back to false.
  virtual bool PagesReusable() const = 0;
};

// One request's state indices, for every state family of the manager (KVArgs::state_families
// order): `indices` holds the families' lists one after the other and counts[f] is the length of
// family f's list. `counts` empty: every index belongs to the one family (the usual case with a
// single family; with several families counts is required whenever indices is not empty).
struct StateIndices {
  std::span<const int32_t> indices;
  std::span<const uint32_t> counts;
};

// Prefill side of one request.
class PDLIB_EXPORT KVSender : public KVPollable {
 public:
  // Announces how many KV pages the whole request will send and which metadata slot carries its
  // first output token. With a decode prefix (decode_prefix_len()) the pages are those after the
  // prefix: ceil((prompt_len - prefix) / page_size) (PagesAfterPrefix computes it). May be called
  // in any non-terminal state.
  virtual Status Init(uint64_t num_kv_pages, std::optional<uint32_t> aux_index) = 0;
  // Decode prefix reuse (SPEC R11.1): the tokens at the start of the prompt that decode already
  // holds, which prefill must not send. Known once Poll() >= kWaitingForInput (every decode rank
  // of the request said the same; ranks that disagree fail the room naming both values);
  // nullopt before. 0: decode holds nothing, send every page. Pages map by position: the k-th
  // page Send() sends (the page of token prefix + k * page_size) lands in the k-th page decode
  // gave. A prefix covering the whole prompt leaves only the aux slot and the state to send
  // (an empty last chunk).
  virtual std::optional<uint64_t> decode_prefix_len() const { return uint64_t{0}; }
  // The KV pages to send for a prompt of `prompt_len` tokens after decode's prefix:
  // ceil((prompt_len - prefix) / page_size). In pull (KVManagerOptions::direction) every page of
  // the prompt, ceil(prompt_len / page_size), known at any time: decode reads only those after
  // its prefix. kFailedPrecondition before the prefix is known,
  // kOutOfRange (naming both numbers) when the prefix is longer than the prompt.
  virtual StatusOr<uint64_t> PagesAfterPrefix(uint64_t prompt_len) const {
    (void)prompt_len;
    return Status::Unimplemented("this KVSender does not know decode prefixes");
  }
  // Queues one chunk of this request's KV pages (SPEC R5.2). Non-last chunks must hold only
  // whole pages; the last chunk's call also sends the aux slot and `state_indices` (one family;
  // SendStates for several). Requires the decode side's TransferInfo (Poll() >=
  // kWaitingForInput).
  virtual Status Send(std::span<const int32_t> kv_page_indices, bool is_last_chunk,
                      std::span<const int32_t> state_indices = {}) = 0;
  // Send() with the state indices of every family (read only with the last chunk).
  virtual Status SendStates(std::span<const int32_t> kv_page_indices, bool is_last_chunk,
                            const StateIndices& state) {
    if (!state.counts.empty()) {
      return Status::Unimplemented("this KVSender does not take several state families");
    }
    return Send(kv_page_indices, is_last_chunk, state.indices);
  }
  // Layer-wise streaming (optional; an engine that only calls Send behaves as before). Announces
  // that the first `layers_done` KV layers of this rank (KVArgs::kv order: the layers of its PP
  // stage, MLA or K and V alike) are computed for the chunk `kv_page_indices`, so that pdlib
  // writes them to decode while the engine computes the next ones. Call it as layers finish,
  // from the forward loop or from a GPU engine's host callback after each layer's CUDA event,
  // with a growing count and the same pages and is_last_chunk; the call with layers_done ==
  // num_layers() completes the chunk exactly as Send(kv_page_indices, is_last_chunk,
  // state_indices) does (state_indices are read only then; aux and state follow the last
  // layer of the last chunk). Only then may the next chunk begin. Never blocks on the network:
  // it checks the call and queues the new layers' writes (about a microsecond). Success still
  // means every byte of every layer has landed.
  // Errors, which change nothing: kOutOfRange for layers_done outside [0, num_layers()],
  // kInvalidArgument for fewer layers than announced before, or pages or is_last_chunk that
  // differ from the chunk's earlier announcements, kFailedPrecondition after the last chunk
  // (and everything Send() refuses). Announcing the same count again, or 0, does nothing.
  virtual Status SendLayers(std::span<const int32_t> kv_page_indices, int32_t layers_done,
                            bool is_last_chunk, std::span<const int32_t> state_indices = {}) {
    return SendLayersStates(kv_page_indices, layers_done, is_last_chunk, {state_indices, {}});
  }
  // SendLayers() with the state indices of every family (read only when the call completes the
  // last chunk).
  virtual Status SendLayersStates(std::span<const int32_t> kv_page_indices, int32_t layers_done,
                                  bool is_last_chunk, const StateIndices& state) {
    (void)kv_page_indices;
    (void)layers_done;
    (void)is_last_chunk;
    (void)state;
    return Status::Unimplemented("this KVSender does not stream layers; call Send()");
  }
  // This rank's KV layers: the layers_done that completes a chunk in SendLayers(). 0 when the
  // sender does not stream layers.
  virtual int32_t num_layers() const { return 0; }
  // Fails the request with `reason` (code kAborted) and tells the decode side. Idempotent.
  virtual void Abort(std::string_view reason) = 0;
};

// What decode hands over for one request (KVReceiver::Init).
struct ReceiveRequest {
  // Destination pages of the tokens [decode_prefix_len, prompt end), in order: the k-th page
  // prefill sends lands in kv_page_indices[k].
  std::span<const int32_t> kv_page_indices;
  std::optional<uint32_t> aux_index;
  // Destination state slots/pages/rows, per state family (see StateIndices).
  StateIndices state;
  // Decode prefix reuse (SPEC R11.1): tokens at the start of the prompt decode already holds
  // (its prefix cache). A multiple of the page size; prefill sends only the pages after it.
  uint64_t decode_prefix_len = 0;
  // Tokens of the whole prompt, when the engine knows them (0: not checked): the prefix must not
  // be longer, and kv_page_indices must hold ceil((prompt_len - prefix) / page_size) pages.
  uint64_t prompt_len = 0;
};

// Decode side of one request.
class PDLIB_EXPORT KVReceiver : public KVPollable {
 public:
  // Hands over the destination pages, the metadata slot and the state slots, and sends them to
  // every prefill rank that writes to this rank (SPEC R1.3). Call once. Poll() reaches
  // kWaitingForInput when the prefill rank is connected; Init() may also come earlier, while
  // Bootstrapping, and is then sent as soon as the connection is up. Errors (nothing is sent):
  // a prefix that is not page-aligned or longer than prompt_len, naming both numbers; indices
  // out of range or repeated; counts that do not match the state families.
  virtual Status Init(const ReceiveRequest& request) = 0;
  // Init() without a prefix, for one state family.
  Status Init(std::span<const int32_t> kv_page_indices, std::optional<uint32_t> aux_index,
              std::span<const int32_t> state_indices = {}) {
    ReceiveRequest request;
    request.kv_page_indices = kv_page_indices;
    request.aux_index = aux_index;
    request.state.indices = state_indices;
    return Init(request);
  }
  // Fails the request with `reason` (code kAborted) and tells the prefill side. Idempotent.
  virtual void Abort(std::string_view reason) = 0;
  // Recompute instead of failing (SPEC R11.4): the pages of Init()'s kv_page_indices that do not
  // hold every byte of their tokens, in Init() order. Empty while the request is live and after
  // Success. After Failed: in pull, the pages some read of which did not complete (the others
  // hold every KV byte and an engine may keep them, recomputing only these); in push, every page
  // (prefill wrote them, decode cannot tell which landed). The aux slot and state are never
  // covered: after Failed they hold nothing usable.
  virtual std::vector<int32_t> InvalidPages() const { return {}; }
};

// Where a request's prefill deployment can be found (from the router, SPEC R1.1).
struct BootstrapAddress {
  std::string host = "127.0.0.1";
  uint16_t port = 8998;
};

// Point-in-time counters of one manager (SPEC R10.1).
struct KVManagerMetrics {
  uint64_t live_rooms = 0;            // handles not yet destroyed
  uint64_t bootstrap_queue_size = 0;  // rooms in Bootstrapping
  uint64_t transfer_queue_size = 0;   // rooms in WaitingForInput or Transferring
  uint64_t rooms_succeeded = 0;
  uint64_t rooms_failed = 0;
  uint64_t bootstrap_failed_reqs = 0;  // failed before leaving Bootstrapping
  uint64_t transfer_failed_reqs = 0;   // failed afterwards
  uint64_t bytes_transferred = 0;      // bytes written to peers (prefill)
  uint64_t pages_transferred = 0;
  uint64_t write_batches = 0;
  uint64_t connections = 0;     // live peer connections
  uint64_t requests_total = 0;  // handles ever created
  // Failed rooms by the failure's status code name ("DEADLINE_EXCEEDED", "UNAVAILABLE", ...).
  std::map<std::string, uint64_t> failed_by_cause;
  // Time from a room's creation to Success, summed over succeeded rooms (mean = sum / count).
  uint64_t transfer_latency_us_sum = 0;
  uint64_t transfer_latency_count = 0;
  // Page reuse ("Page reuse" above). Decode: failed requests whose pages are not reusable yet,
  // and their pages (KV pages + metadata slot + state slots); the longest current hold, the
  // longest hold ever ended, and how holds ended. Prefill counts its failed requests whose
  // source pages are still read by writes in flight.
  uint64_t quarantined_rooms = 0;
  uint64_t quarantined_pages = 0;
  uint64_t quarantine_oldest_ms = 0;
  uint64_t quarantine_max_hold_ms = 0;
  uint64_t quarantine_released_drained = 0;  // the prefill rank confirmed it drained the room
  uint64_t quarantine_released_fenced = 0;   // the connection was fenced
  uint64_t quarantine_released_gone = 0;     // the prefill manager is known gone
  uint64_t fenced_connections = 0;           // decode: connections cut off with FenceTarget
  // KV integrity (KVManagerOptions::checksum): rooms digested; decode: rooms whose bytes did not
  // match what prefill moved (failed DATA_LOSS), and per prefill rank ("host:port" of its
  // control endpoint) the mismatches of rooms it wrote to (a room several ranks wrote to counts
  // for each of them: the digest cannot tell whose bytes went wrong).
  uint64_t rooms_checksummed = 0;
  uint64_t checksum_mismatches = 0;
  // decode: digested rooms whose landed bytes were all digested by the transport as it copied
  // them (capabilities().digests_landings: UCX's am path), with no second pass over the pages;
  // prefill (push): digested rooms whose KV writes the transport digested as it sent them
  // (capabilities().digests_sends), with no pass of the core's own over the source pages.
  uint64_t rooms_checksummed_in_flight = 0;
  // Failure injection stage `corrupt` (failure_injection_stages): KV batches this rank moved
  // wrong on purpose.
  uint64_t corruptions_injected = 0;
  std::map<std::string, uint64_t> checksum_mismatches_by_peer;
};

// Renders `m` in the Prometheus text exposition format, every metric prefixed "pdlib_" and
// carrying `labels` (e.g. {{"role", "prefill"}, {"tp_rank", "0"}}).
PDLIB_EXPORT std::string RenderPrometheus(const KVManagerMetrics& m,
                                          const std::map<std::string, std::string>& labels = {});

// One per engine rank. Create it after the engine has allocated its KV pools.
class PDLIB_EXPORT KVManager {
 public:
  // Validates `options`, creates the named backend, registers every buffer of options.args
  // and starts the manager's background threads.
  static StatusOr<std::unique_ptr<KVManager>> Create(const KVManagerOptions& options);

  virtual ~KVManager() = default;

  virtual Mode mode() const = 0;
  // Prefill: "host:port" of this rank's control endpoint.
  virtual std::string endpoint() const = 0;
  // Prefill with start_bootstrap_server (gRPC control plane): "host:port" of the bootstrap
  // server this manager runs, with the port it bound (a free one when bootstrap_port was 0).
  // "" otherwise.
  virtual std::string bootstrap_endpoint() const { return ""; }

  // Prefill only. Fails with kAlreadyExists when `room` is live on this manager.
  virtual StatusOr<std::unique_ptr<KVSender>> CreateSender(uint64_t room) = 0;
  // Decode only: warm-up. Connects to every prefill rank this decode rank needs in the
  // deployment behind `bootstrap` (all its DP groups), so that the first request pays no
  // connection set-up. Returns OK once every such rank is connected and has accepted this
  // rank's registration; otherwise the reason (a rank not registered within `timeout`, a
  // fingerprint mismatch, ...). Retries what may succeed later until `timeout`; one attempt may
  // run past it by up to connect_timeout. Safe to call again (cheap once connected).
  virtual Status Connect(const BootstrapAddress& bootstrap, std::chrono::milliseconds timeout) {
    (void)bootstrap;
    (void)timeout;
    return Status::FailedPrecondition("Connect() is for decode managers");
  }
  // Decode only. `prefill_dp_rank` overrides the default room % prefill_dp_size (SPEC R5.7).
  virtual StatusOr<std::unique_ptr<KVReceiver>> CreateReceiver(
      const BootstrapAddress& bootstrap, uint64_t room,
      std::optional<int32_t> prefill_dp_rank = std::nullopt) = 0;

  virtual KVManagerMetrics metrics() const = 0;

  // Rooms whose handle was destroyed in state Failed (a live handle destroyed fails first),
  // once their pages are reusable: at once if they already were. Each room comes out once. An
  // engine that drops failed handles keeps their pages aside under the room id and frees them
  // when the room comes out of here; one that keeps handles until PagesReusable() may ignore
  // room ids it does not wait for. Up to 65536 rooms are kept between calls (the oldest are
  // dropped past that, with an ERROR log). Never blocks on the network.
  virtual std::vector<uint64_t> TakeReusableRooms() = 0;
};

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_KV_MANAGER_H_
