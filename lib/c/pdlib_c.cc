// The C API (include/pdlib/c/pdlib.h): a thin layer over the C++ API. Every entry point checks
// its handles and pointers, copies the caller's versioned structs over defaults (only
// struct_size bytes of them), converts, calls C++ and turns a Status into a code and a
// thread-local message. No C++ exception or Status crosses the boundary.
#include <algorithm>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "lib/control/bootstrap_server.h"
#include "pdlib/backends.h"
#include "pdlib/c/pdlib.h"
#include "pdlib/kv_manager.h"
#include "pdlib/log.h"

struct pdlib_manager {
  std::unique_ptr<pdlib::KVManager> cxx;
  std::mutex mu;  // guards reusable (TakeReusableRooms' leftovers)
  std::deque<uint64_t> reusable;
};
struct pdlib_sender {
  std::unique_ptr<pdlib::KVSender> cxx;
};
struct pdlib_receiver {
  std::unique_ptr<pdlib::KVReceiver> cxx;
};
struct pdlib_bootstrap_server {
  std::unique_ptr<pdlib::control::BootstrapServer> cxx;
};

namespace {

using pdlib::Status;
using pdlib::StatusCode;

thread_local std::string last_error;

pdlib_status Fail(const Status& s) {
  last_error = s.ToString();
  return static_cast<pdlib_status>(s.code());
}
pdlib_status Fail(StatusCode code, std::string message) {
  return Fail(Status(code, std::move(message)));
}
pdlib_status Check(const Status& s) { return s.ok() ? PDLIB_OK : Fail(s); }

// A NULL where the API needs a pointer: named, so the caller knows which.
pdlib_status Null(const char* function, const char* what) {
  return Fail(StatusCode::kInvalidArgument, std::string(function) + ": " + what + " is NULL");
}

// Copies `size` bytes of the caller's struct over `*into` (which holds the defaults). A caller
// built against a newer header passes a larger size: fine if what we do not know is all zero.
template <typename T>
pdlib_status ReadVersioned(const char* name, const void* from, size_t size, T* into) {
  if (size < sizeof(size_t)) {
    return Fail(StatusCode::kInvalidArgument,
                std::string(name) + ": struct_size " + std::to_string(size) +
                    " is too small (set it with the struct's _init function)");
  }
  const auto* bytes = static_cast<const unsigned char*>(from);
  if (size > sizeof(T)) {
    for (size_t i = sizeof(T); i < size; ++i) {
      if (bytes[i] != 0) {
        return Fail(StatusCode::kInvalidArgument,
                    std::string(name) + ": struct_size " + std::to_string(size) +
                        " from a newer pdlib.h sets fields this library (" +
                        std::to_string(sizeof(T)) + " bytes) does not know");
      }
    }
    size = sizeof(T);
  }
  std::memcpy(static_cast<void*>(into), from, size);
  into->struct_size = sizeof(T);
  return PDLIB_OK;
}

// A list from pointer + count; a NULL pointer with a count is an error.
template <typename T>
pdlib_status List(const char* what, const T* ptr, size_t count, std::vector<T>* out) {
  if (count > 0 && ptr == nullptr) {
    return Fail(StatusCode::kInvalidArgument,
                std::string(what) + " is NULL with a count of " + std::to_string(count));
  }
  out->assign(ptr, ptr + count);
  return PDLIB_OK;
}

pdlib_status Buffers(const char* what, const pdlib_buffers& in, pdlib::BufferFamily* out) {
  if (in.count > 0 && (in.ptrs == nullptr || in.lens == nullptr || in.item_lens == nullptr)) {
    return Fail(StatusCode::kInvalidArgument, std::string(what) + ": " + std::to_string(in.count) +
                                                  " buffers but ptrs, lens or item_lens is NULL");
  }
  out->ptrs.assign(in.ptrs, in.ptrs + in.count);
  out->lens.assign(in.lens, in.lens + in.count);
  out->item_lens.assign(in.item_lens, in.item_lens + in.count);
  return PDLIB_OK;
}

std::string Str(const char* s, std::string fallback) {
  return s == nullptr || *s == '\0' ? std::move(fallback) : std::string(s);
}

pdlib_status CopyOut(std::string_view text, char* out, size_t capacity, size_t* length) {
  if (length != nullptr) *length = text.size();
  if (out == nullptr) {
    if (capacity > 0) return Fail(StatusCode::kInvalidArgument, "out is NULL with a capacity");
    return PDLIB_OK;
  }
  if (capacity > 0) {
    const size_t n = std::min(capacity - 1, text.size());
    std::memcpy(out, text.data(), n);
    out[n] = '\0';
  }
  return PDLIB_OK;
}

std::chrono::milliseconds Ms(uint32_t ms, std::chrono::milliseconds fallback) {
  return ms == 0 ? fallback : std::chrono::milliseconds(ms);
}

// An enum field's value, which the caller may have set to anything.
pdlib_status EnumIn(const char* field, int32_t value, int32_t last, const char* names) {
  if (value >= 0 && value <= last) return PDLIB_OK;
  return Fail(StatusCode::kInvalidArgument, std::string("pdlib_manager_options: ") + field + " " +
                                                std::to_string(value) + " is not one of " + names);
}

pdlib_status ToOptions(const pdlib_manager_options& c, pdlib::KVManagerOptions* o) {
  const struct {
    const char* field;
    int32_t value, last;
    const char* names;
  } enums[] = {
      {"mode", c.mode, PDLIB_MODE_DECODE, "PDLIB_MODE_PREFILL, PDLIB_MODE_DECODE"},
      {"control_plane", c.control_plane, PDLIB_CONTROL_IN_PROCESS,
       "PDLIB_CONTROL_GRPC, PDLIB_CONTROL_IN_PROCESS"},
      {"direction", c.direction, PDLIB_PULL, "PDLIB_PUSH, PDLIB_PULL"},
      {"kv_layout", c.kv_layout, PDLIB_LAYOUT_HND, "PDLIB_LAYOUT_NHD, PDLIB_LAYOUT_HND"},
      {"memory_kind", c.memory_kind, PDLIB_MEMORY_CUDA, "PDLIB_MEMORY_HOST, PDLIB_MEMORY_CUDA"},
      {"checksum", c.checksum, PDLIB_CHECKSUM_ALL, "PDLIB_CHECKSUM_OFF, _SAMPLED, _ALL"},
  };
  for (const auto& e : enums) {
    if (pdlib_status s = EnumIn(e.field, e.value, e.last, e.names); s != PDLIB_OK) return s;
  }
  o->mode = static_cast<pdlib::Mode>(c.mode);
  o->backend = Str(c.backend, o->backend);
  if (c.backend_option_count > 0 && c.backend_options == nullptr) {
    return Fail(StatusCode::kInvalidArgument, "pdlib_manager_options: backend_options is NULL");
  }
  for (size_t i = 0; i < c.backend_option_count; ++i) {
    const pdlib_key_value& kv = c.backend_options[i];
    if (kv.key == nullptr || kv.value == nullptr) {
      return Fail(StatusCode::kInvalidArgument, "pdlib_manager_options: backend option " +
                                                    std::to_string(i) + " has a NULL key or value");
    }
    o->backend_options[kv.key] = kv.value;
  }
  o->control_plane = static_cast<pdlib::ControlPlane>(c.control_plane);
  o->direction = static_cast<pdlib::TransferDirection>(c.direction);
  pdlib::KVArgs& a = o->args;
  if (pdlib_status s = Buffers("kv", c.kv, &a.kv); s != PDLIB_OK) return s;
  if (pdlib_status s = Buffers("aux", c.aux, &a.aux); s != PDLIB_OK) return s;
  if (c.state_family_count > 0 && c.state_families == nullptr) {
    return Fail(StatusCode::kInvalidArgument, "pdlib_manager_options: state_families is NULL");
  }
  // The caller's array steps by the struct size it was built with (its first element's).
  const size_t stride = c.state_family_count > 0 ? c.state_families[0].struct_size : 0;
  for (size_t f = 0; f < c.state_family_count; ++f) {
    pdlib_state_family in;
    pdlib_state_family_init(&in);
    const std::string name = "state_families[" + std::to_string(f) + "]";
    const auto* element = reinterpret_cast<const unsigned char*>(c.state_families) + f * stride;
    size_t size = 0;
    std::memcpy(&size, element, sizeof size);
    if (size != stride) {
      return Fail(StatusCode::kInvalidArgument,
                  "pdlib_manager_options: " + name + ".struct_size " + std::to_string(size) +
                      " differs from state_families[0]'s " + std::to_string(stride));
    }
    if (pdlib_status s = ReadVersioned(name.c_str(), element, size, &in); s != PDLIB_OK) {
      return s;
    }
    if (pdlib_status s = EnumIn((name + ".type").c_str(), in.type, PDLIB_STATE_C128,
                                "the pdlib_state_type values");
        s != PDLIB_OK) {
      return s;
    }
    pdlib::StateFamily out;
    out.type = static_cast<pdlib::StateType>(in.type);
    if (pdlib_status s = Buffers(name.c_str(), in.buffers, &out.buffers); s != PDLIB_OK) return s;
    if (pdlib_status s =
            List("dim_per_tensor", in.dim_per_tensor, in.dim_per_tensor_count, &out.dim_per_tensor);
        s != PDLIB_OK) {
      return s;
    }
    if (pdlib_status s = List("item_rows", in.item_rows, in.item_rows_count, &out.item_rows);
        s != PDLIB_OK) {
      return s;
    }
    if (pdlib_status s =
            List("split_units", in.split_units, in.split_units_count, &out.split_units);
        s != PDLIB_OK) {
      return s;
    }
    out.start = in.start;
    a.state_families.push_back(std::move(out));
  }
  a.page_size = c.page_size;
  a.kv_head_num = c.kv_head_num;
  a.kv_layout = static_cast<pdlib::KVLayout>(c.kv_layout);
  a.is_mla = c.is_mla != 0;
  a.prefill_start_layer = c.prefill_start_layer;
  a.memory_kind = static_cast<pdlib::MemoryKind>(c.memory_kind);
  a.device_id = c.device_id;
  a.parallel = {c.tp_size, c.tp_rank, c.dp_size, c.dp_rank, c.pp_size, c.pp_rank};
  pdlib::ModelFingerprint& fp = a.fingerprint;
  fp.num_layers = c.num_layers;
  fp.num_kv_heads = c.num_kv_heads;
  fp.head_dim = c.head_dim;
  fp.dtype_bytes = c.dtype_bytes;
  fp.layout_version = c.layout_version;
  fp.model_name = Str(c.model_name, "");
  fp.kv_dtype = Str(c.kv_dtype, "");
  fp.engine_tag = Str(c.engine_tag, "");
  o->listen_host = Str(c.listen_host, o->listen_host);
  o->listen_port = c.listen_port;
  o->bootstrap_host = Str(c.bootstrap_host, o->bootstrap_host);
  o->bootstrap_port = c.bootstrap_port;
  o->start_bootstrap_server = c.start_bootstrap_server != 0;
  o->liveness_timeout = Ms(c.liveness_timeout_ms, o->liveness_timeout);
  o->connect_timeout = Ms(c.connect_timeout_ms, o->connect_timeout);
  o->bootstrap_timeout = Ms(c.bootstrap_timeout_ms, o->bootstrap_timeout);
  o->waiting_timeout = Ms(c.waiting_timeout_ms, o->waiting_timeout);
  o->transfer_timeout = Ms(c.transfer_timeout_ms, o->transfer_timeout);
  o->auth_secret = Str(c.auth_secret, "");
  o->checksum = static_cast<pdlib::KvChecksum>(c.checksum);
  o->checksum_sample_every = c.checksum_sample_every;
  o->transfer_workers = c.transfer_workers;
  return PDLIB_OK;
}

// State indices of pdlib_send_params / pdlib_receive_params.
struct StateLists {
  std::vector<int32_t> indices;
  std::vector<uint32_t> counts;
  pdlib::StateIndices view() const { return {indices, counts}; }
};
// Also checks the params' page list (read in place, not copied).
template <typename P>
pdlib_status States(const char* function, const P& p, StateLists* out) {
  if (p.page_count > 0 && p.pages == nullptr) {
    return Fail(
        StatusCode::kInvalidArgument,
        std::string(function) + ": pages is NULL with a count of " + std::to_string(p.page_count));
  }
  if (pdlib_status s = List("state_indices", p.state_indices, p.state_index_count, &out->indices);
      s != PDLIB_OK) {
    return s;
  }
  return List("state_counts", p.state_counts, p.state_count_count, &out->counts);
}

pdlib_status Failure(const pdlib::KVPollable* h, char* out, size_t capacity, size_t* length) {
  const Status s = h->FailureReason();
  if (pdlib_status c = CopyOut(s.ok() ? "" : s.ToString(), out, capacity, length); c != PDLIB_OK) {
    return c;
  }
  return static_cast<pdlib_status>(s.code());
}

}  // namespace

extern "C" {

const char* pdlib_version(void) {
  static const std::string version = std::to_string(PDLIB_VERSION_MAJOR) + "." +
                                     std::to_string(PDLIB_VERSION_MINOR) + "." +
                                     std::to_string(PDLIB_VERSION_PATCH);
  return version.c_str();
}

uint32_t pdlib_abi_version(void) { return PDLIB_C_ABI_VERSION; }

const char* pdlib_last_error(void) { return last_error.c_str(); }

const char* pdlib_status_name(int32_t code) {
  return pdlib::StatusCodeName(static_cast<StatusCode>(code)).data();
}

const char* pdlib_poll_name(int32_t state) {
  return pdlib::KVPollName(static_cast<pdlib::KVPoll>(state)).data();
}

pdlib_status pdlib_list_backends(const char** names, size_t capacity, size_t* count) {
  if (count == nullptr) return Null("pdlib_list_backends", "count");
  if (capacity > 0 && names == nullptr) return Null("pdlib_list_backends", "names");
  static const std::vector<std::string>* backends =
      new std::vector<std::string>(pdlib::ListBackends());
  *count = backends->size();
  for (size_t i = 0; i < std::min(capacity, backends->size()); ++i) {
    names[i] = (*backends)[i].c_str();
  }
  return PDLIB_OK;
}

void pdlib_set_log_sink(pdlib_log_fn sink, void* user) {
  if (sink == nullptr) {
    pdlib::SetLogSink(nullptr);
    return;
  }
  pdlib::SetLogSink([sink, user](pdlib::LogLevel level, std::string_view file, int line,
                                 std::string_view message) {
    const std::string f(file), m(message);
    sink(user, static_cast<pdlib_log_level>(level), f.c_str(), line, m.c_str());
  });
}

void pdlib_set_log_level(int32_t level) {
  if (level < PDLIB_LOG_DEBUG || level > PDLIB_LOG_OFF) return;  // not a level: ignored
  pdlib::SetLogLevel(static_cast<pdlib::LogLevel>(level));
}

void pdlib_state_family_init(pdlib_state_family* family) {
  if (family == nullptr) return;
  std::memset(static_cast<void*>(family), 0, sizeof *family);
  family->struct_size = sizeof *family;
}

void pdlib_manager_options_init(pdlib_manager_options* options) {
  if (options == nullptr) return;
  std::memset(static_cast<void*>(options), 0, sizeof *options);
  const pdlib::KVManagerOptions d;
  options->struct_size = sizeof *options;
  options->abi_version = PDLIB_C_ABI_VERSION;
  options->mode = static_cast<int32_t>(d.mode);
  options->control_plane = static_cast<int32_t>(d.control_plane);
  options->direction = static_cast<int32_t>(d.direction);
  options->page_size = d.args.page_size;
  options->kv_head_num = d.args.kv_head_num;
  options->kv_layout = static_cast<int32_t>(d.args.kv_layout);
  options->tp_size = d.args.parallel.tp_size;
  options->dp_size = d.args.parallel.dp_size;
  options->pp_size = d.args.parallel.pp_size;
  options->layout_version = d.args.fingerprint.layout_version;
  options->listen_port = d.listen_port;
  options->bootstrap_port = d.bootstrap_port;
  options->checksum = static_cast<int32_t>(d.checksum);
  options->checksum_sample_every = d.checksum_sample_every;
  options->transfer_workers = d.transfer_workers;
}

pdlib_status pdlib_manager_create(const pdlib_manager_options* options, pdlib_manager** out) {
  if (options == nullptr) return Null("pdlib_manager_create", "options");
  if (out == nullptr) return Null("pdlib_manager_create", "out");
  *out = nullptr;
  pdlib_manager_options c;
  pdlib_manager_options_init(&c);
  if (pdlib_status s = ReadVersioned("pdlib_manager_options", options, options->struct_size, &c);
      s != PDLIB_OK) {
    return s;
  }
  if (c.abi_version != PDLIB_C_ABI_VERSION) {
    return Fail(StatusCode::kFailedPrecondition,
                "pdlib_manager_create: the caller was built for pdlib C ABI version " +
                    std::to_string(c.abi_version) + " but this library implements version " +
                    std::to_string(PDLIB_C_ABI_VERSION) + " (pdlib " + pdlib_version() + ")");
  }
  pdlib::KVManagerOptions o;
  if (pdlib_status s = ToOptions(c, &o); s != PDLIB_OK) return s;
  auto manager = pdlib::KVManager::Create(o);
  if (!manager.ok()) return Fail(manager.status());
  auto* m = new pdlib_manager;
  m->cxx = std::move(*manager);
  *out = m;
  return PDLIB_OK;
}

void pdlib_manager_destroy(pdlib_manager* manager) { delete manager; }

pdlib_status pdlib_manager_endpoint(const pdlib_manager* manager, char* out, size_t capacity,
                                    size_t* length) {
  if (manager == nullptr) return Null("pdlib_manager_endpoint", "manager");
  return CopyOut(manager->cxx->endpoint(), out, capacity, length);
}

pdlib_status pdlib_manager_bootstrap_endpoint(const pdlib_manager* manager, char* out,
                                              size_t capacity, size_t* length) {
  if (manager == nullptr) return Null("pdlib_manager_bootstrap_endpoint", "manager");
  return CopyOut(manager->cxx->bootstrap_endpoint(), out, capacity, length);
}

pdlib_status pdlib_manager_connect(pdlib_manager* manager, const char* bootstrap_host,
                                   uint16_t bootstrap_port, uint32_t timeout_ms) {
  if (manager == nullptr) return Null("pdlib_manager_connect", "manager");
  if (bootstrap_host == nullptr) return Null("pdlib_manager_connect", "bootstrap_host");
  return Check(manager->cxx->Connect({bootstrap_host, bootstrap_port},
                                     std::chrono::milliseconds(timeout_ms)));
}

pdlib_status pdlib_manager_take_reusable_rooms(pdlib_manager* manager, uint64_t* rooms,
                                               size_t capacity, size_t* count) {
  if (manager == nullptr) return Null("pdlib_manager_take_reusable_rooms", "manager");
  if (count == nullptr) return Null("pdlib_manager_take_reusable_rooms", "count");
  if (capacity > 0 && rooms == nullptr) return Null("pdlib_manager_take_reusable_rooms", "rooms");
  std::lock_guard lock(manager->mu);
  for (uint64_t r : manager->cxx->TakeReusableRooms()) manager->reusable.push_back(r);
  size_t n = 0;
  for (; n < capacity && !manager->reusable.empty(); ++n) {
    rooms[n] = manager->reusable.front();
    manager->reusable.pop_front();
  }
  *count = n;
  return PDLIB_OK;
}

pdlib_status pdlib_manager_metrics(const pdlib_manager* manager, pdlib_metrics* metrics) {
  if (manager == nullptr) return Null("pdlib_manager_metrics", "manager");
  if (metrics == nullptr) return Null("pdlib_manager_metrics", "metrics");
  const size_t size = metrics->struct_size;
  if (size < sizeof(size_t)) {
    return Fail(StatusCode::kInvalidArgument,
                "pdlib_manager_metrics: set struct_size = sizeof(pdlib_metrics) first");
  }
  const pdlib::KVManagerMetrics m = manager->cxx->metrics();
  pdlib_metrics c;
  std::memset(static_cast<void*>(&c), 0, sizeof c);
  c.struct_size = std::min(size, sizeof c);
  c.live_rooms = m.live_rooms;
  c.bootstrap_queue_size = m.bootstrap_queue_size;
  c.transfer_queue_size = m.transfer_queue_size;
  c.rooms_succeeded = m.rooms_succeeded;
  c.rooms_failed = m.rooms_failed;
  c.bootstrap_failed_reqs = m.bootstrap_failed_reqs;
  c.transfer_failed_reqs = m.transfer_failed_reqs;
  c.bytes_transferred = m.bytes_transferred;
  c.pages_transferred = m.pages_transferred;
  c.write_batches = m.write_batches;
  c.connections = m.connections;
  c.requests_total = m.requests_total;
  c.transfer_latency_us_sum = m.transfer_latency_us_sum;
  c.transfer_latency_count = m.transfer_latency_count;
  c.quarantined_rooms = m.quarantined_rooms;
  c.quarantined_pages = m.quarantined_pages;
  c.quarantine_oldest_ms = m.quarantine_oldest_ms;
  c.quarantine_max_hold_ms = m.quarantine_max_hold_ms;
  c.quarantine_released_drained = m.quarantine_released_drained;
  c.quarantine_released_fenced = m.quarantine_released_fenced;
  c.quarantine_released_gone = m.quarantine_released_gone;
  c.fenced_connections = m.fenced_connections;
  c.rooms_checksummed = m.rooms_checksummed;
  c.checksum_mismatches = m.checksum_mismatches;
  c.rooms_checksummed_in_flight = m.rooms_checksummed_in_flight;
  c.corruptions_injected = m.corruptions_injected;
  // An older caller's struct is shorter: only what it declared is written.
  std::memcpy(static_cast<void*>(metrics), &c, c.struct_size);
  return PDLIB_OK;
}

pdlib_status pdlib_manager_metrics_prometheus(const pdlib_manager* manager, char* out,
                                              size_t capacity, size_t* length) {
  if (manager == nullptr) return Null("pdlib_manager_metrics_prometheus", "manager");
  return CopyOut(pdlib::RenderPrometheus(manager->cxx->metrics()), out, capacity, length);
}

pdlib_status pdlib_sender_create(pdlib_manager* manager, uint64_t room, pdlib_sender** out) {
  if (manager == nullptr) return Null("pdlib_sender_create", "manager");
  if (out == nullptr) return Null("pdlib_sender_create", "out");
  *out = nullptr;
  auto sender = manager->cxx->CreateSender(room);
  if (!sender.ok()) return Fail(sender.status());
  *out = new pdlib_sender{std::move(*sender)};
  return PDLIB_OK;
}

void pdlib_sender_destroy(pdlib_sender* sender) { delete sender; }

pdlib_status pdlib_sender_init(pdlib_sender* sender, uint64_t num_kv_pages, int64_t aux_index) {
  if (sender == nullptr) return Null("pdlib_sender_init", "sender");
  if (aux_index > static_cast<int64_t>(UINT32_MAX)) {
    return Fail(StatusCode::kOutOfRange,
                "pdlib_sender_init: aux_index " + std::to_string(aux_index) + " is too large");
  }
  std::optional<uint32_t> aux;
  if (aux_index >= 0) aux = static_cast<uint32_t>(aux_index);
  return Check(sender->cxx->Init(num_kv_pages, aux));
}

void pdlib_send_params_init(pdlib_send_params* params) {
  if (params == nullptr) return;
  std::memset(static_cast<void*>(params), 0, sizeof *params);
  params->struct_size = sizeof *params;
  params->layers_done = -1;
}

pdlib_status pdlib_sender_send(pdlib_sender* sender, const pdlib_send_params* params) {
  if (sender == nullptr) return Null("pdlib_sender_send", "sender");
  if (params == nullptr) return Null("pdlib_sender_send", "params");
  pdlib_send_params p;
  pdlib_send_params_init(&p);
  if (pdlib_status s = ReadVersioned("pdlib_send_params", params, params->struct_size, &p);
      s != PDLIB_OK) {
    return s;
  }
  StateLists state;
  if (pdlib_status s = States("pdlib_sender_send", p, &state); s != PDLIB_OK) return s;
  const std::span<const int32_t> pages(p.pages, p.page_count);
  const bool last = p.is_last_chunk != 0;
  if (p.layers_done >= 0) {
    return Check(sender->cxx->SendLayersStates(pages, p.layers_done, last, state.view()));
  }
  if (state.counts.empty()) return Check(sender->cxx->Send(pages, last, state.indices));
  return Check(sender->cxx->SendStates(pages, last, state.view()));
}

pdlib_status pdlib_sender_decode_prefix(const pdlib_sender* sender, uint64_t* tokens) {
  if (sender == nullptr) return Null("pdlib_sender_decode_prefix", "sender");
  if (tokens == nullptr) return Null("pdlib_sender_decode_prefix", "tokens");
  const std::optional<uint64_t> prefix = sender->cxx->decode_prefix_len();
  if (!prefix) {
    return Fail(StatusCode::kFailedPrecondition,
                "pdlib_sender_decode_prefix: room " + std::to_string(sender->cxx->room()) +
                    ": not known before the sender reaches WaitingForInput");
  }
  *tokens = *prefix;
  return PDLIB_OK;
}

pdlib_status pdlib_sender_pages_after_prefix(const pdlib_sender* sender, uint64_t prompt_len,
                                             uint64_t* pages) {
  if (sender == nullptr) return Null("pdlib_sender_pages_after_prefix", "sender");
  if (pages == nullptr) return Null("pdlib_sender_pages_after_prefix", "pages");
  auto n = sender->cxx->PagesAfterPrefix(prompt_len);
  if (!n.ok()) return Fail(n.status());
  *pages = *n;
  return PDLIB_OK;
}

int32_t pdlib_sender_num_layers(const pdlib_sender* sender) {
  return sender == nullptr ? 0 : sender->cxx->num_layers();
}

void pdlib_sender_abort(pdlib_sender* sender, const char* reason) {
  if (sender != nullptr) sender->cxx->Abort(reason == nullptr ? "aborted" : reason);
}

pdlib_poll pdlib_sender_poll(const pdlib_sender* sender) {
  return sender == nullptr ? PDLIB_POLL_FAILED : static_cast<pdlib_poll>(sender->cxx->Poll());
}

int32_t pdlib_sender_pages_reusable(const pdlib_sender* sender) {
  return sender != nullptr && sender->cxx->PagesReusable() ? 1 : 0;
}

pdlib_status pdlib_sender_failure(const pdlib_sender* sender, char* out, size_t capacity,
                                  size_t* length) {
  if (sender == nullptr) return Null("pdlib_sender_failure", "sender");
  return Failure(sender->cxx.get(), out, capacity, length);
}

pdlib_status pdlib_receiver_create(pdlib_manager* manager, const char* bootstrap_host,
                                   uint16_t bootstrap_port, uint64_t room, int32_t prefill_dp_rank,
                                   pdlib_receiver** out) {
  if (manager == nullptr) return Null("pdlib_receiver_create", "manager");
  if (bootstrap_host == nullptr) return Null("pdlib_receiver_create", "bootstrap_host");
  if (out == nullptr) return Null("pdlib_receiver_create", "out");
  *out = nullptr;
  std::optional<int32_t> dp;
  if (prefill_dp_rank >= 0) dp = prefill_dp_rank;
  auto receiver = manager->cxx->CreateReceiver({bootstrap_host, bootstrap_port}, room, dp);
  if (!receiver.ok()) return Fail(receiver.status());
  *out = new pdlib_receiver{std::move(*receiver)};
  return PDLIB_OK;
}

void pdlib_receiver_destroy(pdlib_receiver* receiver) { delete receiver; }

void pdlib_receive_params_init(pdlib_receive_params* params) {
  if (params == nullptr) return;
  std::memset(static_cast<void*>(params), 0, sizeof *params);
  params->struct_size = sizeof *params;
  params->aux_index = -1;
}

pdlib_status pdlib_receiver_init(pdlib_receiver* receiver, const pdlib_receive_params* params) {
  if (receiver == nullptr) return Null("pdlib_receiver_init", "receiver");
  if (params == nullptr) return Null("pdlib_receiver_init", "params");
  pdlib_receive_params p;
  pdlib_receive_params_init(&p);
  if (pdlib_status s = ReadVersioned("pdlib_receive_params", params, params->struct_size, &p);
      s != PDLIB_OK) {
    return s;
  }
  if (p.aux_index > static_cast<int64_t>(UINT32_MAX)) {
    return Fail(StatusCode::kOutOfRange,
                "pdlib_receiver_init: aux_index " + std::to_string(p.aux_index) + " is too large");
  }
  StateLists state;
  if (pdlib_status s = States("pdlib_receiver_init", p, &state); s != PDLIB_OK) return s;
  pdlib::ReceiveRequest request;
  request.kv_page_indices = std::span<const int32_t>(p.pages, p.page_count);
  if (p.aux_index >= 0) request.aux_index = static_cast<uint32_t>(p.aux_index);
  request.state = state.view();
  request.decode_prefix_len = p.decode_prefix_len;
  request.prompt_len = p.prompt_len;
  return Check(receiver->cxx->Init(request));
}

void pdlib_receiver_abort(pdlib_receiver* receiver, const char* reason) {
  if (receiver != nullptr) receiver->cxx->Abort(reason == nullptr ? "aborted" : reason);
}

pdlib_poll pdlib_receiver_poll(const pdlib_receiver* receiver) {
  return receiver == nullptr ? PDLIB_POLL_FAILED : static_cast<pdlib_poll>(receiver->cxx->Poll());
}

int32_t pdlib_receiver_pages_reusable(const pdlib_receiver* receiver) {
  return receiver != nullptr && receiver->cxx->PagesReusable() ? 1 : 0;
}

pdlib_status pdlib_receiver_failure(const pdlib_receiver* receiver, char* out, size_t capacity,
                                    size_t* length) {
  if (receiver == nullptr) return Null("pdlib_receiver_failure", "receiver");
  return Failure(receiver->cxx.get(), out, capacity, length);
}

pdlib_status pdlib_receiver_invalid_pages(const pdlib_receiver* receiver, int32_t* pages,
                                          size_t capacity, size_t* count) {
  if (receiver == nullptr) return Null("pdlib_receiver_invalid_pages", "receiver");
  if (count == nullptr) return Null("pdlib_receiver_invalid_pages", "count");
  if (capacity > 0 && pages == nullptr) return Null("pdlib_receiver_invalid_pages", "pages");
  const std::vector<int32_t> invalid = receiver->cxx->InvalidPages();
  *count = invalid.size();
  std::copy_n(invalid.begin(), std::min(capacity, invalid.size()), pages);
  return PDLIB_OK;
}

pdlib_status pdlib_bootstrap_server_start(const char* host, uint16_t port,
                                          pdlib_bootstrap_server** out) {
  if (out == nullptr) return Null("pdlib_bootstrap_server_start", "out");
  *out = nullptr;
  pdlib::control::BootstrapServerOptions o;
  o.host = Str(host, o.host);
  o.port = port;
  auto server = pdlib::control::BootstrapServer::Start(o);
  if (!server.ok()) return Fail(server.status());
  *out = new pdlib_bootstrap_server{std::move(*server)};
  return PDLIB_OK;
}

uint16_t pdlib_bootstrap_server_port(const pdlib_bootstrap_server* server) {
  return server == nullptr ? 0 : static_cast<uint16_t>(server->cxx->port());
}

void pdlib_bootstrap_server_stop(pdlib_bootstrap_server* server) { delete server; }

}  // extern "C"
