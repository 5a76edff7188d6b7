#include "backends/verbs/verbs_wr.h"

#include <algorithm>
#include <string>

namespace pdlib {
inline namespace v1 {
namespace verbs {

std::vector<size_t> StripeOverPairs(std::span<const uint64_t> lengths, size_t pairs,
                                    uint64_t stripe_bytes, size_t first) {
  std::vector<size_t> out(lengths.size(), kNoPair);
  if (pairs == 0) return out;
  size_t pair = first % pairs;
  uint64_t in_stripe = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] == 0) continue;
    if (in_stripe >= stripe_bytes && stripe_bytes > 0) {  // this stripe is full: the next pair
      pair = (pair + 1) % pairs;
      in_stripe = 0;
    }
    out[i] = pair;
    in_stripe += lengths[i];
  }
  return out;
}

StatusOr<WrLimits> EffectiveLimits(uint32_t device_max_sge, uint64_t device_max_message,
                                   uint32_t option_max_sge, uint64_t option_max_message) {
  if (device_max_sge < 1 || device_max_message < 1) {
    return Status::FailedPrecondition(
        "verbs: the device reports max_sge " + std::to_string(device_max_sge) + " and max_msg_sz " +
        std::to_string(device_max_message) + ": it cannot post writes");
  }
  WrLimits limits;
  limits.max_sge = option_max_sge == 0 ? device_max_sge : std::min(option_max_sge, device_max_sge);
  limits.max_message_bytes = std::min<uint64_t>(device_max_message, 0xffffffffu);
  if (option_max_message != 0) {
    limits.max_message_bytes = std::min(limits.max_message_bytes, option_max_message);
  }
  return limits;
}

void PlanWrites(std::span<const WriteSegment> writes, const WrLimits& limits, WrPlan* plan) {
  const uint64_t max_message = std::max<uint64_t>(1, limits.max_message_bytes);
  const uint32_t max_sge = std::max<uint32_t>(1, limits.max_sge);
  // The request being filled: only one appended by this call may be extended.
  PlannedWr* open = nullptr;
  for (const WriteSegment& w : writes) {
    uint64_t done = 0;
    while (done < w.length) {
      const uint64_t local = w.local_addr + done;
      const uint64_t remote = w.remote_addr + done;
      const uint64_t left = w.length - done;
      const bool extends = open != nullptr && open->rkey == w.rkey &&
                           open->remote_addr + open->length == remote && open->length < max_message;
      if (extends) {
        Sge& last = plan->sges.back();
        const uint64_t take = std::min(left, max_message - open->length);
        if (last.lkey == w.lkey && last.addr + last.length == local) {
          last.length += static_cast<uint32_t>(take);  // fits: the request stays <= 2^32 - 1
          open->length += take;
          done += take;
          continue;
        }
        if (open->num_sge < max_sge) {
          plan->sges.push_back({local, static_cast<uint32_t>(take), w.lkey});
          ++open->num_sge;
          open->length += take;
          done += take;
          continue;
        }
      }
      const uint64_t take = std::min(left, max_message);
      plan->wrs.push_back({remote, w.rkey, take, static_cast<uint32_t>(plan->sges.size()), 1});
      plan->sges.push_back({local, static_cast<uint32_t>(take), w.lkey});
      open = &plan->wrs.back();
      done += take;
    }
  }
}

uint32_t ReadDepth(uint32_t device_initiator_depth, uint32_t peer_responder_resources) {
  return std::max<uint32_t>(1, std::min(device_initiator_depth, peer_responder_resources));
}

SendQueueBudget::SendQueueBudget(uint32_t depth, uint32_t signal_every, uint32_t read_depth)
    : depth_(std::max<uint32_t>(1, depth)),
      signal_every_(std::clamp<uint32_t>(signal_every, 1, std::max<uint32_t>(1, depth))),
      read_depth_(std::max<uint32_t>(1, read_depth)) {}

SendQueueBudget::Posted SendQueueBudget::Post(bool must_signal, bool read) {
  ++posted_;
  const bool fills_queue = posted_ - retired_ >= depth_;
  if (read) reads_.push_back(posted_);
  const bool fills_reads = read && reads_.size() >= read_depth_;
  const bool signalled =
      must_signal || fills_queue || fills_reads || since_signal_ + 1 >= signal_every_;
  since_signal_ = signalled ? 0 : since_signal_ + 1;
  return {posted_, signalled};
}

uint32_t SendQueueBudget::Retire(uint64_t seq) {
  if (seq <= retired_ || seq > posted_) return 0;
  const uint32_t freed = static_cast<uint32_t>(seq - retired_);
  retired_ = seq;
  while (!reads_.empty() && reads_.front() <= seq) reads_.pop_front();
  return freed;
}

}  // namespace verbs
}  // namespace v1
}  // namespace pdlib
