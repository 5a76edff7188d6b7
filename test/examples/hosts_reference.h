// The colocated reference the host tests compare with (examples/hosts/reference.h), failing the
// test when it cannot be computed.
#ifndef PDLIB_TEST_EXAMPLES_HOSTS_REFERENCE_H_
#define PDLIB_TEST_EXAMPLES_HOSTS_REFERENCE_H_

#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "examples/hosts/reference.h"

namespace pdlib::hosts::testing {

inline std::vector<int32_t> Reference(const std::string& model, uint64_t seed,
                                      const std::vector<int32_t>& prompt, int32_t max_new) {
  auto tokens = GenerateReference(model, seed, prompt, max_new);
  INFO(tokens.status().ToString());
  REQUIRE(tokens.ok());
  return *tokens;
}

}  // namespace pdlib::hosts::testing

#endif  // PDLIB_TEST_EXAMPLES_HOSTS_REFERENCE_H_
