// libFuzzer target for the transfer planner (lib/planner). The input decoder and the properties
// live in test/planner/fuzz_case.h, shared with the seeded property test planner_test: no write
// leaves its region, and valid inputs cover exactly the expected decode bytes.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "test/planner/fuzz_case.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string why = pdlib::planner::testing::RunFuzzCase(data, size);
  if (!why.empty()) {
    std::fprintf(stderr, "planner property violated: %s\n", why.c_str());
    std::abort();
  }
  return 0;
}
