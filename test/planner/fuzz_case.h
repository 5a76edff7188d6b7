// Decodes arbitrary bytes into planner inputs and checks the planner's properties on them; the
// libFuzzer target (fuzz/planner_fuzz.cc) and the seeded property test share it.
//
// First byte, low two bits, picks the mode:
//   0, 1: a structured deployment for the reference model (reference_model.h). Bit 2 of the
//         mode byte set: only valid configurations and requests are generated, and the planner
//         must accept them and cover exactly the expected bytes. Clear: anything goes (odd TP
//         sizes, PP mismatches, partial pages in non-last chunks, out-of-range or repeated
//         indices, wrong state counts) and the planner must either refuse or stay correct.
//   2, 3: raw SideLayouts and chunks with arbitrary fields: whatever is accepted must plan
//         writes that stay inside their regions.
#ifndef PDLIB_TEST_PLANNER_FUZZ_CASE_H_
#define PDLIB_TEST_PLANNER_FUZZ_CASE_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace pdlib {
inline namespace v1 {
namespace planner {
namespace testing {

// Empty when every property holds; otherwise a description of the violation and the input.
std::string RunFuzzCase(const uint8_t* data, size_t size);

}  // namespace testing
}  // namespace planner
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_TEST_PLANNER_FUZZ_CASE_H_
