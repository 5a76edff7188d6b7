// The pure parts of pdlib-chaos: the byte pattern and its check (which must catch any wrong
// byte), the page allocator, the failure categories and the leftover count from METRICS.
#include <catch2/catch.hpp>
#include <set>
#include <string>
#include <vector>

#include "tools/chaos/chaos_accounting.h"
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
      "aux_free=30 aux_capacity=32 pages_free=250 pages_capacity=256");
  const auto l = pdlib_chaos::Leftovers(held, 2);
  CHECK(l.at("rooms") == 3);
  CHECK(l.at("handles") == 1);
  CHECK(l.at("aux_slots") == 2);
  CHECK(l.at("pages") == 6);
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
