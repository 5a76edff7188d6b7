// pd-demo's command line where it refuses to start (issue #19): --device and --reference-device
// take cpu or cuda, and --device cuda on a machine without a usable GPU exits 1 with CUDA's
// reason before it starts any process; --turns with decode prefix reuse end to end; --direction
// pull and both (issue #29). The other runs are demo_e2e_test's.
#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "pdlib_kernels/cuda_info.h"
#include "tools/common/child_process.h"

namespace {

using Exited = pdlib_tools::ExitedChild;

Exited RunDemo(std::vector<std::string> args,
               std::chrono::seconds limit = std::chrono::seconds(30)) {
  return pdlib_tools::RunToExit(PD_DEMO_BIN, std::move(args), limit);
}

TEST_CASE("pd-demo: --device and --reference-device take cpu or cuda") {
  for (const char* flag : {"--device", "--reference-device"}) {
    const Exited e = RunDemo({flag, "tpu"});
    INFO(e.output);
    CHECK(e.status == 2);
    CHECK_THAT(e.output, Catch::Contains("'tpu': expected cpu or cuda"));
  }
  const Exited e = RunDemo({"--device", "cuda", "--cuda-device", "-1"});
  CHECK(e.status == 2);
  CHECK_THAT(e.output, Catch::Contains("--cuda_device -1 is not in [0, 1023]"));
}

TEST_CASE("pd-demo: --device cuda without a usable GPU exits 1 with the reason, starting nothing") {
  const pdlib::kernels::CudaInfo cuda = pdlib::kernels::ProbeCuda();
  if (cuda.device_count > 0) {
    WARN("skipped: CUDA device " << cuda.device_name << " is present");
    return;
  }
  const std::filesystem::path logs =
      std::filesystem::temp_directory_path() / "pdlib-demo-binary-test-no-gpu";
  std::filesystem::remove_all(logs);
  for (const char* flag : {"--device", "--reference-device"}) {
    const Exited e = RunDemo({flag, "cuda", "--log-dir", logs.string()});
    INFO(e.output);
    CHECK(e.status == 1);
    CHECK_THAT(e.output,
               Catch::Contains(std::string(flag) + " cuda: no CUDA device: " + cuda.reason));
    CHECK(e.output.find("starting") == std::string::npos);
    // No process ran: none left a log.
    CHECK(!std::filesystem::exists(logs));
  }
}

// Issue #27: pd-demo --turns runs multi-turn conversations with decode prefix reuse off, then
// on, and says how many KV bytes each moved; every output of every turn equals the colocated
// run's. A model with per-request state refuses prefix reuse before starting anything.
TEST_CASE("pd-demo: --turns 3 compares decode prefix reuse off and on, outputs identical",
          "[long]") {
  // Four deployments' worth of requests: minutes under TSan, seconds in release.
  const Exited e = RunDemo({"--turns", "3", "--requests", "2", "--max-new-tokens", "4", "--quiet"},
                           std::chrono::seconds(300));
  INFO(e.output);
  CHECK(e.status == 0);
  CHECK_THAT(e.output, Catch::Contains("12/12 outputs identical to the colocated run"));
  CHECK_THAT(e.output, Catch::Contains("decode prefix reuse, 3 turns, rate burst: KV bytes moved"));
  CHECK_THAT(e.output, Catch::Contains("% less)"));
  CHECK(e.output.find("(0% less)") == std::string::npos);
  const Exited refused = RunDemo({"--turns", "2", "--model", "small-hybrid"});
  INFO(refused.output);
  CHECK(refused.status == 2);
  CHECK_THAT(refused.output, Catch::Contains("carries per-request state"));
  CHECK(refused.output.find("starting") == std::string::npos);
}

// Issue #29: pd-demo --direction. Pull end to end through the binaries' flags: multi-turn with
// decode prefix reuse off then on (decode reads only the pages after its prefix: fewer bytes),
// every output identical; --direction both runs push then pull and compares them; a bad value
// and two "both"s are refused before anything starts.
TEST_CASE("pd-demo: --direction pull --turns 3, prefix reuse off and on, outputs identical",
          "[long]") {
  const Exited e = RunDemo({"--direction", "pull", "--turns", "3", "--requests", "2",
                            "--max-new-tokens", "4", "--quiet"},
                           std::chrono::seconds(300));
  INFO(e.output);
  CHECK(e.status == 0);
  CHECK_THAT(e.output, Catch::Contains("decode prefix reuse off, pull)"));
  CHECK_THAT(e.output, Catch::Contains("12/12 outputs identical to the colocated run"));
  CHECK_THAT(e.output, Catch::Contains("% less)"));
  CHECK(e.output.find("(0% less)") == std::string::npos);
}

TEST_CASE("pd-demo: --direction both compares push and pull, outputs identical") {
  const Exited e =
      RunDemo({"--direction", "both", "--requests", "3", "--max-new-tokens", "4", "--quiet"},
              std::chrono::seconds(300));
  INFO(e.output);
  CHECK(e.status == 0);
  CHECK_THAT(e.output, Catch::Contains("push vs pull, rate burst: mean TTFT"));
  CHECK_THAT(e.output, Catch::Contains("6/6 outputs identical to the colocated run"));
  const Exited bad = RunDemo({"--direction", "sideways"});
  CHECK(bad.status == 2);
  CHECK_THAT(bad.output, Catch::Contains("--direction 'sideways': expected push, pull or both"));
  const Exited two = RunDemo({"--direction", "both", "--layerwise", "both"});
  CHECK(two.status == 2);
  CHECK_THAT(two.output, Catch::Contains("pick one of them"));
  CHECK(two.output.find("starting") == std::string::npos);
}

}  // namespace
