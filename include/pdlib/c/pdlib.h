/* pdlib's C API (C99): the per-request API of include/pdlib/kv_manager.h for engines, routers and
 * orchestrators that are not C++ (Rust, Go, C). Link libpdlib_c.so (CMake: pdlib::pdlib_c); it
 * exports these symbols only.
 *
 * Conventions
 *  - Opaque handles, created and destroyed in pairs: pdlib_manager_create/_destroy,
 *    pdlib_sender_create/_destroy, pdlib_receiver_create/_destroy, pdlib_bootstrap_server_start/
 *    _stop. Destroy every sender and receiver before its manager (as in C++). A destroy of NULL
 *    does nothing.
 *  - Every call that can fail returns a pdlib_status (PDLIB_OK = 0; the other values are the
 *    C++ StatusCode, gRPC's codes). The message of the last failed call on this thread is
 *    pdlib_last_error() (valid until the thread's next failed call), e.g. "INVALID_ARGUMENT:
 *    room 7: page index 99 out of range [0, 64)". A NULL handle or out-pointer where one is
 *    required is PDLIB_INVALID_ARGUMENT, never a crash.
 *  - Lists are pointer + count (the pointer may be NULL when the count is 0). Strings are
 *    NUL-terminated UTF-8. Strings handed back are copied into a caller buffer (out, capacity)
 *    and always NUL-terminated when capacity > 0; *length gets the full length (without the NUL),
 *    so a caller can retry with a larger buffer.
 *  - Structs that may grow start with `struct_size` (set by the *_init function to the size this
 *    header declares). pdlib reads only the first struct_size bytes and uses defaults for the
 *    rest, so a caller built against an older header keeps working; a caller built against a
 *    newer header whose extra bytes are not all zero gets PDLIB_INVALID_ARGUMENT naming the
 *    struct. pdlib_manager_options also carries abi_version, checked at pdlib_manager_create.
 *  - One process uses either libpdlib_c.so or pdlib's C++ library, not both: each carries its
 *    own copy of pdlib, and libprotobuf refuses pdlib's messages registered twice.
 *  - Fields and parameters that take one of the enums below are int32_t (a value outside the
 *    enum is an error pdlib reports, not undefined behaviour); results are the enum types.
 *  - Threads: every function may be called from any thread. The poll functions are wait-free
 *    (one atomic load), as KVPollable::Poll in C++.
 */
#ifndef PDLIB_C_PDLIB_H_
#define PDLIB_C_PDLIB_H_

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define PDLIB_C_EXPORT __declspec(dllexport)
#else
#define PDLIB_C_EXPORT __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a declaration here changes incompatibly (a new field at the end of a struct
 * with struct_size is compatible). */
#define PDLIB_C_ABI_VERSION 1

typedef enum pdlib_status {
  PDLIB_OK = 0,
  PDLIB_CANCELLED = 1,
  PDLIB_UNKNOWN = 2,
  PDLIB_INVALID_ARGUMENT = 3,
  PDLIB_DEADLINE_EXCEEDED = 4,
  PDLIB_NOT_FOUND = 5,
  PDLIB_ALREADY_EXISTS = 6,
  PDLIB_PERMISSION_DENIED = 7,
  PDLIB_RESOURCE_EXHAUSTED = 8,
  PDLIB_FAILED_PRECONDITION = 9,
  PDLIB_ABORTED = 10,
  PDLIB_OUT_OF_RANGE = 11,
  PDLIB_UNIMPLEMENTED = 12,
  PDLIB_INTERNAL = 13,
  PDLIB_UNAVAILABLE = 14,
  PDLIB_DATA_LOSS = 15,
  PDLIB_UNAUTHENTICATED = 16
} pdlib_status;

/* A request's state; only moves forward (FAILED < BOOTSTRAPPING < ... < SUCCESS as in C++). */
typedef enum pdlib_poll {
  PDLIB_POLL_FAILED = 0,
  PDLIB_POLL_BOOTSTRAPPING = 1,
  PDLIB_POLL_WAITING_FOR_INPUT = 2,
  PDLIB_POLL_TRANSFERRING = 3,
  PDLIB_POLL_SUCCESS = 4
} pdlib_poll;

typedef enum pdlib_mode { PDLIB_MODE_PREFILL = 0, PDLIB_MODE_DECODE = 1 } pdlib_mode;
typedef enum pdlib_direction { PDLIB_PUSH = 0, PDLIB_PULL = 1 } pdlib_direction;
typedef enum pdlib_control_plane {
  PDLIB_CONTROL_GRPC = 0,      /* processes talk over gRPC (production) */
  PDLIB_CONTROL_IN_PROCESS = 1 /* managers of one process, by direct calls (tests) */
} pdlib_control_plane;
typedef enum pdlib_memory_kind { PDLIB_MEMORY_HOST = 0, PDLIB_MEMORY_CUDA = 1 } pdlib_memory_kind;
typedef enum pdlib_kv_layout { PDLIB_LAYOUT_NHD = 0, PDLIB_LAYOUT_HND = 1 } pdlib_kv_layout;
typedef enum pdlib_checksum {
  PDLIB_CHECKSUM_OFF = 0,
  PDLIB_CHECKSUM_SAMPLED = 1,
  PDLIB_CHECKSUM_ALL = 2
} pdlib_checksum;
/* StateType of include/pdlib/types.h. */
typedef enum pdlib_state_type {
  PDLIB_STATE_NONE = 0,
  PDLIB_STATE_MAMBA = 1,
  PDLIB_STATE_SWA = 2,
  PDLIB_STATE_NSA = 3,
  PDLIB_STATE_MINIMAX_INDEX_K = 4,
  PDLIB_STATE_SWA_RING = 5,
  PDLIB_STATE_C128 = 6
} pdlib_state_type;
typedef enum pdlib_log_level {
  PDLIB_LOG_DEBUG = 0,
  PDLIB_LOG_INFO = 1,
  PDLIB_LOG_WARNING = 2,
  PDLIB_LOG_ERROR = 3,
  PDLIB_LOG_OFF = 4
} pdlib_log_level;

typedef struct pdlib_manager pdlib_manager;
typedef struct pdlib_sender pdlib_sender;
typedef struct pdlib_receiver pdlib_receiver;
typedef struct pdlib_bootstrap_server pdlib_bootstrap_server;

/* ---- Library ---------------------------------------------------------------------------- */

/* "0.2.0"; and the ABI version this library implements (PDLIB_C_ABI_VERSION it was built with). */
PDLIB_C_EXPORT const char* pdlib_version(void);
PDLIB_C_EXPORT uint32_t pdlib_abi_version(void);
/* The message of this thread's last failed call ("" if none). */
PDLIB_C_EXPORT const char* pdlib_last_error(void);
/* "OK", "INVALID_ARGUMENT", ... (gRPC's names); "Failed", "Bootstrapping", ... (KVPollName). */
PDLIB_C_EXPORT const char* pdlib_status_name(int32_t code);
PDLIB_C_EXPORT const char* pdlib_poll_name(int32_t state);
/* The registered backends ("cuda_ipc", "fake", "ucx", "verbs" as built): names[i] for i <
 * min(capacity, *count) point at strings that live as long as the process. */
PDLIB_C_EXPORT pdlib_status pdlib_list_backends(const char** names, size_t capacity, size_t* count);
/* Log sink: every pdlib log line at `level` or above goes to `sink` (from any pdlib thread; it
 * must not call back into pdlib), or to stderr again when sink is NULL. */
typedef void (*pdlib_log_fn)(void* user, pdlib_log_level level, const char* file, int line,
                             const char* message);
PDLIB_C_EXPORT void pdlib_set_log_sink(pdlib_log_fn sink, void* user);
PDLIB_C_EXPORT void pdlib_set_log_level(int32_t level);

/* ---- Manager options -------------------------------------------------------------------- */

/* One family of buffers (KVArgs::kv, aux, a state family's): count buffers, buffer i at ptrs[i]
 * of lens[i] bytes holding items of item_lens[i] bytes (a KV page, a metadata row, a state
 * slot). */
typedef struct pdlib_buffers {
  const uint64_t* ptrs;
  const uint64_t* lens;
  const uint64_t* item_lens;
  size_t count;
} pdlib_buffers;

typedef struct pdlib_key_value {
  const char* key;
  const char* value;
} pdlib_key_value;

/* KVArgs::state_families[i] (kv_args.h, StateFamily). In pdlib_manager_options::state_families
 * every element has the struct_size of the caller's header (the array's stride). */
typedef struct pdlib_state_family {
  size_t struct_size;
  int32_t type; /* pdlib_state_type */
  pdlib_buffers buffers;
  const int32_t* dim_per_tensor;
  size_t dim_per_tensor_count;
  const uint64_t* item_rows;
  size_t item_rows_count;
  const uint64_t* split_units;
  size_t split_units_count;
  int32_t start;
} pdlib_state_family;
PDLIB_C_EXPORT void pdlib_state_family_init(pdlib_state_family* family);

/* KVManagerOptions with its KVArgs, ParallelConfig and ModelFingerprint (kv_args.h): the same
 * names and defaults; timeouts in milliseconds (0: the C++ default); strings NULL or "" for the
 * default. Fill with pdlib_manager_options_init first. */
typedef struct pdlib_manager_options {
  size_t struct_size;
  uint32_t abi_version;
  int32_t mode;        /* pdlib_mode */
  const char* backend; /* "fake" by default */
  const pdlib_key_value* backend_options;
  size_t backend_option_count;
  int32_t control_plane; /* pdlib_control_plane */
  int32_t direction;     /* pdlib_direction */
  /* KVArgs */
  pdlib_buffers kv;
  pdlib_buffers aux;
  const pdlib_state_family* state_families;
  size_t state_family_count;
  uint32_t page_size;
  int32_t kv_head_num;
  int32_t kv_layout; /* pdlib_kv_layout */
  int32_t is_mla;
  int32_t prefill_start_layer;
  int32_t memory_kind; /* pdlib_memory_kind */
  int32_t device_id;
  /* ParallelConfig */
  int32_t tp_size, tp_rank, dp_size, dp_rank, pp_size, pp_rank;
  /* ModelFingerprint */
  int32_t num_layers, num_kv_heads, head_dim, dtype_bytes, layout_version;
  const char* model_name;
  const char* kv_dtype;
  const char* engine_tag;
  /* Control plane */
  const char* listen_host;
  uint16_t listen_port;
  const char* bootstrap_host;
  uint16_t bootstrap_port;
  int32_t start_bootstrap_server;
  uint32_t liveness_timeout_ms, connect_timeout_ms, bootstrap_timeout_ms, waiting_timeout_ms,
      transfer_timeout_ms;
  const char* auth_secret;
  /* KV integrity */
  int32_t checksum; /* pdlib_checksum */
  uint32_t checksum_sample_every;
  int32_t transfer_workers;
} pdlib_manager_options;
/* Zeroes `options`, sets struct_size and abi_version, and the C++ defaults. */
PDLIB_C_EXPORT void pdlib_manager_options_init(pdlib_manager_options* options);

/* ---- Manager ---------------------------------------------------------------------------- */

/* KVManager::Create: validates the options, creates the backend, registers every buffer,
 * starts the background threads. PDLIB_FAILED_PRECONDITION for an abi_version this library
 * does not implement. */
PDLIB_C_EXPORT pdlib_status pdlib_manager_create(const pdlib_manager_options* options,
                                                 pdlib_manager** out);
PDLIB_C_EXPORT void pdlib_manager_destroy(pdlib_manager* manager);
/* Prefill: "host:port" of this rank's control endpoint; and of the bootstrap server it runs
 * (start_bootstrap_server), "" otherwise. */
PDLIB_C_EXPORT pdlib_status pdlib_manager_endpoint(const pdlib_manager* manager, char* out,
                                                   size_t capacity, size_t* length);
PDLIB_C_EXPORT pdlib_status pdlib_manager_bootstrap_endpoint(const pdlib_manager* manager,
                                                             char* out, size_t capacity,
                                                             size_t* length);
/* Decode warm-up (KVManager::Connect). */
PDLIB_C_EXPORT pdlib_status pdlib_manager_connect(pdlib_manager* manager,
                                                  const char* bootstrap_host,
                                                  uint16_t bootstrap_port, uint32_t timeout_ms);
/* KVManager::TakeReusableRooms: up to `capacity` rooms into rooms[0, *count); the ones that did
 * not fit come out of the next call. */
PDLIB_C_EXPORT pdlib_status pdlib_manager_take_reusable_rooms(pdlib_manager* manager,
                                                              uint64_t* rooms, size_t capacity,
                                                              size_t* count);

/* KVManagerMetrics (kv_manager.h), the scalar counters. */
typedef struct pdlib_metrics {
  size_t struct_size;
  uint64_t live_rooms, bootstrap_queue_size, transfer_queue_size, rooms_succeeded, rooms_failed,
      bootstrap_failed_reqs, transfer_failed_reqs, bytes_transferred, pages_transferred,
      write_batches, connections, requests_total, transfer_latency_us_sum, transfer_latency_count,
      quarantined_rooms, quarantined_pages, quarantine_oldest_ms, quarantine_max_hold_ms,
      quarantine_released_drained, quarantine_released_fenced, quarantine_released_gone,
      fenced_connections, rooms_checksummed, checksum_mismatches, rooms_checksummed_in_flight,
      corruptions_injected;
} pdlib_metrics;
/* Fills the first metrics->struct_size bytes (set struct_size = sizeof(pdlib_metrics) first). */
PDLIB_C_EXPORT pdlib_status pdlib_manager_metrics(const pdlib_manager* manager,
                                                  pdlib_metrics* metrics);
/* RenderPrometheus: the metrics in the Prometheus text format (labels none). */
PDLIB_C_EXPORT pdlib_status pdlib_manager_metrics_prometheus(const pdlib_manager* manager,
                                                             char* out, size_t capacity,
                                                             size_t* length);

/* ---- Prefill: senders ------------------------------------------------------------------- */

PDLIB_C_EXPORT pdlib_status pdlib_sender_create(pdlib_manager* manager, uint64_t room,
                                                pdlib_sender** out);
/* A sender not yet terminal is aborted first (as destroying a C++ handle). */
PDLIB_C_EXPORT void pdlib_sender_destroy(pdlib_sender* sender);
/* KVSender::Init; aux_index < 0: no metadata slot. */
PDLIB_C_EXPORT pdlib_status pdlib_sender_init(pdlib_sender* sender, uint64_t num_kv_pages,
                                              int64_t aux_index);

/* One call for every way of sending (KVSender::Send, SendStates, SendLayers, SendLayersStates):
 * the chunk's pages; layers_done < 0 sends the whole chunk, else announces that many layers
 * (SendLayers); the state indices (read with the last chunk) of every family one after the
 * other, state_counts[f] of family f (no counts: one family). */
typedef struct pdlib_send_params {
  size_t struct_size;
  const int32_t* pages;
  size_t page_count;
  int32_t is_last_chunk;
  int32_t layers_done;
  const int32_t* state_indices;
  size_t state_index_count;
  const uint32_t* state_counts;
  size_t state_count_count;
} pdlib_send_params;
PDLIB_C_EXPORT void pdlib_send_params_init(pdlib_send_params* params);
PDLIB_C_EXPORT pdlib_status pdlib_sender_send(pdlib_sender* sender,
                                              const pdlib_send_params* params);
/* The decode prefix in tokens, once known (PDLIB_FAILED_PRECONDITION before), and the pages to
 * send for a prompt of prompt_len tokens (KVSender::PagesAfterPrefix). */
PDLIB_C_EXPORT pdlib_status pdlib_sender_decode_prefix(const pdlib_sender* sender,
                                                       uint64_t* tokens);
PDLIB_C_EXPORT pdlib_status pdlib_sender_pages_after_prefix(const pdlib_sender* sender,
                                                            uint64_t prompt_len, uint64_t* pages);
/* This rank's KV layers: the layers_done that completes a chunk. */
PDLIB_C_EXPORT int32_t pdlib_sender_num_layers(const pdlib_sender* sender);
PDLIB_C_EXPORT void pdlib_sender_abort(pdlib_sender* sender, const char* reason);
/* Wait-free. PDLIB_POLL_FAILED for a NULL handle. */
PDLIB_C_EXPORT pdlib_poll pdlib_sender_poll(const pdlib_sender* sender);
/* 1 once pdlib reads none of the request's source pages any more (KVPollable::PagesReusable). */
PDLIB_C_EXPORT int32_t pdlib_sender_pages_reusable(const pdlib_sender* sender);
/* PDLIB_OK unless the request failed; then its code, and the reason copied to out. */
PDLIB_C_EXPORT pdlib_status pdlib_sender_failure(const pdlib_sender* sender, char* out,
                                                 size_t capacity, size_t* length);

/* ---- Decode: receivers ------------------------------------------------------------------ */

/* prefill_dp_rank < 0: room % the prefill's DP size. */
PDLIB_C_EXPORT pdlib_status pdlib_receiver_create(pdlib_manager* manager,
                                                  const char* bootstrap_host,
                                                  uint16_t bootstrap_port, uint64_t room,
                                                  int32_t prefill_dp_rank, pdlib_receiver** out);
PDLIB_C_EXPORT void pdlib_receiver_destroy(pdlib_receiver* receiver);

/* KVReceiver::Init's ReceiveRequest: destination pages (after the prefix), the metadata slot
 * (aux_index < 0: none), the state slots as in pdlib_send_params, the decode prefix in tokens
 * and the prompt length (0: not checked). */
typedef struct pdlib_receive_params {
  size_t struct_size;
  const int32_t* pages;
  size_t page_count;
  int64_t aux_index;
  const int32_t* state_indices;
  size_t state_index_count;
  const uint32_t* state_counts;
  size_t state_count_count;
  uint64_t decode_prefix_len;
  uint64_t prompt_len;
} pdlib_receive_params;
PDLIB_C_EXPORT void pdlib_receive_params_init(pdlib_receive_params* params);
PDLIB_C_EXPORT pdlib_status pdlib_receiver_init(pdlib_receiver* receiver,
                                                const pdlib_receive_params* params);
PDLIB_C_EXPORT void pdlib_receiver_abort(pdlib_receiver* receiver, const char* reason);
PDLIB_C_EXPORT pdlib_poll pdlib_receiver_poll(const pdlib_receiver* receiver);
PDLIB_C_EXPORT int32_t pdlib_receiver_pages_reusable(const pdlib_receiver* receiver);
PDLIB_C_EXPORT pdlib_status pdlib_receiver_failure(const pdlib_receiver* receiver, char* out,
                                                   size_t capacity, size_t* length);
/* KVReceiver::InvalidPages: up to capacity pages into pages[0, min(capacity, *count)); *count
 * is how many there are. */
PDLIB_C_EXPORT pdlib_status pdlib_receiver_invalid_pages(const pdlib_receiver* receiver,
                                                         int32_t* pages, size_t capacity,
                                                         size_t* count);

/* ---- Bootstrap server ------------------------------------------------------------------- */

/* The bootstrap server a prefill deployment registers with (what pdlib-bootstrap runs): binds
 * host:port (port 0: a free one, pdlib_bootstrap_server_port tells). */
PDLIB_C_EXPORT pdlib_status pdlib_bootstrap_server_start(const char* host, uint16_t port,
                                                         pdlib_bootstrap_server** out);
PDLIB_C_EXPORT uint16_t pdlib_bootstrap_server_port(const pdlib_bootstrap_server* server);
PDLIB_C_EXPORT void pdlib_bootstrap_server_stop(pdlib_bootstrap_server* server);

#ifdef __cplusplus
}
#endif

#endif /* PDLIB_C_PDLIB_H_ */
