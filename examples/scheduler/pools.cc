#include "examples/scheduler/pools.h"

#include <algorithm>
#include <utility>

#include "pdlib/page_index.h"

namespace pdlib::sched {

IndexAllocator::IndexAllocator(int32_t capacity, std::string what)
    : what_(std::move(what)), in_use_(static_cast<size_t>(std::max(capacity, 0)), false) {
  for (int32_t i = 0; i < capacity; ++i) free_.insert(free_.end(), i);
}

std::optional<int32_t> IndexAllocator::Alloc() {
  if (free_.empty()) return std::nullopt;
  const int32_t index = *free_.begin();
  free_.erase(free_.begin());
  in_use_[static_cast<size_t>(index)] = true;
  return index;
}

bool IndexAllocator::AllocMany(int32_t count, std::vector<int32_t>* out) {
  if (count < 0 || count > available()) return false;
  for (int32_t i = 0; i < count; ++i) out->push_back(*Alloc());
  return true;
}

bool IndexAllocator::in_use(int32_t index) const {
  return index >= 0 && index < capacity() && in_use_[static_cast<size_t>(index)];
}

Status IndexAllocator::Free(int32_t index) {
  if (index < 0 || index >= capacity()) {
    return Status::OutOfRange(what_ + " " + std::to_string(index) + " out of range [0, " +
                              std::to_string(capacity()) + ")");
  }
  if (!in_use_[static_cast<size_t>(index)]) {
    return Status::FailedPrecondition(what_ + " " + std::to_string(index) +
                                      " freed but not allocated (double free?)");
  }
  in_use_[static_cast<size_t>(index)] = false;
  free_.insert(index);
  return Status::OK();
}

PageAllocator::PageAllocator(int32_t num_pages, int32_t page_size, KVEventSink* events)
    : pages_(num_pages, "page"), page_size_(page_size), events_(events) {}

bool PageAllocator::Alloc(int32_t count, uint64_t room, std::vector<int32_t>* pages) {
  const size_t first = pages->size();
  if (!pages_.AllocMany(count, pages)) return false;
  if (events_ != nullptr && count > 0) {
    events_->Publish({.type = KVEventType::kBlockStored,
                      .room = room,
                      .pages = {pages->begin() + static_cast<std::ptrdiff_t>(first), pages->end()},
                      .page_size = page_size_});
  }
  return true;
}

Status PageAllocator::Free(std::span<const int32_t> pages, uint64_t room) {
  // Check everything first so that a bad list frees nothing; a page listed twice is a double
  // free as well.
  std::set<int32_t> seen;
  for (int32_t page : pages) {
    if (page < 0 || page >= num_pages()) {
      return Status::OutOfRange("room " + std::to_string(room) + ": page " + std::to_string(page) +
                                " out of range [0, " + std::to_string(num_pages()) + ")");
    }
    if (!pages_.in_use(page) || !seen.insert(page).second) {
      return Status::FailedPrecondition("room " + std::to_string(room) + ": page " +
                                        std::to_string(page) +
                                        " freed but not allocated (double free?)");
    }
  }
  for (int32_t page : pages) pages_.Free(page).IgnoreError();  // checked above
  if (events_ != nullptr && !pages.empty()) {
    events_->Publish({.type = KVEventType::kBlockRemoved,
                      .room = room,
                      .pages = {pages.begin(), pages.end()},
                      .page_size = page_size_});
  }
  return Status::OK();
}

void PageAllocator::Clear() {
  pages_ = IndexAllocator(num_pages(), "page");
  if (events_ != nullptr) {
    events_->Publish(
        {.type = KVEventType::kAllBlocksCleared, .room = 0, .pages = {}, .page_size = page_size_});
  }
}

ReqToTokenPool::ReqToTokenPool(int32_t size, int32_t max_context_len, int32_t page_size)
    : slots_(size, "request slot"),
      max_pages_(static_cast<int32_t>(PageCount(static_cast<uint64_t>(std::max(max_context_len, 0)),
                                                static_cast<uint32_t>(std::max(page_size, 1))))),
      tables_(static_cast<size_t>(std::max(size, 0))) {}

std::optional<int32_t> ReqToTokenPool::Alloc() { return slots_.Alloc(); }

Status ReqToTokenPool::Free(int32_t slot) {
  if (Status s = slots_.Free(slot); !s.ok()) return s;
  tables_[static_cast<size_t>(slot)].clear();
  return Status::OK();
}

}  // namespace pdlib::sched
