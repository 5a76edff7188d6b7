// The host engine (examples/hosts/host.h) in one process, no gRPC: a prefill Host and a decode
// Host whose ranks move real KV with pdlib (UCX over shared memory, in-process control plane),
// for 1P1D, prefill TP 2, prefill PP 2, the hybrid model (mamba state; with TP 2 and PP 2 too),
// sharded decode (TP 1 -> 2, TP 4 -> 2, PP 2 -> 2), MLA and the sliding-window model across TP,
// the swap-heads test fault (tokens must differ), and colocated hosts (also TP 2 x PP 2). Every
// output is compared with a colocated reference computed directly on a kernels::Model. Also:
// failures end with a reason, and shutdown fails in-flight requests.
#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "examples/hosts/host.h"
#include "hosts_reference.h"
#include "pdlib_kernels/cuda_info.h"

namespace pdlib::hosts {
namespace {

using std::chrono::milliseconds;

// Keys of the in-process control plane's bootstrap table: one per prefill host.
uint16_t NextBootstrapPort() {
  static uint16_t next = 43100;
  return next++;
}

HostOptions BaseOptions(Role role, const std::string& model) {
  HostOptions o;
  o.role = role;
  o.model = model;
  o.seed = 11;
  o.control_plane = ControlPlane::kInProcess;
  o.backend = "ucx";
  o.backend_options = {{"ucx.tls", "shm"}};
  o.threads_per_rank = 1;
  o.num_pages = 64;
  o.max_running = 4;
  o.chunked_prefill_size = 24;  // prompts over 24 tokens are prefilled in chunks
  o.reserved_decode_tokens = 16;
  o.bootstrap_timeout = milliseconds(10000);
  o.idle_poll = std::chrono::microseconds(200);
  return o;
}

// Results and streamed tokens per room, filled from a host's coordinator thread.
class Collector {
 public:
  RequestCallbacks For(uint64_t room) {
    return {.on_token = [this, room](int32_t index, int32_t token) { OnToken(room, index, token); },
            .on_result = [this, room](HostRequestResult r) { OnResult(room, std::move(r)); }};
  }
  // Waits until `n` results are in; false on timeout.
  bool Wait(size_t n, milliseconds timeout = milliseconds(60000)) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return results_.size() >= n; });
  }
  std::map<uint64_t, HostRequestResult> results() {
    std::lock_guard lock(mu_);
    return results_;
  }
  std::map<uint64_t, std::vector<std::pair<int32_t, int32_t>>> tokens() {
    std::lock_guard lock(mu_);
    return tokens_;
  }
  int duplicate_results() {
    std::lock_guard lock(mu_);
    return duplicates_;
  }

 private:
  void OnToken(uint64_t room, int32_t index, int32_t token) {
    std::lock_guard lock(mu_);
    tokens_[room].emplace_back(index, token);
  }
  void OnResult(uint64_t room, HostRequestResult r) {
    std::lock_guard lock(mu_);
    if (!results_.emplace(room, std::move(r)).second) ++duplicates_;
    cv_.notify_all();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, HostRequestResult> results_;
  std::map<uint64_t, std::vector<std::pair<int32_t, int32_t>>> tokens_;
  int duplicates_ = 0;
};

struct Prompt {
  uint64_t room;
  std::vector<int32_t> tokens;
  int32_t max_new;
};

std::vector<Prompt> Prompts() {
  std::mt19937 rng(5);
  std::vector<Prompt> out;
  uint64_t room = 1000;
  // Shorter than a page, a page and a bit, chunked (> 24 tokens), chunked and page-aligned.
  for (int32_t len : {5, 17, 41, 48}) {
    Prompt p{room++, {}, 6};
    for (int32_t i = 0; i < len; ++i) p.tokens.push_back(static_cast<int32_t>(rng() % 512));
    out.push_back(std::move(p));
  }
  return out;
}

void CheckDecodeResults(Collector& decode, const std::vector<Prompt>& prompts,
                        const std::string& model, bool colocated) {
  auto results = decode.results();
  auto tokens = decode.tokens();
  CHECK(decode.duplicate_results() == 0);
  for (const Prompt& p : prompts) {
    INFO("room " << p.room << ", prompt of " << p.tokens.size() << " tokens");
    REQUIRE(results.count(p.room) == 1);
    const HostRequestResult& r = results[p.room];
    INFO(r.status.ToString());
    REQUIRE(r.status.ok());
    CHECK(r.output_ids == testing::Reference(model, 11, p.tokens, p.max_new));
    // Streamed in order, the same tokens.
    std::vector<int32_t> streamed;
    for (size_t i = 0; i < tokens[p.room].size(); ++i) {
      CHECK(tokens[p.room][i].first == static_cast<int32_t>(i));
      streamed.push_back(tokens[p.room][i].second);
    }
    CHECK(streamed == r.output_ids);
    CHECK(r.first_token_us > 0);
    CHECK(r.finish_us >= r.first_token_us);
    if (colocated) {
      CHECK(r.kv_bytes == 0);
    } else {
      CHECK(r.kv_bytes > 0);
      CHECK(r.transfer_us >= 0);
    }
  }
}

// A disaggregated deployment of one prefill host and one decode host: the model and each side's
// TP and PP, and the decode host's test-only fault.
struct Layout {
  std::string model = "small";
  int32_t prefill_tp = 1, prefill_pp = 1;
  int32_t decode_tp = 1, decode_pp = 1;
  std::string test_fault{};
  // Both hosts on the CUDA model with GPU KV pools, moved by cuda_ipc (issue #19).
  bool cuda = false;
};

// Whether a side's ranks hold every KV byte exactly once (no GQA head or MLA latent replicated
// across TP ranks), so that the bytes its ranks count add up to the model's.
bool HoldsOnce(const std::string& model, int32_t tp) {
  // MLA's latent row and the NSA indexer's keys are on every TP rank.
  if (model == "small-mla" || model == "small-nsa") return tp == 1;
  return tp <= 2;  // the other models have 2 KV heads
}

// One prefill host and one decode host; every prompt sent to both, as the router would. With a
// test fault, returns how many outputs differ from the reference (and checks none); otherwise
// checks every output against it.
int RunDisaggregated(const Layout& l) {
  INFO("model " << l.model << ", prefill tp " << l.prefill_tp << " pp " << l.prefill_pp
                << " -> decode tp " << l.decode_tp << " pp " << l.decode_pp
                << (l.test_fault.empty() ? "" : ", fault " + l.test_fault));
  const uint16_t bootstrap = NextBootstrapPort();
  auto on_device = [&](HostOptions o) {
    if (l.cuda) {
      o.device = kernels::Device::kCuda;
      o.backend = "cuda_ipc";
      o.backend_options.clear();
    }
    return o;
  };
  HostOptions po = on_device(BaseOptions(Role::kPrefill, l.model));
  po.tp_size = l.prefill_tp;
  po.pp_size = l.prefill_pp;
  po.bootstrap_port = bootstrap;
  auto prefill = Host::Create(po);
  INFO(prefill.status().ToString());
  REQUIRE(prefill.ok());
  HostOptions dopt = on_device(BaseOptions(Role::kDecode, l.model));
  dopt.tp_size = l.decode_tp;
  dopt.pp_size = l.decode_pp;
  dopt.test_fault = l.test_fault;
  auto decode = Host::Create(dopt);
  INFO(decode.status().ToString());
  REQUIRE(decode.ok());

  const HostLoad load = (*prefill)->Load();
  CHECK(load.role == Role::kPrefill);
  CHECK((load.tp_size == l.prefill_tp && load.pp_size == l.prefill_pp));
  CHECK(load.bootstrap.port == bootstrap);
  CHECK(((*decode)->Load().tp_size == l.decode_tp && (*decode)->Load().pp_size == l.decode_pp));

  Collector prefill_results, decode_results;
  const std::vector<Prompt> prompts = Prompts();
  for (const Prompt& p : prompts) {
    (*decode)->Submit({.room = p.room,
                       .prompt = p.tokens,
                       .max_new_tokens = p.max_new,
                       .bootstrap = {"127.0.0.1", bootstrap},
                       .prefill_dp_rank = std::nullopt},
                      decode_results.For(p.room));
    (*prefill)->Submit({.room = p.room,
                        .prompt = p.tokens,
                        .max_new_tokens = p.max_new,
                        .bootstrap = {},
                        .prefill_dp_rank = std::nullopt},
                       prefill_results.For(p.room));
  }
  REQUIRE(decode_results.Wait(prompts.size()));
  REQUIRE(prefill_results.Wait(prompts.size()));
  int differ = 0;
  if (l.test_fault.empty()) {
    CheckDecodeResults(decode_results, prompts, l.model, /*colocated=*/false);
  } else {
    for (auto& [room, r] : decode_results.results()) {
      INFO("room " << room << ": " << r.status.ToString());
      REQUIRE(r.status.ok());
      const Prompt& p = *std::find_if(prompts.begin(), prompts.end(),
                                      [room = room](const Prompt& q) { return q.room == room; });
      differ += r.output_ids != testing::Reference(l.model, 11, p.tokens, p.max_new) ? 1 : 0;
    }
  }
  auto pr = prefill_results.results();
  auto dr = decode_results.results();
  for (const Prompt& p : prompts) {
    INFO("room " << p.room << ": " << pr[p.room].status.ToString());
    REQUIRE(pr[p.room].status.ok());
    CHECK(pr[p.room].output_ids == std::vector<int32_t>{dr[p.room].output_ids.at(0)});
    // Prefill's ranks together sent what decode's received: every head of every layer, and the
    // state; when a side replicates heads across its TP ranks, each copy counts there.
    if (HoldsOnce(l.model, l.prefill_tp) && HoldsOnce(l.model, l.decode_tp)) {
      CHECK(pr[p.room].kv_bytes == dr[p.room].kv_bytes);
    }
    CHECK(pr[p.room].kv_bytes > 0);
    CHECK(pr[p.room].transfer_us > 0);
  }
  CHECK(prefill_results.tokens().empty());  // prefill streams no tokens
  (*decode)->Shutdown();
  (*prefill)->Shutdown();
  return differ;
}

void RunDisaggregated(const std::string& model, int32_t tp, int32_t pp) {
  RunDisaggregated(Layout{.model = model, .prefill_tp = tp, .prefill_pp = pp});
}

TEST_CASE("hosts engine: 1P1D outputs equal the colocated reference") {
  RunDisaggregated("small", 1, 1);
}

TEST_CASE("hosts engine: prefill TP 2 -> decode TP 1 (head shards)") {
  RunDisaggregated("small", 2, 1);
}

TEST_CASE("hosts engine: prefill PP 2 -> decode PP 1 (layer stages)") {
  RunDisaggregated("small", 1, 2);
}

TEST_CASE("hosts engine: hybrid model with mamba state (1P1D and prefill TP 2 x PP 2)") {
  RunDisaggregated("small-hybrid", 1, 1);
  RunDisaggregated("small-hybrid", 2, 2);
}

TEST_CASE("hosts engine: sharded decode: TP 1 -> 2, TP 4 -> 2, PP 2 -> PP 2", "[long]") {
  RunDisaggregated(Layout{.model = "small", .decode_tp = 2});
  RunDisaggregated(Layout{.model = "small", .prefill_tp = 4, .decode_tp = 2});
  RunDisaggregated(Layout{.model = "small", .prefill_pp = 2, .decode_pp = 2});
  RunDisaggregated(Layout{
      .model = "small-hybrid", .prefill_tp = 2, .prefill_pp = 2, .decode_tp = 2, .decode_pp = 2});
}

// Issue #19: the CUDA model's KV pools in GPU memory, registered as kCuda and moved by cuda_ipc,
// compared token for token with the CPU reference; the test fault (read, corrupted and written
// back through cudaMemcpy) must change the outputs. Only where a GPU can be used.
TEST_CASE("hosts engine: device cuda, GPU KV pools over cuda_ipc (1P1D, TP 2 -> 1, hybrid)") {
  const kernels::CudaInfo cuda = kernels::ProbeCuda();
  if (cuda.device_count == 0) {
    WARN("skipped: no CUDA device (" << cuda.reason << ")");
    return;
  }
  RunDisaggregated(Layout{.model = "small", .cuda = true});
  RunDisaggregated(Layout{.model = "small", .prefill_tp = 2, .cuda = true});
  RunDisaggregated(Layout{.model = "small-hybrid", .cuda = true});
  CHECK(RunDisaggregated(Layout{.model = "small", .test_fault = "swap-heads", .cuda = true}) > 0);
}

TEST_CASE("hosts engine: MLA (prefill TP 2 -> decode TP 1, TP 1 -> TP 2)") {
  RunDisaggregated(Layout{.model = "small-mla", .prefill_tp = 2});
  RunDisaggregated(Layout{.model = "small-mla", .decode_tp = 2});
}

TEST_CASE("hosts engine: sliding-window hybrid (1P1D, prefill TP 2 -> decode TP 1, TP 1 -> 2)") {
  RunDisaggregated(Layout{.model = "small-swa"});
  RunDisaggregated(Layout{.model = "small-swa", .prefill_tp = 2});
  RunDisaggregated(Layout{.model = "small-swa", .decode_tp = 2, .decode_pp = 1});
}

TEST_CASE("hosts engine: NSA-style indexer (1P1D, prefill TP 2 -> decode TP 1, TP 1 -> 2)") {
  RunDisaggregated(Layout{.model = "small-nsa"});
  RunDisaggregated(Layout{.model = "small-nsa", .prefill_tp = 2});
  RunDisaggregated(Layout{.model = "small-nsa", .decode_tp = 2});
}

// The negative control: the same runs with decode rank tp 0 pp 0 corrupting what it received
// must give other tokens, so the comparisons above cannot pass vacuously.
TEST_CASE("hosts engine: the test faults change the tokens, every family", "[long]") {
  for (const Layout& l : {Layout{.model = "small", .test_fault = "swap-heads"},
                          Layout{.model = "small", .decode_tp = 2, .test_fault = "swap-heads"},
                          Layout{.model = "small-mla", .prefill_tp = 2, .test_fault = "swap-heads"},
                          Layout{.model = "small-swa", .test_fault = "swap-heads"},
                          Layout{.model = "small-nsa", .test_fault = "swap-index"}}) {
    const int differ = RunDisaggregated(l);
    std::printf("hosts_engine_test: fault on %s decode tp %d: %d of %zu outputs differ\n",
                l.model.c_str(), l.decode_tp, differ, Prompts().size());
    CHECK(differ >= 1);
  }
}

TEST_CASE("hosts engine: colocated host equals the reference without a transfer", "[long]") {
  struct Case {
    const char* model;
    int32_t tp, pp;
  };
  for (const Case& c : {Case{"small", 1, 1}, Case{"small-hybrid", 1, 1}, Case{"small-mla", 1, 1},
                        Case{"small-swa", 1, 1}, Case{"small-nsa", 1, 1}, Case{"small", 2, 2}}) {
    const char* model = c.model;
    INFO(model << " tp " << c.tp << " pp " << c.pp);
    HostOptions o = BaseOptions(Role::kColocated, model);
    o.tp_size = c.tp;
    o.pp_size = c.pp;
    auto host = Host::Create(o);
    INFO(host.status().ToString());
    REQUIRE(host.ok());
    Collector results;
    const std::vector<Prompt> prompts = Prompts();
    for (const Prompt& p : prompts) {
      // The bootstrap address is ignored.
      (*host)->Submit({.room = p.room,
                       .prompt = p.tokens,
                       .max_new_tokens = p.max_new,
                       .bootstrap = {"192.0.2.1", 1},
                       .prefill_dp_rank = std::nullopt},
                      results.For(p.room));
    }
    REQUIRE(results.Wait(prompts.size()));
    CheckDecodeResults(results, prompts, model, /*colocated=*/true);
  }
}

// The fake backend moves no bytes, so decode cannot get the right tokens (its metadata room check
// fails), but every request must still end on both sides.
TEST_CASE("hosts engine: the fake backend ends every request") {
  const uint16_t bootstrap = NextBootstrapPort();
  HostOptions po = BaseOptions(Role::kPrefill, "small");
  po.backend = "fake";
  po.backend_options.clear();
  po.bootstrap_port = bootstrap;
  po.tp_size = 2;
  HostOptions dopt = BaseOptions(Role::kDecode, "small");
  dopt.backend = "fake";
  dopt.backend_options.clear();
  auto prefill = Host::Create(po);
  INFO(prefill.status().ToString());
  REQUIRE(prefill.ok());
  auto decode = Host::Create(dopt);
  INFO(decode.status().ToString());
  REQUIRE(decode.ok());
  Collector p, d;
  const std::vector<Prompt> prompts = Prompts();
  for (const Prompt& q : prompts) {
    (*decode)->Submit({.room = q.room,
                       .prompt = q.tokens,
                       .max_new_tokens = q.max_new,
                       .bootstrap = {"127.0.0.1", bootstrap},
                       .prefill_dp_rank = {}},
                      d.For(q.room));
    (*prefill)->Submit({.room = q.room,
                        .prompt = q.tokens,
                        .max_new_tokens = q.max_new,
                        .bootstrap = {},
                        .prefill_dp_rank = {}},
                       p.For(q.room));
  }
  REQUIRE(d.Wait(prompts.size(), milliseconds(30000)));
  REQUIRE(p.Wait(prompts.size(), milliseconds(30000)));
  for (auto& [room, r] : d.results()) {
    INFO("room " << room << ": " << r.status.ToString());
    CHECK((r.status.ok() || !r.status.message().empty()));
  }
}

TEST_CASE("hosts engine: failures end with ok=false and a reason and nothing hangs") {
  HostOptions dopt = BaseOptions(Role::kDecode, "small");
  dopt.bootstrap_timeout = milliseconds(1000);
  dopt.connect_timeout = milliseconds(1000);
  dopt.waiting_timeout = milliseconds(2000);
  dopt.transfer_timeout = milliseconds(2000);
  auto decode = Host::Create(dopt);
  REQUIRE(decode.ok());
  HostOptions popt = BaseOptions(Role::kPrefill, "small");
  popt.bootstrap_port = NextBootstrapPort();
  popt.bootstrap_timeout = milliseconds(1000);
  auto prefill = Host::Create(popt);
  REQUIRE(prefill.ok());
  Collector d, p;
  // Decode: its prefill host never gets the request, so it stays live until a timeout ends it;
  // meanwhile the same room again is refused.
  (*decode)->Submit({.room = 1,
                     .prompt = {1, 2, 3},
                     .max_new_tokens = 4,
                     .bootstrap = {"127.0.0.1", popt.bootstrap_port},
                     .prefill_dp_rank = {}},
                    d.For(1));
  (*decode)->Submit(
      {.room = 1, .prompt = {1}, .max_new_tokens = 1, .bootstrap = {}, .prefill_dp_rank = {}},
      d.For(3));
  // Decode: refused at once (max_new_tokens 0); no prefill registered at that address.
  (*decode)->Submit(
      {.room = 2, .prompt = {1, 2, 3}, .max_new_tokens = 0, .bootstrap = {}, .prefill_dp_rank = {}},
      d.For(2));
  (*decode)->Submit({.room = 4,
                     .prompt = {1, 2, 3},
                     .max_new_tokens = 4,
                     .bootstrap = {"127.0.0.1", NextBootstrapPort()},
                     .prefill_dp_rank = {}},
                    d.For(4));
  // Prefill: no decode ever asks for room 9.
  (*prefill)->Submit(
      {.room = 9, .prompt = {4, 5, 6}, .max_new_tokens = 1, .bootstrap = {}, .prefill_dp_rank = {}},
      p.For(9));
  REQUIRE(d.Wait(4, milliseconds(30000)));
  REQUIRE(p.Wait(1, milliseconds(30000)));
  auto dr = d.results();
  for (uint64_t key : {1, 4}) {
    INFO("request " << key << ": " << dr[key].status.ToString());
    CHECK(!dr[key].status.ok());
    CHECK(std::string(dr[key].status.message()).find("room") != std::string::npos);
  }
  CHECK(dr[2].status.code() == StatusCode::kInvalidArgument);
  CHECK(dr[3].status.code() == StatusCode::kAlreadyExists);
  auto pr = p.results();
  CHECK(pr[9].status.code() == StatusCode::kDeadlineExceeded);
  CHECK(std::string(pr[9].status.message()).find("room 9") != std::string::npos);
}

TEST_CASE("hosts engine: decode requests fail promptly when their prefill host goes away") {
  HostOptions popt = BaseOptions(Role::kPrefill, "small");
  popt.bootstrap_port = NextBootstrapPort();
  auto prefill = Host::Create(popt);
  REQUIRE(prefill.ok());
  HostOptions dopt = BaseOptions(Role::kDecode, "small");
  dopt.transfer_timeout = milliseconds(60000);  // must not be what ends the request
  auto decode = Host::Create(dopt);
  REQUIRE(decode.ok());
  Collector d;
  // The prefill host never gets these requests: decode connects, pre-allocates and waits.
  for (uint64_t room = 1; room <= 2; ++room) {
    (*decode)->Submit({.room = room,
                       .prompt = {1, 2, 3, 4},
                       .max_new_tokens = 3,
                       .bootstrap = {"127.0.0.1", popt.bootstrap_port},
                       .prefill_dp_rank = {}},
                      d.For(room));
  }
  // Let decode reach the prefill ranks, then take prefill away.
  std::this_thread::sleep_for(milliseconds(300));
  const auto gone = std::chrono::steady_clock::now();
  prefill->reset();
  REQUIRE(d.Wait(2, milliseconds(20000)));
  CHECK(std::chrono::steady_clock::now() - gone < milliseconds(10000));
  for (auto& [room, r] : d.results()) {
    INFO("room " << room << ": " << r.status.ToString());
    CHECK(!r.status.ok());
    CHECK(!r.status.message().empty());
  }
}

TEST_CASE("hosts engine: shutdown fails in-flight requests with a reason") {
  HostOptions popt = BaseOptions(Role::kPrefill, "small");
  popt.bootstrap_port = NextBootstrapPort();
  popt.tp_size = 2;
  auto prefill = Host::Create(popt);
  REQUIRE(prefill.ok());
  Collector p;
  for (uint64_t room = 1; room <= 3; ++room) {
    (*prefill)->Submit({.room = room,
                        .prompt = {4, 5, 6},
                        .max_new_tokens = 1,
                        .bootstrap = {},
                        .prefill_dp_rank = {}},
                       p.For(room));
  }
  (*prefill)->Shutdown();
  REQUIRE(p.Wait(3, milliseconds(0)));
  for (auto& [room, r] : p.results()) {
    INFO("room " << room);
    CHECK(r.status.code() == StatusCode::kUnavailable);
    CHECK(std::string(r.status.message()).find("shutting down") != std::string::npos);
  }
  // After shutdown a request is refused at once.
  (*prefill)->Submit(
      {.room = 4, .prompt = {1}, .max_new_tokens = 1, .bootstrap = {}, .prefill_dp_rank = {}},
      p.For(4));
  REQUIRE(p.Wait(4, milliseconds(0)));
  CHECK(p.duplicate_results() == 0);
}

TEST_CASE("hosts engine: a split the model does not have is refused with the numbers") {
  HostOptions o = BaseOptions(Role::kDecode, "small");
  o.tp_size = 3;  // 4 query heads
  auto host = Host::Create(o);
  CHECK(host.status().code() == StatusCode::kInvalidArgument);
  CHECK(std::string(host.status().message()).find("model small with tp 3 pp 1") !=
        std::string::npos);
  o.tp_size = 1;
  o.pp_size = 5;  // 4 layers
  CHECK(Host::Create(o).status().code() == StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdlib::hosts
