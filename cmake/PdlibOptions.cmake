# Build options and dependency detection.
#
# PDLIB_WITH_UCX / PDLIB_WITH_VERBS / PDLIB_WITH_CUDA take AUTO (default: on when the dependency
# is found), ON (fail the configure when it is missing) or OFF.

set(PDLIB_WITH_UCX AUTO CACHE STRING "Build the UCX backend (AUTO|ON|OFF)")
set(PDLIB_WITH_VERBS AUTO CACHE STRING "Build the raw ibverbs backend (AUTO|ON|OFF)")
set(PDLIB_WITH_CUDA AUTO CACHE STRING "Build the CUDA model kernels and CUDA memory support (AUTO|ON|OFF)")
set_property(CACHE PDLIB_WITH_UCX PROPERTY STRINGS AUTO ON OFF)
set_property(CACHE PDLIB_WITH_VERBS PROPERTY STRINGS AUTO ON OFF)
set_property(CACHE PDLIB_WITH_CUDA PROPERTY STRINGS AUTO ON OFF)
set(PDLIB_WITH_PYTHON AUTO CACHE STRING
    "Build the Python package (pybind11; AUTO: with Python 3 and pybind11, without sanitizers)")
set_property(CACHE PDLIB_WITH_PYTHON PROPERTY STRINGS AUTO ON OFF)
option(PDLIB_BUILD_TESTS "Build the Catch2 tests" ON)
option(PDLIB_BUILD_BENCH "Build the benchmarks" ON)
option(PDLIB_BUILD_EXAMPLES "Build the examples" ON)
option(PDLIB_WERROR "Treat compiler warnings as errors (CI turns this on)" OFF)
set(PDLIB_SANITIZE "" CACHE STRING "Sanitizers to build with: '', 'address;undefined' or 'thread'")

find_program(CCACHE_PROGRAM ccache)
if(CCACHE_PROGRAM AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(CMAKE_C_COMPILER_LAUNCHER "${CCACHE_PROGRAM}")
  set(CMAKE_CXX_COMPILER_LAUNCHER "${CCACHE_PROGRAM}")
  set(CMAKE_CUDA_COMPILER_LAUNCHER "${CCACHE_PROGRAM}")
endif()

find_package(Threads REQUIRED)
find_package(absl CONFIG REQUIRED)
# The control plane: protobuf messages and gRPC services (lib/proto).
find_package(Protobuf REQUIRED)
find_package(gRPC CONFIG REQUIRED)
find_program(GRPC_CPP_PLUGIN grpc_cpp_plugin REQUIRED)
if(PDLIB_BUILD_TESTS)
  find_package(Catch2 2 REQUIRED)
  include(Catch)
endif()
if(PDLIB_BUILD_BENCH)
  find_package(benchmark REQUIRED)
endif()

# Resolves an AUTO|ON|OFF option against whether its dependency was found. Sets
# PDLIB_HAVE_<name> to ON or OFF.
function(pdlib_resolve_option option found what)
  string(TOUPPER "${${option}}" value)
  if(value STREQUAL "OFF" OR value STREQUAL "FALSE" OR value STREQUAL "0")
    set(result OFF)
  elseif(found)
    set(result ON)
  elseif(value STREQUAL "ON" OR value STREQUAL "TRUE" OR value STREQUAL "1")
    message(FATAL_ERROR "${option}=ON but ${what} was not found; run scripts/install-deps.sh")
  else()
    set(result OFF)
  endif()
  string(REPLACE "PDLIB_WITH_" "PDLIB_HAVE_" have "${option}")
  set(${have} ${result} PARENT_SCOPE)
endfunction()

find_package(ucx CONFIG QUIET)
pdlib_resolve_option(PDLIB_WITH_UCX "${ucx_FOUND}" "UCX (libucx-dev)")

find_path(IBVERBS_INCLUDE_DIR infiniband/verbs.h)
find_library(IBVERBS_LIBRARY ibverbs)
if(IBVERBS_INCLUDE_DIR AND IBVERBS_LIBRARY)
  set(ibverbs_found TRUE)
else()
  set(ibverbs_found FALSE)
endif()
pdlib_resolve_option(PDLIB_WITH_VERBS "${ibverbs_found}" "libibverbs (libibverbs-dev)")

# The Python package (python/). Debian's interpreter unless Python3_EXECUTABLE says otherwise:
# its numpy and torch (python3-numpy, python3-torch) are the ones the tests import, and a pyenv
# or other interpreter first on PATH has none of them. Sanitizer builds leave it out: the
# interpreter is not instrumented (ASan needs to be loaded first, TSan sees its threads blind).
set(python_found FALSE)
if(NOT PDLIB_WITH_PYTHON STREQUAL "OFF" AND NOT PDLIB_SANITIZE)
  if(NOT Python3_EXECUTABLE AND EXISTS /usr/bin/python3)
    set(Python3_EXECUTABLE /usr/bin/python3)
  endif()
  find_package(Python3 COMPONENTS Interpreter Development.Module QUIET)
  if(Python3_FOUND)
    find_package(pybind11 CONFIG QUIET)
    set(python_found ${pybind11_FOUND})
  endif()
endif()
pdlib_resolve_option(PDLIB_WITH_PYTHON "${python_found}"
                     "Python 3 and pybind11 (python3-dev, pybind11-dev; not with sanitizers)")

set(cuda_found FALSE)
if(NOT PDLIB_WITH_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(cuda_found TRUE)
  endif()
endif()
pdlib_resolve_option(PDLIB_WITH_CUDA "${cuda_found}" "a CUDA compiler (nvcc)")
if(PDLIB_HAVE_CUDA)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 80 90)
  endif()
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
endif()

# Warnings everywhere; errors when asked (CI).
set(PDLIB_WARNING_FLAGS -Wall -Wextra -Wno-unused-parameter)
if(PDLIB_WERROR)
  list(APPEND PDLIB_WARNING_FLAGS -Werror)
endif()

if(PDLIB_SANITIZE)
  string(REPLACE ";" "," san "${PDLIB_SANITIZE}")
  # C and C++ only: nvcc does not take these flags.
  add_compile_options(
    "$<$<COMPILE_LANGUAGE:C,CXX>:-fsanitize=${san};-fno-omit-frame-pointer;-fno-sanitize-recover=all>")
  add_link_options(-fsanitize=${san})
endif()
