// The rest of the public API for Python: metadata buffers (fields as numpy views), the slot
// allocator, KV pools, the standalone bootstrap server, logging and the backend list.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <cstdio>
#include <memory>

#include "lib/control/bootstrap_server.h"
#include "pdlib/backends.h"
#include "pdlib/kv_pool.h"
#include "pdlib/log.h"
#include "pdlib/metadata_buffers.h"
#include "python/src/binding.h"

namespace pdlib_py {
namespace {

using pdlib::MetadataField;

// A [num_slots, elements] view of one metadata field: rows are row_bytes apart (a multiple of
// 64), so the view is strided along the first axis and contiguous within a row.
py::array FieldView(py::object self, MetadataField field, const py::dtype& dtype, size_t elements) {
  auto& mb = self.cast<pdlib::MetadataBuffers&>();
  auto row = mb.Row(field, 0);
  const auto rows = static_cast<py::ssize_t>(mb.num_slots());
  const auto stride = static_cast<py::ssize_t>(mb.row_bytes(field));
  return py::array(dtype, {rows, static_cast<py::ssize_t>(elements)},
                   {stride, static_cast<py::ssize_t>(dtype.itemsize())}, row.data(), self);
}

MetadataField ToField(py::handle field) {
  return static_cast<MetadataField>(ToInt(field, "field", 0, pdlib::kMetadataFieldCount - 1));
}

// Holds a Python callable for pdlib's log sink. Its last reference may be dropped on a pdlib
// thread, so the deleter takes the GIL (unless Python is already gone).
struct PySink {
  explicit PySink(py::object f) : fn(std::move(f)) {}
  ~PySink() {
    if (!Py_IsInitialized()) {
      fn.release();  // leak rather than touch a finalised interpreter
      return;
    }
    py::gil_scoped_acquire acquire;
    fn = py::object();
  }
  py::object fn;
};

void SetLogSink(py::object sink) {
  if (sink.is_none()) {
    py::gil_scoped_release release;
    pdlib::SetLogSink(nullptr);
    return;
  }
  if (!PyCallable_Check(sink.ptr())) ThrowType("sink: expected a callable or None");
  auto holder = std::make_shared<PySink>(std::move(sink));
  pdlib::LogSink fn = [holder](pdlib::LogLevel level, std::string_view file, int line,
                               std::string_view message) {
    if (!Py_IsInitialized()) return;
    py::gil_scoped_acquire acquire;
    try {
      holder->fn(types().log_level(static_cast<int>(level)), py::str(file.data(), file.size()),
                 line, py::str(message.data(), message.size()));
    } catch (py::error_already_set& e) {
      // A sink must not throw into pdlib's threads: report it where Python reports such errors.
      e.discard_as_unraisable("pdlib log sink");
    }
  };
  py::gil_scoped_release release;
  pdlib::SetLogSink(std::move(fn));
}

class PyBootstrapServer {
 public:
  PyBootstrapServer(const std::string& host, int port, const std::string& auth_secret,
                    const std::string& tls_cert_file, const std::string& tls_key_file,
                    const std::string& tls_ca_file) {
    pdlib::control::BootstrapServerOptions o;
    o.host = host;
    o.port = static_cast<int32_t>(ToInt(py::int_(port), "port", 0, 65535));
    o.security.shared_secret = auth_secret;
    o.security.tls_cert_file = tls_cert_file;
    o.security.tls_key_file = tls_key_file;
    o.security.tls_ca_file = tls_ca_file;
    ThrowIfError(pdlib::control::ValidateSecurity(o.security));
    pdlib::StatusOr<std::unique_ptr<pdlib::control::BootstrapServer>> server =
        pdlib::Status::Internal("unset");
    {
      py::gil_scoped_release release;
      server = pdlib::control::BootstrapServer::Start(o);
    }
    if (!server.ok()) ThrowStatus(server.status());
    server_ = std::move(*server);
  }
  ~PyBootstrapServer() { Shutdown(); }

  void Shutdown() {
    std::unique_ptr<pdlib::control::BootstrapServer> server = std::move(server_);
    if (!server) return;
    py::gil_scoped_release release;
    server->Shutdown();
    server.reset();
  }
  pdlib::control::BootstrapServer& get() const {
    if (!server_) ThrowClosed("BootstrapServer");
    return *server_;
  }
  bool closed() const { return server_ == nullptr; }

 private:
  std::unique_ptr<pdlib::control::BootstrapServer> server_;
};

}  // namespace

void BindExtras(py::module_& m) {
  py::class_<pdlib::MetadataBuffers> mb(
      m, "MetadataBuffers",
      "Per-request aux slots carrying prefill's first output token to decode (SPEC R4.1). "
      "Each field is a [num_slots, elements] numpy view of the registered memory.");
  mb.def(py::init([](size_t num_slots, size_t hidden_size, size_t hidden_dtype_bytes) {
           auto created =
               pdlib::MetadataBuffers::Create(num_slots, hidden_size, hidden_dtype_bytes);
           if (!created.ok()) ThrowStatus(created.status());
           return std::move(*created);
         }),
         py::arg("num_slots"), py::arg("hidden_size") = 0, py::arg("hidden_dtype_bytes") = 0)
      .def_static("slot_count_for", &pdlib::MetadataBuffers::SlotCountFor,
                  py::arg("max_running_requests"))
      .def_property_readonly("num_slots", &pdlib::MetadataBuffers::num_slots)
      .def(
          "row_bytes",
          [](const pdlib::MetadataBuffers& b, py::handle f) { return b.row_bytes(ToField(f)); },
          py::arg("field"))
      .def(
          "elements",
          [](const pdlib::MetadataBuffers& b, py::handle f) { return b.elements(ToField(f)); },
          py::arg("field"))
      .def(
          "describe",
          [](py::object self) {
            pdlib::BufferFamily f = self.cast<pdlib::MetadataBuffers&>().Describe();
            py::list owners;
            owners.append(self);  // the registered memory lives as long as the family refers to it
            return types().buffer_family(f.ptrs, f.lens, f.item_lens, owners);
          },
          "The aux BufferFamily for KVArgs.aux (one buffer per field); keeps this object alive.");
  struct FieldSpec {
    const char* name;
    MetadataField field;
    const char* dtype;
  };
  static constexpr FieldSpec kFields[] = {
      {"output_ids", MetadataField::kOutputIds, "int32"},
      {"cached_tokens", MetadataField::kCachedTokens, "int32"},
      {"output_token_logprobs_val", MetadataField::kOutputTokenLogprobsVal, "float32"},
      {"output_token_logprobs_idx", MetadataField::kOutputTokenLogprobsIdx, "int32"},
      {"output_top_logprobs_val", MetadataField::kOutputTopLogprobsVal, "float32"},
      {"output_top_logprobs_idx", MetadataField::kOutputTopLogprobsIdx, "int32"},
      {"output_topk_p", MetadataField::kOutputTopkP, "float32"},
      {"output_topk_index", MetadataField::kOutputTopkIndex, "int64"},
      {"bootstrap_room", MetadataField::kBootstrapRoom, "uint64"},
  };
  for (const FieldSpec& spec : kFields) {
    mb.def_property_readonly(spec.name, [spec](py::object self) {
      auto& b = self.cast<pdlib::MetadataBuffers&>();
      return FieldView(self, spec.field, py::dtype(spec.dtype), b.elements(spec.field));
    });
  }
  mb.def_property_readonly("output_hidden_states", [](py::object self) {
    auto& b = self.cast<pdlib::MetadataBuffers&>();
    // hidden_size * dtype bytes per row; the engine views it with its own dtype.
    const size_t bytes = b.num_slots() > 0 ? b.output_hidden_states(0).size() : 0;
    return FieldView(self, MetadataField::kOutputHiddenStates, py::dtype("uint8"), bytes);
  });

  py::class_<pdlib::MetadataSlotAllocator>(m, "MetadataSlotAllocator",
                                           "Hands out metadata slot indices; thread-safe.")
      .def(py::init<size_t>(), py::arg("capacity"))
      .def("alloc", &pdlib::MetadataSlotAllocator::Alloc, "A free slot, or None when all are used.")
      .def(
          "free",
          [](pdlib::MetadataSlotAllocator& a, py::handle slot) {
            ThrowIfError(a.Free(static_cast<uint32_t>(ToInt(slot, "slot", 0, UINT32_MAX))));
          },
          py::arg("slot"))
      .def_property_readonly("capacity", &pdlib::MetadataSlotAllocator::capacity)
      .def_property_readonly("available", &pdlib::MetadataSlotAllocator::available);

  py::class_<pdlib::KVPool>(m, "KVPool", "Memory allocated the way a backend moves it fastest.")
      .def_property_readonly(
          "data_ptr", [](const pdlib::KVPool& p) { return reinterpret_cast<uintptr_t>(p.data()); })
      .def_property_readonly("size", &pdlib::KVPool::size)
      .def_property_readonly(
          "kind",
          [](const pdlib::KVPool& p) { return types().memory_kind(static_cast<int>(p.kind())); })
      .def_property_readonly("allocator",
                             [](const pdlib::KVPool& p) { return std::string(p.allocator()); })
      .def(
          "view",
          [](py::object self) {
            auto& p = self.cast<pdlib::KVPool&>();
            if (p.kind() != pdlib::MemoryKind::kHost) {
              ThrowStatus(pdlib::Status::FailedPrecondition(
                  "view(): the pool is CUDA memory; wrap data_ptr with your CUDA library"));
            }
            return py::array(py::dtype("uint8"), {static_cast<py::ssize_t>(p.size())}, {1},
                             p.data(), self);
          },
          "A writable uint8 numpy view of the whole (host) pool; keeps the pool alive.");
  m.def(
      "allocate_kv_pool",
      [](const std::string& backend, py::handle nbytes, py::handle kind,
         std::map<std::string, std::string> backend_options, py::handle mode) {
        const uint64_t bytes = ToU64(nbytes, "nbytes");
        const auto k = static_cast<pdlib::MemoryKind>(ToInt(kind, "kind", 0, 1));
        const auto m = mode.is_none() ? pdlib::Mode::kPrefill
                                      : static_cast<pdlib::Mode>(ToInt(mode, "mode", 0, 1));
        pdlib::StatusOr<std::unique_ptr<pdlib::KVPool>> pool = pdlib::Status::Internal("unset");
        {
          py::gil_scoped_release release;
          pool = pdlib::AllocateKVPool(backend, bytes, k, backend_options, m);
        }
        if (!pool.ok()) ThrowStatus(pool.status());
        return std::move(*pool);
      },
      py::arg("backend"), py::arg("nbytes"), py::arg("kind") = 0,
      py::arg("backend_options") = std::map<std::string, std::string>{},
      py::arg("mode") = py::none());

  py::class_<PyBootstrapServer>(m, "BootstrapServer",
                                "A bootstrap server for one prefill deployment, in this process.")
      .def(py::init<const std::string&, int, const std::string&, const std::string&,
                    const std::string&, const std::string&>(),
           py::arg("host") = "0.0.0.0", py::arg("port") = 8998, py::arg("auth_secret") = "",
           py::arg("tls_cert_file") = "", py::arg("tls_key_file") = "", py::arg("tls_ca_file") = "")
      .def_property_readonly("host", [](const PyBootstrapServer& s) { return s.get().host(); })
      .def_property_readonly("port", [](const PyBootstrapServer& s) { return s.get().port(); })
      .def_property_readonly("address",
                             [](const PyBootstrapServer& s) { return s.get().address(); })
      .def_property_readonly("ranks_registered",
                             [](const PyBootstrapServer& s) { return s.get().ranks_registered(); })
      .def_property_readonly("closed", &PyBootstrapServer::closed)
      .def("shutdown", &PyBootstrapServer::Shutdown)
      .def("close", &PyBootstrapServer::Shutdown)
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyBootstrapServer& s, py::args) { s.Shutdown(); });

  m.def("set_log_sink", &SetLogSink, py::arg("sink"),
        "Routes pdlib's log lines to sink(level, file, line, message), called with the GIL from "
        "pdlib's threads; None restores the stderr sink.");
  m.def(
      "set_log_level",
      [](py::handle level) {
        pdlib::SetLogLevel(static_cast<pdlib::LogLevel>(ToInt(level, "level", 0, 4)));
      },
      py::arg("level"));
  m.def("get_log_level", [] { return types().log_level(static_cast<int>(pdlib::GetLogLevel())); });
  m.def("list_backends", [] {
    py::gil_scoped_release release;
    return pdlib::ListBackends();
  });
  m.def("builtin_backends", [] { return pdlib::BuiltinBackends(); });
  m.def(
      "element_type_names", [] { return pdlib::ElementTypeNames(); },
      "The names ModelFingerprint.kv_dtype and state_dtype accept.");
  m.def(
      "element_type_bytes", [](const std::string& name) { return pdlib::ElementTypeBytes(name); },
      py::arg("name"), "Bytes per element of a named type; 0 for a name pdlib does not know.");
}

}  // namespace pdlib_py
