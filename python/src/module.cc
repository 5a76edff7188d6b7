// _pdlib: the compiled half of the pdlib Python package (python/pdlib/__init__.py re-exports
// it). One module, built from the files of this folder; see binding.h for what each adds.
#include "python/src/binding.h"

PYBIND11_MODULE(_pdlib, m) {
  m.doc() = "pdlib's C++ API for Python (use the pdlib package, not this module)";
  pdlib_py::InitTypes();
  pdlib_py::BindManager(m);
  pdlib_py::BindExtras(m);
  pdlib_py::BindConvert(m);
}
