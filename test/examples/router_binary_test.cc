// The pd-router executable: flags, the READY line, serving over gRPC and HTTP, and a clean exit
// on SIGTERM, against fake hosts in this process (router_test_harness.h). The router's logic is
// covered in process by router_service_test and router_http_server_test; this checks the
// process contract pd-demo relies on.
#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "router_test_harness.h"
#include "tools/common/child_process.h"

namespace pdlib::router {

using namespace testing;  // NOLINT(build/namespaces): the test deployment's helpers

namespace {

// pd-router with its stdout on a pipe (pdlib_tools::ChildProcess: posix_spawn, safe in a process
// that runs gRPC threads); its stderr stays ours. Killed and reaped if the test left it running.
class RouterProcess {
 public:
  explicit RouterProcess(std::vector<std::string> args)
      : process_({.program = PDLIB_ROUTER_BINARY, .args = args}) {
    REQUIRE(process_.started());
  }

  // One line of stdout without its newline, or "" when none came within `timeout`.
  std::string ReadLine(std::chrono::milliseconds timeout) {
    return process_.Expect("", Clock::now() + timeout).value_or("");
  }

  // The exit status, or -1 while it still runs after `timeout`.
  int Wait(std::chrono::milliseconds timeout) { return process_.Wait(Clock::now() + timeout); }

  pid_t pid() const { return process_.pid(); }

 private:
  pdlib_tools::ChildProcess process_;
};

}  // namespace

TEST_CASE("router binary: READY line, serves gRPC and HTTP, exits 0 on SIGTERM") {
  FakeHost prefill("prefill", 40000);
  FakeHost decode("decode", 0);
  RouterProcess router({"--prefill", prefill.address(), "--decode", decode.address(), "--policy",
                        "least-loaded", "--max-new-tokens", "3", "--seed", "7"});
  const std::string line = router.ReadLine(std::chrono::seconds(30));
  INFO("stdout: " << line);
  // Exactly "READY role=router port=<n> http_port=<n>" (std::regex trips GCC 12's
  // maybe-uninitialized warning under ASan).
  int port = 0, http_port = 0, consumed = 0;
  REQUIRE(std::sscanf(line.c_str(), "READY role=router port=%d http_port=%d%n", &port, &http_port,
                      &consumed) == 2);
  CHECK(consumed == static_cast<int>(line.size()));
  CHECK(port > 0);
  CHECK(http_port > 0);

  GrpcOutcome out = GenerateOverGrpc("127.0.0.1:" + std::to_string(port), TextRequest("abc"));
  REQUIRE(out.has_result);
  CHECK(out.result.ok());
  CHECK(out.result.output_ids_size() == 3);  // --max-new-tokens

  HttpReply reply = HttpExchange(http_port, Post("/v1/completions", R"({"prompt":"hi"})"));
  CHECK(reply.status == 200);
  CHECK(Contains(reply.body, "\"completion_tokens\":3"));

  REQUIRE(::kill(router.pid(), SIGTERM) == 0);
  CHECK(router.Wait(std::chrono::seconds(20)) == 0);
}

TEST_CASE("router binary: usage errors exit 2, missing hosts exit 1") {
  {
    RouterProcess router({"--prefill", "127.0.0.1:1"});
    CHECK(router.Wait(std::chrono::seconds(20)) == 2);
  }
  {
    RouterProcess router({"--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", "--policy", "x"});
    CHECK(router.Wait(std::chrono::seconds(20)) == 2);
  }
  {
    RouterProcess router(
        {"--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", "--startup-timeout-ms", "300"});
    CHECK(router.ReadLine(std::chrono::seconds(20)).empty());  // no READY
    CHECK(router.Wait(std::chrono::seconds(20)) == 1);
  }
}

}  // namespace pdlib::router
