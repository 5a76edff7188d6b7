// A prefill and a decode process (pdlib_test_peer, fake backend, gRPC control plane) run 1P1D
// requests with both processes under valgrind memcheck; each must exit 0, which with
// --error-exitcode means memcheck found no invalid read or write, no use of uninitialised values
// and no definitely lost block (after QUIT destroys every handle and the manager).
#include <unistd.h>

#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "test/multiprocess/peer_harness.h"

namespace {

using pdlib_test::PeerProcess;
using pdlib_test::Scene;
using std::chrono::milliseconds;

constexpr int kMemcheckError = 97;

std::vector<std::string> UnderValgrind(std::vector<std::string> peer_args) {
  std::vector<std::string> a = {"--quiet",
                                "--error-exitcode=" + std::to_string(kMemcheckError),
                                "--leak-check=full",
                                "--errors-for-leak-kinds=definite",
                                "--show-leak-kinds=definite",
                                "--num-callers=40",
                                "--suppressions=" PDLIB_VALGRIND_SUPPRESSIONS,
                                PDLIB_TEST_PEER_BINARY};
  a.insert(a.end(), peer_args.begin(), peer_args.end());
  return a;
}

}  // namespace

TEST_CASE("valgrind memcheck: 1P1D in two processes, no memory error and no definite leak") {
  const std::string valgrind = PDLIB_VALGRIND;
  if (valgrind.empty() || access(valgrind.c_str(), X_OK) != 0) {
    WARN("SKIP: valgrind is not installed (scripts/install-deps.sh installs it)");
    return;
  }
  Scene scene;
  const uint16_t bootstrap = pdlib_test::UnusedLocalPort();
  // Valgrind runs everything about 20-50 times slower: generous timeouts.
  std::vector<std::string> slow = {"--liveness-ms", "20000",         "--connect-timeout-ms",
                                   "60000",         "--max-seconds", "240"};
  auto pargs = pdlib_test::PeerArgs("prefill", bootstrap, {"--start-bootstrap"});
  pargs.insert(pargs.end(), slow.begin(), slow.end());
  PeerProcess& prefill = scene.Start("prefill", UnderValgrind(pargs), valgrind);
  SCENE_REQUIRE(scene, prefill.WaitReady(milliseconds(120000))["role"] == "prefill");
  auto dargs = pdlib_test::PeerArgs("decode", bootstrap);
  dargs.insert(dargs.end(), slow.begin(), slow.end());
  PeerProcess& decode = scene.Start("decode", UnderValgrind(dargs), valgrind);
  SCENE_REQUIRE(scene, decode.WaitReady(milliseconds(120000))["role"] == "decode");

  constexpr uint64_t kRooms = 20;
  SCENE_REQUIRE(scene, prefill.Send("RUN 500 20"));
  SCENE_REQUIRE(scene, decode.RunBatch(500, kRooms, milliseconds(120000)) == int64_t(kRooms));
  SCENE_REQUIRE(scene, prefill.Expect("DONE first=500 ", milliseconds(60000)).has_value());
  // Exit codes: 0 clean; kMemcheckError when memcheck reported something (in the transcript).
  SCENE_CHECK(scene, decode.Quit(milliseconds(120000)) == 0);
  SCENE_CHECK(scene, prefill.Quit(milliseconds(120000)) == 0);
}
