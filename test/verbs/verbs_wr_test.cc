// Pure tests of the verbs backend (no device needed): work-request and SGE construction within
// max_sge and the maximum message size, send-queue pacing and the signalling cadence, the
// endpoint/reply/key blobs with every peer field validated, and option parsing.
#include "backends/verbs/verbs_wr.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <map>
#include <random>
#include <set>

#include "backends/verbs/verbs_device.h"
#include "backends/verbs/verbs_options.h"
#include "backends/verbs/verbs_wire.h"
#include "test/support/sysfs_tree.h"

using namespace pdlib::verbs;
using pdlib::Status;
using pdlib::StatusCode;

namespace {

// Where every remote byte of a plan comes from: (rkey, remote addr) -> (lkey, local addr).
using ByteMap = std::map<std::pair<uint32_t, uint64_t>, std::pair<uint32_t, uint64_t>>;

ByteMap ExpectedBytes(const std::vector<WriteSegment>& writes) {
  ByteMap m;
  for (const WriteSegment& w : writes) {
    for (uint64_t i = 0; i < w.length; ++i) {
      m[{w.rkey, w.remote_addr + i}] = {w.lkey, w.local_addr + i};
    }
  }
  return m;
}

// Checks the plan's invariants against the limits and returns the bytes it moves.
ByteMap PlannedBytes(const WrPlan& plan, const WrLimits& limits) {
  ByteMap m;
  uint32_t next_sge = 0;
  for (const PlannedWr& wr : plan.wrs) {
    INFO("wr remote " << wr.remote_addr << " length " << wr.length << " sges " << wr.num_sge);
    REQUIRE(wr.num_sge >= 1);
    REQUIRE(wr.num_sge <= limits.max_sge);
    REQUIRE(wr.length >= 1);
    REQUIRE(wr.length <= limits.max_message_bytes);
    REQUIRE(wr.first_sge == next_sge);  // SGE lists are laid out in order, without gaps
    next_sge += wr.num_sge;
    uint64_t total = 0, remote = wr.remote_addr;
    for (uint32_t s = 0; s < wr.num_sge; ++s) {
      const Sge& sge = plan.sges[wr.first_sge + s];
      REQUIRE(sge.length >= 1);
      for (uint64_t i = 0; i < sge.length; ++i) {
        auto [it, fresh] = m.insert({{wr.rkey, remote++}, {sge.lkey, sge.addr + i}});
        REQUIRE(fresh);  // no remote byte is written twice
      }
      total += sge.length;
    }
    REQUIRE(total == wr.length);
  }
  REQUIRE(next_sge == plan.sges.size());
  return m;
}

WrPlan Plan(const std::vector<WriteSegment>& writes, uint32_t max_sge, uint64_t max_message) {
  WrPlan plan;
  PlanWrites(writes, WrLimits{max_sge, max_message}, &plan);
  return plan;
}

}  // namespace

TEST_CASE("verbs wr: one write within the limits is one request with one SGE") {
  const WrPlan plan = Plan({{0x1000, 7, 0x9000, 9, 4096}}, 4, 1 << 20);
  REQUIRE(plan.wrs.size() == 1);
  CHECK(plan.wrs[0].remote_addr == 0x9000);
  CHECK(plan.wrs[0].rkey == 9);
  CHECK(plan.wrs[0].length == 4096);
  REQUIRE(plan.sges.size() == 1);
  CHECK(plan.sges[0] == Sge{0x1000, 4096, 7});
}

TEST_CASE("verbs wr: a write longer than the maximum message is split") {
  const WrPlan plan = Plan({{0x1000, 1, 0x100000, 2, 10000}}, 4, 4096);
  REQUIRE(plan.wrs.size() == 3);
  CHECK(plan.wrs[0].length == 4096);
  CHECK(plan.wrs[1].length == 4096);
  CHECK(plan.wrs[2].length == 10000 - 8192);
  CHECK(plan.wrs[1].remote_addr == 0x100000 + 4096);
  CHECK(plan.sges[2] == Sge{0x1000 + 8192, 10000 - 8192, 1});
}

TEST_CASE("verbs wr: scattered sources into one contiguous destination gather up to max_sge") {
  // Ten 64-byte pages, scattered locally (every other page), contiguous remotely.
  std::vector<WriteSegment> writes;
  for (uint64_t i = 0; i < 10; ++i)
    writes.push_back({0x10000 + 128 * i, 3, 0x50000 + 64 * i, 4, 64});
  const WrPlan plan = Plan(writes, 4, 1 << 20);
  REQUIRE(plan.wrs.size() == 3);  // 4 + 4 + 2 SGEs
  CHECK(plan.wrs[0].num_sge == 4);
  CHECK(plan.wrs[1].num_sge == 4);
  CHECK(plan.wrs[2].num_sge == 2);
  CHECK(plan.wrs[1].remote_addr == 0x50000 + 4 * 64);
  CHECK(plan.wrs[0].length == 256);
  CHECK(PlannedBytes(plan, {4, 1 << 20}) == ExpectedBytes(writes));
}

TEST_CASE("verbs wr: contiguous runs merge into one SGE, breaks start a new request") {
  std::vector<WriteSegment> writes = {
      {0x1000, 1, 0x8000, 2, 100},  // local and remote both continue: one SGE
      {0x1064, 1, 0x8064, 2, 100},
      {0x5000, 1, 0x80c8, 2, 50},  // remote continues, local jumps: a second SGE
      {0x5032, 5, 0x80fa, 2, 10},  // another lkey: a third SGE even though addresses follow
      {0x6000, 1, 0x9000, 2, 10},  // remote jumps: a new request
      {0x600a, 1, 0x900a, 3, 10},  // other rkey: a new request
  };
  const WrPlan plan = Plan(writes, 8, 1 << 20);
  REQUIRE(plan.wrs.size() == 3);
  CHECK(plan.wrs[0].num_sge == 3);
  CHECK(plan.sges[0] == Sge{0x1000, 200, 1});
  CHECK(plan.sges[1] == Sge{0x5000, 50, 1});
  CHECK(plan.sges[2] == Sge{0x5032, 10, 5});
  CHECK(plan.wrs[0].length == 260);
  CHECK(plan.wrs[1].remote_addr == 0x9000);
  CHECK(plan.wrs[2].rkey == 3);
  CHECK(PlannedBytes(plan, {8, 1 << 20}) == ExpectedBytes(writes));
}

TEST_CASE("verbs wr: a merged request is cut at the maximum message, SGE by SGE") {
  // Contiguous on both sides: one SGE would do, but messages stop at 1000 bytes.
  std::vector<WriteSegment> writes = {{0, 1, 0x10000, 2, 600}, {600, 1, 0x10000 + 600, 2, 600}};
  const WrPlan plan = Plan(writes, 2, 1000);
  REQUIRE(plan.wrs.size() == 2);
  CHECK(plan.wrs[0].length == 1000);
  CHECK(plan.wrs[0].num_sge == 1);
  CHECK(plan.wrs[1].length == 200);
  CHECK(plan.wrs[1].remote_addr == 0x10000 + 1000);
  CHECK(PlannedBytes(plan, {2, 1000}) == ExpectedBytes(writes));
}

TEST_CASE("verbs wr: empty writes are skipped and separate calls never merge") {
  WrPlan plan;
  std::vector<WriteSegment> a = {{0, 1, 100, 2, 0}, {0, 1, 100, 2, 10}};
  std::vector<WriteSegment> b = {{10, 1, 110, 2, 10}};  // continues a's last write exactly
  PlanWrites(a, {4, 1 << 20}, &plan);
  PlanWrites(b, {4, 1 << 20}, &plan);
  REQUIRE(plan.wrs.size() == 2);
  CHECK(plan.wrs[1].first_sge == 1);
  WrPlan none;
  PlanWrites({}, {4, 64}, &none);
  CHECK(none.wrs.empty());
  CHECK(none.sges.empty());
}

TEST_CASE("verbs wr: random write lists respect every limit and move exactly their bytes") {
  std::mt19937_64 rng(12345);
  for (int iter = 0; iter < 400; ++iter) {
    const uint32_t max_sge = 1 + rng() % 5;
    const uint64_t max_message = 1 + rng() % 300;
    std::vector<WriteSegment> writes;
    uint64_t remote = 1 << 20, local = 0;
    const int n = 1 + int(rng() % 12);
    for (int i = 0; i < n; ++i) {
      WriteSegment w;
      w.length = rng() % 200;  // sometimes 0
      // Locally contiguous or not; remotely contiguous or not; keys sometimes change.
      local = (rng() % 2) ? local : local + 1000 + rng() % 1000;
      remote = (rng() % 3) ? remote : remote + 5000;
      w.local_addr = local;
      w.remote_addr = remote;
      w.lkey = 1 + rng() % 2;
      w.rkey = 10 + (rng() % 4 == 0 ? 1 : 0);
      local += w.length;
      remote += w.length;
      writes.push_back(w);
    }
    INFO("iteration " << iter << " max_sge " << max_sge << " max_message " << max_message);
    const WrPlan plan = Plan(writes, max_sge, max_message);
    CHECK(PlannedBytes(plan, {max_sge, max_message}) == ExpectedBytes(writes));
    // Requests are as few as the limits allow for a fully contiguous list.
    uint64_t bytes = 0;
    for (const auto& w : writes) bytes += w.length;
    CHECK(plan.wrs.size() >= (bytes + max_message - 1) / max_message);
  }
}

TEST_CASE("verbs wr: effective limits take the device's, lowered by the options") {
  auto l = EffectiveLimits(32, uint64_t{1} << 31, 0, 0);
  REQUIRE(l.ok());
  CHECK(l->max_sge == 32);
  CHECK(l->max_message_bytes == uint64_t{1} << 31);
  l = EffectiveLimits(32, uint64_t{1} << 40, 4, 65536);
  REQUIRE(l.ok());
  CHECK(l->max_sge == 4);
  CHECK(l->max_message_bytes == 65536);
  l = EffectiveLimits(2, uint64_t{1} << 40, 16, 0);  // never above the device; SGE lengths 32-bit
  REQUIRE(l.ok());
  CHECK(l->max_sge == 2);
  CHECK(l->max_message_bytes == 0xffffffffu);
  CHECK_FALSE(EffectiveLimits(0, 4096, 0, 0).ok());
  CHECK_FALSE(EffectiveLimits(4, 0, 0, 0).ok());
}

TEST_CASE("verbs send queue: signalling cadence") {
  SendQueueBudget q(100, 4);
  std::vector<bool> signalled;
  for (int i = 0; i < 10; ++i) signalled.push_back(q.Post(false).signalled);
  CHECK(signalled ==
        std::vector<bool>{false, false, false, true, false, false, false, true, false, false});
  CHECK(q.Post(true).signalled);         // forced (the last request of a batch)
  CHECK_FALSE(q.Post(false).signalled);  // the cadence restarts after a forced signal
  CHECK(q.last_posted() == 12);
  CHECK(q.outstanding() == 12);
  CHECK(q.room() == 88);
}

TEST_CASE("verbs send queue: slots are retired in order by completions") {
  SendQueueBudget q(8, 8);
  for (int i = 0; i < 7; ++i) CHECK_FALSE(q.Post(false).signalled);
  const auto last = q.Post(false);
  CHECK(last.signalled);  // fills the queue: must be signalled, or nothing would free it
  CHECK(last.seq == 8);
  CHECK(q.room() == 0);
  CHECK(q.Retire(5) == 5);
  CHECK(q.room() == 5);
  CHECK(q.Retire(5) == 0);   // repeated
  CHECK(q.Retire(3) == 0);   // stale
  CHECK(q.Retire(99) == 0);  // never posted
  CHECK(q.Retire(8) == 3);
  CHECK(q.outstanding() == 0);
  CHECK(SendQueueBudget(4, 0).signal_every() == 1);
  CHECK(SendQueueBudget(4, 50).signal_every() == 4);
}

TEST_CASE("verbs send queue: a poster that waits for room always has a completion coming") {
  // Simulates the progress thread against an in-order NIC that reports only signalled requests
  // (and only once they are done): batches of random sizes, chains cut by room and max_chain.
  std::mt19937 rng(7);
  for (uint32_t depth : {1u, 2u, 3u, 8u, 64u}) {
    for (uint32_t every : {1u, 2u, 5u, 64u}) {
      SendQueueBudget q(depth, every);
      std::vector<std::pair<uint64_t, bool>> in_flight;  // (seq, signalled), oldest first
      uint64_t signalled_batch_ends = 0, batches = 0;
      std::vector<size_t> sizes;
      for (int b = 0; b < 200; ++b) sizes.push_back(1 + rng() % 20);
      size_t batch = 0, next = 0;
      const uint32_t max_chain = 1 + rng() % 7;
      while (batch < sizes.size()) {
        const uint32_t room = std::min(q.room(), max_chain);
        if (room == 0) {
          // Waiting: some outstanding request must be signalled, or this would hang.
          auto it = std::find_if(in_flight.begin(), in_flight.end(),
                                 [](const auto& r) { return r.second; });
          INFO("depth " << depth << " every " << every);
          REQUIRE(it != in_flight.end());
          CHECK(q.Retire(it->first) == it - in_flight.begin() + 1);
          in_flight.erase(in_flight.begin(), it + 1);
          continue;
        }
        // One chain of up to `room` requests over the queued batches.
        uint32_t taken = 0;
        size_t left_total = 0;
        for (size_t b = batch; b < sizes.size(); ++b)
          left_total += sizes[b] - (b == batch ? next : 0);
        const uint32_t chain = static_cast<uint32_t>(std::min<size_t>(room, left_total));
        while (taken < chain) {
          const bool last_of_batch = next + 1 == sizes[batch];
          const bool last_before_wait = taken + 1 == chain && left_total > chain;
          auto posted = q.Post(last_of_batch || last_before_wait);
          if (last_of_batch) {
            CHECK(posted.signalled);
            signalled_batch_ends += posted.signalled;
            ++batches;
          }
          in_flight.push_back({posted.seq, posted.signalled});
          ++taken;
          if (++next == sizes[batch]) {
            ++batch;
            next = 0;
          }
        }
      }
      CHECK(signalled_batch_ends == batches);
    }
  }
}

TEST_CASE("verbs read depth: the smaller of our initiator depth and the peer's responder") {
  CHECK(ReadDepth(16, 128) == 16);
  CHECK(ReadDepth(128, 16) == 16);
  CHECK(ReadDepth(128, 128) == 128);
  CHECK(ReadDepth(0, 8) == 1);  // a device reporting 0 still reads, one at a time
  CHECK(ReadDepth(8, 0) == 1);
}

TEST_CASE("verbs send queue: reads stay within the read depth, writes do not count") {
  SendQueueBudget q(64, 64, 3);
  CHECK(q.read_depth() == 3);
  CHECK(q.read_room() == 3);
  CHECK_FALSE(q.Post(false, /*read=*/false).signalled);  // a write: read room unchanged
  CHECK(q.read_room() == 3);
  CHECK_FALSE(q.Post(false, true).signalled);  // seq 2
  CHECK_FALSE(q.Post(false, true).signalled);  // seq 3
  CHECK(q.read_room() == 1);
  auto filling = q.Post(false, true);  // seq 4 fills the depth: signalled, or none would come
  CHECK(filling.signalled);
  CHECK(q.read_room() == 0);
  CHECK(q.reads_outstanding() == 3);
  CHECK(q.room() == 60);
  // A completion retires the reads up to it (in order), freeing their depth.
  CHECK(q.Retire(2) == 2);
  CHECK(q.read_room() == 1);
  CHECK(q.Retire(4) == 2);
  CHECK(q.read_room() == 3);
  CHECK(q.reads_outstanding() == 0);
  // Unbounded by default.
  CHECK(SendQueueBudget(8, 8).read_room() > 1000);
  CHECK(SendQueueBudget(8, 8, 0).read_depth() == 1);
}

TEST_CASE("verbs send queue: a reader that waits for read depth always has a completion coming") {
  // The progress thread's loop against an in-order NIC that reports only signalled requests:
  // batches of reads and writes mixed, chains cut by room, read depth and max_chain. Reads
  // outstanding never exceed the depth, and whoever waits has a signalled request in flight.
  std::mt19937 rng(11);
  for (uint32_t depth : {2u, 8u, 64u}) {
    for (uint32_t read_depth : {1u, 2u, 4u, 16u}) {
      for (uint32_t every : {1u, 5u, 64u}) {
        INFO("depth " << depth << " read depth " << read_depth << " every " << every);
        SendQueueBudget q(depth, every, read_depth);
        std::vector<std::pair<uint64_t, bool>> in_flight;  // (seq, signalled)
        struct B {
          size_t size;
          bool reads;
        };
        std::vector<B> batches;
        for (int b = 0; b < 150; ++b) batches.push_back({1 + rng() % 20, rng() % 3 != 0});
        size_t batch = 0, next = 0, ends = 0;
        const uint32_t max_chain = 1 + rng() % 7;
        while (batch < batches.size()) {
          // What the poster takes now: up to room (and read room for reads), in order.
          uint32_t room = std::min(q.room(), max_chain);
          uint32_t read_room = q.read_room();
          size_t total = 0, left_after = 0;
          std::vector<std::pair<size_t, size_t>> takes;  // (batch, count)
          for (size_t b = batch; b < batches.size(); ++b) {
            const size_t remaining = batches[b].size - (b == batch ? next : 0);
            size_t cap = room - total;
            if (batches[b].reads) cap = std::min<size_t>(cap, read_room);
            const size_t n = std::min(remaining, cap);
            if (n > 0) {
              takes.push_back({b, n});
              total += n;
              if (batches[b].reads) read_room -= static_cast<uint32_t>(n);
            }
            left_after += remaining - n;
            if (n < remaining) break;
          }
          if (total == 0) {
            auto it = std::find_if(in_flight.begin(), in_flight.end(),
                                   [](const auto& r) { return r.second; });
            REQUIRE(it != in_flight.end());
            q.Retire(it->first);
            in_flight.erase(in_flight.begin(), it + 1);
            continue;
          }
          size_t w = 0;
          for (auto [b, n] : takes) {
            for (size_t i = 0; i < n; ++i, ++w) {
              const bool last_of_batch = next + 1 == batches[b].size;
              const bool last_before_wait = w + 1 == total && left_after > 0;
              auto posted = q.Post(last_of_batch || last_before_wait, batches[b].reads);
              CHECK(q.reads_outstanding() <= read_depth);
              if (last_of_batch) {
                CHECK(posted.signalled);
                ++ends;
              }
              in_flight.push_back({posted.seq, posted.signalled});
              if (++next == batches[b].size) {
                ++batch;
                next = 0;
              }
            }
          }
        }
        CHECK(ends == batches.size());
      }
    }
  }
}

TEST_CASE("verbs wire: QP addresses round-trip") {
  QpAddress a;
  a.qp_num = 0x123456;
  a.psn = 0xabcdef;
  a.lid = 0;
  a.mtu = 3;
  a.global = true;
  a.port = 1;
  for (int i = 0; i < 16; ++i) a.gid[i] = uint8_t(i * 17);
  QpAddress b = a;
  b.global = false;
  b.lid = 77;
  b.qp_num = 2;
  b.rd_atomic = 200;
  const auto blob = EncodeQpAddresses(kEndpointMagic, {a, b});
  CHECK(blob.size() == 8 + 2 * 32);
  auto decoded = DecodeQpAddresses(blob, kEndpointMagic, "endpoint");
  REQUIRE(decoded.ok());
  REQUIRE(decoded->size() == 2);
  CHECK((*decoded)[0] == a);
  CHECK((*decoded)[1] == b);
  // A rail without a QP (its port was down) is an entry of zero bytes, between live ones.
  const auto with_absent = EncodeQpAddresses(kEndpointMagic, {a, QpAddress::Absent(), b});
  CHECK(std::all_of(with_absent.begin() + 8 + 32, with_absent.begin() + 8 + 64,
                    [](uint8_t byte) { return byte == 0; }));
  auto three = DecodeQpAddresses(with_absent, kEndpointMagic, "endpoint");
  REQUIRE(three.ok());
  REQUIRE(three->size() == 3);
  CHECK((*three)[0] == a);
  CHECK((*three)[1].absent());
  CHECK_FALSE((*three)[0].absent());
  CHECK((*three)[2] == b);
  // A reply is not an endpoint, and the other way round.
  auto wrong = DecodeQpAddresses(blob, kReplyMagic, "reply");
  REQUIRE_FALSE(wrong.ok());
  CHECK(std::string(wrong.status().message())
            .find("expected a verbs reply blob, got a verbs endpoint blob") != std::string::npos);
}

TEST_CASE("verbs wire: every field from the peer is checked") {
  QpAddress good;
  good.qp_num = 100;
  good.psn = 5;
  good.mtu = 3;
  good.global = true;
  good.port = 1;
  good.gid[15] = 1;
  const pdlib::spi::Blob base = EncodeQpAddresses(kEndpointMagic, {good});
  REQUIRE(DecodeQpAddresses(base, kEndpointMagic, "endpoint").ok());
  struct Case {
    const char* what;
    size_t offset;
    uint8_t value;
    const char* expect;
  };
  const Case cases[] = {
      {"qp_num 0", 8, 0, "qp_num 0 out of range"},
      {"qp_num above 24 bits", 11, 1, "qp_num 16777316 out of range"},
      {"psn above 24 bits", 15, 1, "psn 16777221 out of range"},
      {"mtu 0", 18, 0, "mtu 0 out of range [1, 5]"},
      {"mtu 6", 18, 6, "mtu 6 out of range [1, 5]"},
      {"unknown flag", 19, 3, "unknown flags 3"},
      {"rd_atomic 0", 21, 0, "rd_atomic 0 out of range"},
      {"reserved byte", 22, 9, "non-zero reserved"},
      {"port 0", 20, 0, "port 0"},
      {"no GID routing and LID 0", 19, 0, "LID 0 is not a unicast LID"},
      {"version", 4, 1, "has version 1"},
      {"count 0", 6, 0, "has 0 entries"},
      {"count 17", 6, 17, "has 17 entries"},
      {"count 2 but one entry", 6, 2, "does not hold 2 entries"},
      {"magic", 0, 0, "not a verbs blob"},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    pdlib::spi::Blob bad = base;
    bad[c.offset] = c.value;
    auto r = DecodeQpAddresses(bad, kEndpointMagic, "endpoint");
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(r.status().message()), Catch::Contains(c.expect));
  }
  for (size_t cut : {size_t{0}, size_t{3}, size_t{8}, base.size() - 1}) {
    pdlib::spi::Blob shorter(base.begin(), base.begin() + cut);
    CHECK_FALSE(DecodeQpAddresses(shorter, kEndpointMagic, "endpoint").ok());
  }
  pdlib::spi::Blob longer = base;
  longer.push_back(0);
  CHECK_FALSE(DecodeQpAddresses(longer, kEndpointMagic, "endpoint").ok());
}

TEST_CASE("verbs wire: key blobs") {
  const auto blob = EncodeKeys({0xdeadbeef, 7});
  auto keys = DecodeKeys(blob);
  REQUIRE(keys.ok());
  CHECK(*keys == std::vector<uint32_t>{0xdeadbeef, 7});
  CHECK_FALSE(DecodeKeys({9}).ok());
  CHECK_FALSE(DecodeKeys(EncodeQpAddresses(kEndpointMagic, {})).ok());  // wrong magic and count
  pdlib::spi::Blob truncated(blob.begin(), blob.end() - 1);
  CHECK_FALSE(DecodeKeys(truncated).ok());
  CHECK_FALSE(DecodeKeys(EncodeKeys(std::vector<uint32_t>(kMaxDevices + 1, 1))).ok());
}

TEST_CASE("verbs options: defaults and every option") {
  pdlib::spi::TransportOptions o;
  auto d = ParseVerbsOptions(o);
  REQUIRE(d.ok());
  CHECK(d->devices.empty());
  CHECK(d->gid_index == -1);
  CHECK(d->sq_depth == 512);
  CHECK(d->signal_every == 32);
  CHECK(d->timeout == 14);
  CHECK(d->retry_cnt == 7);
  CHECK(d->rail_stall_ms == 3000);
  CHECK(d->rail_retry_ms == 1000);

  o.options = {{"verbs.devices", "mlx5_0, mlx5_1:2"},
               {"verbs.gid_index", "3"},
               {"verbs.sq_depth", "64"},
               {"verbs.cq_depth", "4k"},
               {"verbs.signal_every", "100"},  // clamped to the queue depth
               {"verbs.max_sge", "4"},
               {"verbs.max_message_bytes", "64k"},
               {"verbs.max_chain", "8"},
               {"verbs.busy_poll_us", "0"},
               {"verbs.timeout", "10"},
               {"verbs.retry_cnt", "3"},
               {"verbs.traffic_class", "106"},
               {"verbs.rail_stall_ms", "0"},
               {"verbs.rail_retry_ms", "250"},
               {"ucx.tls", "shm"}};  // other backends' options are not ours to judge
  auto v = ParseVerbsOptions(o);
  REQUIRE(v.ok());
  REQUIRE(v->devices.size() == 2);
  CHECK(v->devices[0].name == "mlx5_0");
  CHECK(v->devices[0].port == 0);
  CHECK(v->devices[1].name == "mlx5_1");
  CHECK(v->devices[1].port == 2);
  CHECK(v->gid_index == 3);
  CHECK(v->sq_depth == 64);
  CHECK(v->cq_depth == 4096);
  CHECK(v->signal_every == 64);
  CHECK(v->max_sge == 4);
  CHECK(v->max_message_bytes == 65536);
  CHECK(v->max_chain == 8);
  CHECK(v->busy_poll_us == 0);
  CHECK(v->timeout == 10);
  CHECK(v->retry_cnt == 3);
  CHECK(v->traffic_class == 106);
  CHECK(v->rail_stall_ms == 0);
  CHECK(v->rail_retry_ms == 250);
}

TEST_CASE("verbs options: retry_cnt 7 becomes 6 on Soft-RoCE only (rxe retries forever at 7)") {
  Device hardware, soft;
  soft.soft_roce = true;
  VerbsOptions o;
  CHECK(RcRetryCount(hardware, o) == 7);
  CHECK(RcRetryCount(soft, o) == 6);
  o.retry_cnt = 3;
  CHECK(RcRetryCount(hardware, o) == 3);
  CHECK(RcRetryCount(soft, o) == 3);
}

TEST_CASE("verbs options: nic_names select devices unless verbs.devices does") {
  pdlib::spi::TransportOptions o;
  o.nic_names = {"rxe0", "rxe1:1"};
  auto v = ParseVerbsOptions(o);
  REQUIRE(v.ok());
  REQUIRE(v->devices.size() == 2);
  CHECK(v->devices[1].name == "rxe1");
  o.options = {{"verbs.devices", "mlx5_3"}};
  v = ParseVerbsOptions(o);
  REQUIRE(v.ok());
  REQUIRE(v->devices.size() == 1);
  CHECK(v->devices[0].name == "mlx5_3");
}

TEST_CASE("verbs options: bad values are refused with the key and the range") {
  const std::pair<std::string, std::string> bad[] = {
      {"verbs.sq_depth", "1"},           {"verbs.sq_depth", "lots"},
      {"verbs.retry_cnt", "8"},          {"verbs.timeout", "0"},
      {"verbs.gid_index", "-1"},         {"verbs.max_sge", "0"},
      {"verbs.max_message_bytes", "8g"}, {"verbs.cq_depth", "12x"},
      {"verbs.devices", "mlx5_0,,x"},    {"verbs.devices", "mlx5_0:0"},
      {"verbs.devices", ":1"},           {"verbs.typo", "1"},
  };
  for (const auto& [key, value] : bad) {
    INFO(key << "=" << value);
    pdlib::spi::TransportOptions o;
    o.options = {{key, value}};
    auto v = ParseVerbsOptions(o);
    REQUIRE_FALSE(v.ok());
    CHECK(v.status().code() == StatusCode::kInvalidArgument);
    const std::string message(v.status().message());
    CHECK((message.find(key) != std::string::npos || message.find(value) != std::string::npos));
  }
  pdlib::spi::TransportOptions o;
  o.options = {{"verbs.sq_depth", "1024"}, {"verbs.cq_depth", "512"}};
  auto v = ParseVerbsOptions(o);
  REQUIRE_FALSE(v.ok());
  CHECK_THAT(std::string(v.status().message()), Catch::Contains("verbs.cq_depth=512"));
  std::string many;
  for (int i = 0; i < 17; ++i) many += (i ? ",d" : "d") + std::to_string(i);
  CHECK_FALSE(ParseDeviceList(many).ok());
}

TEST_CASE("verbs striping: whole ops, a stripe's bytes per pair, round robin from the first") {
  using pdlib::verbs::kNoPair;
  using pdlib::verbs::StripeOverPairs;
  const uint64_t k = 1024;
  // 8 ops of 100 KiB, stripes of 256 KiB: 3 ops (300 KiB) fill a stripe, then the next pair.
  const std::vector<uint64_t> eight(8, 100 * k);
  CHECK(StripeOverPairs(eight, 2, 256 * k, 0) == std::vector<size_t>{0, 0, 0, 1, 1, 1, 0, 0});
  CHECK(StripeOverPairs(eight, 3, 256 * k, 1) == std::vector<size_t>{1, 1, 1, 2, 2, 2, 0, 0});
  CHECK(StripeOverPairs(eight, 1, 256 * k, 5) == std::vector<size_t>(8, 0));
  // Empty ops go nowhere and do not count.
  CHECK(StripeOverPairs(std::vector<uint64_t>{0, 300 * k, 0, 10, 0}, 2, 256 * k, 0) ==
        std::vector<size_t>{kNoPair, 0, kNoPair, 1, kNoPair});
  // An op longer than a stripe stays whole on one pair.
  CHECK(StripeOverPairs(std::vector<uint64_t>{1 << 20, 1 << 20}, 2, 256 * k, 1) ==
        std::vector<size_t>{1, 0});
  // Many pages: every pair gets its share of the bytes, within one stripe of the others.
  std::vector<uint64_t> pages(1000, 32 * k);
  for (size_t pairs : {2, 3, 4}) {
    std::vector<uint64_t> bytes(pairs, 0);
    const auto to = StripeOverPairs(pages, pairs, 256 * k, 0);
    for (size_t i = 0; i < pages.size(); ++i) bytes[to[i]] += pages[i];
    const auto [lo, hi] = std::minmax_element(bytes.begin(), bytes.end());
    INFO(pairs);
    CHECK(*hi - *lo <= 256 * k);
    CHECK(*lo > 0);
  }
}

// Rails by topology (issue #31): with neither verbs.devices nor nic_names, the RDMA devices
// closest to the KV pool, read from a sysfs tree (verbs.sysfs_root).
TEST_CASE("verbs options: devices by topology when none are named") {
  pdlib_test::SysfsTree sys;
  sys.AddPci("pci0000:00/0000:00:01.0/0000:01:00.0", "0");
  sys.AddRdma("pci0000:00/0000:00:01.0/0000:01:00.0", "mlx5_0");
  sys.AddPci("pci0000:80/0000:80:01.0/0000:81:00.0", "1");
  sys.AddRdma("pci0000:80/0000:80:01.0/0000:81:00.0", "mlx5_2");
  sys.AddPci("pci0000:80/0000:80:02.0/0000:82:00.0", "1");
  sys.AddRdma("pci0000:80/0000:80:02.0/0000:82:00.0", "mlx5_1");
  sys.AddVirtualRdma("rxe0");
  pdlib::spi::TransportOptions t;
  t.options = {{"verbs.sysfs_root", sys.root()}};
  t.memory_numa_node = 1;  // the pool's memory is on node 1
  auto parsed = pdlib::verbs::ParseVerbsOptions(t);
  REQUIRE(parsed.ok());
  CHECK(parsed->devices.empty());  // nothing named: the transport asks the topology
  std::string why;
  auto closest = pdlib::verbs::DevicesByTopology(*parsed, t, &why);
  REQUIRE(closest.ok());
  std::vector<std::string> names;
  for (const auto& d : *closest) names.push_back(d.name);
  CHECK(names == std::vector<std::string>{"mlx5_1", "mlx5_2"});
  CHECK(why.find("mlx5_1 (same NUMA node)") != std::string::npos);
  t.memory_numa_node = 0;
  closest = pdlib::verbs::DevicesByTopology(*parsed, t, &why);
  REQUIRE(closest.ok());
  REQUIRE(closest->size() == 1);
  CHECK(closest->front().name == "mlx5_0");
  // Only Soft-RoCE (no device on PCI): nothing, and the transport falls back to the first
  // active device.
  pdlib_test::SysfsTree bare;
  bare.AddVirtualRdma("rxe0");
  t.options = {{"verbs.sysfs_root", bare.root()}};
  parsed = pdlib::verbs::ParseVerbsOptions(t);
  REQUIRE(parsed.ok());
  closest = pdlib::verbs::DevicesByTopology(*parsed, t, &why);
  REQUIRE(closest.ok());
  CHECK(closest->empty());
  CHECK(why.find("no RDMA device on PCI") != std::string::npos);
}
