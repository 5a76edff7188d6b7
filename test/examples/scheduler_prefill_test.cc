// PrefillScheduler: bootstrap -> waiting (chunked prefill under a token budget) -> inflight,
// what is sent per chunk, the metadata slot, freeing on success and failure, rejection of
// requests longer than the KV cache, KV events, TP agreement through PollAndAllReduce, page reuse
// (a failed request's source pages stay quarantined until PagesReusable()).
#include <catch2/catch.hpp>
#include <map>

#include "examples/scheduler/prefill_scheduler.h"
#include "scheduler_fakes.h"
#include "scheduler_test_rig.h"

namespace pdlib::sched {
namespace {

using testing::FakeModel;
using testing::FakeTransport;
using testing::NextToken;
using testing::StepAllRanks;

struct PrefillRig : testing::SchedulerRig<PrefillScheduler> {
  explicit PrefillRig(PrefillSchedulerOptions o, int32_t num_pages = 32, int32_t page_size = 4)
      : SchedulerRig(num_pages, page_size) {
    metadata = std::move(*MetadataBuffers::Create(
        MetadataBuffers::SlotCountFor(static_cast<size_t>(o.max_running_requests)), 0, 0));
    auto s = PrefillScheduler::Create(o, {&pages, metadata.get(), &transport, &model});
    REQUIRE(s.ok());
    sched = std::move(*s);
  }

  void Add(uint64_t room, int32_t prompt_len, bool connect = true) {
    Request r;
    r.room = room;
    for (int32_t i = 0; i < prompt_len; ++i)
      r.prompt.push_back(static_cast<int32_t>((room + 3 * i) % 50));
    SchedulerRig::Add(r, connect);
  }
};

std::vector<KVEvent> AllEvents(KVEventPublisher& p) {
  auto sub = p.Subscribe(0, [](const KVEvent&) {});
  p.Unsubscribe(sub.id);
  return sub.replay;
}

}  // namespace

TEST_CASE("scheduler: prefill chunks under the token budget and sends whole pages until the last") {
  PrefillSchedulerOptions o;
  o.chunked_prefill_size = 8;
  o.kv_bytes_per_page = 100;
  PrefillRig rig(o, /*num_pages=*/32, /*page_size=*/4);
  rig.Add(1, 10);
  rig.Add(2, 5);
  rig.Add(3, 4, /*connect=*/false);  // decode has not sent its TransferInfo yet
  rig.Step();
  // Bootstrapped requests got a metadata slot and announced their page counts.
  CHECK(rig.transport[1].init_num_pages == 3);
  CHECK(rig.transport[2].init_num_pages == 2);
  CHECK(rig.transport[1].aux != rig.transport[2].aux);
  CHECK_FALSE(rig.transport[3].init_called);
  CHECK(rig.sched->bootstrap_queue_size() == 1);
  // First forward: 8 of room 1's 10 tokens (the budget); two whole pages sent, not last.
  REQUIRE(rig.model.batches.size() == 1);
  REQUIRE(rig.model.batches[0].size() == 1);
  CHECK(rig.model.batches[0][0].start_pos == 0);
  CHECK(rig.model.batches[0][0].tokens == 8);
  REQUIRE(rig.transport[1].sends.size() == 1);
  CHECK(rig.transport[1].sends[0].pages == std::vector<int32_t>{0, 1});
  CHECK_FALSE(rig.transport[1].sends[0].last);

  rig.Step();
  // Second forward: room 1's last 2 tokens and all of room 2 (7 of 8 budget tokens).
  REQUIRE(rig.model.batches.size() == 2);
  REQUIRE(rig.model.batches[1].size() == 2);
  CHECK(rig.model.batches[1][0].room == 1);
  CHECK(rig.model.batches[1][0].start_pos == 8);
  CHECK(rig.model.batches[1][0].tokens == 2);
  CHECK(rig.model.batches[1][1].room == 2);
  CHECK(rig.model.batches[1][1].tokens == 5);
  REQUIRE(rig.transport[1].sends.size() == 2);
  CHECK(rig.transport[1].sends[1].pages == std::vector<int32_t>{2});  // the partial last page
  CHECK(rig.transport[1].sends[1].last);
  REQUIRE(rig.transport[2].sends.size() == 1);
  CHECK(rig.transport[2].sends[0].pages == std::vector<int32_t>{3, 4});
  CHECK(rig.transport[2].sends[0].last);
  CHECK(rig.sched->inflight_queue_size() == 2);

  // The metadata slot carries the first token, its logprobs and the room (SPEC R4.1, R4.4).
  const uint32_t slot = *rig.transport[1].aux;
  const int32_t first = NextToken(rig.requests[1].prompt, rig.model.vocab());
  CHECK(rig.metadata->output_ids(slot)[0] == first);
  CHECK(rig.metadata->output_token_logprobs_val(slot)[0] == -0.5f);
  CHECK(rig.metadata->output_top_logprobs_idx(slot)[1] == (first + 1) % rig.model.vocab());
  CHECK(rig.metadata->output_top_logprobs_val(slot)[1] == -1.5f);
  CHECK(rig.metadata->bootstrap_room(slot)[0] == 1u);

  // Transfers end: success frees the pages and the slot; failure too, with the reason.
  CHECK(rig.pages.free_pages() == 32 - 5);
  rig.transport[1].state = KVPoll::kSuccess;
  rig.transport[2].Fail("decode rank 0 went away");
  rig.Step();
  REQUIRE(rig.finished.size() == 2);
  CHECK(rig.finished[1].status.ok());
  CHECK(rig.finished[1].output_ids == std::vector<int32_t>{first});
  CHECK(rig.finished[2].status.message() == "decode rank 0 went away");
  CHECK(rig.pages.free_pages() == 32);
  SchedulerMetrics m = rig.sched->metrics();
  CHECK(m.finished_reqs == 1);
  CHECK(m.transfer_failed_reqs == 1);
  CHECK(m.transferred_pages == 5);
  CHECK(m.transferred_bytes == 500);
  CHECK(m.forward_passes == 2);
  CHECK(m.forward_tokens == 15);
  CHECK(m.bootstrap_queue_size == 1);
  CHECK(m.inflight_queue_size == 0);
  CHECK(m.transfer_latency_count == 1);

  // KV events: pages stored per request on its first chunk, removed when its transfer ended.
  std::vector<KVEvent> ev = AllEvents(rig.events);
  REQUIRE(ev.size() == 4);
  CHECK(ev[0].type == KVEventType::kBlockStored);
  CHECK(ev[0].room == 1u);
  CHECK(ev[0].pages == std::vector<int32_t>{0, 1, 2});
  CHECK(ev[1].room == 2u);
  CHECK(ev[1].pages == std::vector<int32_t>{3, 4});
  CHECK(ev[2].type == KVEventType::kBlockRemoved);
  CHECK(ev[3].type == KVEventType::kBlockRemoved);
  CHECK(ev[3].seq == 4u);
  CHECK(ev[0].page_size == 4);
}

TEST_CASE("scheduler: layer-wise prefill announces each chunk's layers during its forward") {
  PrefillSchedulerOptions o;
  o.chunked_prefill_size = 8;
  o.layerwise = true;
  PrefillRig rig(o, /*num_pages=*/32, /*page_size=*/4);
  rig.model.kv_layers = 3;
  rig.Add(1, 10);
  rig.Add(2, 2);
  rig.transport[1].num_layers = 3;
  rig.transport[2].num_layers = 3;
  rig.Step();
  // Chunk 1 of room 1 (8 tokens: pages 0, 1): layers 1 and 2 announced during the forward, all
  // three completed by Send() after it.
  const auto& r1 = rig.transport[1];
  REQUIRE(r1.layer_sends.size() == 2);
  CHECK(r1.layer_sends[0].pages == std::vector<int32_t>{0, 1});
  CHECK(r1.layer_sends[0].layers == 1);
  CHECK(r1.layer_sends[1].layers == 2);
  CHECK_FALSE(r1.layer_sends[1].last);
  CHECK(r1.layer_sends[1].sends_before == 0);
  REQUIRE(r1.sends.size() == 1);
  CHECK(r1.sends[0].pages == std::vector<int32_t>{0, 1});
  rig.Step();
  // Last chunk of room 1 (the partial page 2) and room 2 (page 3), in one forward.
  REQUIRE(r1.layer_sends.size() == 4);
  CHECK(r1.layer_sends[2].pages == std::vector<int32_t>{2});
  CHECK(r1.layer_sends[2].last);
  CHECK(r1.layer_sends[3].layers == 2);
  CHECK(r1.layer_sends[3].sends_before == 1);
  REQUIRE(r1.sends.size() == 2);
  CHECK(r1.sends[1].last);
  const auto& r2 = rig.transport[2];
  REQUIRE(r2.layer_sends.size() == 2);
  CHECK(r2.layer_sends[0].pages == std::vector<int32_t>{3});
  REQUIRE(r2.sends.size() == 1);
  CHECK(r2.sends[0].last);

  // Without the option the same requests are only Send()-ed.
  PrefillSchedulerOptions off = o;
  off.layerwise = false;
  PrefillRig plain(off, 32, 4);
  plain.model.kv_layers = 3;
  plain.Add(1, 10);
  plain.transport[1].num_layers = 3;
  plain.Step();
  plain.Step();
  CHECK(plain.transport[1].layer_sends.empty());
  CHECK(plain.transport[1].sends.size() == 2);
}

TEST_CASE("scheduler: pull sends every page of the prompt, before decode's TransferInfo too") {
  PrefillSchedulerOptions o;
  o.chunked_prefill_size = 8;
  o.kv_bytes_per_page = 100;
  o.direction = TransferDirection::kPull;
  PrefillRig rig(o, /*num_pages=*/32, /*page_size=*/4);
  rig.Add(1, 10, /*connect=*/false);  // decode has not come: prefill publishes anyway
  rig.Add(2, 12);
  rig.transport[1].pull = rig.transport[2].pull = true;
  rig.transport[2].sender_prefix = 8;  // decode holds room 2's first two pages
  rig.Step();
  // Both admitted at once, each announcing every page of its prompt, decode's prefix or not.
  CHECK(rig.sched->bootstrap_queue_size() == 0);
  CHECK(rig.transport[1].init_num_pages == 3);
  CHECK(rig.transport[2].init_num_pages == 3);
  REQUIRE(rig.transport[1].sends.size() == 1);
  CHECK(rig.transport[1].sends[0].pages == std::vector<int32_t>{0, 1});
  CHECK_FALSE(rig.transport[1].sends[0].last);
  rig.Step();
  rig.Step();
  REQUIRE(rig.transport[1].sends.size() == 2);
  CHECK(rig.transport[1].sends[1].pages == std::vector<int32_t>{2});
  CHECK(rig.transport[1].sends[1].last);
  // Room 2's pages from the first one on, its prefix pages included.
  std::vector<int32_t> sent;
  for (const auto& c : rig.transport[2].sends)
    sent.insert(sent.end(), c.pages.begin(), c.pages.end());
  CHECK(sent.size() == 3);
  CHECK(rig.transport[2].sends.back().last);
  CHECK(rig.sched->inflight_queue_size() == 2);
  // Success once decode has read them; the bytes moved are those decode read (after its
  // prefix): 3 pages for room 1, 1 for room 2.
  rig.transport[1].state = KVPoll::kSuccess;
  rig.transport[2].state = KVPoll::kSuccess;
  rig.Step();
  REQUIRE(rig.finished.size() == 2);
  CHECK(rig.finished[1].status.ok());
  CHECK(rig.finished[1].kv_bytes == 300);
  CHECK(rig.finished[2].kv_bytes == 100);
  CHECK(rig.pages.free_pages() == 32);

  // The same in push: room 1 waits for decode, room 2 sends only its page after the prefix.
  PrefillSchedulerOptions push = o;
  push.direction = TransferDirection::kPush;
  PrefillRig p(push, 32, 4);
  p.Add(1, 10, /*connect=*/false);
  p.Add(2, 12);
  p.transport[2].sender_prefix = 8;
  p.Step();
  p.Step();
  CHECK_FALSE(p.transport[1].init_called);
  CHECK(p.transport[2].init_num_pages == 1);
  REQUIRE(p.transport[2].sends.size() == 1);
  CHECK(p.transport[2].sends[0].pages.size() == 1);
}

TEST_CASE("scheduler: a refused layer announcement fails the request with the reason") {
  PrefillSchedulerOptions o;
  o.layerwise = true;
  PrefillRig rig(o, 32, 4);
  rig.model.kv_layers = 2;
  rig.Add(1, 6);
  rig.transport[1].num_layers = 2;
  rig.Step();  // bootstrapped, prefilled, announced, sent
  REQUIRE(rig.transport[1].layer_sends.size() == 1);
  rig.Add(2, 6);
  rig.transport[2].num_layers = 2;
  rig.transport[2].layer_error = Status::InvalidArgument("pages differ");
  rig.Step();
  rig.Step();
  REQUIRE(rig.finished.count(2) == 1);
  CHECK(rig.finished[2].status.ToString().find("pages differ") != std::string::npos);
}

TEST_CASE("scheduler: prefill rejects a request longer than the KV capacity, with the numbers") {
  PrefillSchedulerOptions o;
  PrefillRig rig(o, /*num_pages=*/4, /*page_size=*/4);
  Request r;
  r.room = 9;
  r.prompt.assign(17, 1);
  Status s = rig.sched->AddRequest(r);
  CHECK(s.code() == StatusCode::kResourceExhausted);
  CHECK(s.message() ==
        "room 9: prompt of 17 tokens needs 5 pages of 4 tokens, but the KV cache holds only 4 "
        "pages (16 tokens)");
  CHECK(rig.transport.handles.empty());  // no sender was created
  r.prompt.assign(16, 1);
  CHECK(rig.sched->AddRequest(r).ok());
  CHECK(rig.sched->AddRequest(r).code() == StatusCode::kAlreadyExists);
  CHECK(rig.sched->metrics().rejected_reqs == 2);
}

TEST_CASE("scheduler: prefill waits for pages in arrival order and frees them after transfer") {
  PrefillSchedulerOptions o;
  o.chunked_prefill_size = 64;
  PrefillRig rig(o, /*num_pages=*/4, /*page_size=*/4);
  rig.Add(1, 12);  // 3 pages
  rig.Add(2, 8);   // 2 pages: must wait for room 1's
  rig.Add(3, 4);   // 1 page would fit, but arrival order holds
  rig.Step();
  CHECK(rig.transport[1].sends.size() == 1);
  CHECK(rig.transport[2].sends.empty());
  CHECK(rig.transport[3].sends.empty());
  rig.Step();
  CHECK(rig.transport[2].sends.empty());
  rig.transport[1].state = KVPoll::kSuccess;
  rig.Step();
  CHECK(rig.finished.count(1) == 1);
  CHECK(rig.transport[2].sends.size() == 1);
  CHECK(rig.transport[3].sends.size() == 1);
  CHECK(rig.pages.free_pages() == 1);
}

TEST_CASE("scheduler: prefill bootstrap failures are counted and hold nothing") {
  PrefillSchedulerOptions o;
  PrefillRig rig(o);
  rig.Add(1, 6, /*connect=*/false);
  rig.transport[1].Fail("no TransferInfo from decode within 30000 ms");
  rig.Step();
  REQUIRE(rig.finished.count(1) == 1);
  CHECK(rig.finished[1].status.message() == "no TransferInfo from decode within 30000 ms");
  CHECK(rig.sched->metrics().bootstrap_failed_reqs == 1);
  CHECK(rig.sched->idle());
  CHECK(rig.pages.free_pages() == 32);
  CHECK(rig.transport.handles.at(1)->destroyed);
  // The room may be used again once finished.
  rig.Add(1, 6);
  rig.Step();
  CHECK(rig.transport[1].sends.size() == 1);
}

TEST_CASE("scheduler: prefill sends the state slot with the last chunk (hybrid models)") {
  PrefillSchedulerOptions o;
  o.num_state_slots = 2;
  o.chunked_prefill_size = 4;
  PrefillRig rig(o);
  rig.Add(1, 6);
  rig.Add(2, 3);
  for (int i = 0; i < 3; ++i) rig.Step();
  REQUIRE(rig.transport[1].sends.size() == 2);
  CHECK(rig.transport[1].sends[0].state.empty());
  CHECK(rig.transport[1].sends[1].state == std::vector<int32_t>{0});
  REQUIRE(rig.transport[2].sends.size() == 1);
  CHECK(rig.transport[2].sends[0].state == std::vector<int32_t>{1});
}

TEST_CASE("scheduler: prefill sends the window pages with the last chunk (sliding window)") {
  // Window 6, pages of 4: a prompt of 10 tokens leaves positions [5, 10) to read, pages 1 and 2;
  // one of 3 tokens all of its page 0, and so does one of 1 token (position 0).
  PrefillSchedulerOptions o;
  o.sliding_window = 6;
  o.chunked_prefill_size = 4;
  o.page_state_bytes_per_page = 100;
  PrefillRig rig(o);
  rig.Add(1, 10);
  rig.Add(2, 3);
  rig.Add(3, 1);
  for (int i = 0; i < 6; ++i) rig.Step();
  const auto& s1 = rig.transport[1].sends;
  REQUIRE(s1.size() == 3);
  CHECK(s1[0].state.empty());
  CHECK(s1[1].state.empty());
  const std::vector<int32_t> table1 = {s1[0].pages[0], s1[1].pages[0], s1[2].pages[0]};
  CHECK(s1[2].state == std::vector<int32_t>{table1[1], table1[2]});
  REQUIRE(rig.transport[2].sends.size() == 1);
  CHECK(rig.transport[2].sends[0].state == rig.transport[2].sends[0].pages);
  REQUIRE(rig.transport[3].sends.size() == 1);
  CHECK(rig.transport[3].sends[0].state == rig.transport[3].sends[0].pages);
  // Sliding window and state slots are one or the other.
  o.num_state_slots = 1;
  PageAllocator pages(8, 4);
  auto metadata = std::move(*MetadataBuffers::Create(32, 0, 0));
  FakeTransport transport;
  FakeModel model(8, 4);
  CHECK(PrefillScheduler::Create(o, {&pages, metadata.get(), &transport, &model}).status().code() ==
        StatusCode::kInvalidArgument);
}

TEST_CASE("scheduler: prefill sends every prompt page as state (NSA-style whole sequence)") {
  PrefillSchedulerOptions o;
  o.whole_sequence_state = true;
  o.chunked_prefill_size = 4;
  PrefillRig rig(o);
  rig.Add(1, 10);
  for (int i = 0; i < 4; ++i) rig.Step();
  const auto& s1 = rig.transport[1].sends;
  REQUIRE(s1.size() == 3);
  CHECK((s1[0].state.empty() && s1[1].state.empty()));
  CHECK(s1[2].state == std::vector<int32_t>{s1[0].pages[0], s1[1].pages[0], s1[2].pages[0]});
  // One kind of state per request.
  o.sliding_window = 6;
  PageAllocator pages(8, 4);
  auto metadata = std::move(*MetadataBuffers::Create(32, 0, 0));
  FakeTransport transport;
  FakeModel model(8, 4);
  auto refused = PrefillScheduler::Create(o, {&pages, metadata.get(), &transport, &model});
  CHECK(refused.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(refused.status().ToString(), Catch::Contains("one kind of state"));
}

TEST_CASE("scheduler: a prompt token outside the vocabulary is refused alone, at admission") {
  PrefillSchedulerOptions o;
  o.vocab_size = 100;
  PrefillRig rig(o);
  Request bad;
  bad.room = 7;
  bad.prompt = {1, 2, 100, 3};
  const Status s = rig.sched->AddRequest(bad);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message() ==
        "room 7: prompt token 100 at position 2 is not in the model's vocabulary "
        "[0, 100)");
  bad.prompt = {-1};
  CHECK(rig.sched->AddRequest(bad).code() == StatusCode::kInvalidArgument);
  rig.Add(1, 6);  // a good request in the same step is unaffected
  rig.Step();
  CHECK(rig.sched->inflight_queue_size() == 1);
}

TEST_CASE("scheduler: a Send refused on one TP rank fails the request on every rank together") {
  // Rank 1 refuses room 2's Send. Finishing it there alone would leave the ranks' queues, and
  // the next poll's handle lists, different; instead rank 1 aborts its sender, keeps the
  // request, and the next poll fails it on both ranks in the same step.
  auto [group, rigs] = testing::MakeTpRanks<PrefillRig>(2, PrefillSchedulerOptions{});
  for (auto& rig : rigs) {
    rig->Add(1, 6);
    rig->Add(2, 6);
  }
  rigs[1]->transport[2].call_error = Status::Unavailable("rank 1: send refused");
  StepAllRanks(rigs);
  for (auto& rig : rigs) {
    CHECK(rig->sched->inflight_queue_size() == 2);
    CHECK(rig->finished.empty());
  }
  CHECK(rigs[1]->transport[2].state == KVPoll::kFailed);
  for (auto& rig : rigs) rig->transport[1].state = KVPoll::kSuccess;
  rigs[0]->transport[2].state = KVPoll::kTransferring;
  StepAllRanks(rigs);
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    REQUIRE(rigs[r]->finished.count(1) == 1);
    CHECK(rigs[r]->finished[1].status.ok());
    REQUIRE(rigs[r]->finished.count(2) == 1);
    CHECK_FALSE(rigs[r]->finished[2].status.ok());
    CHECK(rigs[r]->sched->inflight_queue_size() == 0);
  }
  CHECK_THAT(std::string(rigs[1]->finished[2].status.message()),
             Catch::Contains("rank 1: send refused"));
  CHECK(rigs[0]->finished[2].status.message() == "room 2: the transfer failed on another TP rank");
}

TEST_CASE("scheduler: prefill TP ranks agree through PollAndAllReduce") {
  // Two ranks, each with its own scheduler and senders, step in lockstep. Room 2's sender fails
  // on rank 1 only: both ranks fail it; room 1 succeeds on both.
  auto [group, rigs] = testing::MakeTpRanks<PrefillRig>(2, PrefillSchedulerOptions{});
  for (auto& rig : rigs) {
    rig->Add(1, 6);
    rig->Add(2, 6);
  }
  StepAllRanks(rigs);
  for (auto& rig : rigs) CHECK(rig->sched->inflight_queue_size() == 2);
  rigs[0]->transport[1].state = KVPoll::kSuccess;
  rigs[1]->transport[1].state = KVPoll::kTransferring;  // rank 1 not done yet
  rigs[1]->transport[2].Fail("rank 1: decode peer gone");
  rigs[0]->transport[2].state = KVPoll::kSuccess;
  StepAllRanks(rigs);
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    CHECK(rigs[r]->finished.count(1) == 0);  // MIN(Success, Transferring) = Transferring
    REQUIRE(rigs[r]->finished.count(2) == 1);
    CHECK_FALSE(rigs[r]->finished[2].status.ok());
  }
  CHECK(rigs[1]->finished[2].status.message() == "rank 1: decode peer gone");
  CHECK(rigs[0]->finished[2].status.message() == "room 2: the transfer failed on another TP rank");
  rigs[1]->transport[1].state = KVPoll::kSuccess;
  StepAllRanks(rigs);
  for (auto& rig : rigs) {
    REQUIRE(rig->finished.count(1) == 1);
    CHECK(rig->finished[1].status.ok());
    CHECK(rig->pages.free_pages() == 32);
  }
}

TEST_CASE("scheduler: prefill quarantines a failed request's source pages until PagesReusable") {
  // One request slot, 2 metadata slots, one state slot, 3 pages of 4 tokens.
  PrefillSchedulerOptions o;
  o.max_running_requests = 1;
  o.num_state_slots = 1;
  PrefillRig rig(o, /*num_pages=*/3, /*page_size=*/4);
  rig.Add(1, 8);
  rig.Step();
  REQUIRE(rig.sched->inflight_queue_size() == 1);
  REQUIRE(rig.transport[1].sends.size() == 1);
  const std::vector<int32_t> pages1 = rig.transport[1].sends[0].pages;
  const std::vector<int32_t> state1 = rig.transport[1].sends[0].state;
  const std::optional<uint32_t> aux1 = rig.transport[1].aux;
  REQUIRE(pages1.size() == 2);
  CHECK(rig.pages.free_pages() == 1);

  // pdlib may still be reading the pages for a write in flight.
  rig.transport[1].Fail("decode rank went away", /*quarantined=*/true);
  rig.Step();
  testing::CheckHeld(rig, 1, "decode rank went away", /*free_pages=*/1, /*held_pages=*/2);
  Request again = rig.requests[1];
  CHECK(rig.sched->AddRequest(again).code() == StatusCode::kAlreadyExists);

  // Room 2 gets the other metadata slot but neither a request slot nor pages; room 3 gets no
  // metadata slot.
  rig.Add(2, 8);
  rig.Add(3, 4);
  for (int i = 0; i < 5; ++i) rig.Step();
  CHECK(rig.transport[2].init_called);
  CHECK(rig.transport[2].aux != aux1);
  CHECK(rig.transport[2].sends.empty());
  CHECK_FALSE(rig.transport[3].init_called);
  CHECK(rig.pages.free_pages() == 1);

  // Reusable: the next step frees everything and hands it on.
  rig.transport[1].reusable = true;
  rig.Step();
  CHECK(rig.transport.handles.at(1)->destroyed);
  CHECK(rig.sched->quarantined_size() == 0);
  REQUIRE(rig.transport[2].sends.size() == 1);
  CHECK(rig.transport[2].sends[0].pages == pages1);
  CHECK(rig.transport[2].sends[0].state == state1);
  CHECK(rig.transport[3].init_called);
  CHECK(rig.transport[3].aux == aux1);
}

TEST_CASE("scheduler: prefill FailAll quarantines aborted senders, shutdown frees all") {
  PrefillSchedulerOptions o;
  PrefillRig rig(o, /*num_pages=*/8, /*page_size=*/4);
  rig.Add(1, 8);
  rig.Add(2, 4);
  rig.Step();
  REQUIRE(rig.sched->inflight_queue_size() == 2);
  rig.transport[1].state = KVPoll::kSuccess;
  rig.transport[2].abort_quarantines = true;
  rig.Step();  // room 1 done: its pages come back at once
  CHECK(rig.finished[1].status.ok());
  CHECK(rig.pages.free_pages() == 7);
  rig.sched->FailAll(Status::Unavailable("prefill host is shutting down"));
  rig.CollectFinished();
  REQUIRE(rig.finished.count(2) == 1);
  CHECK(rig.finished[2].status.code() == StatusCode::kUnavailable);
  CHECK(rig.sched->quarantined_size() == 1);
  CHECK(rig.pages.free_pages() == 7);
  rig.Step();
  CHECK(rig.pages.free_pages() == 7);
  rig.sched.reset();
  CHECK(rig.transport.handles.at(2)->destroyed);
  CHECK(rig.pages.free_pages() == 8);
}

TEST_CASE("scheduler: prefill TP ranks free a quarantined request's pages on the same step") {
  auto [group, rigs] = testing::MakeTpRanks<PrefillRig>(2, PrefillSchedulerOptions{});
  for (auto& rig : rigs) rig->Add(1, 6);
  StepAllRanks(rigs);
  for (auto& rig : rigs) REQUIRE(rig->sched->inflight_queue_size() == 1);
  // Rank 1's sender fails with a write in flight; rank 0's succeeded (reusable there at once).
  rigs[1]->transport[1].Fail("decode rank went away", /*quarantined=*/true);
  rigs[0]->transport[1].state = KVPoll::kSuccess;
  StepAllRanks(rigs);
  for (int i = 0; i < 3; ++i) StepAllRanks(rigs);
  testing::CheckQuarantinedOnAllRanks(rigs, 1, 30);
  rigs[1]->transport[1].reusable = true;
  StepAllRanks(rigs);
  testing::CheckReleasedOnAllRanks(rigs, 1, 32);
}

TEST_CASE("scheduler: prefill metrics render as Prometheus text") {
  PrefillSchedulerOptions o;
  PrefillRig rig(o);
  rig.Add(1, 6, /*connect=*/false);
  rig.Add(2, 6);
  rig.Step();
  const std::string text =
      RenderPrometheus(rig.sched->metrics(), {{"role", "prefill"}, {"tp_rank", "0"}});
  CHECK(text.find("pdlib_scheduler_bootstrap_queue_size{role=\"prefill\",tp_rank=\"0\"} 1\n") !=
        std::string::npos);
  CHECK(text.find("pdlib_scheduler_inflight_queue_size{role=\"prefill\",tp_rank=\"0\"} 1\n") !=
        std::string::npos);
  CHECK(text.find("pdlib_scheduler_free_tokens{role=\"prefill\",tp_rank=\"0\"} 120\n") !=
        std::string::npos);
  CHECK(text.find("# TYPE pdlib_scheduler_transfer_failed_reqs_total counter\n") !=
        std::string::npos);
}

}  // namespace pdlib::sched
