// Conversions between Python objects and pdlib's C++ types: statuses to exceptions, index
// arrays to spans (without a copy where the memory allows), options dataclasses to
// KVManagerOptions. Every error names the argument or field it is about.
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <limits>

#include "pdlib/page_index.h"
#include "python/src/binding.h"

namespace pdlib_py {
namespace {

Types* g_types = nullptr;

// The largest StateType value (kC128State); pdlib._enums.StateType has the same members.
constexpr int32_t kMaxStateType = static_cast<int32_t>(pdlib::StateType::kC128State);

std::string TypeName(py::handle obj) { return py::str(py::type::handle_of(obj).attr("__name__")); }

}  // namespace

void InitTypes() {
  auto* t = new Types();  // never freed: see Types
  py::module_ enums = py::module_::import("pdlib._enums");
  py::module_ errors = py::module_::import("pdlib._errors");
  t->kv_poll = enums.attr("KVPoll");
  for (int i = 0; i < 5; ++i) t->kv_poll_members[i] = t->kv_poll(i);
  t->mode = enums.attr("Mode");
  t->state_type = enums.attr("StateType");
  t->memory_kind = enums.attr("MemoryKind");
  t->kv_layout = enums.attr("KVLayout");
  t->control_plane = enums.attr("ControlPlane");
  t->status_code = enums.attr("StatusCode");
  t->log_level = enums.attr("LogLevel");
  t->metadata_field = enums.attr("MetadataField");
  py::dict by_code = errors.attr("ERROR_BY_CODE");
  for (int code = 1; code <= 16; ++code) {
    t->error_by_code[code] = by_code[t->status_code(code)];
  }
  t->error_by_code[0] = errors.attr("UnknownError");
  t->closed_error = errors.attr("ClosedError");
  t->buffer_family = py::module_::import("pdlib._options").attr("BufferFamily");
  g_types = t;
}

const Types& types() { return *g_types; }

py::object ErrorFromStatus(const pdlib::Status& s) {
  if (s.ok()) return py::none();
  const int code = static_cast<int>(s.code());
  py::object cls = types().error_by_code[code >= 1 && code <= 16 ? code : 0];
  return cls(s.ToString(), code, std::string(s.message()));
}

void ThrowStatus(const pdlib::Status& s) {
  py::object error = ErrorFromStatus(s);
  PyErr_SetObject(py::type::handle_of(error).ptr(), error.ptr());
  throw py::error_already_set();
}

void ThrowClosed(std::string_view what) {
  const std::string reason = std::string(what) + " is closed";
  py::object error =
      types().closed_error("FAILED_PRECONDITION: " + reason,
                           static_cast<int>(pdlib::StatusCode::kFailedPrecondition), reason);
  PyErr_SetObject(types().closed_error.ptr(), error.ptr());
  throw py::error_already_set();
}

void ThrowType(const std::string& message) { throw py::type_error(message); }

void ThrowOutOfRange(const std::string& message) {
  ThrowStatus(pdlib::Status::OutOfRange(message));
}

int64_t ToInt(py::handle obj, const std::string& what, int64_t lo, int64_t hi) {
  // bool is an int subclass in Python; as an index or a size it is almost surely a mistake.
  if (!PyLong_Check(obj.ptr()) || PyBool_Check(obj.ptr())) {
    // numpy integer scalars are not PyLong but have __index__.
    if (PyBool_Check(obj.ptr()) || !PyIndex_Check(obj.ptr())) {
      ThrowType(what + ": expected int, got " + TypeName(obj));
    }
  }
  int overflow = 0;
  py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(obj.ptr()));
  if (!index) throw py::error_already_set();
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow != 0 || v < lo || v > hi) {
    ThrowOutOfRange(what + ": " + std::string(py::str(index)) + " is out of range [" +
                    std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  return v;
}

uint64_t ToU64(py::handle obj, const std::string& what) {
  if (!PyLong_Check(obj.ptr()) || PyBool_Check(obj.ptr())) {
    if (PyBool_Check(obj.ptr()) || !PyIndex_Check(obj.ptr())) {
      ThrowType(what + ": expected int, got " + TypeName(obj));
    }
  }
  py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(obj.ptr()));
  if (!index) throw py::error_already_set();
  const unsigned long long v = PyLong_AsUnsignedLongLong(index.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    ThrowOutOfRange(what + ": " + std::string(py::str(index)) + " is out of range [0, 2^64)");
  }
  return v;
}

std::optional<uint32_t> ToOptionalSlot(py::handle obj, const char* what) {
  if (obj.is_none()) return std::nullopt;
  return static_cast<uint32_t>(ToInt(obj, what, 0, std::numeric_limits<uint32_t>::max()));
}

Indices ToIndices(py::handle obj, const char* what) {
  Indices out;
  if (obj.is_none()) return out;
  if (py::isinstance<py::array>(obj)) {
    auto array = py::reinterpret_borrow<py::array>(obj);
    const py::dtype dtype = array.dtype();
    if (dtype.kind() != 'i' || dtype.itemsize() != 4) {
      ThrowType(std::string(what) + ": expected an int32 array, got dtype " +
                std::string(py::str(static_cast<py::handle>(dtype))));
    }
    if (array.ndim() != 1) {
      ThrowType(std::string(what) + ": expected a 1-D array, got " + std::to_string(array.ndim()) +
                " dimensions");
    }
    if (array.size() > 1 && array.strides(0) != sizeof(int32_t)) {
      ThrowType(std::string(what) + ": array is not contiguous (use numpy.ascontiguousarray)");
    }
    if (!dtype.attr("isnative").cast<bool>()) {
      ThrowType(std::string(what) + ": array is not in native byte order");
    }
    out.span_ = {static_cast<const int32_t*>(array.data()), static_cast<size_t>(array.size())};
    out.keep_ = std::move(array);
    return out;
  }
  if (PyList_Check(obj.ptr()) || PyTuple_Check(obj.ptr())) {
    auto seq = py::reinterpret_borrow<py::sequence>(obj);
    const size_t n = seq.size();
    out.copy_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      out.copy_[i] = static_cast<int32_t>(
          ToInt(seq[i], std::string(what) + "[" + std::to_string(i) + "]",
                std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()));
    }
    out.span_ = out.copy_;
    return out;
  }
  // A torch tensor: checked through its attributes so that the module does not need torch.
  if (py::hasattr(obj, "data_ptr") && py::hasattr(obj, "is_contiguous") &&
      py::hasattr(obj, "dtype")) {
    const std::string dtype = py::str(obj.attr("dtype"));
    if (dtype != "torch.int32") {
      ThrowType(std::string(what) + ": expected a torch.int32 tensor, got " + dtype);
    }
    if (obj.attr("dim")().cast<int>() != 1) {
      ThrowType(std::string(what) + ": expected a 1-D tensor");
    }
    if (obj.attr("is_cuda").cast<bool>()) {
      ThrowType(std::string(what) + ": indices must be in host memory (call .cpu())");
    }
    if (!obj.attr("is_contiguous")().cast<bool>()) {
      ThrowType(std::string(what) + ": tensor is not contiguous (call .contiguous())");
    }
    const auto n = obj.attr("numel")().cast<size_t>();
    const auto ptr = obj.attr("data_ptr")().cast<uintptr_t>();
    out.span_ = {reinterpret_cast<const int32_t*>(ptr), n};
    out.keep_ = py::reinterpret_borrow<py::object>(obj);
    return out;
  }
  ThrowType(std::string(what) +
            ": expected an int32 numpy array, a torch.int32 tensor or a list "
            "of ints, got " +
            TypeName(obj));
}

namespace {

// True for an item of a per-family state list (an index list or None), false for an index
// (a Python int or a numpy integer scalar).
bool IsIndexList(py::handle item) {
  return item.is_none() || PyList_Check(item.ptr()) || PyTuple_Check(item.ptr()) ||
         py::isinstance<py::array>(item) || py::hasattr(item, "data_ptr");
}

}  // namespace

StateIndicesArg ToStateIndices(py::handle obj, const char* what) {
  StateIndicesArg out;
  const bool sequence = PyList_Check(obj.ptr()) || PyTuple_Check(obj.ptr());
  if (!sequence || py::len(obj) == 0 ||
      !IsIndexList(py::reinterpret_borrow<py::sequence>(obj)[0])) {
    out.flat_ = ToIndices(obj, what);
    out.span_ = out.flat_.span();
    return out;
  }
  auto families = py::reinterpret_borrow<py::sequence>(obj);
  out.counts_.reserve(families.size());
  for (size_t f = 0; f < families.size(); ++f) {
    const std::string name = std::string(what) + "[" + std::to_string(f) + "]";
    py::object item = families[f];
    if (!IsIndexList(item)) {
      ThrowType(name + ": expected the index list of state family " + std::to_string(f) +
                " (a list of lists gives one list per family), got " + TypeName(item));
    }
    Indices family = ToIndices(item, name.c_str());
    const std::span<const int32_t> span = family.span();
    if (span.size() > std::numeric_limits<uint32_t>::max()) {
      ThrowOutOfRange(name + ": " + std::to_string(span.size()) + " indices");
    }
    out.concat_.insert(out.concat_.end(), span.begin(), span.end());
    out.counts_.push_back(static_cast<uint32_t>(span.size()));
  }
  out.span_ = out.concat_;
  return out;
}

namespace {

// Reads options field by field so that a wrong type is reported with its path.
class Reader {
 public:
  Reader(py::handle obj, std::string path) : obj_(obj), path_(std::move(path)) {}

  py::object Get(const char* name) const {
    if (!py::hasattr(obj_, name)) ThrowType(path_ + ": has no field '" + name + "'");
    return obj_.attr(name);
  }
  std::string Path(const char* name) const { return path_ + "." + name; }

  int32_t I32(const char* name) const {
    return static_cast<int32_t>(ToInt(Get(name), Path(name), INT32_MIN, INT32_MAX));
  }
  uint32_t U32(const char* name) const {
    return static_cast<uint32_t>(ToInt(Get(name), Path(name), 0, UINT32_MAX));
  }
  uint16_t Port(const char* name) const {
    return static_cast<uint16_t>(ToInt(Get(name), Path(name), 0, 65535));
  }
  bool Bool(const char* name) const {
    py::object v = Get(name);
    if (!PyBool_Check(v.ptr())) ThrowType(Path(name) + ": expected bool, got " + TypeName(v));
    return v.cast<bool>();
  }
  std::string Str(const char* name) const {
    py::object v = Get(name);
    if (!PyUnicode_Check(v.ptr())) ThrowType(Path(name) + ": expected str, got " + TypeName(v));
    return v.cast<std::string>();
  }
  double Float(const char* name) const {
    py::object v = Get(name);
    if (PyBool_Check(v.ptr()) || !(PyFloat_Check(v.ptr()) || PyLong_Check(v.ptr()))) {
      ThrowType(Path(name) + ": expected a number, got " + TypeName(v));
    }
    return v.cast<double>();
  }
  std::chrono::milliseconds Seconds(const char* name) const {
    const double s = Float(name);
    if (!std::isfinite(s) || s < 0 || s > 1e9) {
      ThrowOutOfRange(Path(name) + ": " + std::to_string(s) + " s is not a duration");
    }
    return std::chrono::milliseconds(static_cast<int64_t>(std::llround(s * 1000.0)));
  }
  template <typename E>
  E Enum(const char* name, int32_t lo, int32_t hi) const {
    return static_cast<E>(ToInt(Get(name), Path(name), lo, hi));
  }
  std::vector<uint64_t> U64List(const char* name) const {
    py::object v = Get(name);
    std::vector<uint64_t> out;
    if (!py::isinstance<py::sequence>(v) || PyUnicode_Check(v.ptr())) {
      ThrowType(Path(name) + ": expected a list of ints, got " + TypeName(v));
    }
    auto seq = py::reinterpret_borrow<py::sequence>(v);
    out.reserve(seq.size());
    for (size_t i = 0; i < seq.size(); ++i) {
      out.push_back(ToU64(seq[i], Path(name) + "[" + std::to_string(i) + "]"));
    }
    return out;
  }
  std::vector<int32_t> I32List(const char* name) const {
    py::object v = Get(name);
    if (!py::isinstance<py::sequence>(v) || PyUnicode_Check(v.ptr())) {
      ThrowType(Path(name) + ": expected a list of ints, got " + TypeName(v));
    }
    auto seq = py::reinterpret_borrow<py::sequence>(v);
    std::vector<int32_t> out;
    for (size_t i = 0; i < seq.size(); ++i) {
      out.push_back(static_cast<int32_t>(
          ToInt(seq[i], Path(name) + "[" + std::to_string(i) + "]", INT32_MIN, INT32_MAX)));
    }
    return out;
  }
  std::vector<std::string> StrList(const char* name) const {
    py::object v = Get(name);
    if (!py::isinstance<py::sequence>(v) || PyUnicode_Check(v.ptr())) {
      ThrowType(Path(name) + ": expected a list of str, got " + TypeName(v));
    }
    std::vector<std::string> out;
    for (py::handle item : v) {
      if (!PyUnicode_Check(item.ptr())) ThrowType(Path(name) + ": expected str items");
      out.push_back(item.cast<std::string>());
    }
    return out;
  }
  Reader Sub(const char* name) const { return Reader(Get(name), Path(name)); }

 private:
  py::handle obj_;
  std::string path_;
};

}  // namespace

pdlib::BufferFamily ToBufferFamily(py::handle family, const std::string& what) {
  Reader r(family, what);
  pdlib::BufferFamily f;
  f.ptrs = r.U64List("ptrs");
  f.lens = r.U64List("lens");
  f.item_lens = r.U64List("item_lens");
  // pdlib validates the shapes too; a length mismatch here is a Python-side bookkeeping error
  // that deserves a message naming the Python field.
  if (f.lens.size() != f.ptrs.size() || f.item_lens.size() != f.ptrs.size()) {
    ThrowStatus(pdlib::Status::InvalidArgument(
        what + ": ptrs, lens and item_lens have different lengths (" +
        std::to_string(f.ptrs.size()) + ", " + std::to_string(f.lens.size()) + ", " +
        std::to_string(f.item_lens.size()) + ")"));
  }
  return f;
}

pdlib::KVManagerOptions ToOptions(py::handle options) {
  Reader o(options, "options");
  pdlib::KVManagerOptions out;
  out.mode = o.Enum<pdlib::Mode>("mode", 0, 1);
  {
    Reader a = o.Sub("args");
    pdlib::KVArgs& args = out.args;
    args.kv = ToBufferFamily(a.Get("kv"), a.Path("kv"));
    args.aux = ToBufferFamily(a.Get("aux"), a.Path("aux"));
    args.aux_room_buffer = a.I32("aux_room_buffer");
    args.state = ToBufferFamily(a.Get("state"), a.Path("state"));
    args.state_type = a.Enum<pdlib::StateType>("state_type", 0, kMaxStateType);
    args.state_dim_per_tensor = a.I32List("state_dim_per_tensor");
    args.state_item_rows = a.U64List("state_item_rows");
    args.state_split_units = a.U64List("state_split_units");
    args.state_start = a.I32("state_start");
    {
      // Several families (pdlib.StateFamily); with the shorthand above too, Create() refuses.
      py::object families = a.Get("state_families");
      if (!py::isinstance<py::sequence>(families) || PyUnicode_Check(families.ptr())) {
        ThrowType(a.Path("state_families") + ": expected a list of StateFamily, got " +
                  TypeName(families));
      }
      auto seq = py::reinterpret_borrow<py::sequence>(families);
      args.state_families.reserve(seq.size());
      for (size_t i = 0; i < seq.size(); ++i) {
        const std::string path = a.Path("state_families") + "[" + std::to_string(i) + "]";
        py::object item = seq[i];
        Reader r(item, path);
        pdlib::StateFamily& fam = args.state_families.emplace_back();
        fam.type = r.Enum<pdlib::StateType>("type", 0, kMaxStateType);
        fam.buffers = ToBufferFamily(r.Get("buffers"), r.Path("buffers"));
        fam.dim_per_tensor = r.I32List("dim_per_tensor");
        fam.item_rows = r.U64List("item_rows");
        fam.split_units = r.U64List("split_units");
        fam.start = r.I32("start");
      }
    }
    args.page_size = a.U32("page_size");
    args.kv_head_num = a.I32("kv_head_num");
    args.kv_layout = a.Enum<pdlib::KVLayout>("kv_layout", 0, 1);
    args.is_mla = a.Bool("is_mla");
    Reader p = a.Sub("parallel");
    args.parallel.tp_size = p.I32("tp_size");
    args.parallel.tp_rank = p.I32("tp_rank");
    args.parallel.dp_size = p.I32("dp_size");
    args.parallel.dp_rank = p.I32("dp_rank");
    args.parallel.pp_size = p.I32("pp_size");
    args.parallel.pp_rank = p.I32("pp_rank");
    args.prefill_start_layer = a.I32("prefill_start_layer");
    args.device_id = a.I32("device_id");
    // memory_kind None means "inferred from the buffers" (KVArgs.resolved_memory_kind()).
    py::object resolved = options.attr("args").attr("resolved_memory_kind")();
    args.memory_kind = static_cast<pdlib::MemoryKind>(ToInt(resolved, a.Path("memory_kind"), 0, 1));
    args.nic_names = a.StrList("nic_names");
    Reader f = a.Sub("fingerprint");
    args.fingerprint.num_layers = f.I32("num_layers");
    args.fingerprint.num_kv_heads = f.I32("num_kv_heads");
    args.fingerprint.head_dim = f.I32("head_dim");
    args.fingerprint.dtype_bytes = f.I32("dtype_bytes");
    args.fingerprint.layout_version = f.I32("layout_version");
    args.fingerprint.model_name = f.Str("model_name");
    args.fingerprint.kv_dtype = f.Str("kv_dtype");
    args.fingerprint.state_dtype = f.Str("state_dtype");
    args.fingerprint.page_layout = f.Str("page_layout");
    args.fingerprint.engine_tag = f.Str("engine_tag");
  }
  out.control_plane = o.Enum<pdlib::ControlPlane>("control_plane", 0, 1);
  out.backend = o.Str("backend");
  {
    py::object opts = o.Get("backend_options");
    if (!py::isinstance<py::dict>(opts)) ThrowType("options.backend_options: expected a dict");
    for (auto [k, v] : py::reinterpret_borrow<py::dict>(opts)) {
      if (!PyUnicode_Check(k.ptr())) ThrowType("options.backend_options: keys must be str");
      out.backend_options[k.cast<std::string>()] = py::str(v).cast<std::string>();
    }
  }
  out.listen_host = o.Str("listen_host");
  out.listen_port = o.Port("listen_port");
  out.bootstrap_host = o.Str("bootstrap_host");
  out.bootstrap_port = o.Port("bootstrap_port");
  out.start_bootstrap_server = o.Bool("start_bootstrap_server");
  out.liveness_timeout = o.Seconds("liveness_timeout");
  out.connect_timeout = o.Seconds("connect_timeout");
  out.bootstrap_timeout = o.Seconds("bootstrap_timeout");
  out.waiting_timeout = o.Seconds("waiting_timeout");
  out.transfer_timeout = o.Seconds("transfer_timeout");
  out.quarantine_warn_after = o.Seconds("quarantine_warn_after");
  out.auth_secret = o.Str("auth_secret");
  out.tls_cert_file = o.Str("tls_cert_file");
  out.tls_key_file = o.Str("tls_key_file");
  out.tls_ca_file = o.Str("tls_ca_file");
  out.transfer_workers = o.I32("transfer_workers");
  out.room_log_every = o.U32("room_log_every");  // 0: auto
  out.failure_injection_prob = o.Float("failure_injection_prob");
  out.failure_injection_stages = o.Str("failure_injection_stages");
  out.discovery = o.Enum<pdlib::Discovery>("discovery", 0, 1);
  out.etcd_endpoints = o.StrList("etcd_endpoints");
  out.etcd_prefix = o.Str("etcd_prefix");
  out.etcd_username = o.Str("etcd_username");
  out.etcd_password = o.Str("etcd_password");
  out.etcd_tls_ca_file = o.Str("etcd_tls_ca_file");
  out.etcd_tls_cert_file = o.Str("etcd_tls_cert_file");
  out.etcd_tls_key_file = o.Str("etcd_tls_key_file");
  out.direction = o.Enum<pdlib::TransferDirection>("direction", 0, 1);
  out.pull_lease = o.Seconds("pull_lease");
  out.checksum = o.Enum<pdlib::KvChecksum>("checksum", 0, 2);
  out.checksum_sample_every = o.U32("checksum_sample_every");
  return out;
}

void BindConvert(py::module_& m) {
  m.def(
      "token_indices_to_page_indices",
      [](py::handle token_indices, uint32_t page_size) {
        Indices tokens = ToIndices(token_indices, "token_indices");
        auto pages = pdlib::TokenIndicesToPageIndices(tokens.span(), page_size);
        if (!pages.ok()) ThrowStatus(pages.status());
        return py::array_t<int32_t>(static_cast<py::ssize_t>(pages->size()), pages->data());
      },
      py::arg("token_indices"), py::arg("page_size"),
      "The page index of every page a request's token slots touch (SPEC R5.1).");
  m.def(
      "page_count",
      [](uint64_t num_tokens, uint32_t page_size) {
        return pdlib::PageCount(num_tokens, page_size);
      },
      py::arg("num_tokens"), py::arg("page_size"));
}

}  // namespace pdlib_py
