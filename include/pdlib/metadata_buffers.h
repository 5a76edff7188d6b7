// MetadataBuffers: the per-request "aux" slots that carry prefill's first output token and its
// logprobs to decode (SPEC §4), and MetadataSlotAllocator, which hands slots out.
//
// Ownership: MetadataBuffers owns its host memory; register it with pdlib through Describe().
// Threads: distinct slots may be read and written concurrently; one slot by one thread at a
// time. MetadataSlotAllocator is thread-safe.
#ifndef PDLIB_METADATA_BUFFERS_H_
#define PDLIB_METADATA_BUFFERS_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

#include "pdlib/export.h"
#include "pdlib/kv_args.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {

// Every metadata row is padded to at least this many bytes (SPEC R4.2: RDMA alignment).
inline constexpr size_t kMetadataMinRowBytes = 64;

// The fields of one slot, in buffer order (SPEC R4.1).
enum class MetadataField : int32_t {
  kOutputIds = 0,               // 16 x int32: output_ids[0] is the first output token
  kCachedTokens = 1,            // 16 x int32
  kOutputTokenLogprobsVal = 2,  // 16 x float
  kOutputTokenLogprobsIdx = 3,  // 16 x int32
  kOutputTopLogprobsVal = 4,    // 128 x float
  kOutputTopLogprobsIdx = 5,    // 128 x int32
  kOutputTopkP = 6,             // 16 x float
  kOutputTopkIndex = 7,         // 16 x int64
  kOutputHiddenStates = 8,      // hidden_size x dtype
  kBootstrapRoom = 9,           // 8 x uint64: [0] is the request's bootstrap_room
};
inline constexpr int kMetadataFieldCount = 10;

// One slot's contents as plain arrays: what WriteSlot stores and ReadSlot returns.
struct MetadataSlot {
  std::array<int32_t, 16> output_ids{};
  std::array<int32_t, 16> cached_tokens{};
  std::array<float, 16> output_token_logprobs_val{};
  std::array<int32_t, 16> output_token_logprobs_idx{};
  std::array<float, 128> output_top_logprobs_val{};
  std::array<int32_t, 128> output_top_logprobs_idx{};
  std::array<float, 16> output_topk_p{};
  std::array<int64_t, 16> output_topk_index{};
  std::vector<uint8_t> output_hidden_states;  // hidden_size * hidden_dtype_bytes bytes
  std::array<uint64_t, 8> bootstrap_room{};

  friend bool operator==(const MetadataSlot&, const MetadataSlot&) = default;
};

class PDLIB_EXPORT MetadataBuffers {
 public:
  // `num_slots` rows per field; SlotCountFor() gives the recommended count. The hidden-state
  // row holds hidden_size elements of hidden_dtype_bytes each (0 hidden_size: no hidden states,
  // the row still exists at its 64-byte minimum).
  static StatusOr<std::unique_ptr<MetadataBuffers>> Create(size_t num_slots, size_t hidden_size,
                                                           size_t hidden_dtype_bytes);
  // SPEC R4.3: twice the maximum number of running requests.
  static size_t SlotCountFor(size_t max_running_requests) { return 2 * max_running_requests; }

  ~MetadataBuffers();
  MetadataBuffers(const MetadataBuffers&) = delete;
  MetadataBuffers& operator=(const MetadataBuffers&) = delete;

  size_t num_slots() const { return num_slots_; }
  // Bytes of one row of `field` (a multiple of 64, at least 64).
  size_t row_bytes(MetadataField field) const;
  // Number of meaningful elements in one row of `field`.
  size_t elements(MetadataField field) const;

  // Raw row of `field` for `slot`; empty span when slot >= num_slots().
  std::span<std::byte> Row(MetadataField field, size_t slot);
  std::span<const std::byte> Row(MetadataField field, size_t slot) const;

  // Typed views of one row (empty when slot is out of range).
  std::span<int32_t> output_ids(size_t slot) {
    return Typed<int32_t>(MetadataField::kOutputIds, slot);
  }
  std::span<int32_t> cached_tokens(size_t slot) {
    return Typed<int32_t>(MetadataField::kCachedTokens, slot);
  }
  std::span<float> output_token_logprobs_val(size_t slot) {
    return Typed<float>(MetadataField::kOutputTokenLogprobsVal, slot);
  }
  std::span<int32_t> output_token_logprobs_idx(size_t slot) {
    return Typed<int32_t>(MetadataField::kOutputTokenLogprobsIdx, slot);
  }
  std::span<float> output_top_logprobs_val(size_t slot) {
    return Typed<float>(MetadataField::kOutputTopLogprobsVal, slot);
  }
  std::span<int32_t> output_top_logprobs_idx(size_t slot) {
    return Typed<int32_t>(MetadataField::kOutputTopLogprobsIdx, slot);
  }
  std::span<float> output_topk_p(size_t slot) {
    return Typed<float>(MetadataField::kOutputTopkP, slot);
  }
  std::span<int64_t> output_topk_index(size_t slot) {
    return Typed<int64_t>(MetadataField::kOutputTopkIndex, slot);
  }
  std::span<std::byte> output_hidden_states(size_t slot) {
    return Row(MetadataField::kOutputHiddenStates, slot).first(hidden_bytes_);
  }
  std::span<uint64_t> bootstrap_room(size_t slot) {
    return Typed<uint64_t>(MetadataField::kBootstrapRoom, slot);
  }

  // Copies a whole slot in or out. Errors: slot out of range, hidden-state size mismatch.
  Status WriteSlot(size_t slot, const MetadataSlot& values);
  StatusOr<MetadataSlot> ReadSlot(size_t slot) const;

  // The aux BufferFamily to put in KVArgs::aux: one buffer per field, item = one row.
  BufferFamily Describe() const;

 private:
  MetadataBuffers(size_t num_slots, size_t hidden_bytes);
  template <typename T>
  std::span<T> Typed(MetadataField field, size_t slot) {
    auto row = Row(field, slot);
    if (row.empty()) return {};
    return {reinterpret_cast<T*>(row.data()), elements(field)};
  }

  size_t num_slots_;
  size_t hidden_bytes_;
  std::array<size_t, kMetadataFieldCount> row_bytes_{};
  std::array<std::byte*, kMetadataFieldCount> buffers_{};
};

// Hands out metadata slot indices [0, capacity). Thread-safe. Alloc is O(1); freeing a slot
// that is not allocated is refused (a double free would hand one slot to two requests).
class PDLIB_EXPORT MetadataSlotAllocator {
 public:
  explicit MetadataSlotAllocator(size_t capacity);
  ~MetadataSlotAllocator();
  MetadataSlotAllocator(const MetadataSlotAllocator&) = delete;
  MetadataSlotAllocator& operator=(const MetadataSlotAllocator&) = delete;

  // nullopt when every slot is in use.
  std::optional<uint32_t> Alloc();
  // kOutOfRange for an index >= capacity, kFailedPrecondition when the slot is not allocated.
  Status Free(uint32_t slot);
  size_t capacity() const { return in_use_.size(); }
  size_t available() const;

 private:
  mutable std::mutex mu_;
  std::vector<uint32_t> free_;  // stack of free slots
  std::vector<bool> in_use_;
};

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_METADATA_BUFFERS_H_
