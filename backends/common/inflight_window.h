// How a backend paces its writes: long writes are split into chunks, and the bytes posted to
// one connection but not yet completed are bounded by a window; the rest waits in the
// connection's queue. Pure arithmetic, no wire and no threads, so it is unit-tested directly.
//
// Why (measured with the UCX backend): with UCX 1.13 over tcp (and whenever puts are emulated
// with active messages), posting every put of a large transfer at once queues them all inside
// UCX and throughput collapses (16 MiB messages: 33-357 MiB/s unbounded, 4-12 GB/s with a
// bounded window). Chunks keep one write from occupying the window alone and let the next chunk
// start while the previous drains. A wire that bounds itself in other units (verbs: work
// requests per send queue, verbs_wr.h) keeps its own budget.
#ifndef PDLIB_BACKENDS_COMMON_INFLIGHT_WINDOW_H_
#define PDLIB_BACKENDS_COMMON_INFLIGHT_WINDOW_H_

#include <cstdint>

namespace pdlib {
inline namespace v1 {
namespace toolkit {

// Number of chunks a write of `length` bytes is split into (0 for an empty write). A
// `chunk_bytes` of 0 means "do not split".
uint64_t ChunkCount(uint64_t length, uint64_t chunk_bytes);

// Length of the chunk that starts `offset` bytes into a write of `length` bytes: chunk_bytes,
// except for the last chunk, which takes the rest. Precondition: offset < length.
uint64_t ChunkLength(uint64_t length, uint64_t offset, uint64_t chunk_bytes);

// Bytes posted to one connection and not yet completed. Owned by the progress thread.
class InflightWindow {
 public:
  explicit InflightWindow(uint64_t limit_bytes) : limit_(limit_bytes) {}

  // A chunk may be posted when it fits, or when nothing is in flight (so that a chunk larger
  // than the window still moves, alone). A limit of 0 means unbounded.
  bool CanPost(uint64_t bytes) const {
    return limit_ == 0 || in_flight_ == 0 || (in_flight_ < limit_ && bytes <= limit_ - in_flight_);
  }
  // Only writes that the wire did not complete immediately need counting.
  void OnPosted(uint64_t bytes) { in_flight_ += bytes; }
  void OnCompleted(uint64_t bytes) { in_flight_ -= bytes < in_flight_ ? bytes : in_flight_; }

  uint64_t in_flight() const { return in_flight_; }
  uint64_t limit() const { return limit_; }

 private:
  uint64_t limit_;
  uint64_t in_flight_ = 0;
};

}  // namespace toolkit
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_COMMON_INFLIGHT_WINDOW_H_
