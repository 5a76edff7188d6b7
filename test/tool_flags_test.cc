// tools/common/flags.h: what every binary's command line goes through (issue #15).
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "tools/common/flags.h"

ABSL_FLAG(int32_t, zeta_count, 7, "how many zetas");
ABSL_FLAG(std::string, alpha_name, "", "the alpha's name");

namespace {

using pdlib_tools::FlagsHelp;
using pdlib_tools::NormalizeFlagNames;
using pdlib_tools::WantsHelp;
using V = std::vector<std::string>;

bool InThisFile(std::string_view file) {
  return absl::StrContains(absl::string_view(file.data(), file.size()), "tool_flags_test");
}

TEST_CASE("flag names may use dashes; values, positionals and what follows -- do not change") {
  CHECK(NormalizeFlagNames(V{"prog", "--auth-secret-file=a-b", "--tls-ca", "x-y", "pos-1", "-5",
                             "--", "--not-a-flag"}) == V{"prog", "--auth_secret_file=a-b",
                                                         "--tls_ca", "x-y", "pos-1", "-5", "--",
                                                         "--not-a-flag"});
  CHECK(NormalizeFlagNames(V{"prog", "--port"}) == V{"prog", "--port"});
}

TEST_CASE("a list flag may be repeated: its values are joined where it first stood") {
  CHECK(pdlib_tools::MergeListFlags(V{"prog", "--prefill", "a", "--port", "1", "--prefill=b,c",
                                      "--decode", "d", "--", "--prefill", "e"},
                                    {"prefill", "decode"}) ==
        V{"prog", "--prefill=a,b,c", "--port", "1", "--decode=d", "--", "--prefill", "e"});
  CHECK(pdlib_tools::MergeListFlags(V{"prog", "--port", "1"}, {"prefill"}) ==
        V{"prog", "--port", "1"});
}

TEST_CASE("--help and -h ask for help, not after --") {
  CHECK(WantsHelp(V{"prog", "--port", "1", "--help"}));
  CHECK(WantsHelp(V{"prog", "-h"}));
  CHECK_FALSE(WantsHelp(V{"prog", "--port", "1"}));
  CHECK_FALSE(WantsHelp(V{"prog", "--", "--help"}));
}

TEST_CASE("--help is the usage, then the binary's own flags from their definitions, sorted") {
  const std::string help = FlagsHelp("usage: prog [flags]\nDoes things.", InThisFile);
  INFO(help);
  CHECK(help.starts_with("usage: prog [flags]\nDoes things.\n"));
  const size_t alpha = help.find("  --alpha_name (default \"\")\n      the alpha's name\n");
  const size_t zeta = help.find("  --zeta_count (default 7)\n      how many zetas\n");
  REQUIRE(alpha != std::string::npos);
  REQUIRE(zeta != std::string::npos);
  CHECK(alpha < zeta);
  CHECK_FALSE(absl::StrContains(help, "flagfile"));  // Abseil's own flags are left out
}

}  // namespace
