// pd-demo's command line where it refuses to start (issue #19): --device and --reference-device
// take cpu or cuda, and --device cuda on a machine without a usable GPU exits 1 with CUDA's
// reason before it starts any process. The runs themselves are demo_e2e_test's.
#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "pdlib_kernels/cuda_info.h"
#include "tools/common/child_process.h"

namespace {

struct Exited {
  int status = -1;
  std::string output;  // stdout and stderr
};

Exited RunDemo(std::vector<std::string> args) {
  pdlib_tools::ChildProcess p({.program = PD_DEMO_BIN,
                               .args = std::move(args),
                               .stderr_mode = pdlib_tools::ChildOptions::Stderr::kMerge});
  REQUIRE(p.started());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  Exited e;
  while (auto line = p.ReadLine(deadline)) e.output += *line + "\n";
  e.status = p.Wait(deadline);
  if (e.status < 0) e.status = p.KillAndReap(std::chrono::seconds(5));
  return e;
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

}  // namespace
