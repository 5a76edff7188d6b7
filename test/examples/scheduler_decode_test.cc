// DecodeScheduler: the allocatable-token formula, pre-allocation limits, the prebuilt batch,
// retraction and resume order, polling interval, failures, page reuse (a failed request's memory
// stays quarantined until PagesReusable()). Transfers are played by the test:
// it writes the prompt's "KV" into the pages the receiver was given and the first token into the
// metadata slot, as prefill would, and the fake model's tokens depend on every stored token.
#include <algorithm>
#include <catch2/catch.hpp>
#include <map>

#include "examples/scheduler/decode_scheduler.h"
#include "scheduler_fakes.h"
#include "scheduler_test_rig.h"

namespace pdlib::sched {
namespace {

using testing::FakeModel;
using testing::FakeTransport;
using testing::NextToken;
using testing::ReferenceOutput;
using testing::StepAllRanks;

struct DecodeRig : testing::SchedulerRig<DecodeScheduler> {
  DecodeRig(DecodeSchedulerOptions o, int32_t num_pages, int32_t page_size,
            size_t metadata_slots = 64)
      : SchedulerRig(num_pages, page_size) {
    metadata = std::move(*MetadataBuffers::Create(metadata_slots, 0, 0));
    o.vocab_size = model.vocab();
    auto s = DecodeScheduler::Create(o, {&pages, metadata.get(), &transport, &model});
    REQUIRE(s.ok());
    sched = std::move(*s);
  }

  void Add(uint64_t room, int32_t prompt_len, int32_t max_new, bool connect = true) {
    Request r;
    r.room = room;
    for (int32_t i = 0; i < prompt_len; ++i)
      r.prompt.push_back(static_cast<int32_t>((room * 7 + i) % 50));
    r.max_new_tokens = max_new;
    SchedulerRig::Add(r, connect);
  }

  // Plays prefill for every receiver that was given pages: KV, metadata slot, Success.
  void Deliver(uint64_t room, uint64_t room_in_slot = 0) {
    auto& h = transport[room];
    REQUIRE(h.init_called);
    const Request& r = requests.at(room);
    model.WritePrompt(h.init_pages, r.prompt);
    metadata->bootstrap_room(*h.aux)[0] = room_in_slot != 0 ? room_in_slot : room;
    metadata->output_ids(*h.aux)[0] = NextToken(r.prompt, model.vocab());
    h.state = KVPoll::kSuccess;
  }
  void DeliverAll() {
    for (auto& [room, h] : transport.handles) {
      if (h->init_called && h->state == KVPoll::kWaitingForInput) Deliver(room);
    }
  }
};

}  // namespace

TEST_CASE("scheduler: allocatable tokens, each term of the formula") {
  AllocatableTokensInput in;
  in.available_tokens = 1000;
  in.reserved_decode_tokens = 10;
  in.num_running = 3;
  in.num_transfer = 2;
  in.num_waiting = 1;
  // Reserved decode space dominates: 1000 - max(60, 0) = 940.
  CHECK(AllocatableTokens(in) == 940);
  // The largest request finishing alone dominates: 1000 - max(60, 500 - 100) = 600.
  in.max_single_request_need = 500;
  in.retractable_tokens = 100;
  CHECK(AllocatableTokens(in) == 600);
  // Retracting the others would free enough: back to the reserved term.
  in.retractable_tokens = 480;
  CHECK(AllocatableTokens(in) == 940);
  // Retracted requests' needs come off the top.
  in.retracted_need = 300;
  CHECK(AllocatableTokens(in) == 640);
  // It may go negative: then nothing is pre-allocated.
  in.available_tokens = 50;
  CHECK(AllocatableTokens(in) == 50 - 60 - 300);
  // Nothing running, nothing queued: everything is allocatable.
  CHECK(AllocatableTokens({.available_tokens = 77}) == 77);
}

TEST_CASE("scheduler: pre-allocation charge checks now and worst case") {
  // Now: prompt + reserved; worst: prompt + max_new - retractable.
  CHECK(PreallocCharge(100, 30, 50, 10, 0) == 40);
  CHECK(PreallocCharge(79, 30, 50, 10, 0) == std::nullopt);  // worst 80 > 79
  CHECK(PreallocCharge(79, 30, 50, 10, 1) == 40);            // retracting frees 1: worst 79
  CHECK(PreallocCharge(39, 30, 5, 10, 0) == std::nullopt);   // now 40 > 39
  CHECK(PreallocCharge(40, 30, 5, 10, 0) == 40);
}

TEST_CASE("scheduler: retraction victim is the least advanced, then the longest prompt") {
  std::vector<RetractCandidate> running = {{5, 10}, {2, 10}, {2, 30}, {7, 100}};
  CHECK(PickRetractVictim(running) == 2u);
  running[2].output_tokens = 3;
  CHECK(PickRetractVictim(running) == 1u);
  running.push_back({2, 10});  // a tie with index 1: the later one goes
  CHECK(PickRetractVictim(running) == 4u);
  CHECK(PickRetractVictim({}) == std::nullopt);
}

TEST_CASE("scheduler: decode pre-allocates only what the formula allows") {
  // 8 pages of 4 tokens = 32 tokens; reserved 4 per request; each request: prompt 6, max_new 4,
  // so each charges 6 + 4 = 10 tokens (worst case 10 as well).
  DecodeSchedulerOptions o;
  o.max_running_requests = 8;
  o.pre_alloc_size = 8;
  o.reserved_decode_tokens = 4;
  DecodeRig rig(o, /*num_pages=*/8, /*page_size=*/4);
  for (uint64_t room = 1; room <= 5; ++room) rig.Add(room, 6, 4);
  CHECK(rig.sched->AllocatableTokens() == 32);
  rig.Step();
  // 32 -> 22 -> 12 -> 2: the fourth does not fit, and neither does the fifth (FIFO).
  CHECK(rig.sched->transfer_queue_size() == 3);
  CHECK(rig.sched->prealloc_queue_size() == 2);
  for (uint64_t room = 1; room <= 3; ++room) {
    CHECK(rig.transport[room].init_pages.size() == 2);  // PageCount(6, 4)
    CHECK(rig.transport[room].aux.has_value());
  }
  CHECK_FALSE(rig.transport[4].init_called);
  CHECK(rig.pages.free_pages() == 2);
  // Next step: 8 free tokens - max(4 * 3 in transfer, 0) = -4.
  CHECK(rig.sched->AllocatableTokens() == -4);
  rig.Step();
  CHECK(rig.sched->transfer_queue_size() == 3);
  CHECK(rig.sched->metrics().prealloc_tokens == 18);
  CHECK(rig.sched->metrics().prealloc_queue_size == 2);

  // Run everything to the end: every output equals the colocated reference.
  for (int i = 0; i < 100 && !rig.sched->idle(); ++i) {
    rig.DeliverAll();
    rig.Step();
  }
  REQUIRE(rig.sched->idle());
  REQUIRE(rig.finished.size() == 5);
  for (auto& [room, f] : rig.finished) {
    INFO("room " << room << ": " << f.status.ToString());
    CHECK(f.status.ok());
    CHECK(f.output_ids == ReferenceOutput(rig.requests[room].prompt, 4, rig.model.vocab()));
  }
  CHECK(rig.pages.free_pages() == 8);
  CHECK(rig.metadata->num_slots() == 64);
}

TEST_CASE("scheduler: DecodeReqToTokenPool bounds pre-allocation to pre_alloc_size extra slots") {
  DecodeSchedulerOptions o;
  o.max_running_requests = 1;
  o.pre_alloc_size = 2;
  o.reserved_decode_tokens = 0;
  DecodeRig rig(o, /*num_pages=*/64, /*page_size=*/4);
  for (uint64_t room = 1; room <= 5; ++room) rig.Add(room, 4, 3);
  rig.Step();
  // Plenty of memory, 1 + 2 request slots.
  CHECK(rig.sched->transfer_queue_size() == 3);
  CHECK(rig.sched->prealloc_queue_size() == 2);
  rig.DeliverAll();
  rig.Step();
  // One runs, two wait for a running slot holding their slots; nothing new is pre-allocated.
  CHECK(rig.sched->running_size() == 1);
  CHECK(rig.sched->waiting_queue_size() == 2);
  CHECK(rig.sched->prealloc_queue_size() == 2);
  for (int i = 0; i < 100 && !rig.sched->idle(); ++i) {
    CHECK(rig.sched->running_size() <= 1);
    CHECK(rig.sched->transfer_queue_size() + rig.sched->waiting_queue_size() +
              rig.sched->running_size() <=
          3);
    rig.DeliverAll();
    rig.Step();
  }
  REQUIRE(rig.finished.size() == 5);
  for (auto& [room, f] : rig.finished) CHECK(f.status.ok());
}

TEST_CASE("scheduler: unconnected receivers are skipped, not blocking later ones") {
  DecodeSchedulerOptions o;
  o.reserved_decode_tokens = 0;
  DecodeRig rig(o, 64, 4);
  rig.Add(1, 4, 2, /*connect=*/false);
  rig.Add(2, 4, 2);
  rig.Step();
  CHECK_FALSE(rig.transport[1].init_called);
  CHECK(rig.transport[2].init_called);
  rig.transport[1].state = KVPoll::kWaitingForInput;
  rig.Step();
  CHECK(rig.transport[1].init_called);
}

TEST_CASE("scheduler: the prebuilt batch starts decoding from the received KV and first token") {
  DecodeSchedulerOptions o;
  o.reserved_decode_tokens = 0;
  DecodeRig rig(o, 64, 4);
  rig.Add(10, 5, 3);
  rig.Add(11, 6, 1);  // max_new_tokens 1: the first token from prefill is the whole answer
  rig.Step();
  rig.DeliverAll();
  rig.Step();
  // No prefill forward: the first forward is a decode step at position prompt_len, fed with the
  // first token; room 11 finished without any forward.
  REQUIRE(rig.model.batches.size() == 1);
  REQUIRE(rig.model.batches[0].size() == 1);
  CHECK(rig.model.batches[0][0].room == 10);
  CHECK(rig.model.batches[0][0].start_pos == 5);
  CHECK(rig.model.batches[0][0].tokens == 1);
  REQUIRE(rig.finished.count(11) == 1);
  CHECK(rig.finished[11].status.ok());
  CHECK(rig.finished[11].output_ids ==
        std::vector<int32_t>{NextToken(rig.requests[11].prompt, rig.model.vocab())});
  rig.Step();
  REQUIRE(rig.finished.count(10) == 1);
  CHECK(rig.finished[10].output_ids == ReferenceOutput(rig.requests[10].prompt, 3, 50));
  CHECK(rig.pages.free_pages() == 64);
  // Every slot is back: a fresh round can use all of them.
  CHECK(rig.sched->AllocatableTokens() == 256);
}

TEST_CASE("scheduler: a wrong bootstrap_room in the metadata slot fails the request") {
  DecodeSchedulerOptions o;
  o.reserved_decode_tokens = 0;
  DecodeRig rig(o, 16, 4);
  rig.Add(21, 5, 3);
  rig.Step();
  rig.Deliver(21, /*room_in_slot=*/99);
  rig.Step();
  REQUIRE(rig.finished.count(21) == 1);
  CHECK(rig.finished[21].status.code() == StatusCode::kDataLoss);
  CHECK(rig.finished[21].status.message().find("bootstrap_room 99") != std::string::npos);
  CHECK(rig.pages.free_pages() == 16);
  CHECK(rig.sched->metrics().transfer_failed_reqs == 1);
  CHECK(rig.transport.handles.at(21)->destroyed);
}

TEST_CASE("scheduler: failed receivers free everything and are counted by stage") {
  DecodeSchedulerOptions o;
  o.reserved_decode_tokens = 0;
  DecodeRig rig(o, 16, 4);
  rig.Add(31, 5, 3, /*connect=*/false);
  rig.Add(32, 5, 3);
  rig.Step();
  rig.transport[31].Fail("bootstrap: no prefill rank");
  rig.transport[32].Fail("prefill rank died");
  rig.Step();
  REQUIRE(rig.finished.size() == 2);
  CHECK(rig.finished[31].status.message() == "bootstrap: no prefill rank");
  CHECK(rig.finished[32].status.code() == StatusCode::kUnavailable);
  SchedulerMetrics m = rig.sched->metrics();
  CHECK(m.bootstrap_failed_reqs == 1);
  CHECK(m.transfer_failed_reqs == 1);
  CHECK(rig.pages.free_pages() == 16);
  CHECK(rig.sched->idle());
}

TEST_CASE("scheduler: decode names the window pages as state indices (sliding window)") {
  // Window 6, pages of 4: a prompt of 10 tokens needs pages 1 and 2 of its 3; the KV arrives and
  // the hook sees the page table before the first decode step.
  DecodeSchedulerOptions o;
  o.reserved_decode_tokens = 0;
  o.sliding_window = 6;
  o.kv_bytes_per_page = 1000;
  o.page_state_bytes_per_page = 10;
  std::vector<std::pair<uint64_t, int64_t>> arrived;
  o.on_kv_arrived = [&](uint64_t room, std::span<const int32_t> table, int64_t tokens) {
    CHECK(table.size() == 3);
    arrived.emplace_back(room, tokens);
  };
  DecodeRig rig(o, 64, 4);
  rig.Add(1, 10, 2);
  rig.Step();
  REQUIRE(rig.transport[1].init_called);
  const std::vector<int32_t>& pages = rig.transport[1].init_pages;
  REQUIRE(pages.size() == 3);
  CHECK(rig.transport[1].state_indices == std::vector<int32_t>{pages[1], pages[2]});
  CHECK(arrived.empty());
  rig.DeliverAll();
  for (int i = 0; i < 5 && rig.finished.empty(); ++i) rig.Step();
  CHECK(arrived == std::vector<std::pair<uint64_t, int64_t>>{{1, 10}});
  REQUIRE(rig.finished.count(1) == 1);
  CHECK(rig.finished[1].status.ok());
  CHECK(rig.finished[1].kv_bytes == 3 * 1000 + 2 * 10);
}

TEST_CASE("scheduler: decode names every prompt page as state (NSA-style whole sequence)") {
  DecodeSchedulerOptions o;
  o.reserved_decode_tokens = 0;
  o.whole_sequence_state = true;
  DecodeRig rig(o, 64, 4);
  rig.Add(1, 10, 2);
  rig.Step();
  REQUIRE(rig.transport[1].init_called);
  const std::vector<int32_t>& pages = rig.transport[1].init_pages;
  REQUIRE(pages.size() == 3);
  CHECK(rig.transport[1].state_indices == pages);
}

TEST_CASE("scheduler: a KVReceiver::Init refused on this rank fails the request at the next poll") {
  DecodeSchedulerOptions o;
  o.reserved_decode_tokens = 0;
  DecodeRig rig(o, 64, 4);
  rig.Add(1, 8, 2);
  rig.transport[1].call_error = Status::Unavailable("Init refused here");
  rig.Step();
  CHECK(rig.finished.empty());  // still queued, like on the ranks whose Init succeeded
  CHECK(rig.transport[1].state == KVPoll::kFailed);
  for (int i = 0; i < 3 && rig.finished.empty(); ++i) rig.Step();
  REQUIRE(rig.finished.count(1) == 1);
  CHECK_THAT(std::string(rig.finished[1].status.message()), Catch::Contains("Init refused here"));
  CHECK_THAT(std::string(rig.finished[1].status.message()), Catch::Contains("KVReceiver::Init"));
}

TEST_CASE("scheduler: decode quarantines a failed request's pages and slots until PagesReusable") {
  // 3 pages of 4 tokens, one metadata slot, one state slot: while room 1 (prompt 8: 2 pages)
  // holds its memory, room 2 cannot be pre-allocated.
  DecodeSchedulerOptions o;
  o.reserved_decode_tokens = 0;
  o.num_state_slots = 1;
  DecodeRig rig(o, /*num_pages=*/3, /*page_size=*/4, /*metadata_slots=*/1);
  rig.Add(1, 8, 2);
  rig.Step();
  REQUIRE(rig.transport[1].init_called);
  const std::vector<int32_t> pages1 = rig.transport[1].init_pages;
  const std::optional<uint32_t> aux1 = rig.transport[1].aux;
  const std::vector<int32_t> state1 = rig.transport[1].state_indices;
  REQUIRE(pages1.size() == 2);
  REQUIRE(state1.size() == 1);
  CHECK(rig.pages.free_pages() == 1);

  // A late write from prefill may still land: pdlib does not call the pages reusable yet.
  rig.transport[1].Fail("prefill rank paused mid-transfer", /*quarantined=*/true);
  rig.Step();
  // The request itself finishes at once, with the reason, but its memory stays out of use, its
  // receiver kept.
  testing::CheckHeld(rig, 1, "prefill rank paused mid-transfer", /*free_pages=*/1,
                     /*held_pages=*/2);
  SchedulerMetrics m = rig.sched->metrics();
  CHECK(m.transfer_failed_reqs == 1);
  CHECK(m.free_tokens == 4);
  const std::string text = RenderPrometheus(m, {{"role", "decode"}});
  CHECK(text.find("pdlib_scheduler_quarantined_pages{role=\"decode\"} 2\n") != std::string::npos);
  CHECK(text.find("pdlib_scheduler_quarantined_requests{role=\"decode\"} 1\n") !=
        std::string::npos);
  // Its room cannot come back while the old receiver is held.
  Status again = rig.sched->AddRequest(rig.requests[1]);
  CHECK(again.code() == StatusCode::kAlreadyExists);
  CHECK(again.message().find("quarantined") != std::string::npos);

  // Room 2 fits the cache, but not beside room 1's held pages, metadata slot and state slot.
  rig.Add(2, 8, 2);
  for (int i = 0; i < 5; ++i) rig.Step();
  CHECK_FALSE(rig.transport[2].init_called);
  CHECK(rig.sched->prealloc_queue_size() == 1);
  CHECK(rig.pages.free_pages() == 1);
  CHECK(rig.sched->quarantined_size() == 1);
  CHECK_FALSE(rig.transport.handles.at(1)->destroyed);

  // pdlib says nothing will land any more: the next step frees them, and room 2 gets them.
  rig.transport[1].reusable = true;
  rig.Step();
  CHECK(rig.transport.handles.at(1)->destroyed);
  CHECK(rig.sched->quarantined_size() == 0);
  CHECK(rig.sched->metrics().quarantined_pages == 0);
  REQUIRE(rig.transport[2].init_called);
  CHECK(rig.transport[2].init_pages == pages1);
  CHECK(rig.transport[2].aux == aux1);
  CHECK(rig.transport[2].state_indices == state1);
  rig.Deliver(2);
  for (int i = 0; i < 10 && !rig.sched->idle(); ++i) rig.Step();
  REQUIRE(rig.finished.count(2) == 1);
  CHECK(rig.finished[2].status.ok());
  CHECK(rig.finished[2].output_ids == ReferenceOutput(rig.requests[2].prompt, 2, 50));
  CHECK(rig.pages.free_pages() == 3);
}

TEST_CASE("scheduler: decode checks the quarantine on every step, not only when it polls") {
  DecodeSchedulerOptions o;
  o.polling_interval = 2;
  o.reserved_decode_tokens = 0;
  DecodeRig rig(o, 8, 4);
  rig.Add(1, 4, 2);
  rig.Add(2, 4, 2, /*connect=*/false);  // stays in the prealloc queue: its polls show the polls
  rig.Step();                           // step 0 polls: room 1 pre-allocated
  REQUIRE(rig.transport[1].init_called);
  rig.transport[1].Fail("prefill rank paused", /*quarantined=*/true);
  rig.Step();  // step 1 does not poll
  rig.Step();  // step 2 polls: failed, quarantined
  REQUIRE(rig.finished.count(1) == 1);
  CHECK(rig.pages.free_pages() == 7);
  rig.Step();  // steps 3 and 4: nothing reusable yet
  rig.Step();
  CHECK(rig.pages.free_pages() == 7);
  CHECK(rig.transport[2].polls == 3);
  rig.transport[1].reusable = true;
  rig.Step();  // step 5 does not poll the queues, but the quarantine is checked
  CHECK(rig.transport[2].polls == 3);
  CHECK(rig.pages.free_pages() == 8);
  CHECK(rig.transport.handles.at(1)->destroyed);
}

TEST_CASE(
    "scheduler: decode FailAll quarantines what prefill may still write, shutdown frees all") {
  DecodeSchedulerOptions o;
  o.reserved_decode_tokens = 0;
  o.num_state_slots = 4;
  DecodeRig rig(o, 16, 4);
  rig.Add(1, 4, 5);
  rig.Add(2, 4, 5);
  rig.Step();
  rig.Deliver(1);
  rig.Step();
  // Room 1 is running (its transfer succeeded: 2 pages by now), room 2 still transferring.
  REQUIRE(rig.sched->running_size() == 1);
  REQUIRE(rig.sched->transfer_queue_size() == 1);
  CHECK(rig.pages.free_pages() == 13);
  // Aborting room 2's live receiver leaves a write possibly in flight (a real pdlib's answer
  // until prefill drains the room).
  rig.transport[2].abort_quarantines = true;
  rig.sched->FailAll(Status::Unavailable("decode host gives up"));
  rig.CollectFinished();
  REQUIRE(rig.finished.size() == 2);
  for (auto& [room, f] : rig.finished) CHECK(f.status.code() == StatusCode::kUnavailable);
  CHECK(rig.transport[2].state == KVPoll::kFailed);
  CHECK(rig.sched->idle());
  // Room 1's pages come back at once (pdlib wrote them all before Success); room 2's are held.
  CHECK(rig.transport.handles.at(1)->destroyed);
  CHECK_FALSE(rig.transport.handles.at(2)->destroyed);
  CHECK(rig.sched->quarantined_size() == 1);
  CHECK(rig.pages.free_pages() == 15);
  for (int i = 0; i < 3; ++i) rig.Step();
  CHECK(rig.pages.free_pages() == 15);
  // Shutdown: the scheduler goes (the manager next), and everything with it, without waiting.
  rig.sched.reset();
  CHECK(rig.transport.handles.at(2)->destroyed);
  CHECK(rig.pages.free_pages() == 16);
}

TEST_CASE("scheduler: decode TP ranks free a quarantined request's memory on the same step") {
  // Room 1 fails on rank 0 with its pages quarantined; rank 1's receiver was still transferring
  // and is aborted (reusable at once there). Both ranks hold the memory until rank 0's pages are
  // reusable, so their pools stay the same.
  DecodeSchedulerOptions o;
  o.reserved_decode_tokens = 0;
  auto [group, rigs] = testing::MakeTpRanks<DecodeRig>(2, o, 8, 4);
  for (auto& rig : rigs) rig->Add(1, 8, 2);
  StepAllRanks(rigs);
  for (auto& rig : rigs) REQUIRE(rig->transport[1].init_called);
  rigs[0]->transport[1].Fail("prefill rank paused", /*quarantined=*/true);
  rigs[1]->transport[1].state = KVPoll::kTransferring;
  StepAllRanks(rigs);
  testing::CheckQuarantinedOnAllRanks(rigs, 1, 6);
  CHECK(rigs[1]->transport[1].state == KVPoll::kFailed);  // aborted
  CHECK(rigs[1]->transport[1].reusable);
  for (int i = 0; i < 3; ++i) StepAllRanks(rigs);
  for (auto& rig : rigs) CHECK(rig->pages.free_pages() == 6);
  rigs[0]->transport[1].reusable = true;
  StepAllRanks(rigs);
  testing::CheckReleasedOnAllRanks(rigs, 1, 8);
}

TEST_CASE("scheduler: decode rejects a request longer than the KV capacity, with the numbers") {
  DecodeSchedulerOptions o;
  DecodeRig rig(o, /*num_pages=*/4, /*page_size=*/4);
  Request r;
  r.room = 5;
  r.prompt.assign(14, 1);
  r.max_new_tokens = 3;
  Status s = rig.sched->AddRequest(r);
  CHECK(s.code() == StatusCode::kResourceExhausted);
  CHECK(s.message() ==
        "room 5: prompt of 14 tokens + max_new_tokens 3 needs 17 tokens, but the KV cache holds "
        "only 4 pages of 4 tokens (16 tokens)");
  r.prompt.clear();
  CHECK(rig.sched->AddRequest(r).code() == StatusCode::kInvalidArgument);
  r.prompt.assign(3, 1);
  r.max_new_tokens = 0;
  CHECK(rig.sched->AddRequest(r).code() == StatusCode::kInvalidArgument);
  r.max_new_tokens = 2;
  CHECK(rig.sched->AddRequest(r).ok());
  CHECK(rig.sched->AddRequest(r).code() == StatusCode::kAlreadyExists);
  CHECK(rig.sched->metrics().rejected_reqs == 4);
  CHECK(rig.sched->metrics().requests_total == 1);
}

TEST_CASE("scheduler: polling interval spaces out the receiver polls") {
  DecodeSchedulerOptions o;
  o.polling_interval = 3;
  o.reserved_decode_tokens = 0;
  DecodeRig rig(o, 16, 4);
  rig.Add(41, 4, 5);
  rig.Step();  // step 0 polls: pre-allocated
  CHECK(rig.transport[41].polls == 1);
  CHECK(rig.transport[41].init_called);
  rig.Deliver(41);
  rig.Step();  // steps 1 and 2 do not poll: the finished transfer is not seen yet
  rig.Step();
  CHECK(rig.transport[41].polls == 1);
  CHECK(rig.sched->transfer_queue_size() == 1);
  rig.Step();  // step 3 polls
  CHECK(rig.transport[41].polls == 2);
  CHECK(rig.sched->running_size() == 1);
}

TEST_CASE("scheduler: retraction under memory pressure, resumed first and in order") {
  // 9 pages of 2 tokens. Three requests of prompt 3, max_new 8 (11 tokens each at most) all fit
  // the formula at first (reserved 0), but as they grow the pages run out: the least advanced
  // request is retracted, KV to host memory, and resumed when memory frees up.
  DecodeSchedulerOptions o;
  o.max_running_requests = 4;
  o.pre_alloc_size = 4;
  o.reserved_decode_tokens = 0;
  DecodeRig rig(o, /*num_pages=*/9, /*page_size=*/2);
  rig.Add(1, 3, 8);
  rig.Add(2, 3, 8);
  rig.Add(3, 3, 8);
  std::vector<std::string> log;
  std::vector<uint64_t> last_retracted;
  bool late_added = false;
  uint64_t resumed_before_late_init = 0;
  for (int i = 0; i < 200 && !(rig.sched->idle() && late_added); ++i) {
    rig.DeliverAll();
    rig.Step();
    const std::vector<uint64_t> retracted = rig.sched->retracted_rooms();
    for (uint64_t room : retracted) {
      if (std::find(last_retracted.begin(), last_retracted.end(), room) == last_retracted.end()) {
        log.push_back("retract " + std::to_string(room));
      }
    }
    for (uint64_t room : last_retracted) {
      if (std::find(retracted.begin(), retracted.end(), room) == retracted.end()) {
        log.push_back("resume " + std::to_string(room));
      }
    }
    last_retracted = retracted;
    // A new request arrives while requests are retracted: it must wait for them.
    if (!late_added && !retracted.empty()) {
      rig.Add(4, 2, 2);
      late_added = true;
    }
    if (late_added && rig.transport[4].init_called && resumed_before_late_init == 0) {
      resumed_before_late_init = rig.sched->metrics().resumed_reqs;
      log.push_back("init 4");
    }
  }
  REQUIRE(rig.sched->idle());
  INFO("log: " << [&] {
    std::string s;
    for (auto& l : log) s += l + "; ";
    return s;
  }());
  // Room 3 goes first (ties on progress and prompt: the latest), then room 2. Retracted
  // requests resume in the order they were retracted (with reserved_decode_tokens 0 a resumed
  // request may be retracted again), and the late request gets memory only once none is left.
  REQUIRE(log.size() >= 5);
  CHECK(log[0] == "retract 3");
  CHECK(log[1] == "retract 2");
  CHECK(log.back() == "init 4");
  std::vector<std::string> queue;  // the retracted queue replayed from the log
  for (const std::string& l : log) {
    if (l.rfind("retract ", 0) == 0) queue.push_back(l.substr(8));
    if (l.rfind("resume ", 0) == 0) {
      REQUIRE_FALSE(queue.empty());
      CHECK(l.substr(7) == queue.front());  // FIFO
      queue.erase(queue.begin());
    }
  }
  CHECK(queue.empty());
  SchedulerMetrics m = rig.sched->metrics();
  CHECK(m.retracted_reqs >= 2);
  CHECK(resumed_before_late_init == m.retracted_reqs);
  CHECK(m.resumed_reqs == m.retracted_reqs);
  CHECK(rig.model.offloads == static_cast<int>(m.retracted_reqs));
  CHECK(rig.model.restores == static_cast<int>(m.retracted_reqs));
  // Retraction lost nothing: every output equals the colocated reference.
  REQUIRE(rig.finished.size() == 4);
  for (auto& [room, f] : rig.finished) {
    INFO("room " << room << ": " << f.status.ToString());
    CHECK(f.status.ok());
    CHECK(f.output_ids == ReferenceOutput(rig.requests[room].prompt,
                                          rig.requests[room].max_new_tokens, rig.model.vocab()));
  }
  CHECK(rig.pages.free_pages() == 9);
}

TEST_CASE("scheduler: decode metrics render as Prometheus text") {
  DecodeSchedulerOptions o;
  o.reserved_decode_tokens = 0;
  o.kv_bytes_per_page = 1000;
  DecodeRig rig(o, 16, 4);
  rig.Add(51, 5, 2);
  rig.Add(52, 5, 2, /*connect=*/false);
  rig.Step();
  rig.Deliver(51);
  rig.Step();
  SchedulerMetrics m = rig.sched->metrics();
  CHECK(m.transferred_pages == 2);
  CHECK(m.transferred_bytes == 2000);
  CHECK(m.transfer_latency_count == 1);
  const std::string text = RenderPrometheus(m, {{"role", "decode"}});
  CHECK(text.find("# TYPE pdlib_scheduler_prealloc_queue_size gauge\n"
                  "pdlib_scheduler_prealloc_queue_size{role=\"decode\"} 1\n") != std::string::npos);
  CHECK(text.find("pdlib_scheduler_transferred_pages_total{role=\"decode\"} 2\n") !=
        std::string::npos);
  CHECK(text.find("pdlib_scheduler_finished_reqs_total{role=\"decode\"} 1\n") != std::string::npos);
  CHECK(text.find("pdlib_scheduler_transfer_latency_seconds_count{role=\"decode\"} 1\n") !=
        std::string::npos);
  CHECK(text.find("pdlib_scheduler_bootstrap_failed_reqs_total{role=\"decode\"} 0\n") !=
        std::string::npos);
}

}  // namespace pdlib::sched
