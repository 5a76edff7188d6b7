// The pure parts of pdlib-chaos: the byte pattern and its check (which must catch any wrong
// byte), request shapes (decode prefixes, swa windows), state families by name, the page
// allocator, the failure categories and the leftover count from METRICS, the fault kinds
// --faults names, their random parameters, which requests a fault touched, and the report.
#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <climits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "tools/chaos/chaos_accounting.h"
#include "tools/chaos/chaos_faults.h"
#include "tools/chaos/chaos_pattern.h"
#include "tools/chaos/chaos_report.h"

using pdlib_chaos::Outcome;

TEST_CASE("a filled page passes its own check and no other") {
  std::vector<uint8_t> page(1000);  // not a multiple of 8: the tail word is partial
  pdlib_chaos::FillPage(page.data(), page.size(), 42, 3, 5);
  CHECK_FALSE(pdlib_chaos::CheckPage(page.data(), page.size(), 42, 3, 5));
  CHECK(pdlib_chaos::CheckPage(page.data(), page.size(), 43, 3, 5));  // another room
  CHECK(pdlib_chaos::CheckPage(page.data(), page.size(), 42, 2, 5));  // another buffer
  CHECK(pdlib_chaos::CheckPage(page.data(), page.size(), 42, 3, 4));  // another position
  for (size_t offset : {size_t{0}, size_t{517}, size_t{999}}) {
    std::vector<uint8_t> bad = page;
    bad[offset] ^= 0x80;
    auto what = pdlib_chaos::CheckPage(bad.data(), bad.size(), 42, 3, 5);
    REQUIRE(what);
    CHECK(what->find("offset=" + std::to_string(offset) + ",") != std::string::npos);
  }
}

TEST_CASE("an aux slot passes its own check, and any changed field is named") {
  const pdlib::MetadataSlot slot = pdlib_chaos::AuxSlotOf(7);
  CHECK(slot.bootstrap_room[0] == 7);
  CHECK_FALSE(pdlib_chaos::CheckAuxSlot(slot, 7));
  CHECK(pdlib_chaos::CheckAuxSlot(slot, 8)->starts_with("aux.bootstrap_room[0]="));
  pdlib::MetadataSlot bad = slot;
  bad.output_topk_index[15] ^= 1;
  CHECK(pdlib_chaos::CheckAuxSlot(bad, 7)->starts_with("aux.output_topk_index[15]="));
  bad = slot;
  bad.output_top_logprobs_val[100] += 1;
  CHECK(pdlib_chaos::CheckAuxSlot(bad, 7)->starts_with("aux.output_top_logprobs_val[100]="));
}

TEST_CASE("request shapes stay within their bounds and vary") {
  std::set<size_t> pages, chunks;
  for (uint64_t room = 0; room < 2000; ++room) {
    const auto s = pdlib_chaos::ShapeOf(room, 8, 3);
    REQUIRE(s.pages >= 1);
    REQUIRE(s.pages <= 8);
    REQUIRE(s.chunks >= 1);
    REQUIRE(s.chunks <= std::min<size_t>(3, s.pages));
    size_t sum = 0;
    for (size_t c = 0; c < s.chunks; ++c) sum += pdlib_chaos::ChunkPages(s, c);
    REQUIRE(sum == s.pages);
    pages.insert(s.pages);
    chunks.insert(s.chunks);
  }
  CHECK(pages.size() == 8);
  CHECK(chunks.size() == 3);
}

TEST_CASE("a share of shapes carry a decode prefix of whole pages that the prompt covers") {
  std::set<size_t> prefixes, chunks, windows;
  size_t with_prefix = 0, whole = 0, partial_last = 0, drift = 0;
  constexpr uint64_t kRooms = 4000;
  for (uint64_t room = 0; room < kRooms; ++room) {
    const auto old = pdlib_chaos::ShapeOf(room, 8, 3);
    const auto s = pdlib_chaos::ShapeOf(room, 8, 3, 0.5);
    INFO("room " << room);
    // The prefix changes nothing the old shape had but the chunks of what is left to send.
    REQUIRE(s.pages == old.pages);
    REQUIRE(s.contiguous == old.contiguous);
    REQUIRE(s.early_init == old.early_init);
    REQUIRE(old.prefix_pages == 0);
    REQUIRE(s.prefix_pages <= s.pages);
    // A prefix is whole pages, no longer than the prompt; the last page may be partial.
    REQUIRE(s.prompt_tokens > (s.pages - 1) * pdlib_chaos::kPageTokens);
    REQUIRE(s.prompt_tokens <= s.pages * pdlib_chaos::kPageTokens);
    REQUIRE(s.prefix_pages * pdlib_chaos::kPageTokens <= s.prompt_tokens);
    const size_t sent = pdlib_chaos::SentPages(s);
    // What prefill sends: ceil((prompt - prefix) / page_size), as PagesAfterPrefix counts.
    REQUIRE(sent == (s.prompt_tokens - s.prefix_pages * pdlib_chaos::kPageTokens +
                     pdlib_chaos::kPageTokens - 1) /
                        pdlib_chaos::kPageTokens);
    REQUIRE(s.chunks >= 1);
    REQUIRE(s.chunks <= std::max<size_t>(1, std::min<size_t>(3, sent)));
    size_t sum = 0;
    for (size_t c = 0; c < s.chunks; ++c) sum += pdlib_chaos::ChunkPages(s, c);
    REQUIRE(sum == sent);
    // Pull publishes every page of the prompt in the same number of chunks, none of them empty.
    REQUIRE(pdlib_chaos::PublishedPages(s, pdlib::TransferDirection::kPull) == s.pages);
    size_t published = 0;
    for (size_t c = 0; c < s.chunks; ++c) {
      const size_t n = pdlib_chaos::ChunkPages(s, c, pdlib::TransferDirection::kPull);
      REQUIRE(n >= 1);
      published += n;
    }
    REQUIRE(published == s.pages);
    // Windows: 1..3 pages on prefill, decode's at most one page apart, both within the prompt.
    REQUIRE(s.swa_prefill >= 1);
    REQUIRE(s.swa_prefill <= std::min<size_t>(3, s.pages));
    REQUIRE(s.swa_decode >= 1);
    REQUIRE(s.swa_decode <= s.pages);
    REQUIRE(s.swa_decode <= pdlib_chaos::kMaxWindowPages);
    REQUIRE(std::max(s.swa_prefill, s.swa_decode) - std::min(s.swa_prefill, s.swa_decode) <= 1);
    if (s.prefix_pages > 0) ++with_prefix;
    if (s.prefix_pages == s.pages) ++whole;
    if (s.prompt_tokens % pdlib_chaos::kPageTokens != 0) ++partial_last;
    if (s.swa_decode != s.swa_prefill) ++drift;
    prefixes.insert(s.prefix_pages);
    chunks.insert(s.chunks);
    windows.insert(s.swa_prefill);
  }
  CHECK(with_prefix > kRooms * 45 / 100);
  CHECK(with_prefix < kRooms * 55 / 100);
  CHECK(whole > 100);  // an empty last chunk with aux and state
  CHECK(partial_last > kRooms / 2);
  CHECK(drift > kRooms / 4);
  CHECK(prefixes.size() == 9);  // 0..8
  CHECK(chunks.size() == 3);
  CHECK(windows.size() == 3);
  // Share 0: never a prefix; share 1: always one.
  for (uint64_t room = 0; room < 500; ++room) {
    CHECK(pdlib_chaos::ShapeOf(room, 8, 3, 0).prefix_pages == 0);
    CHECK(pdlib_chaos::ShapeOf(room, 8, 3, 1).prefix_pages >= 1);
  }
}

TEST_CASE("state families by name") {
  std::vector<pdlib::StateType> f;
  std::string why;
  REQUIRE(pdlib_chaos::ParseStateFamilies("mamba,swa", &f, &why));
  CHECK(f == std::vector<pdlib::StateType>{pdlib::StateType::kMamba, pdlib::StateType::kSwa});
  CHECK(pdlib_chaos::StateFamiliesName(f) == "mamba,swa");
  REQUIRE(pdlib_chaos::ParseStateFamilies("c128_state,swa,swa", &f, &why));
  CHECK(pdlib_chaos::StateFamiliesName(f) == "c128_state,swa,swa");
  REQUIRE(pdlib_chaos::ParseStateFamilies("none", &f, &why));
  CHECK(f.empty());
  CHECK(pdlib_chaos::StateFamiliesName(f) == "none");
  CHECK_FALSE(pdlib_chaos::ParseStateFamilies("mamba,nsa", &f, &why));
  CHECK(why.find("unknown state family 'nsa'") != std::string::npos);
  CHECK_FALSE(pdlib_chaos::ParseStateFamilies("mamba,", &f, &why));
  CHECK(why.find("unknown state family ''") != std::string::npos);
  CHECK_FALSE(pdlib_chaos::ParseStateFamilies("", &f, &why));
}

TEST_CASE("the page pool never hands out a page twice and gives back what is freed") {
  pdlib_chaos::PagePool pool(64, 1);
  std::set<int32_t> held;
  std::vector<std::vector<int32_t>> requests;
  for (uint64_t room = 0; room < 12; ++room) {
    auto pages = pool.Alloc(room, 5, room % 2 == 0);
    REQUIRE(pages);
    REQUIRE(pages->size() == 5);
    if (room == 0) {  // an empty pool has a free run (later ones may fall back to scattered)
      for (size_t i = 1; i < pages->size(); ++i) CHECK((*pages)[i] == (*pages)[i - 1] + 1);
    }
    for (int32_t p : *pages) {
      CHECK(pool.in_use(size_t(p)));
      CHECK(held.insert(p).second);
    }
    requests.push_back(*pages);
  }
  CHECK(pool.available() == 4);
  CHECK_FALSE(pool.Alloc(99, 5, false));
  for (const auto& r : requests) pool.Free(r);
  CHECK(pool.available() == 64);
}

TEST_CASE("failure categories") {
  auto at = [](Outcome::Kind kind, std::string detail = "") {
    Outcome o;
    o.kind = kind;
    o.detail = std::move(detail);
    return o;
  };
  const Outcome ok = at(Outcome::kSuccess, "OK");
  CHECK(pdlib_chaos::FailureCategory(ok, ok, true).empty());
  // Decode has the bytes; the prefill process was killed after writing them.
  CHECK(pdlib_chaos::FailureCategory(at(Outcome::kLost, "prefill0 killed"), ok, true).empty());
  CHECK(pdlib_chaos::FailureCategory(ok, ok, false) == "NOT_TERMINAL");
  CHECK(pdlib_chaos::FailureCategory(ok, at(Outcome::kBadBytes, "buffer=1"), true) == "BAD_BYTES");
  CHECK(pdlib_chaos::FailureCategory(at(Outcome::kFailed, "ABORTED: x"),
                                     at(Outcome::kFailed, "UNAVAILABLE: room 1: y"),
                                     true) == "UNAVAILABLE");
  CHECK(pdlib_chaos::FailureCategory(at(Outcome::kFailed, "DEADLINE_EXCEEDED: z"),
                                     at(Outcome::kLost, "decode0 killed"),
                                     true) == "DEADLINE_EXCEEDED");
  CHECK(pdlib_chaos::FailureCategory(at(Outcome::kFailed, "ABORTED: z"), ok, true) ==
        "PREFILL_FAILED_DECODE_SUCCEEDED");
  CHECK(pdlib_chaos::FailureCategory(ok, at(Outcome::kLost, "decode1 killed"), true) ==
        "DECODE_KILLED");
  CHECK(pdlib_chaos::FailureCategory(ok, at(Outcome::kLost, "decode1 crashed"), true) ==
        "DECODE_CRASHED");
  CHECK(pdlib_chaos::FailureCategory(at(Outcome::kLost, "prefill0 killed"),
                                     at(Outcome::kLost, "decode0 killed"), true) == "BOTH_LOST");
  // Prefill was told another decode prefix than the one decode holds: it aborts the room.
  CHECK(pdlib_chaos::FailureCategory(at(Outcome::kBadBytes, "prefix:decode_prefix_len=16"),
                                     at(Outcome::kFailed, "ABORTED: pdlib-chaos: prefix"),
                                     true) == "BAD_BYTES");
  CHECK(pdlib_chaos::StatusCodeOf("no code here") == "OTHER");
}

TEST_CASE("leftovers from a METRICS line") {
  const auto clean = pdlib_chaos::ParseCounters(
      "METRICS live_rooms=0 connections=2 bootstrap_queue=0 transfer_queue=0 handles=0 "
      "aux_free=32 aux_capacity=32 pages_free=256 pages_capacity=256 name=x");
  CHECK_FALSE(clean.contains("name"));
  for (const auto& [what, n] : pdlib_chaos::Leftovers(clean, 2)) {
    INFO(what);
    CHECK(n == 0);
  }
  const auto held = pdlib_chaos::ParseCounters(
      "METRICS live_rooms=1 connections=3 bootstrap_queue=2 transfer_queue=0 handles=1 "
      "aux_free=30 aux_capacity=32 pages_free=250 pages_capacity=256 state_free=90 "
      "state_capacity=96");
  const auto l = pdlib_chaos::Leftovers(held, 2);
  CHECK(l.at("rooms") == 3);
  CHECK(l.at("handles") == 1);
  CHECK(l.at("aux_slots") == 2);
  CHECK(l.at("pages") == 6);
  CHECK(l.at("state_items") == 6);
  CHECK(l.at("connections") == 1);
}

TEST_CASE("a child's log with UCX 1.13's wireup assertion is a known UCX abort, nothing else is") {
  // The head of what a decode process printed when a prefill was killed while connecting.
  const std::string ucx_abort =
      "[vm:25505:0:25521] ucp_request.c:684  Assertion `(req->send.wireup.type == "
      "UCP_WIREUP_MSG_EP_REMOVED) || (req->send.wireup.type == UCP_WIREUP_MSG_EP_CHECK) || "
      "(req->send.wireup.type == UCP_WIREUP_MSG_ACK)' failed: req 0x7b44 ep 0x7f69: got REP "
      "message\n==== backtrace (tid:  25521) ====\n"
      " 4  /lib/x86_64-linux-gnu/libucp.so.0(ucp_request_send_state_ff+0x44f) [0x7f69ea53497f]\n"
      " 5  /lib/x86_64-linux-gnu/libuct.so.0(uct_tcp_ep_pending_purge+0x71) [0x7f69e96c79e1]\n";
  CHECK(pdlib_chaos::IsKnownUcxAbort(ucx_abort));
  CHECK(pdlib_chaos::IsKnownUcxAbort("READY\nQUARANTINE 3 2\n" + ucx_abort));
  // Any other abort stays a crash: another assertion, a segfault, an ASan report.
  CHECK_FALSE(pdlib_chaos::IsKnownUcxAbort(
      "[vm:1:0:1] ucp_ep.c:12  Assertion `ep->flags' failed\n==== backtrace ====\n"
      " 4  libucp.so.0(ucp_request_send_state_ff+0x44f)\n"));
  CHECK_FALSE(pdlib_chaos::IsKnownUcxAbort(ucx_abort.substr(0, ucx_abort.find("===="))));
  CHECK_FALSE(pdlib_chaos::IsKnownUcxAbort("==1==ERROR: AddressSanitizer: heap-use-after-free"));
  CHECK_FALSE(pdlib_chaos::IsKnownUcxAbort(""));
}

// --- faults (chaos_faults.h) ---

namespace {

using pdlib_chaos::FaultKind;

std::string Names(const std::vector<FaultKind>& kinds) {
  std::string out;
  for (FaultKind k : kinds) out += (out.empty() ? "" : ",") + std::string(FaultKindName(k));
  return out;
}

std::string Parsed(const std::string& text, bool etcd) {
  std::vector<FaultKind> kinds = {FaultKind::kKill};
  std::string error;
  if (!pdlib_chaos::ParseFaultKinds(text, etcd, &kinds, &error)) return "error: " + error;
  return Names(kinds);
}

}  // namespace

TEST_CASE(
    "a faults list names groups and kinds, the network group brings the discovery's own fault") {
  CHECK(Parsed("process", false) == "kill,stop");
  CHECK(Parsed("kill,stop", false) == "kill,stop");
  CHECK(Parsed("stop,kill", false) == "kill,stop");  // one canonical order
  CHECK(Parsed("kill", false) == "kill");
  CHECK(Parsed("none", false).empty());
  CHECK(Parsed("network", false) == "partition,loss,bandwidth,latency,bootstrap_restart");
  CHECK(Parsed("network", true) == "partition,loss,bandwidth,latency,etcd_member");
  CHECK(Parsed("network,process", false) ==
        "kill,stop,partition,loss,bandwidth,latency,bootstrap_restart");
  CHECK(Parsed("process,network,kill,partition", true) ==
        "kill,stop,partition,loss,bandwidth,latency,etcd_member");  // repeats once
  CHECK(Parsed("partition,bootstrap_restart", false) == "partition,bootstrap_restart");
  // rail is not in the network group (it needs --rails): named on its own.
  CHECK(Parsed("network,process,rail", false) ==
        "kill,stop,partition,loss,bandwidth,latency,bootstrap_restart,rail");
  CHECK(Parsed("rail", true) == "rail");
  // Refused, naming what is wrong.
  CHECK(Parsed("partiton", false).find("unknown fault 'partiton'") != std::string::npos);
  CHECK(Parsed("", false).find("unknown fault ''") != std::string::npos);
  CHECK(Parsed("kill,", false).find("unknown fault ''") != std::string::npos);
  CHECK(Parsed("none,kill", false).find("'none' cannot go with") != std::string::npos);
  CHECK(Parsed("etcd_member", false).find("needs --discovery etcd") != std::string::npos);
  CHECK(Parsed("bootstrap_restart", true).find("no bootstrap server with etcd") !=
        std::string::npos);
}

TEST_CASE("fault kinds by what they hit") {
  for (FaultKind k : {FaultKind::kKill, FaultKind::kStop}) {
    CHECK(pdlib_chaos::IsProcessFault(k));
    CHECK_FALSE(pdlib_chaos::IsLinkFault(k));
    CHECK_FALSE(pdlib_chaos::IsDiscoveryFault(k));
  }
  for (FaultKind k : {FaultKind::kPartition, FaultKind::kLoss, FaultKind::kBandwidth,
                      FaultKind::kLatency, FaultKind::kRail}) {
    CHECK(pdlib_chaos::IsLinkFault(k));
    CHECK_FALSE(pdlib_chaos::IsProcessFault(k));
    CHECK_FALSE(pdlib_chaos::IsDiscoveryFault(k));
  }
  for (FaultKind k : {FaultKind::kBootstrapRestart, FaultKind::kEtcdMember}) {
    CHECK(pdlib_chaos::IsDiscoveryFault(k));
    CHECK_FALSE(pdlib_chaos::IsLinkFault(k));
  }
}

TEST_CASE("fault parameters stay in their ranges and cover them") {
  pdlib_chaos::FaultTimes times;
  times.stop_ms = 1000;
  times.partition_ms = 2000;
  times.link_ms = 3000;
  times.discovery_down_ms = 400;
  std::mt19937_64 rng(7);
  std::set<int> losses, rates, delays;
  int64_t shortest = INT64_MAX, longest = 0;
  for (int i = 0; i < 4000; ++i) {
    const auto loss = pdlib_chaos::DrawFaultParams(FaultKind::kLoss, times, rng);
    REQUIRE(loss.loss_percent >= 1);
    REQUIRE(loss.loss_percent <= 10);
    REQUIRE(loss.duration_ms >= 1500);
    REQUIRE(loss.duration_ms <= 4500);
    losses.insert(loss.loss_percent);
    const auto cap = pdlib_chaos::DrawFaultParams(FaultKind::kBandwidth, times, rng);
    REQUIRE(cap.rate_mbit >= 50);
    REQUIRE(cap.rate_mbit <= 500);
    REQUIRE(cap.loss_percent == 0);
    rates.insert(cap.rate_mbit);
    const auto slow = pdlib_chaos::DrawFaultParams(FaultKind::kLatency, times, rng);
    REQUIRE(slow.delay_ms >= 1);
    REQUIRE(slow.delay_ms <= 50);
    REQUIRE(slow.jitter_ms >= 0);
    REQUIRE(slow.jitter_ms <= slow.delay_ms / 2);
    delays.insert(slow.delay_ms);
    const auto cut = pdlib_chaos::DrawFaultParams(FaultKind::kPartition, times, rng);
    REQUIRE(cut.duration_ms >= 1000);
    REQUIRE(cut.duration_ms <= 3000);
    shortest = std::min(shortest, cut.duration_ms);
    longest = std::max(longest, cut.duration_ms);
    const auto kill = pdlib_chaos::DrawFaultParams(FaultKind::kKill, times, rng);
    REQUIRE(kill.duration_ms >= 50);  // the restart delay
    REQUIRE(kill.duration_ms <= 500);
    const auto stop = pdlib_chaos::DrawFaultParams(FaultKind::kStop, times, rng);
    REQUIRE(stop.duration_ms >= 500);
    REQUIRE(stop.duration_ms <= 1500);
    for (FaultKind k : {FaultKind::kBootstrapRestart, FaultKind::kEtcdMember}) {
      const auto down = pdlib_chaos::DrawFaultParams(k, times, rng);
      REQUIRE(down.duration_ms >= 200);
      REQUIRE(down.duration_ms <= 600);
    }
  }
  // Rail faults: a rail among the host's, partitioned two times in three, else capped.
  int partitions = 0, caps = 0;
  std::set<int> rails;
  for (int i = 0; i < 3000; ++i) {
    const auto r = pdlib_chaos::DrawFaultParams(FaultKind::kRail, times, rng, 3);
    REQUIRE(r.rail >= 0);
    REQUIRE(r.rail <= 2);
    rails.insert(r.rail);
    if (r.rate_mbit == 0) {
      ++partitions;
      REQUIRE(r.duration_ms >= 1000);  // partition_ms
      REQUIRE(r.duration_ms <= 3000);
    } else {
      ++caps;
      REQUIRE(r.rate_mbit >= 50);
      REQUIRE(r.rate_mbit <= 500);
      REQUIRE(r.duration_ms >= 1500);  // link_ms
      REQUIRE(r.duration_ms <= 4500);
    }
  }
  CHECK(rails.size() == 3);
  CHECK(partitions > 1800);
  CHECK(partitions < 2200);
  CHECK(caps > 800);
  CHECK(pdlib_chaos::DrawFaultParams(FaultKind::kRail, times, rng, 1).rail == 0);
  CHECK(losses.size() == 10);
  CHECK(rates.size() > 400);
  CHECK(delays.size() == 50);
  CHECK(shortest < 1100);
  CHECK(longest > 2900);
  // The same seed draws the same faults (a seeded run repeats its schedule).
  std::mt19937_64 a(3), b(3);
  for (int i = 0; i < 10; ++i) {
    const auto x = pdlib_chaos::DrawFaultParams(FaultKind::kLatency, times, a);
    const auto y = pdlib_chaos::DrawFaultParams(FaultKind::kLatency, times, b);
    CHECK(x.delay_ms == y.delay_ms);
    CHECK(x.jitter_ms == y.jitter_ms);
    CHECK(x.duration_ms == y.duration_ms);
  }
}

TEST_CASE("a fault's description names its kind and parameters") {
  pdlib_chaos::FaultParams p;
  p.duration_ms = 1500;
  p.loss_percent = 7;
  CHECK(pdlib_chaos::DescribeFault(FaultKind::kLoss, p) == "loss 7% for 1500 ms");
  p = {};
  p.duration_ms = 900;
  p.delay_ms = 23;
  p.jitter_ms = 9;
  CHECK(pdlib_chaos::DescribeFault(FaultKind::kLatency, p) == "latency 23+-9 ms for 900 ms");
  p = {};
  p.duration_ms = 2000;
  p.rate_mbit = 120;
  CHECK(pdlib_chaos::DescribeFault(FaultKind::kBandwidth, p) == "bandwidth 120 Mbit/s for 2000 ms");
  p = {};
  p.duration_ms = 1800;
  CHECK(pdlib_chaos::DescribeFault(FaultKind::kPartition, p) == "partition for 1800 ms");
  p.duration_ms = 120;
  CHECK(pdlib_chaos::DescribeFault(FaultKind::kKill, p) == "kill, restart after 120 ms");
  p = {};
  p.duration_ms = 900;
  p.rail = 1;
  CHECK(pdlib_chaos::DescribeFault(FaultKind::kRail, p) == "rail 1 partition for 900 ms");
  p.rate_mbit = 200;
  CHECK(pdlib_chaos::DescribeFault(FaultKind::kRail, p) == "rail 1 200 Mbit/s for 900 ms");
}

TEST_CASE("a fault touches the requests alive during it and shortly after it ended") {
  using Clock = std::chrono::steady_clock;
  using std::chrono::milliseconds;
  const Clock::time_point t0{};
  auto at = [&](int ms) { return t0 + milliseconds(ms); };
  const milliseconds settle(1000);
  pdlib_chaos::FaultWindow w{at(10000), at(12000), "partition of decode0"};
  // Over before the fault began; overlapping its start, its middle, its end.
  CHECK_FALSE(pdlib_chaos::Touches(w, at(8000), at(9999), settle));
  CHECK(pdlib_chaos::Touches(w, at(9000), at(10000), settle));
  CHECK(pdlib_chaos::Touches(w, at(10500), at(11000), settle));
  CHECK(pdlib_chaos::Touches(w, at(11900), at(15000), settle));
  // Started after the heal: within the settle time it is touched, after it not.
  CHECK(pdlib_chaos::Touches(w, at(12500), at(13000), settle));
  CHECK(pdlib_chaos::Touches(w, at(13000), at(13100), settle));
  CHECK_FALSE(pdlib_chaos::Touches(w, at(13001), at(14000), settle));
  CHECK_FALSE(pdlib_chaos::Touches(w, at(12001), at(14000), milliseconds(0)));
  // A fault still in effect touches everything from its start on.
  pdlib_chaos::FaultWindow open{at(10000), Clock::time_point::max(), "SIGKILL of prefill0"};
  CHECK(pdlib_chaos::Touches(open, at(50000), at(60000), settle));
  CHECK_FALSE(pdlib_chaos::Touches(open, at(1000), at(9000), settle));
}

TEST_CASE("a failed request no fault touched, or a fault that would not go in, is not clean") {
  pdlib_chaos::Tally t;
  CHECK(t.Clean());
  t.failed_untouched = 1;
  CHECK_FALSE(t.Clean());
  t.failed_untouched = 0;
  t.fault_errors = 1;
  CHECK_FALSE(t.Clean());
  t.fault_errors = 0;
  // Requests that failed while a fault touched them are what chaos is for.
  t.failed = 40;
  t.failure_reasons["UNAVAILABLE"] = 40;
  CHECK(t.Clean());
}

TEST_CASE("the summary names the faults by kind, what was skipped, and ends RESULT: CLEAN") {
  pdlib_chaos::Report r;
  r.backend = "ucx";
  r.transport = "ucx.tls=tcp";
  r.netns = true;
  r.skipped_faults["latency"] = "kernel has no sch_netem";
  r.total.requests = 10;
  r.total.succeeded = 10;
  r.total.faults = 3;
  r.total.faults_by_kind = {{"partition_decode", 1}, {"loss_prefill", 1}, {"bootstrap_restart", 1}};
  r.total.untouched_requests = 4;
  r.total.requests_after_heal = 2;
  r.by_topology["1p1d"] = r.total;
  std::string text = pdlib_chaos::RenderSummary(r);
  CHECK(text.find("partition_decode=1") != std::string::npos);
  CHECK(text.find("loss_prefill=1") != std::string::npos);
  CHECK(text.find("bootstrap_restart=1") != std::string::npos);
  CHECK(text.find("skipped: latency (kernel has no sch_netem)") != std::string::npos);
  CHECK(text.find("4 requests, 2 of them after a heal; 0 failed") != std::string::npos);
  CHECK(text.find("verified 0 requests (0 with a decode prefix)") != std::string::npos);
  CHECK(text.ends_with("RESULT: CLEAN\n"));
  const std::string json = pdlib_chaos::RenderJson(r);
  CHECK(json.find("\"skipped_faults\":{\"latency\":\"kernel has no sch_netem\"}") !=
        std::string::npos);
  CHECK(json.find("\"failed_untouched\":0") != std::string::npos);
  r.total.failed_untouched = 1;
  text = pdlib_chaos::RenderSummary(r);
  CHECK(text.ends_with("RESULT: NOT CLEAN\n"));
}
