// The standalone pdlib-bootstrap binary: starts, answers a health check and registrations,
// and exits 0 on SIGTERM / SIGINT.
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "lib/control/bootstrap_client.h"
#include "test/control/bootstrap_test_util.h"

extern char** environ;

namespace pdlib::control {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

// The child's environment: ours, with TSAN_OPTIONS starting with the options this test binary
// gets from tsan_defaults.cc (a TSan-built child needs them too; others ignore the variable).
std::vector<std::string> ChildEnvironment() {
  constexpr std::string_view kTsanOptions = "TSAN_OPTIONS=";
  std::string tsan_options = "TSAN_OPTIONS=ignore_noninstrumented_modules=1";
  std::vector<std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string_view var(*entry);
    if (var.starts_with(kTsanOptions)) {
      tsan_options += " " + std::string(var.substr(kTsanOptions.size()));
    } else {
      env.emplace_back(var);
    }
  }
  env.push_back(tsan_options);
  return env;
}

// A child process started with posix_spawn (safe in a process that already runs gRPC threads),
// its stdout on a pipe. The destructor kills and reaps a child the test left running.
class Child {
 public:
  explicit Child(std::vector<std::string> args) {
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&actions, fds[0]);
    posix_spawn_file_actions_addclose(&actions, fds[1]);
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(PDLIB_BOOTSTRAP_BINARY));
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    std::vector<std::string> env = ChildEnvironment();
    std::vector<char*> envp;
    for (std::string& var : env) envp.push_back(var.data());
    envp.push_back(nullptr);
    const int err =
        posix_spawn(&pid_, PDLIB_BOOTSTRAP_BINARY, &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    ::close(fds[1]);
    stdout_fd_ = fds[0];
    REQUIRE(err == 0);
  }
  ~Child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (stdout_fd_ >= 0) ::close(stdout_fd_);
  }

  // Reads stdout until `timeout` passes or the child closes it.
  std::string ReadLine(milliseconds timeout) {
    std::string line;
    const auto deadline = steady_clock::now() + timeout;
    while (line.empty() || line.back() != '\n') {
      const auto left = std::chrono::duration_cast<milliseconds>(deadline - steady_clock::now());
      if (left.count() <= 0) break;
      pollfd pfd{stdout_fd_, POLLIN, 0};
      if (::poll(&pfd, 1, static_cast<int>(left.count())) <= 0) break;
      char c;
      if (::read(stdout_fd_, &c, 1) != 1) break;
      line.push_back(c);
    }
    return line;
  }

  std::string ReadAll(milliseconds timeout) {
    std::string out;
    for (std::string line; !(line = ReadLine(timeout)).empty();) out += line;
    return out;
  }

  // The exit status, or -1 when the child is still running after `timeout`.
  int Wait(milliseconds timeout) {
    const auto deadline = steady_clock::now() + timeout;
    while (steady_clock::now() < deadline) {
      int status = 0;
      const pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(milliseconds(10));
    }
    return -1;
  }

  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  int stdout_fd_ = -1;
};

constexpr milliseconds kStartTimeout{30000};  // sanitizer builds start slowly

int32_t ParseListeningPort(const std::string& line) {
  const std::string prefix = "pdlib-bootstrap listening on 127.0.0.1:";
  if (line.rfind(prefix, 0) != 0) return -1;
  return std::stoi(line.substr(prefix.size()));
}

void ServeThenStop(int signal_number) {
  Child child({"--host", "127.0.0.1", "--port", "0"});
  const std::string line = child.ReadLine(kStartTimeout);
  INFO("stdout: " << line);
  const int32_t port = ParseListeningPort(line);
  REQUIRE(port > 0);

  auto client = BootstrapClient::Create("127.0.0.1", port);
  REQUIRE(client.ok());
  CHECK((*client)->CheckHealth().ok());
  REQUIRE((*client)->RegisterRank(testing::TestRank(0, 0, 0)).ok());
  auto info = (*client)->GetParallelInfo();
  REQUIRE(info.ok());
  CHECK(info->tp_size == 2);

  REQUIRE(::kill(child.pid(), signal_number) == 0);
  CHECK(child.Wait(milliseconds(20000)) == 0);
}

TEST_CASE("pdlib-bootstrap serves and exits 0 on SIGTERM") { ServeThenStop(SIGTERM); }

TEST_CASE("pdlib-bootstrap serves and exits 0 on SIGINT") { ServeThenStop(SIGINT); }

TEST_CASE("pdlib-bootstrap --help prints usage and exits 0") {
  Child child({"--help"});
  const std::string out = child.ReadAll(kStartTimeout);
  CHECK_THAT(out, Catch::Contains("usage: pdlib-bootstrap"));
  CHECK_THAT(out, Catch::Contains("default 8998"));
  CHECK(child.Wait(kStartTimeout) == 0);
}

TEST_CASE("pdlib-bootstrap rejects a bad port with exit status 2") {
  Child child({"--port", "70000"});
  CHECK(child.Wait(kStartTimeout) == 2);
}

TEST_CASE("pdlib-bootstrap fails with status 1 when the port is taken") {
  Child first({"--host", "127.0.0.1", "--port", "0"});
  const int32_t port = ParseListeningPort(first.ReadLine(kStartTimeout));
  REQUIRE(port > 0);
  Child second({"--host", "127.0.0.1", "--port=" + std::to_string(port)});
  CHECK(second.Wait(kStartTimeout) == 1);
}

}  // namespace
}  // namespace pdlib::control
