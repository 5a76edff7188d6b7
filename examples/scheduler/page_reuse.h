// Page reuse (pdlib/kv_manager.h): after a request fails, pdlib may still have a write in flight
// into its decode pages (or still read its prefill source pages), so its pages, metadata slot and
// state slot stay out of use until its handle's PagesReusable() is true. Both schedulers keep
// such a request, handle included, in a quarantine list and check it every step; the request
// itself has already finished for the caller.
//
// TP ranks must free that memory on the same step, or their pools (and so their decisions)
// drift apart: ReusablePoll lets the check ride on the step's PollAndAllReduce.
#ifndef PDLIB_EXAMPLES_SCHEDULER_PAGE_REUSE_H_
#define PDLIB_EXAMPLES_SCHEDULER_PAGE_REUSE_H_

#include <cstdint>

#include "pdlib/kv_manager.h"

namespace pdlib::sched {

// Poll() is kSuccess once `handle`'s pages are reusable and kBootstrapping before (one atomic
// load), so its MIN over a group is kSuccess only when they are reusable on every rank.
class ReusablePoll final : public KVPollable {
 public:
  explicit ReusablePoll(const KVPollable* handle) : handle_(handle) {}
  KVPoll Poll() const override {
    return handle_->PagesReusable() ? KVPoll::kSuccess : KVPoll::kBootstrapping;
  }
  Status FailureReason() const override { return Status::OK(); }
  uint64_t room() const override { return handle_->room(); }
  bool PagesReusable() const override { return handle_->PagesReusable(); }

 private:
  const KVPollable* handle_;
};

}  // namespace pdlib::sched

#endif  // PDLIB_EXAMPLES_SCHEDULER_PAGE_REUSE_H_
