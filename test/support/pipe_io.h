// Blocking whole-buffer reads and writes on a pipe, length-prefixed blobs over it, and waiting
// for a child: how the multi-process transport tests hand endpoints and keys to the children
// they fork, and collect their verdicts.
#ifndef PDLIB_TEST_SUPPORT_PIPE_IO_H_
#define PDLIB_TEST_SUPPORT_PIPE_IO_H_

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <thread>

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

// The child's exit status; 128 when a signal ended it; -1 when it was still running after
// `limit` (it is killed then).
inline int WaitExit(pid_t pid, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return -1;
}

}  // namespace pdlib::testing

#endif  // PDLIB_TEST_SUPPORT_PIPE_IO_H_
