// Blocking whole-buffer reads and writes on a pipe, and length-prefixed blobs over it: how the
// multi-process transport tests hand endpoints and keys to the children they fork.
#ifndef PDLIB_TEST_SUPPORT_PIPE_IO_H_
#define PDLIB_TEST_SUPPORT_PIPE_IO_H_

#include <unistd.h>

#include <cstddef>
#include <cstdint>

#include "pdlib/spi/transport.h"

namespace pdlib::testing {

// False when the pipe closed or failed before `size` bytes came.
inline bool ReadAll(int fd, void* data, size_t size) {
  auto* p = static_cast<uint8_t*>(data);
  while (size > 0) {
    ssize_t n = read(fd, p, size);
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

// Gives up silently when the reader is gone (the test notices by the reader's exit status).
inline void WriteAll(int fd, const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    ssize_t n = write(fd, p, size);
    if (n <= 0) return;
    p += n;
    size -= static_cast<size_t>(n);
  }
}

inline void SendBlob(int fd, const spi::Blob& blob) {
  const uint64_t size = blob.size();
  WriteAll(fd, &size, sizeof(size));
  WriteAll(fd, blob.data(), blob.size());
}

// At most 1 MiB (a blob is an endpoint or a key).
inline bool ReceiveBlob(int fd, spi::Blob* blob) {
  uint64_t size = 0;
  if (!ReadAll(fd, &size, sizeof(size)) || size > (1u << 20)) return false;
  blob->resize(size);
  return ReadAll(fd, blob->data(), size);
}

}  // namespace pdlib::testing

#endif  // PDLIB_TEST_SUPPORT_PIPE_IO_H_
