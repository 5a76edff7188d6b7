// BootstrapClient: deadlines, clear errors for an unreachable server, retry with backoff while
// the server starts late, and cancellation.
#include "lib/control/bootstrap_client.h"

#include <catch2/catch.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "lib/control/bootstrap_server.h"
#include "test/control/bootstrap_test_util.h"

namespace pdlib::control {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;
using testing::TestRank;
using testing::UnusedLocalPort;

std::string Message(const Status& s) { return std::string(s.message()); }

milliseconds Since(steady_clock::time_point start) {
  return std::chrono::duration_cast<milliseconds>(steady_clock::now() - start);
}

TEST_CASE("Create validates the address and options") {
  CHECK(BootstrapClient::Create("", 8998).status().code() == StatusCode::kInvalidArgument);
  CHECK(BootstrapClient::Create("127.0.0.1", 0).status().code() == StatusCode::kInvalidArgument);
  CHECK(BootstrapClient::Create("127.0.0.1", 65536).status().code() ==
        StatusCode::kInvalidArgument);
  BootstrapClientOptions options;
  options.rpc_timeout = milliseconds(0);
  const Status timeout = BootstrapClient::Create("127.0.0.1", 8998, options).status();
  CHECK(timeout.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(Message(timeout), Catch::Contains("rpc_timeout 0 ms"));
  options = {};
  options.backoff_multiplier = 0.5;
  CHECK(BootstrapClient::Create("127.0.0.1", 8998, options).status().code() ==
        StatusCode::kInvalidArgument);
  auto client = BootstrapClient::Create("::1", 8998);
  REQUIRE(client.ok());
  CHECK((*client)->address() == "[::1]:8998");
}

TEST_CASE("an unreachable server fails queries within the deadline, naming the address") {
  const int32_t port = UnusedLocalPort();
  REQUIRE(port > 0);
  BootstrapClientOptions options;
  options.rpc_timeout = milliseconds(500);
  auto client = BootstrapClient::Create("127.0.0.1", port, options);
  REQUIRE(client.ok());
  const std::string where = "bootstrap 127.0.0.1:" + std::to_string(port);

  auto start = steady_clock::now();
  const Status info = (*client)->GetParallelInfo().status();
  CHECK(Since(start) < milliseconds(5000));  // the deadline plus scheduling slack
  CHECK(info.code() == StatusCode::kUnavailable);
  CHECK_THAT(Message(info), Catch::StartsWith(where + " unreachable (GetParallelInfo): "));

  const Status address = (*client)->GetRankAddress({0, 0, 0}).status();
  CHECK(address.code() == StatusCode::kUnavailable);
  CHECK_THAT(Message(address), Catch::Contains(where + " unreachable"));

  const Status health = (*client)->CheckHealth();
  CHECK(health.code() == StatusCode::kUnavailable);
}

TEST_CASE("RegisterRank gives up at its overall deadline with the attempts it made") {
  const int32_t port = UnusedLocalPort();
  REQUIRE(port > 0);
  BootstrapClientOptions options;
  options.rpc_timeout = milliseconds(200);
  options.register_deadline = milliseconds(600);
  options.initial_backoff = milliseconds(20);
  options.max_backoff = milliseconds(100);
  auto client = BootstrapClient::Create("127.0.0.1", port, options);
  REQUIRE(client.ok());

  const auto start = steady_clock::now();
  const Status s = (*client)->RegisterRank(TestRank(0, 0, 0)).status();
  const milliseconds elapsed = Since(start);
  CHECK(elapsed >= milliseconds(500));
  CHECK(elapsed < milliseconds(5000));
  CHECK((s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded));
  CHECK_THAT(Message(s), Catch::Contains("bootstrap 127.0.0.1:" + std::to_string(port)));
  CHECK_THAT(Message(s), Catch::Contains("gave up after"));
}

TEST_CASE("RegisterRank stops after register_max_attempts") {
  const int32_t port = UnusedLocalPort();
  REQUIRE(port > 0);
  BootstrapClientOptions options;
  options.register_max_attempts = 3;
  options.initial_backoff = milliseconds(10);
  auto client = BootstrapClient::Create("127.0.0.1", port, options);
  REQUIRE(client.ok());
  const Status s = (*client)->RegisterRank(TestRank(0, 0, 0)).status();
  CHECK(s.code() == StatusCode::kUnavailable);
  CHECK_THAT(Message(s), Catch::Contains("gave up after 3 attempts"));
}

TEST_CASE("RegisterRank retries until a late server starts") {
  const int32_t port = UnusedLocalPort();
  REQUIRE(port > 0);
  BootstrapClientOptions options;
  options.rpc_timeout = milliseconds(2000);
  options.register_deadline = milliseconds(30000);
  options.initial_backoff = milliseconds(20);
  options.max_backoff = milliseconds(200);
  auto client = BootstrapClient::Create("127.0.0.1", port, options);
  REQUIRE(client.ok());

  std::unique_ptr<BootstrapServer> server;
  Status server_status;
  std::thread late_start([&] {
    std::this_thread::sleep_for(milliseconds(400));
    BootstrapServerOptions server_options;
    server_options.host = "127.0.0.1";
    server_options.port = port;
    auto started = BootstrapServer::Start(server_options);
    if (started.ok()) {
      server = std::move(started).value();
    } else {
      server_status = started.status();
    }
  });
  auto result = (*client)->RegisterRank(TestRank(0, 1, 0));
  late_start.join();
  REQUIRE(server_status.ok());
  REQUIRE(result.ok());
  CHECK(result->ranks_registered == 1);
  CHECK(server->ranks_registered() == 1);
  auto address = (*client)->GetRankAddress({0, 1, 0});
  REQUIRE(address.ok());
  CHECK(address->port == 7000);
}

TEST_CASE("RegisterRank returns a rejection at once, without retrying") {
  BootstrapServerOptions server_options;
  server_options.host = "127.0.0.1";
  server_options.port = 0;
  auto server = BootstrapServer::Start(server_options);
  REQUIRE(server.ok());
  BootstrapClientOptions options;
  options.register_deadline = milliseconds(60000);
  auto client = BootstrapClient::Create("127.0.0.1", (*server)->port(), options);
  REQUIRE(client.ok());
  const auto start = steady_clock::now();
  const Status s = (*client)->RegisterRank(TestRank(0, 0, 0, 1, 2, 1, /*port=*/0)).status();
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(Message(s), Catch::Contains("port 0 out of range"));
  CHECK(Since(start) < milliseconds(10000));
}

TEST_CASE("Cancel interrupts a RegisterRank that is retrying") {
  const int32_t port = UnusedLocalPort();
  REQUIRE(port > 0);
  BootstrapClientOptions options;
  options.register_deadline = milliseconds(60000);
  options.initial_backoff = milliseconds(50);
  options.max_backoff = milliseconds(1000);
  auto client = BootstrapClient::Create("127.0.0.1", port, options);
  REQUIRE(client.ok());

  Status result;
  const auto start = steady_clock::now();
  std::thread registering([&] { result = (*client)->RegisterRank(TestRank(0, 0, 0)).status(); });
  std::this_thread::sleep_for(milliseconds(300));
  (*client)->Cancel();
  registering.join();
  CHECK(Since(start) < milliseconds(10000));
  CHECK(result.code() == StatusCode::kCancelled);
  CHECK_THAT(Message(result), Catch::Contains("RegisterRank cancelled"));
  // Later calls are cancelled too.
  CHECK((*client)->GetParallelInfo().status().code() == StatusCode::kCancelled);
}

}  // namespace
}  // namespace pdlib::control
