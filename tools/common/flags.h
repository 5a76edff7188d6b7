// Command-line flags for pdlib's binaries, through Abseil flags (ABSL_FLAG in the binary's own
// files; absl::GetFlag to read them), parsed by TryParseFlags below rather than
// absl::ParseCommandLine (which can only exit on an error). The rules:
// - names may be spelled with dashes: --auth-secret-file is --auth_secret_file;
// - --help (or -h) prints the usage message and every flag of the binary's own files, generated
//   from their definitions (name, default, help), and exits 0;
// - a wrong flag or value is one line naming the flag ("<program>: Unknown command line flag 'x'
//   (see --help)"), exit status 2, as for every other bad command line. Checks of a value's range
//   are the binary's, after parsing, also naming the flag;
// - Abseil's own flags (--flagfile, --helpfull, ...) are not taken.
// Target pdlib_tool_flags; not part of the pdlib library.
#ifndef PDLIB_TOOLS_COMMON_FLAGS_H_
#define PDLIB_TOOLS_COMMON_FLAGS_H_

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/string_view.h"

namespace pdlib_tools {

// Parses `argv` (see above) and returns the positional arguments, argv[0] first. `usage` starts
// with "usage: <program> ..." and says what the program does; --help prints it, then the flags.
// Flags named in `lists` (std::vector<std::string> flags) may be repeated: "--prefill a
// --prefill b" is "--prefill a,b". Flags named in `repeated` (Repeated flags) may be repeated
// too, each value kept whole, commas included. Any other flag given twice keeps its last value
// (Abseil's rule). On an error prints "<program>: <error>" on stderr and exits 2.
std::vector<std::string> ParseFlags(int argc, char** argv, std::string_view usage,
                                    const std::vector<std::string>& lists = {},
                                    const std::vector<std::string>& repeated = {});

// ParseFlags for a program that takes no positional argument: one is refused with
// "<program>: unexpected argument 'x' (see --help)" on stderr, exit status 2.
void ParseFlagsNoArguments(int argc, char** argv, std::string_view usage,
                           const std::vector<std::string>& lists = {},
                           const std::vector<std::string>& repeated = {});

// For a program that parses flags more than once, or must not exit on a bad command line (the
// hosts check their flags in tests): what TryParseFlags found.
struct FlagParse {
  std::string error;                    // empty on success: one line naming the flag otherwise
  bool help = false;                    // --help or -h was given (nothing else is parsed then)
  std::vector<std::string> given;       // the flags given, by name (underscores), in order
  std::vector<std::string> positional;  // every other argument, in order
};
// Parses `args` (argv without the program name) into the binary's Abseil flags without exiting:
// first every flag of the binary's own files is set back to its default, then each argument is
// applied ("--name value", "--name=value", "--name" / "--noname" for a bool). Names may use dashes;
// `lists` and `repeated` as for ParseFlags. Errors, in Abseil's words: an unknown flag, a missing
// value, a value the flag's type refuses ("Illegal value 'x' specified for flag 'port'"). Not
// thread-safe (flags are process-wide).
FlagParse TryParseFlags(std::vector<std::string> args, const std::vector<std::string>& lists = {},
                        const std::vector<std::string>& repeated = {});

// The type of a flag that may be given many times, each value whole ("--backend_option
// ucx.tls=shm,tcp --backend_option k=v"): ABSL_FLAG(pdlib_tools::Repeated, name, {}, "...").
struct Repeated {
  std::vector<std::string> values;
};
bool AbslParseFlag(absl::string_view text, Repeated* out, std::string* error);
std::string AbslUnparseFlag(const Repeated& r);

// Pure pieces, for tests.
// "--auth-secret-file=x" -> "--auth_secret_file=x": only names after "--" change, not values,
// positional arguments, or anything after a lone "--".
std::vector<std::string> NormalizeFlagNames(std::vector<std::string> args);
// Every occurrence of the flags in `lists` ("--name v" or "--name=v", after NormalizeFlagNames)
// merged into one "--name=v1<separator>v2" where the first one stood.
std::vector<std::string> MergeListFlags(std::vector<std::string> args,
                                        const std::vector<std::string>& lists,
                                        char separator = ',');
// True when --help or -h is among the flags (before "--").
bool WantsHelp(const std::vector<std::string>& args);
// `usage`, then one entry per flag defined in a file for which `ours` is true, sorted by name:
//   --name (default D)
//       help text
std::string FlagsHelp(std::string_view usage, bool (*ours)(std::string_view file));
// The same for the flags (of the binary's own files) whose name `shown` accepts: for programs
// that share one set of flag definitions but take different subsets of them.
std::string FlagsHelpFor(std::string_view usage,
                         const std::function<bool(std::string_view name)>& shown);

}  // namespace pdlib_tools

#endif  // PDLIB_TOOLS_COMMON_FLAGS_H_
