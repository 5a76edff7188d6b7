// The pd-router executable: flags, the READY line, serving over gRPC and HTTP, and a clean exit
// on SIGTERM, against fake hosts in this process (router_test_harness.h). The router's logic is
// covered in process by router_service_test and router_http_server_test; this checks the
// process contract pd-demo relies on.
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <regex>
#include <string>
#include <vector>

#include "router_test_harness.h"

extern char** environ;

namespace pdlib::router {

using namespace testing;  // NOLINT(build/namespaces): the test deployment's helpers

namespace {

// pd-router started with posix_spawn (safe in a process that runs gRPC threads), its stdout on a
// pipe. The destructor kills and reaps a child the test left running.
class RouterProcess {
 public:
  explicit RouterProcess(std::vector<std::string> args) {
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&actions, fds[0]);
    posix_spawn_file_actions_addclose(&actions, fds[1]);
    std::vector<char*> argv = {const_cast<char*>(PDLIB_ROUTER_BINARY)};
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    const int err =
        ::posix_spawn(&pid_, PDLIB_ROUTER_BINARY, &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    ::close(fds[1]);
    stdout_fd_ = fds[0];
    REQUIRE(err == 0);
  }
  ~RouterProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    ::close(stdout_fd_);
  }

  // One line of stdout, or what came before `timeout` passed or stdout closed.
  std::string ReadLine(std::chrono::milliseconds timeout) {
    std::string line;
    const auto deadline = Clock::now() + timeout;
    while (line.empty() || line.back() != '\n') {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      pollfd p{stdout_fd_, POLLIN, 0};
      if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) break;
      char c;
      if (::read(stdout_fd_, &c, 1) != 1) break;
      line.push_back(c);
    }
    return line;
  }

  // The exit status, or -1 while it still runs after `timeout`.
  int Wait(std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }

  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  int stdout_fd_ = -1;
};

}  // namespace

TEST_CASE("router binary: READY line, serves gRPC and HTTP, exits 0 on SIGTERM") {
  FakeHost prefill("prefill", 40000);
  FakeHost decode("decode", 0);
  RouterProcess router({"--prefill", prefill.address(), "--decode", decode.address(), "--policy",
                        "least-loaded", "--max-new-tokens", "3", "--seed", "7"});
  const std::string line = router.ReadLine(std::chrono::seconds(30));
  INFO("stdout: " << line);
  std::smatch m;
  REQUIRE(
      std::regex_match(line, m, std::regex("READY role=router port=(\\d+) http_port=(\\d+)\n")));
  const int port = std::stoi(m[1]);
  const int http_port = std::stoi(m[2]);
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
