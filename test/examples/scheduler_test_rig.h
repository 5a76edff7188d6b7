// The fixture both scheduler tests (prefill, decode) build on: one rank's KV cache with its KV
// events, the fake model and transport (scheduler_fakes.h), metadata buffers, the scheduler under
// test and the requests it finished; MakeTpRanks, which builds TP ranks over one group, and
// StepAllRanks, which steps them in lockstep.
#ifndef PDLIB_TEST_EXAMPLES_SCHEDULER_TEST_RIG_H_
#define PDLIB_TEST_EXAMPLES_SCHEDULER_TEST_RIG_H_

#include <catch2/catch.hpp>
#include <map>
#include <memory>
#include <string_view>
#include <thread>
#include <vector>

#include "examples/scheduler/kv_events.h"
#include "examples/scheduler/pools.h"
#include "pdlib/metadata_buffers.h"
#include "pdlib/poll_reduce.h"
#include "scheduler_fakes.h"

namespace pdlib::sched::testing {

// `Scheduler` is PrefillScheduler or DecodeScheduler; the side's rig creates `metadata` and
// `sched`.
template <typename Scheduler>
struct SchedulerRig {
  SchedulerRig(int32_t num_pages, int32_t page_size)
      : pages(num_pages, page_size, &events), model(num_pages, page_size) {}

  // Adds `r`, which must be accepted; `connect`: the peer connects at once (the handle polls
  // WaitingForInput).
  void Add(const Request& r, bool connect) {
    REQUIRE(sched->AddRequest(r).ok());
    requests[r.room] = r;
    if (connect) transport[r.room].state = KVPoll::kWaitingForInput;
  }

  // One step, which must succeed; then collects what finished.
  void Step() {
    REQUIRE(sched->Step().ok());
    CollectFinished();
  }
  void CollectFinished() {
    for (FinishedRequest& f : sched->TakeFinished()) finished[f.room] = std::move(f);
  }

  KVEventPublisher events{4096};
  PageAllocator pages;
  FakeModel model;
  FakeTransport transport;
  std::unique_ptr<MetadataBuffers> metadata;
  std::unique_ptr<Scheduler> sched;
  std::map<uint64_t, Request> requests;
  std::map<uint64_t, FinishedRequest> finished;
};

// `size` TP ranks in one InProcessGroup, each with its own rig built as Rig(options with
// options.group set to its member, args...). The group outlives the rigs (declared first).
template <typename Rig>
struct TpRanks {
  std::vector<std::unique_ptr<ProcessGroup>> group;
  std::vector<std::unique_ptr<Rig>> rigs;
};
template <typename Rig, typename Options, typename... Args>
TpRanks<Rig> MakeTpRanks(int size, Options options, Args... args) {
  TpRanks<Rig> ranks{.group = InProcessGroup::Create(size), .rigs = {}};
  for (auto& member : ranks.group) {
    options.group = member.get();
    ranks.rigs.push_back(std::make_unique<Rig>(options, args...));
  }
  return ranks;
}

// One step of every rank's scheduler, each on its own thread as TP ranks run (their
// PollAndAllReduce meets in the group); every step must succeed. Then collects what finished.
template <typename Rig>
void StepAllRanks(std::vector<std::unique_ptr<Rig>>& rigs) {
  std::vector<Status> results(rigs.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < rigs.size(); ++r) {
    threads.emplace_back([&, r] { results[r] = rigs[r]->sched->Step(); });
  }
  for (std::thread& t : threads) t.join();
  for (const Status& s : results) REQUIRE(s.ok());
  for (auto& rig : rigs) rig->CollectFinished();
}

// One rank: `room` finished with `reason` at once but its memory is held (quarantined, its
// handle kept, `free_pages` pages free; the metrics count one request of `held_pages` pages).
template <typename Rig>
void CheckHeld(Rig& rig, uint64_t room, std::string_view reason, int32_t free_pages,
               uint64_t held_pages) {
  REQUIRE(rig.finished.count(room) == 1);
  CHECK(rig.finished[room].status.message() == reason);
  CHECK(rig.sched->idle());
  CHECK(rig.sched->quarantined_size() == 1);
  CHECK_FALSE(rig.transport.handles.at(room)->destroyed);
  CHECK(rig.pages.free_pages() == free_pages);
  const SchedulerMetrics m = rig.sched->metrics();
  CHECK(m.quarantined_requests == 1);
  CHECK(m.quarantined_pages == held_pages);
}

// Page reuse across TP ranks (the same checks on prefill and decode): every rank finished `room`
// with an error and holds it quarantined, with `free_pages` pages free.
template <typename Rig>
void CheckQuarantinedOnAllRanks(std::vector<std::unique_ptr<Rig>>& rigs, uint64_t room,
                                int32_t free_pages) {
  for (size_t r = 0; r < rigs.size(); ++r) {
    INFO("rank " << r);
    REQUIRE(rigs[r]->finished.count(room) == 1);
    CHECK_FALSE(rigs[r]->finished[room].status.ok());
    CHECK(rigs[r]->sched->quarantined_size() == 1);
    CHECK(rigs[r]->pages.free_pages() == free_pages);
  }
}

// ... and, once every rank's handle is reusable, released it: nothing quarantined, `free_pages`
// free, the handle destroyed.
template <typename Rig>
void CheckReleasedOnAllRanks(std::vector<std::unique_ptr<Rig>>& rigs, uint64_t room,
                             int32_t free_pages) {
  for (size_t r = 0; r < rigs.size(); ++r) {
    INFO("rank " << r);
    CHECK(rigs[r]->sched->quarantined_size() == 0);
    CHECK(rigs[r]->pages.free_pages() == free_pages);
    CHECK(rigs[r]->transport.handles.at(room)->destroyed);
  }
}

}  // namespace pdlib::sched::testing

#endif  // PDLIB_TEST_EXAMPLES_SCHEDULER_TEST_RIG_H_
