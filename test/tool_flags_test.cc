// tools/common/flags.h: what every binary's command line goes through (issue #15).
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "tools/common/flags.h"

ABSL_FLAG(int32_t, zeta_count, 7, "how many zetas");
ABSL_FLAG(std::string, alpha_name, "", "the alpha's name");
ABSL_FLAG(bool, beta_on, false, "whether beta is on");
ABSL_FLAG(std::vector<std::string>, gamma_hosts, {}, "gamma hosts");
ABSL_FLAG(pdlib_tools::Repeated, delta_option, {}, "delta options");

namespace {

using pdlib_tools::FlagsHelp;
using pdlib_tools::NormalizeFlagNames;
using pdlib_tools::WantsHelp;
using V = std::vector<std::string>;

bool InThisFile(std::string_view file) {
  return absl::StrContains(absl::string_view(file.data(), file.size()), "tool_flags_test");
}

TEST_CASE("flag names may use dashes, values, positionals and what follows -- do not change") {
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

// The whole path, as a binary runs it. A bool flag followed by another flag: Abseil must know the
// flag is a bool (it compares per-type ids across shared libraries; see tools/CMakeLists.txt).
TEST_CASE("ParseFlags: dashes, a bool flag before another, lists, repeated values, positionals") {
  std::vector<std::string> argv = {"prog",
                                   "--beta-on",
                                   "--zeta-count",
                                   "9",
                                   "--gamma-hosts",
                                   "a:1",
                                   "pos",
                                   "--gamma_hosts=b:2,c:3",
                                   "--delta-option",
                                   "k=v,w",
                                   "--delta_option",
                                   "x=y"};
  std::vector<char*> raw;
  for (auto& a : argv) raw.push_back(a.data());
  const auto rest = pdlib_tools::ParseFlags(int(raw.size()), raw.data(), "usage: prog",
                                            {"gamma_hosts"}, {"delta_option"});
  CHECK(rest == V{"prog", "pos"});
  CHECK(absl::GetFlag(FLAGS_beta_on));
  CHECK(absl::GetFlag(FLAGS_zeta_count) == 9);
  CHECK(absl::GetFlag(FLAGS_gamma_hosts) == V{"a:1", "b:2", "c:3"});
  CHECK(absl::GetFlag(FLAGS_delta_option).values == V{"k=v,w", "x=y"});
}

// What the hosts use: the same rules, no exit, every flag back to its default first.
TEST_CASE("TryParseFlags: resets to defaults, reports what was given, one line per error") {
  using pdlib_tools::TryParseFlags;
  auto ok = TryParseFlags(V{"--zeta-count=3", "--beta_on", "x", "--gamma-hosts", "a",
                            "--gamma_hosts", "b", "--delta-option", "k=v,w", "--", "--zeta_count"},
                          {"gamma_hosts"}, {"delta_option"});
  INFO(ok.error);
  REQUIRE(ok.error.empty());
  CHECK(ok.given == V{"zeta_count", "beta_on", "gamma_hosts", "delta_option"});
  CHECK(ok.positional == V{"x", "--zeta_count"});
  CHECK(absl::GetFlag(FLAGS_zeta_count) == 3);
  CHECK(absl::GetFlag(FLAGS_beta_on));
  CHECK(absl::GetFlag(FLAGS_gamma_hosts) == V{"a", "b"});
  CHECK(absl::GetFlag(FLAGS_delta_option).values == V{"k=v,w"});

  // A second parse starts from the defaults, not from the first one's values.
  auto again = TryParseFlags(V{"--nobeta-on", "--alpha_name", "a"});
  REQUIRE(again.error.empty());
  CHECK(again.given == V{"beta_on", "alpha_name"});
  CHECK(absl::GetFlag(FLAGS_zeta_count) == 7);
  CHECK_FALSE(absl::GetFlag(FLAGS_beta_on));
  CHECK(absl::GetFlag(FLAGS_gamma_hosts).empty());
  CHECK(absl::GetFlag(FLAGS_delta_option).values.empty());
  CHECK(absl::GetFlag(FLAGS_alpha_name) == "a");

  CHECK(TryParseFlags(V{"--omega", "1"}).error == "Unknown command line flag 'omega' (see --help)");
  CHECK(TryParseFlags(V{"--zeta_count"}).error == "Missing the value for the flag 'zeta_count'");
  const std::string bad = TryParseFlags(V{"--zeta-count", "many"}).error;
  CHECK(bad.starts_with("Illegal value 'many' specified for flag 'zeta_count'"));
  CHECK(TryParseFlags(V{"--flagfile=/etc/passwd"}).error.starts_with("Unknown command line flag"));
  auto help = TryParseFlags(V{"--zeta_count", "x", "-h"});
  CHECK((help.help && help.error.empty()));
}

TEST_CASE("FlagsHelpFor lists only the flags a program takes") {
  const std::string help = pdlib_tools::FlagsHelpFor(
      "usage: prog", [](std::string_view name) { return name == "zeta_count"; });
  CHECK(absl::StrContains(help, "--zeta_count (default 7)"));
  CHECK_FALSE(absl::StrContains(help, "--alpha_name"));
  CHECK_FALSE(absl::StrContains(help, "flagfile"));
}

}  // namespace
