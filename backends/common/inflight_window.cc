#include "backends/common/inflight_window.h"

namespace pdlib {
inline namespace v1 {
namespace toolkit {

uint64_t ChunkCount(uint64_t length, uint64_t chunk_bytes) {
  if (length == 0) return 0;
  if (chunk_bytes == 0) return 1;
  return length / chunk_bytes + (length % chunk_bytes != 0 ? 1 : 0);
}

uint64_t ChunkLength(uint64_t length, uint64_t offset, uint64_t chunk_bytes) {
  uint64_t rest = length - offset;
  return chunk_bytes == 0 || rest < chunk_bytes ? rest : chunk_bytes;
}

}  // namespace toolkit
}  // namespace v1
}  // namespace pdlib
