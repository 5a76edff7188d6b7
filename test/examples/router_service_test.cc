// pd-router end to end in one process over gRPC: fake prefill and decode hosts
// (router_test_harness.h) behind a real Router, driven through service Router: streaming, failing
// and hanging hosts, a dead host, the policies against reported load, cancellation, shutdown and
// startup.
#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <future>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "examples/router/router.h"
#include "examples/router/tokenizer.h"
#include "router_test_harness.h"

namespace pdlib::router {

using namespace testing;  // NOLINT(build/namespaces): the test deployment's helpers
namespace pb = ::pdlib::serving;

TEST_CASE("router service: gRPC streams decode's tokens, then the result") {
  Deployment d;
  const std::string prompt = "Hello, router";
  GrpcOutcome out = GenerateOverGrpc(d.grpc_target(), TextRequest(prompt, 5));
  REQUIRE(out.status.ok());
  REQUIRE(out.has_result);
  const pb::GenerateResult& r = out.result;
  INFO(r.reason());
  CHECK(r.ok());
  CHECK(r.code() == 0);
  const std::vector<int32_t> expected = ExpectedTokens(prompt, 5);
  REQUIRE(out.tokens.size() == 5);
  for (size_t i = 0; i < out.tokens.size(); ++i) {
    CHECK(out.tokens[i].token_id() == expected[i]);
    CHECK(out.tokens[i].index() == static_cast<int32_t>(i));
  }
  CHECK(Ids(r.output_ids()) == expected);
  CHECK(r.room() != 0);
  CHECK(r.prefill_host() == d.prefill[0]->address());
  CHECK(r.decode_host() == d.decode[0]->address());
  CHECK(r.prompt_tokens() == static_cast<int32_t>(prompt.size()));
  CHECK(r.kv_bytes() == 100 * prompt.size());  // from prefill's result
  CHECK(r.transfer_us() == 7);                 // from decode's result
  CHECK(r.ttft_us() > 0);
  CHECK(r.latency_us() >= r.ttft_us());

  // Both hosts got the same request; decode's names the prefill host's bootstrap server.
  const auto p = d.prefill[0]->requests();
  const auto q = d.decode[0]->requests();
  REQUIRE(p.size() == 1);
  REQUIRE(q.size() == 1);
  CHECK(p[0].room() == r.room());
  CHECK(q[0].room() == r.room());
  CHECK(Ids(p[0].prompt_ids()) == Tokenize(prompt));
  CHECK(Ids(q[0].prompt_ids()) == Tokenize(prompt));
  CHECK(p[0].max_new_tokens() == 5);
  CHECK(q[0].bootstrap_host() == "127.0.0.1");
  CHECK(q[0].bootstrap_port() == 40000);
  CHECK(q[0].prefill_dp_rank() == -1);
}

TEST_CASE("router service: token ids in, the default max_new_tokens, late tokens") {
  Deployment d;
  pb::GenerateRequest request;
  for (int32_t id : std::vector<int32_t>{'N', 'O', 'S', 'T', 'R', 'E', 'A', 'M', 300}) {
    request.add_prompt_ids(id);
  }
  // Decode sends no token events, only its result: the router still streams every token.
  GrpcOutcome out = GenerateOverGrpc(d.grpc_target(), request);
  REQUIRE(out.has_result);
  CHECK(out.result.ok());
  CHECK(out.tokens.size() == 6);  // the router's default
  CHECK(out.result.output_ids_size() == 6);
  CHECK(d.decode[0]->requests().at(0).max_new_tokens() == 6);
  CHECK(Ids(d.prefill[0]->requests().at(0).prompt_ids()).back() == 300);
}

TEST_CASE("router service: invalid gRPC requests fail with INVALID_ARGUMENT") {
  Deployment d;
  GrpcOutcome out = GenerateOverGrpc(d.grpc_target(), pb::GenerateRequest());
  CHECK(out.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(Contains(out.status.error_message(), "empty prompt"));
  CHECK_FALSE(out.has_result);
  out = GenerateOverGrpc(d.grpc_target(), TextRequest("x", -2));
  CHECK(out.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  pb::GenerateRequest negative;
  negative.add_prompt_ids(-5);
  out = GenerateOverGrpc(d.grpc_target(), negative);
  CHECK(out.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(d.prefill[0]->requests().empty());  // nothing was dispatched
}

TEST_CASE("router service: concurrent requests get unique rooms and all complete") {
  Deployment d(2, 2);
  constexpr int kRequests = 24;
  std::vector<std::future<GrpcOutcome>> futures;
  for (int i = 0; i < kRequests; ++i) {
    futures.push_back(std::async(std::launch::async, [&d, i] {
      return GenerateOverGrpc(d.grpc_target(), TextRequest("prompt " + std::to_string(i), 4));
    }));
  }
  std::set<uint64_t> rooms;
  std::set<std::string> prefills, decodes;
  for (int i = 0; i < kRequests; ++i) {
    GrpcOutcome out = futures[static_cast<size_t>(i)].get();
    REQUIRE(out.has_result);
    INFO(out.result.reason());
    CHECK(out.result.ok());
    CHECK(Ids(out.result.output_ids()) == ExpectedTokens("prompt " + std::to_string(i), 4));
    CHECK(out.result.room() != 0);
    rooms.insert(out.result.room());
    prefills.insert(out.result.prefill_host());
    decodes.insert(out.result.decode_host());
  }
  CHECK(rooms.size() == kRequests);
  CHECK(prefills.size() == 2);  // power-of-two spreads the load
  CHECK(decodes.size() == 2);
  CHECK(WaitFor(
      [&] { return Contains(d.router->MetricsText(), "pdlib_router_requests_in_flight 0"); }));
  CHECK(Contains(d.router->MetricsText(), "pdlib_router_requests_total 24"));
}

TEST_CASE("router service: a failing prefill fails the request, naming the host and reason") {
  Deployment d;
  const auto start = Clock::now();
  GrpcOutcome out = GenerateOverGrpc(d.grpc_target(), TextRequest("PFAIL please", 4));
  REQUIRE(out.status.ok());
  REQUIRE(out.has_result);
  const pb::GenerateResult& r = out.result;
  CHECK_FALSE(r.ok());
  CHECK(r.code() == static_cast<int32_t>(StatusCode::kResourceExhausted));
  INFO(r.reason());
  CHECK(Contains(r.reason(), "prefill host " + d.prefill[0]->address() + " failed"));
  CHECK(Contains(r.reason(), "fake prefill: no KV pages"));
  CHECK_FALSE(Contains(r.reason(), "decode host"));  // decode was only cancelled
  CHECK(r.room() != 0);
  // Decode (waiting for KV that never comes) was cancelled after the settle time, long before
  // the request timeout.
  CHECK(Clock::now() - start < std::chrono::seconds(5));
  CHECK(WaitFor([&] { return d.decode[0]->cancelled.load() == 1; }));
  // The router goes on serving.
  out = GenerateOverGrpc(d.grpc_target(), TextRequest("fine", 3));
  REQUIRE(out.has_result);
  CHECK(out.result.ok());
}

TEST_CASE("router service: a prefill that never answers fails at the request timeout") {
  Deployment d(1, 1, [](RouterOptions* o) { o->request_timeout = std::chrono::milliseconds(600); });
  const auto start = Clock::now();
  GrpcOutcome out = GenerateOverGrpc(d.grpc_target(), TextRequest("PHANG", 4));
  const auto elapsed = Clock::now() - start;
  REQUIRE(out.has_result);
  const pb::GenerateResult& r = out.result;
  INFO(r.reason());
  CHECK_FALSE(r.ok());
  CHECK(r.code() == static_cast<int32_t>(StatusCode::kDeadlineExceeded));
  CHECK(Contains(r.reason(), "prefill host " + d.prefill[0]->address() +
                                 " did not finish within the request timeout of 600 ms"));
  CHECK(elapsed >= std::chrono::milliseconds(500));
  CHECK(elapsed < std::chrono::seconds(5));
  CHECK(WaitFor([&] { return d.prefill[0]->open.load() == 0 && d.decode[0]->open.load() == 0; }));
}

TEST_CASE("router service: a prefill that ends without a result, a failing decode") {
  Deployment d;
  GrpcOutcome out = GenerateOverGrpc(d.grpc_target(), TextRequest("PNORES", 4));
  REQUIRE(out.has_result);
  CHECK_FALSE(out.result.ok());
  CHECK(Contains(out.result.reason(),
                 "prefill host " + d.prefill[0]->address() + " ended its stream without a result"));

  out = GenerateOverGrpc(d.grpc_target(), TextRequest("DFAIL", 4));
  REQUIRE(out.has_result);
  const pb::GenerateResult& r = out.result;
  INFO(r.reason());
  CHECK_FALSE(r.ok());
  CHECK(r.code() == static_cast<int32_t>(StatusCode::kAborted));
  CHECK(Contains(r.reason(), "decode host " + d.decode[0]->address() +
                                 " failed: ABORTED: fake decode: KV transfer aborted"));
  CHECK(out.tokens.size() == 2);  // what decode sent before failing reached the client
  CHECK(r.output_ids_size() == 2);
}

TEST_CASE("router service: a dead prefill host fails only its requests and is then skipped") {
  Deployment d(2, 1, [](RouterOptions* o) {
    o->policy = Policy::kRandom;
    o->load_poll_interval = std::chrono::milliseconds(60000);  // only Generate errors count
    o->unavailable_backoff = std::chrono::milliseconds(60000);
  });
  const std::string dead = d.prefill[0]->address();
  const std::string alive = d.prefill[1]->address();
  d.prefill[0]->Kill();
  int failures = 0, i = 0;
  for (; i < 60 && failures == 0; ++i) {
    GrpcOutcome out = GenerateOverGrpc(d.grpc_target(), TextRequest("req", 3));
    REQUIRE(out.has_result);
    if (out.result.ok()) {
      CHECK(out.result.prefill_host() == alive);
      continue;
    }
    ++failures;
    INFO(out.result.reason());
    CHECK(out.result.prefill_host() == dead);
    CHECK(Contains(out.result.reason(), "prefill host " + dead + " failed: UNAVAILABLE"));
  }
  REQUIRE(failures == 1);  // random picks the dead host with probability 1/2 each time
  // From now on the dead host is skipped and every request completes on the other.
  for (int k = 0; k < 10; ++k) {
    GrpcOutcome out = GenerateOverGrpc(d.grpc_target(), TextRequest("after", 3));
    REQUIRE(out.has_result);
    CHECK(out.result.ok());
    CHECK(out.result.prefill_host() == alive);
  }
  const std::string metrics = d.router->MetricsText();
  CHECK(Contains(metrics, "pdlib_router_host_available{role=\"prefill\",host=\"" + dead + "\"} 0"));
  CHECK(Contains(metrics, "pdlib_router_requests_failed_total 1"));
}

TEST_CASE("router service: least-loaded follows the hosts' reported load") {
  Deployment d(2, 2, [](RouterOptions* o) { o->policy = Policy::kLeastLoaded; });
  d.prefill[0]->set_queued(50);
  d.decode[1]->set_queued(50);
  // Wait for a GetLoad poll to pick the queue lengths up.
  REQUIRE(WaitFor([&] {
    return Contains(d.router->MetricsText(),
                    "pdlib_router_host_reported_load{role=\"prefill\",host=\"" +
                        d.prefill[0]->address() + "\"} 50") &&
           Contains(d.router->MetricsText(),
                    "pdlib_router_host_reported_load{role=\"decode\",host=\"" +
                        d.decode[1]->address() + "\"} 50");
  }));
  for (int i = 0; i < 8; ++i) {
    GrpcOutcome out = GenerateOverGrpc(d.grpc_target(), TextRequest("x", 2));
    REQUIRE(out.has_result);
    CHECK(out.result.prefill_host() == d.prefill[1]->address());
    CHECK(out.result.decode_host() == d.decode[0]->address());
  }
}

TEST_CASE("router service: a client that cancels cancels both host RPCs") {
  Deployment d;
  grpc::ClientContext ctx;
  auto future = std::async(std::launch::async, [&] {
    return GenerateOverGrpc(d.grpc_target(), TextRequest("PHANG", 4), &ctx);
  });
  REQUIRE(WaitFor([&] { return d.prefill[0]->open.load() == 1 && d.decode[0]->open.load() == 1; }));
  ctx.TryCancel();
  GrpcOutcome out = future.get();
  CHECK(out.status.error_code() == grpc::StatusCode::CANCELLED);
  CHECK(WaitFor([&] { return d.prefill[0]->open.load() == 0 && d.decode[0]->open.load() == 0; }));
  CHECK(d.prefill[0]->cancelled.load() == 1);
  CHECK(d.decode[0]->cancelled.load() == 1);
  CHECK(WaitFor(
      [&] { return Contains(d.router->MetricsText(), "pdlib_router_requests_in_flight 0"); }));
}

TEST_CASE("router service: shutdown ends requests in flight promptly") {
  Deployment d;
  auto future = std::async(std::launch::async, [&] {
    return GenerateOverGrpc(d.grpc_target(), TextRequest("PHANG", 4));
  });
  REQUIRE(WaitFor([&] { return d.prefill[0]->open.load() == 1; }));
  const auto start = Clock::now();
  d.router->Shutdown();
  CHECK(Clock::now() - start < std::chrono::seconds(5));
  GrpcOutcome out = future.get();
  // Either the result (UNAVAILABLE, shutting down) made it out, or the stream was cut.
  if (out.has_result) {
    CHECK_FALSE(out.result.ok());
    CHECK(out.result.code() == static_cast<int32_t>(StatusCode::kUnavailable));
    CHECK(Contains(out.result.reason(), "shutting down"));
  } else {
    CHECK_FALSE(out.status.ok());
  }
  CHECK(WaitFor([&] { return d.prefill[0]->open.load() == 0 && d.decode[0]->open.load() == 0; }));
}

TEST_CASE("router service: startup waits for hosts, and fails naming those missing") {
  SECTION("a host that never comes") {
    FakeHost prefill("prefill", 1);
    RouterOptions o;
    o.prefill_hosts = {prefill.address()};
    o.decode_hosts = {"127.0.0.1:1"};  // nothing listens there
    o.startup_timeout = std::chrono::milliseconds(1500);
    std::vector<std::string> progress;
    std::mutex mu;
    o.progress = [&](const std::string& line) {
      std::lock_guard<std::mutex> lock(mu);
      progress.push_back(line);
    };
    StatusOr<std::unique_ptr<Router>> r = Router::Start(o);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kUnavailable);
    CHECK(Contains(r.status().message(), "decode 127.0.0.1:1"));
    CHECK_FALSE(Contains(r.status().message(), "prefill"));
    std::lock_guard<std::mutex> lock(mu);
    CHECK_FALSE(progress.empty());  // a progress line about once a second
  }
  SECTION("a host with the wrong role") {
    FakeHost decode("decode", 0);
    FakeHost other("decode", 0);
    RouterOptions o;
    o.prefill_hosts = {other.address()};
    o.decode_hosts = {decode.address()};
    o.startup_timeout = std::chrono::milliseconds(300);
    StatusOr<std::unique_ptr<Router>> r = Router::Start(o);
    REQUIRE_FALSE(r.ok());
    CHECK(Contains(r.status().message(), "role 'decode', but it was given as --prefill"));
  }
  SECTION("bad options") {
    RouterOptions o;
    CHECK(Router::Start(o).status().code() == StatusCode::kInvalidArgument);  // no hosts
    o.prefill_hosts = {"nohostport"};
    o.decode_hosts = {"127.0.0.1:5"};
    CHECK(Contains(Router::Start(o).status().message(), "not host:port"));
    o.prefill_hosts = {"127.0.0.1:5"};
    CHECK(Contains(Router::Start(o).status().message(), "more than once"));
    o.prefill_hosts = {"127.0.0.1:70000"};
    CHECK(Contains(Router::Start(o).status().message(), "[1, 65535]"));
  }
  SECTION("a host that comes up late") {
    RouterOptions o;
    // Reserve a port for the late decode host by starting and stopping a fake on it.
    auto probe = std::make_unique<FakeHost>("decode", 0);
    const std::string decode_address = probe->address();
    probe.reset();
    FakeHost prefill("prefill", 1);
    o.prefill_hosts = {prefill.address()};
    o.decode_hosts = {decode_address};
    o.startup_timeout = std::chrono::milliseconds(10000);
    auto started = std::async(std::launch::async, [o] { return Router::Start(o); });
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    FakeHost late("decode", 0, decode_address);  // on exactly that port
    REQUIRE(late.address() == decode_address);
    StatusOr<std::unique_ptr<Router>> r = started.get();
    REQUIRE(r.ok());
    (*r)->Shutdown();
  }
}

}  // namespace pdlib::router
