// Shared pieces of the _pdlib extension module: how a pdlib::Status becomes a Python exception,
// how Python objects become page-index spans and KVManagerOptions, and the per-file Bind*
// functions that module.cc calls.
//
// Threads: everything here runs with the GIL held unless a function says otherwise.
#ifndef PDLIB_PYTHON_SRC_BINDING_H_
#define PDLIB_PYTHON_SRC_BINDING_H_

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pdlib/kv_args.h"
#include "pdlib/kv_manager.h"
#include "pdlib/status.h"
#include "pdlib/types.h"

namespace pdlib_py {

namespace py = pybind11;

// Python objects looked up once at import (pdlib._enums, pdlib._errors): building them per call
// would cost more than the pdlib call itself. Filled by InitTypes(), never freed (the module is
// never unloaded).
struct Types {
  py::object kv_poll_members[5];  // KVPoll.Failed .. KVPoll.Success, by value
  py::object kv_poll, mode, state_type, memory_kind, kv_layout, control_plane, status_code,
      log_level, metadata_field;
  py::object error_by_code[17];  // pdlib.Error subclass per StatusCode (0 unused)
  py::object closed_error;
  py::object buffer_family;  // pdlib.BufferFamily (pdlib._options)
};
void InitTypes();
const Types& types();

// The KVPoll member for `state` (a cached object: no allocation).
inline py::object PollObject(pdlib::KVPoll state) {
  return types().kv_poll_members[static_cast<int>(state)];
}
// An instance of the Error subclass for s.code(): str() is s.ToString(), .code the StatusCode,
// .reason the message. None when s is OK.
py::object ErrorFromStatus(const pdlib::Status& s);
// Raises ErrorFromStatus(s) (as a C++ exception pybind11 turns into the Python one).
[[noreturn]] void ThrowStatus(const pdlib::Status& s);
inline void ThrowIfError(const pdlib::Status& s) {
  if (!s.ok()) ThrowStatus(s);
}
// Raises pdlib.ClosedError (a FailedPreconditionError) saying `what` cannot be used any more.
[[noreturn]] void ThrowClosed(std::string_view what);
// Raises TypeError / pdlib.OutOfRangeError with `message`.
[[noreturn]] void ThrowType(const std::string& message);
[[noreturn]] void ThrowOutOfRange(const std::string& message);

// A read-only view of int32 indices taken from a Python object without copying when it is a
// C-contiguous int32 numpy array or CPU torch tensor; a list or tuple of ints is copied. Holds a
// reference to the source so the span stays valid while the GIL is released.
class Indices {
 public:
  std::span<const int32_t> span() const { return span_; }

 private:
  friend Indices ToIndices(py::handle obj, const char* what);
  std::span<const int32_t> span_;
  py::object keep_;
  std::vector<int32_t> copy_;
};
// None gives an empty span. Errors name `what`: TypeError for a wrong dtype, a non-contiguous
// or multi-dimensional array or a non-int element; pdlib.OutOfRangeError for a Python int that
// does not fit int32.
Indices ToIndices(py::handle obj, const char* what);

// One request's state indices for every state family (pdlib::StateIndices), from None (no
// state), one flat index list as ToIndices takes it (one family: no counts, no copy for an
// array), or a list/tuple whose items are index lists, one per family in
// KVArgs::state_families order (None or [] for a family that takes no part): concatenated into
// one copy, with the per-family counts. Holds what the spans point into, like Indices.
class StateIndicesArg {
 public:
  pdlib::StateIndices get() const { return {span_, counts_}; }

 private:
  friend StateIndicesArg ToStateIndices(py::handle obj, const char* what);
  Indices flat_;
  std::vector<int32_t> concat_;
  std::vector<uint32_t> counts_;
  std::span<const int32_t> span_;
};
// Errors name `what` ("state_indices[1][3]: ..."), as ToIndices does.
StateIndicesArg ToStateIndices(py::handle obj, const char* what);

// An optional uint32 slot index (None: nullopt); pdlib.OutOfRangeError outside [0, 2^32).
std::optional<uint32_t> ToOptionalSlot(py::handle obj, const char* what);
// A Python int in [lo, hi]; pdlib.OutOfRangeError / TypeError naming `what` otherwise.
int64_t ToInt(py::handle obj, const std::string& what, int64_t lo, int64_t hi);
uint64_t ToU64(py::handle obj, const std::string& what);

// Reads a pdlib.KVManagerOptions (or any object with its attributes) field by field. Errors name
// the field, e.g. "options.args.kv.ptrs[3]: expected int, got str".
pdlib::KVManagerOptions ToOptions(py::handle options);
pdlib::BufferFamily ToBufferFamily(py::handle family, const std::string& what);

void BindManager(py::module_& m);  // manager.cc
void BindExtras(py::module_& m);   // extras.cc: metadata, pools, bootstrap server, logging
void BindConvert(py::module_& m);  // convert.cc: page-index helpers

}  // namespace pdlib_py

#endif  // PDLIB_PYTHON_SRC_BINDING_H_
