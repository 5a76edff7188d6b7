// The standalone pdlib-bootstrap binary: starts, answers a health check and registrations,
// and exits 0 on SIGTERM / SIGINT.
#include <signal.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "lib/control/bootstrap_client.h"
#include "test/control/bootstrap_test_util.h"
#include "tools/common/child_process.h"

namespace pdlib::control {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

// pdlib-bootstrap with its stdout on a pipe (pdlib_tools::ChildProcess: posix_spawn, safe in a
// process that already runs gRPC threads). Killed and reaped if the test left it running.
class Child {
 public:
  explicit Child(std::vector<std::string> args)
      : process_({.program = PDLIB_BOOTSTRAP_BINARY,
                  .args = std::move(args),
                  .env = {pdlib_tools::TsanOptionsForChild()}}) {
    REQUIRE(process_.started());
  }

  // One line of stdout with its newline, or "" when none came within `timeout`.
  std::string ReadLine(milliseconds timeout) {
    auto line = process_.ReadLine(steady_clock::now() + timeout);
    return line ? *line + "\n" : "";
  }

  std::string ReadAll(milliseconds timeout) {
    std::string out;
    for (std::string line; !(line = ReadLine(timeout)).empty();) out += line;
    return out;
  }

  // The exit status, or -1 when the child is still running after `timeout`.
  int Wait(milliseconds timeout) { return process_.Wait(steady_clock::now() + timeout); }

  pid_t pid() const { return process_.pid(); }

 private:
  pdlib_tools::ChildProcess process_;
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
