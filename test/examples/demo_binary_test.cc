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

using Exited = pdlib_tools::ExitedChild;

Exited RunDemo(std::vector<std::string> args) {
  return pdlib_tools::RunToExit(PD_DEMO_BIN, std::move(args), std::chrono::seconds(30));
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
