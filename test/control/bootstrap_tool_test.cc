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
  // With `merge_stderr`, its stderr is read with its stdout.
  explicit Child(std::vector<std::string> args, bool merge_stderr = false)
      : process_({.program = PDLIB_BOOTSTRAP_BINARY,
                  .args = std::move(args),
                  .env = {pdlib_tools::TsanOptionsForChild()},
                  .stderr_mode = merge_stderr ? pdlib_tools::ChildOptions::Stderr::kMerge
                                              : pdlib_tools::ChildOptions::Stderr::kInherit}) {
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

// Issue #15: flags through Abseil flags (tools/common/flags.h).
TEST_CASE("pdlib-bootstrap: --help lists every flag from its definition") {
  Child child({"-h"});
  const std::string out = child.ReadAll(kStartTimeout);
  for (const char* flag : {"--host", "--port", "--auth_secret_file", "--tls_cert", "--tls_key",
                           "--tls_ca", "--verbose"}) {
    CHECK_THAT(out, Catch::Contains(std::string("  ") + flag + " (default "));
  }
  CHECK(child.Wait(kStartTimeout) == 0);
}

TEST_CASE("pdlib-bootstrap: a wrong flag is refused, naming it, dashed names are accepted") {
  Child unknown({"--no-such-flag"}, true);
  CHECK_THAT(unknown.ReadAll(kStartTimeout),
             Catch::Contains("pdlib-bootstrap: Unknown command line flag 'no_such_flag'"));
  CHECK(unknown.Wait(kStartTimeout) == 2);
  Child bad_value({"--port", "eighty"}, true);
  CHECK_THAT(bad_value.ReadAll(kStartTimeout),
             Catch::Contains("'eighty'") && Catch::Contains("flag 'port'"));
  CHECK(bad_value.Wait(kStartTimeout) == 2);
  Child positional({"--port", "0", "stray"}, true);
  CHECK_THAT(positional.ReadAll(kStartTimeout),
             Catch::Contains("pdlib-bootstrap: unexpected argument 'stray'"));
  CHECK(positional.Wait(kStartTimeout) == 2);
  // --auth-secret-file is --auth_secret_file: the missing file is named, exit status 2.
  Child dashed({"--host", "127.0.0.1", "--port", "0", "--auth-secret-file", "/nonexistent/s"},
               true);
  CHECK_THAT(dashed.ReadAll(kStartTimeout), Catch::Contains("--auth_secret_file '/nonexistent/s'"));
  CHECK(dashed.Wait(kStartTimeout) == 2);
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
