// SchedulerCore: what neither side's tests reach. A broken pool invariant is what Step() returns
// (once, named, the first one); a failed collective ends the step before any request moves;
// Allocate takes nothing when one resource is short; a model that returns the wrong number of
// results fails the forward pass; the refusal of a quarantined room names why; SweepQueue keeps
// what it does not move, in order.
#include "examples/scheduler/scheduler_core.h"

#include <catch2/catch.hpp>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "scheduler_fakes.h"

namespace pdlib::sched {
namespace {

using testing::FakeModel;
using testing::FakeTransport;

// The smallest policy over the core: one queue of senders, each holding memory for its tokens
// from AddRequest on, finished when its transfer ends.
class OneQueueScheduler final : public SchedulerCore {
 public:
  OneQueueScheduler(SchedulerCoreOptions o, PageAllocator* pages, ModelRunner* model,
                    FakeTransport* transport)
      : SchedulerCore(std::move(o), pages, model,
                      std::make_unique<ReqToTokenPool>(2, 64, pages->page_size()),
                      /*aux_slots=*/2),
        transport_(transport) {}
  ~OneQueueScheduler() override {
    for (auto& r : queue_) Release(r->mem, r->room);
  }

  Status AddRequest(uint64_t room, int64_t tokens) {
    if (Status s = CheckRoomFree(room); !s.ok()) return Reject(std::move(s));
    auto r = std::make_unique<Req>();
    r->room = room;
    r->sender = std::move(*transport_->CreateSender(room));
    if (!Allocate(r->mem, room, tokens)) return Reject(Status::ResourceExhausted("no memory"));
    Admit(room);
    queue_.push_back(std::move(r));
    return Status::OK();
  }
  const std::vector<int32_t>& pages_of(size_t k) const { return page_table(queue_[k]->mem); }

  using SchedulerCore::Allocate;
  using SchedulerCore::CoreMetrics;
  using SchedulerCore::Forward;
  using SchedulerCore::Release;

  int on_polls = 0;
  int schedules = 0;

 private:
  struct Req {
    uint64_t room = 0;
    std::unique_ptr<KVSender> sender;
    RequestMemory mem;
  };

  void AppendPolledHandles(std::vector<const KVPollable*>* handles) const override {
    for (const auto& r : queue_) handles->push_back(r->sender.get());
  }
  void OnPolls(std::span<const KVPoll> polls) override {
    ++on_polls;
    SweepQueue(queue_, polls, [&](std::unique_ptr<Req>& r, KVPoll p) {
      if (!IsTerminal(p)) return;
      const bool ok = p == KVPoll::kSuccess;
      FinishedRequest f;
      f.room = r->room;
      if (!ok) f.status = FailureOf(*r->sender);
      FinishRequest(std::move(f), FailStage::kTransfer, std::move(r->sender), r->mem, ok);
      r.reset();
    });
  }
  void Schedule() override { ++schedules; }

  FakeTransport* transport_;
  std::deque<std::unique_ptr<Req>> queue_;
};

struct CoreRig {
  explicit CoreRig(SchedulerCoreOptions o = {.name = "test scheduler",
                                             .quarantine_why = "a peer may still use them"})
      : pages(8, 4), model(8, 4), sched(std::move(o), &pages, &model, &transport) {}
  PageAllocator pages;
  FakeModel model;
  FakeTransport transport;
  OneQueueScheduler sched;
};

// A group whose collective always fails, as when a peer rank died.
class BrokenGroup final : public ProcessGroup {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  Status AllReduceMin(std::span<int32_t>) override {
    return Status::Unavailable("rank 1 left the group");
  }
};

// A model that drops a result.
class ShortModel final : public ModelRunner {
 public:
  Status Forward(std::span<const ForwardChunk> batch, std::vector<ForwardOutput>* out) override {
    out->assign(batch.size() - 1, ForwardOutput{});
    return Status::OK();
  }
};

}  // namespace

TEST_CASE("scheduler core: a broken pool invariant is returned by the step it happened in") {
  CoreRig rig;
  REQUIRE(rig.sched.AddRequest(1, 8).ok());
  REQUIRE(rig.sched.AddRequest(2, 4).ok());
  CHECK(rig.pages.free_pages() == 5);
  REQUIRE(rig.sched.Step().ok());
  // Something else frees both requests' pages behind the scheduler's back.
  const std::vector<int32_t> pages1 = rig.sched.pages_of(0), pages2 = rig.sched.pages_of(1);
  REQUIRE(rig.pages.Free(pages1, 1).ok());
  REQUIRE(rig.pages.Free(pages2, 2).ok());
  rig.transport[1].state = KVPoll::kSuccess;
  rig.transport[2].state = KVPoll::kSuccess;
  Status s = rig.sched.Step();
  // The first broken invariant, named by the scheduler; the requests themselves finished.
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK(s.message() == "test scheduler: room 1: page " + std::to_string(pages1[0]) +
                           " freed but not allocated (double free?)");
  std::vector<FinishedRequest> finished = rig.sched.TakeFinished();
  REQUIRE(finished.size() == 2);
  CHECK(finished[0].status.ok());
  CHECK(rig.sched.CoreMetrics().finished_reqs == 2);
  // Reported once: the next step is clean.
  CHECK(rig.sched.Step().ok());
}

TEST_CASE("scheduler core: a failed collective ends the step before any request moves") {
  BrokenGroup group;
  CoreRig rig({.name = "test scheduler", .group = &group});
  REQUIRE(rig.sched.AddRequest(1, 4).ok());
  rig.transport[1].state = KVPoll::kSuccess;
  Status s = rig.sched.Step();
  CHECK(s.code() == StatusCode::kUnavailable);
  CHECK(s.message() == "test scheduler: PollAndAllReduce: rank 1 left the group");
  CHECK(rig.sched.on_polls == 0);
  CHECK(rig.sched.schedules == 0);
  CHECK(rig.sched.TakeFinished().empty());
  CHECK(rig.pages.free_pages() == 7);
}

TEST_CASE("scheduler core: the polling interval skips polls, not scheduling") {
  CoreRig rig({.name = "test scheduler", .polling_interval = 3});
  REQUIRE(rig.sched.AddRequest(1, 4).ok());
  for (int i = 0; i < 7; ++i) REQUIRE(rig.sched.Step().ok());
  CHECK(rig.sched.on_polls == 3);  // steps 0, 3 and 6
  CHECK(rig.sched.schedules == 7);
  CHECK(rig.transport[1].polls == 3);
}

TEST_CASE("scheduler core: Allocate takes nothing when one resource is short") {
  CoreRig rig({.name = "test scheduler", .num_state_slots = 1});
  RequestMemory a, b, c;
  REQUIRE(rig.sched.Allocate(a, 1, 9));  // 3 pages, a request slot and the state slot
  CHECK(a.state_slot == 0);
  CHECK(rig.pages.free_pages() == 5);
  // No state slot left: no request slot or page is taken either.
  CHECK_FALSE(rig.sched.Allocate(b, 2, 4));
  CHECK_FALSE(b.holds_any());
  CHECK(rig.pages.free_pages() == 5);
  rig.sched.Release(a, 1);
  CHECK_FALSE(a.holds_any());
  CHECK(rig.pages.free_pages() == 8);
  // Too few pages: nothing taken.
  CHECK_FALSE(rig.sched.Allocate(c, 3, 33));
  CHECK_FALSE(c.holds_any());
  REQUIRE(rig.sched.Allocate(b, 2, 32));
  CHECK(rig.pages.free_pages() == 0);
  rig.sched.Release(b, 2);
  CHECK(rig.sched.Step().ok());
}

TEST_CASE("scheduler core: a model that drops a result fails the forward pass") {
  PageAllocator pages(8, 4);
  ShortModel model;
  FakeTransport transport;
  OneQueueScheduler sched({.name = "test scheduler"}, &pages, &model, &transport);
  const std::vector<int32_t> tokens = {1, 2, 3};
  const std::vector<ForwardChunk> chunks = {
      {.room = 1, .tokens = tokens, .start_pos = 0, .page_table = {}, .state_slot = -1},
      {.room = 2, .tokens = tokens, .start_pos = 0, .page_table = {}, .state_slot = -1}};
  std::vector<ForwardOutput> results;
  Status s = sched.Forward(chunks, &results);
  CHECK(s.code() == StatusCode::kInternal);
  CHECK(s.message() == "model returned 1 results for 2 chunks");
  CHECK(sched.CoreMetrics().forward_passes == 1);
  CHECK(sched.CoreMetrics().forward_tokens == 0);
  // A good pass counts every chunk's tokens.
  FakeModel good(8, 4);
  OneQueueScheduler counted({.name = "test scheduler"}, &pages, &good, &transport);
  std::vector<int32_t> table = {0};
  const std::vector<ForwardChunk> one = {
      {.room = 1, .tokens = tokens, .start_pos = 0, .page_table = table, .state_slot = -1}};
  REQUIRE(counted.Forward(one, &results).ok());
  CHECK(counted.CoreMetrics().forward_tokens == 3);
}

TEST_CASE("scheduler core: a quarantined room is refused with the side's reason") {
  CoreRig rig;
  REQUIRE(rig.sched.AddRequest(1, 4).ok());
  CHECK(rig.sched.AddRequest(1, 4).message() == "room 1 is already live");
  rig.transport[1].Fail("peer paused", /*quarantined=*/true);
  REQUIRE(rig.sched.Step().ok());
  CHECK(rig.sched.quarantined_size() == 1);
  Status s = rig.sched.AddRequest(1, 4);
  CHECK(s.code() == StatusCode::kAlreadyExists);
  CHECK(s.message() ==
        "room 1: its failed request's pages are still quarantined (a peer may still use them)");
  CHECK(rig.sched.CoreMetrics().rejected_reqs == 2);
  CHECK(rig.sched.CoreMetrics().quarantined_pages == 1);
  rig.transport[1].reusable = true;
  REQUIRE(rig.sched.Step().ok());
  CHECK(rig.sched.quarantined_size() == 0);
  CHECK(rig.sched.AddRequest(1, 4).ok());
}

TEST_CASE("scheduler core: SweepQueue keeps what it does not move, in order") {
  std::deque<std::unique_ptr<int>> queue;
  for (int i = 0; i < 5; ++i) queue.push_back(std::make_unique<int>(i));
  std::vector<std::unique_ptr<int>> moved;
  const std::vector<KVPoll> polls = {KVPoll::kSuccess, KVPoll::kTransferring, KVPoll::kSuccess};
  std::vector<int> visited;
  SweepQueue(queue, polls, [&](std::unique_ptr<int>& v, KVPoll p) {
    visited.push_back(*v);
    if (p == KVPoll::kSuccess) moved.push_back(std::move(v));
  });
  CHECK(visited == std::vector<int>{0, 1, 2});  // only the polled ones
  REQUIRE(moved.size() == 2);
  CHECK(*moved[0] == 0);
  CHECK(*moved[1] == 2);
  std::vector<int> left;
  for (const auto& v : queue) left.push_back(*v);
  CHECK(left == std::vector<int>{1, 3, 4});  // requests beyond the polls stay too
}

}  // namespace pdlib::sched
