# pdlib_cuda_ipc_copy: the cuda_ipc backend's copy engine (issue #19). copy_plan.cc (coalescing
# and tiling, pure C++) builds in every configuration and its test runs everywhere, including the
# sanitizer builds without CUDA; gather_copy.cu (the one-pass gather kernel, GatherCopier) joins
# it when nvcc was found.
#
# Included from backends/CMakeLists.txt before add_subdirectory(cuda_ipc), whatever
# PDLIB_HAVE_CUDA says, so the target exists for the tests either way. The backend itself
# (backends/cuda_ipc/CMakeLists.txt) only links it (pdlib_add_backend LIBS pdlib_cuda_ipc_copy).
#
# The KV digest of GPU memory (issue #42) lives here too: digest_plan.cc (the kernel's tables, its
# tiling and its arithmetic on the CPU) everywhere, digest_kernel.cu (DeviceDigester) with nvcc.
set(PDLIB_CUDA_IPC_COPY_SOURCES ${CMAKE_CURRENT_LIST_DIR}/copy_plan.cc
  ${CMAKE_CURRENT_LIST_DIR}/digest_plan.cc)
if(PDLIB_HAVE_CUDA)
  list(APPEND PDLIB_CUDA_IPC_COPY_SOURCES ${CMAKE_CURRENT_LIST_DIR}/gather_copy.cu
    ${CMAKE_CURRENT_LIST_DIR}/digest_kernel.cu)
endif()
add_library(pdlib_cuda_ipc_copy STATIC ${PDLIB_CUDA_IPC_COPY_SOURCES})
add_library(pdlib::cuda_ipc_copy ALIAS pdlib_cuda_ipc_copy)
target_link_libraries(pdlib_cuda_ipc_copy PUBLIC pdlib_base)
set_target_properties(pdlib_cuda_ipc_copy PROPERTIES POSITION_INDEPENDENT_CODE ON
  EXPORT_NAME cuda_ipc_copy)
pdlib_target_defaults(pdlib_cuda_ipc_copy)
if(PDLIB_HAVE_CUDA)
  # As in kernels/CMakeLists.txt: CMake 3.25 does not know nvcc's C++20 flag; the headers use
  # std::span. 2810: nvcc flags `status = Status::X(...)` ([[nodiscard]] Status's operator=).
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  set_target_properties(pdlib_cuda_ipc_copy PROPERTIES CUDA_ARCHITECTURES "80;90")
  set(pdlib_cuda_ipc_copy_werror "")
  if(PDLIB_WERROR)
    set(pdlib_cuda_ipc_copy_werror -Werror=all-warnings -Xcompiler=-Werror)
  endif()
  target_compile_options(pdlib_cuda_ipc_copy PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Wno-unused-parameter -diag-suppress=2810 ${pdlib_cuda_ipc_copy_werror}>)
  target_link_libraries(pdlib_cuda_ipc_copy PRIVATE CUDA::cudart)
  # The backend links it, so it is installed and exported with the backends (as the transport
  # toolkit is).
  set_property(GLOBAL APPEND PROPERTY PDLIB_BACKEND_TARGETS pdlib_cuda_ipc_copy)
endif()
