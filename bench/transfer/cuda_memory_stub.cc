// cuda_memory.h where CMake found no CUDA (PDLIB_HAVE_CUDA off): every call says why it cannot
// run, so --memory cuda fails with that reason instead of not existing.
#include "bench/transfer/cuda_memory.h"

namespace pdlib_bench {
namespace {

constexpr char kNotBuilt[] =
    "pdlib-transfer-bench was built without CUDA (PDLIB_WITH_CUDA=OFF or no nvcc at configure "
    "time)";

}  // namespace

std::string CudaUsable(int) { return kNotBuilt; }
std::string CudaBuffer::Allocate(int, uint64_t, std::unique_ptr<CudaBuffer>*) { return kNotBuilt; }
CudaBuffer::~CudaBuffer() = default;
std::string CudaCopyToDevice(int, void*, const void*, uint64_t) { return kNotBuilt; }
std::string CudaCopyToHost(int, void*, const void*, uint64_t) { return kNotBuilt; }
std::string CudaZero(int, void*, uint64_t) { return kNotBuilt; }
std::string CudaCopyStream::Create(int, std::unique_ptr<CudaCopyStream>*) { return kNotBuilt; }
CudaCopyStream::~CudaCopyStream() = default;
std::string CudaCopyStream::Copy(void*, const void*, uint64_t) { return kNotBuilt; }
std::string CudaCopyStream::Synchronize() { return kNotBuilt; }

}  // namespace pdlib_bench
