#include "pdlib/metadata_buffers.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

namespace pdlib {
inline namespace v1 {
namespace {

struct FieldShape {
  size_t elements;
  size_t element_bytes;
};

// Element counts and sizes of SPEC R4.1, indexed by MetadataField. The hidden-state entry is
// filled per instance.
constexpr FieldShape kShapes[kMetadataFieldCount] = {
    {16, 4}, {16, 4}, {16, 4}, {16, 4}, {128, 4}, {128, 4}, {16, 4}, {16, 8}, {0, 1}, {8, 8},
};

size_t RoundUpRow(size_t bytes) {
  size_t rounded = (bytes + kMetadataMinRowBytes - 1) / kMetadataMinRowBytes * kMetadataMinRowBytes;
  return rounded < kMetadataMinRowBytes ? kMetadataMinRowBytes : rounded;
}

template <typename A>
void CopyIn(std::span<std::byte> row, const A& values) {
  std::memcpy(row.data(), values.data(), sizeof(values[0]) * values.size());
}
template <typename A>
void CopyOut(std::span<const std::byte> row, A& values) {
  std::memcpy(values.data(), row.data(), sizeof(values[0]) * values.size());
}

}  // namespace

StatusOr<std::unique_ptr<MetadataBuffers>> MetadataBuffers::Create(size_t num_slots,
                                                                   size_t hidden_size,
                                                                   size_t hidden_dtype_bytes) {
  if (num_slots == 0) return Status::InvalidArgument("MetadataBuffers needs at least one slot");
  if (hidden_size > 0 && hidden_dtype_bytes == 0) {
    return Status::InvalidArgument("hidden_dtype_bytes must be > 0 when hidden_size is " +
                                   std::to_string(hidden_size));
  }
  if (hidden_size > (size_t{1} << 24) || hidden_dtype_bytes > 16) {
    return Status::InvalidArgument("hidden state of " + std::to_string(hidden_size) + " x " +
                                   std::to_string(hidden_dtype_bytes) + " bytes is implausible");
  }
  std::unique_ptr<MetadataBuffers> buffers(
      new MetadataBuffers(num_slots, hidden_size * hidden_dtype_bytes));
  for (int f = 0; f < kMetadataFieldCount; ++f) {
    size_t bytes = buffers->row_bytes_[f] * num_slots;
    // 64-byte aligned, zeroed: a slot read before its first write holds zeros, not garbage.
    void* p = ::operator new(bytes, std::align_val_t(kMetadataMinRowBytes), std::nothrow);
    if (p == nullptr) {
      return Status::ResourceExhausted("cannot allocate " + std::to_string(bytes) +
                                       " bytes of metadata");
    }
    std::memset(p, 0, bytes);
    buffers->buffers_[f] = static_cast<std::byte*>(p);
  }
  return buffers;
}

MetadataBuffers::MetadataBuffers(size_t num_slots, size_t hidden_bytes)
    : num_slots_(num_slots), hidden_bytes_(hidden_bytes) {
  for (int f = 0; f < kMetadataFieldCount; ++f) {
    size_t bytes = f == static_cast<int>(MetadataField::kOutputHiddenStates)
                       ? hidden_bytes
                       : kShapes[f].elements * kShapes[f].element_bytes;
    row_bytes_[f] = RoundUpRow(bytes);
  }
}

MetadataBuffers::~MetadataBuffers() {
  for (std::byte* p : buffers_) {
    if (p) ::operator delete(p, std::align_val_t(kMetadataMinRowBytes));
  }
}

size_t MetadataBuffers::row_bytes(MetadataField field) const {
  return row_bytes_[static_cast<int>(field)];
}

size_t MetadataBuffers::elements(MetadataField field) const {
  if (field == MetadataField::kOutputHiddenStates) return hidden_bytes_;
  return kShapes[static_cast<int>(field)].elements;
}

std::span<std::byte> MetadataBuffers::Row(MetadataField field, size_t slot) {
  int f = static_cast<int>(field);
  if (slot >= num_slots_ || f < 0 || f >= kMetadataFieldCount) return {};
  return {buffers_[f] + slot * row_bytes_[f], row_bytes_[f]};
}

std::span<const std::byte> MetadataBuffers::Row(MetadataField field, size_t slot) const {
  return const_cast<MetadataBuffers*>(this)->Row(field, slot);
}

Status MetadataBuffers::WriteSlot(size_t slot, const MetadataSlot& v) {
  if (slot >= num_slots_) {
    return Status::OutOfRange("metadata slot " + std::to_string(slot) + " out of range [0, " +
                              std::to_string(num_slots_) + ")");
  }
  if (v.output_hidden_states.size() != hidden_bytes_ &&
      !(v.output_hidden_states.empty() && hidden_bytes_ == 0)) {
    return Status::InvalidArgument("output_hidden_states has " +
                                   std::to_string(v.output_hidden_states.size()) +
                                   " bytes, the buffer row holds " + std::to_string(hidden_bytes_));
  }
  CopyIn(Row(MetadataField::kOutputIds, slot), v.output_ids);
  CopyIn(Row(MetadataField::kCachedTokens, slot), v.cached_tokens);
  CopyIn(Row(MetadataField::kOutputTokenLogprobsVal, slot), v.output_token_logprobs_val);
  CopyIn(Row(MetadataField::kOutputTokenLogprobsIdx, slot), v.output_token_logprobs_idx);
  CopyIn(Row(MetadataField::kOutputTopLogprobsVal, slot), v.output_top_logprobs_val);
  CopyIn(Row(MetadataField::kOutputTopLogprobsIdx, slot), v.output_top_logprobs_idx);
  CopyIn(Row(MetadataField::kOutputTopkP, slot), v.output_topk_p);
  CopyIn(Row(MetadataField::kOutputTopkIndex, slot), v.output_topk_index);
  if (hidden_bytes_ > 0)
    CopyIn(Row(MetadataField::kOutputHiddenStates, slot), v.output_hidden_states);
  CopyIn(Row(MetadataField::kBootstrapRoom, slot), v.bootstrap_room);
  return Status::OK();
}

StatusOr<MetadataSlot> MetadataBuffers::ReadSlot(size_t slot) const {
  if (slot >= num_slots_) {
    return Status::OutOfRange("metadata slot " + std::to_string(slot) + " out of range [0, " +
                              std::to_string(num_slots_) + ")");
  }
  MetadataSlot v;
  CopyOut(Row(MetadataField::kOutputIds, slot), v.output_ids);
  CopyOut(Row(MetadataField::kCachedTokens, slot), v.cached_tokens);
  CopyOut(Row(MetadataField::kOutputTokenLogprobsVal, slot), v.output_token_logprobs_val);
  CopyOut(Row(MetadataField::kOutputTokenLogprobsIdx, slot), v.output_token_logprobs_idx);
  CopyOut(Row(MetadataField::kOutputTopLogprobsVal, slot), v.output_top_logprobs_val);
  CopyOut(Row(MetadataField::kOutputTopLogprobsIdx, slot), v.output_top_logprobs_idx);
  CopyOut(Row(MetadataField::kOutputTopkP, slot), v.output_topk_p);
  CopyOut(Row(MetadataField::kOutputTopkIndex, slot), v.output_topk_index);
  v.output_hidden_states.resize(hidden_bytes_);
  if (hidden_bytes_ > 0)
    CopyOut(Row(MetadataField::kOutputHiddenStates, slot), v.output_hidden_states);
  CopyOut(Row(MetadataField::kBootstrapRoom, slot), v.bootstrap_room);
  return v;
}

BufferFamily MetadataBuffers::Describe() const {
  BufferFamily family;
  for (int f = 0; f < kMetadataFieldCount; ++f) {
    family.ptrs.push_back(reinterpret_cast<uint64_t>(buffers_[f]));
    family.lens.push_back(row_bytes_[f] * num_slots_);
    family.item_lens.push_back(row_bytes_[f]);
  }
  return family;
}

MetadataSlotAllocator::MetadataSlotAllocator(size_t capacity) : in_use_(capacity, false) {
  free_.reserve(capacity);
  // Hand out low indices first.
  for (size_t i = capacity; i > 0; --i) free_.push_back(static_cast<uint32_t>(i - 1));
}

MetadataSlotAllocator::~MetadataSlotAllocator() = default;

std::optional<uint32_t> MetadataSlotAllocator::Alloc() {
  std::lock_guard lock(mu_);
  if (free_.empty()) return std::nullopt;
  uint32_t slot = free_.back();
  free_.pop_back();
  in_use_[slot] = true;
  return slot;
}

Status MetadataSlotAllocator::Free(uint32_t slot) {
  std::lock_guard lock(mu_);
  if (slot >= in_use_.size()) {
    return Status::OutOfRange("metadata slot " + std::to_string(slot) + " out of range [0, " +
                              std::to_string(in_use_.size()) + ")");
  }
  if (!in_use_[slot]) {
    return Status::FailedPrecondition("metadata slot " + std::to_string(slot) +
                                      " is not allocated (double free?)");
  }
  in_use_[slot] = false;
  free_.push_back(slot);
  return Status::OK();
}

size_t MetadataSlotAllocator::available() const {
  std::lock_guard lock(mu_);
  return free_.size();
}

}  // namespace v1
}  // namespace pdlib
