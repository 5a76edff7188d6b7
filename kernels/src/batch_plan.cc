#include "batch_plan.h"

#include <limits>
#include <string>
#include <unordered_map>

namespace pdlib::kernels::internal {

StatusOr<BatchPlan> PlanBatch(const ModelConfig& config, int32_t num_pages, int32_t num_state_slots,
                              std::span<const SequenceChunk> batch, const ForwardOptions& options) {
  if (batch.empty()) return Status::InvalidArgument("forward: empty batch");
  if (options.top_k < 0 || options.top_k > config.vocab_size) {
    return Status::InvalidArgument("forward: top_k " + std::to_string(options.top_k) +
                                   " not in [0, vocab_size = " + std::to_string(config.vocab_size) +
                                   "]");
  }
  const int64_t page_size = config.page_size;
  const bool hybrid = config.is_hybrid();
  BatchPlan plan;
  plan.num_seqs = static_cast<int32_t>(batch.size());
  plan.seq_token_begin.push_back(0);
  plan.page_table_begin.push_back(0);
  // Which chunk writes each page (and uses each state slot): two requests sharing either would
  // corrupt each other.
  std::unordered_map<int32_t, int32_t> page_writer;
  std::unordered_map<int32_t, int32_t> slot_user;
  int64_t total_tokens = 0;
  for (size_t s = 0; s < batch.size(); ++s) {
    const SequenceChunk& chunk = batch[s];
    const std::string who = "forward: request " + std::to_string(s) + " of the batch";
    if (chunk.tokens.empty()) return Status::InvalidArgument(who + " has no tokens");
    if (chunk.start_pos < 0) {
      return Status::InvalidArgument(who + " has negative start_pos " +
                                     std::to_string(chunk.start_pos));
    }
    const int64_t n = static_cast<int64_t>(chunk.tokens.size());
    const int64_t end = chunk.start_pos + n;
    total_tokens += n;
    if (end > std::numeric_limits<int32_t>::max() ||
        total_tokens > std::numeric_limits<int32_t>::max()) {
      return Status::InvalidArgument(who + " has too many tokens");
    }
    const int64_t pages_needed = (end + page_size - 1) / page_size;
    if (static_cast<int64_t>(chunk.page_table.size()) < pages_needed) {
      return Status::InvalidArgument(
          who + " covers positions [0, " + std::to_string(end) + ") which need " +
          std::to_string(pages_needed) + " pages of " + std::to_string(page_size) +
          " tokens, but its page table has " + std::to_string(chunk.page_table.size()));
    }
    const int64_t first_written_page = chunk.start_pos / page_size;
    for (int64_t i = 0; i < pages_needed; ++i) {
      const int32_t page = chunk.page_table[static_cast<size_t>(i)];
      if (page < 0 || page >= num_pages) {
        return Status::OutOfRange(who + ": page index " + std::to_string(page) + " (entry " +
                                  std::to_string(i) + " of its page table) out of range [0, " +
                                  std::to_string(num_pages) + ")");
      }
      if (i >= first_written_page) {
        auto [it, inserted] = page_writer.emplace(page, static_cast<int32_t>(s));
        if (!inserted && it->second != static_cast<int32_t>(s)) {
          return Status::InvalidArgument(who + " writes page " + std::to_string(page) +
                                         " which request " + std::to_string(it->second) +
                                         " of the same batch also writes");
        }
      }
      plan.page_tables.push_back(page);
    }
    int32_t slot = -1;
    if (hybrid) {
      slot = chunk.state_slot;
      if (slot < 0 || slot >= num_state_slots) {
        return Status::OutOfRange(who + ": state slot " + std::to_string(slot) +
                                  " out of range [0, " + std::to_string(num_state_slots) + ")");
      }
      auto [it, inserted] = slot_user.emplace(slot, static_cast<int32_t>(s));
      if (!inserted) {
        return Status::InvalidArgument(who + " uses state slot " + std::to_string(slot) +
                                       " which request " + std::to_string(it->second) +
                                       " of the same batch also uses");
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      const int32_t token = chunk.tokens[static_cast<size_t>(i)];
      if (token < 0 || token >= config.vocab_size) {
        return Status::InvalidArgument(who + ": token " + std::to_string(i) + " has id " +
                                       std::to_string(token) + " outside the vocabulary [0, " +
                                       std::to_string(config.vocab_size) + ")");
      }
      const int64_t pos = chunk.start_pos + i;
      const int32_t page = chunk.page_table[static_cast<size_t>(pos / page_size)];
      plan.token_ids.push_back(token);
      plan.positions.push_back(static_cast<int32_t>(pos));
      plan.token_seq.push_back(static_cast<int32_t>(s));
      plan.write_slots.push_back(static_cast<int64_t>(page) * page_size + pos % page_size);
    }
    plan.seq_start_pos.push_back(chunk.start_pos);
    plan.seq_state_slot.push_back(slot);
    plan.seq_token_begin.push_back(static_cast<int32_t>(total_tokens));
    plan.page_table_begin.push_back(static_cast<int32_t>(plan.page_tables.size()));
  }
  plan.num_tokens = static_cast<int32_t>(total_tokens);
  return plan;
}

}  // namespace pdlib::kernels::internal
