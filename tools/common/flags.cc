#include "tools/common/flags.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace pdlib_tools {
namespace {

// Abseil's own flags (--flagfile, --helpfull, ...) live in its files; every other flag is the
// binary's.
bool NotAbseils(std::string_view file) {
  return !absl::StrContains(absl::string_view(file.data(), file.size()), "absl/");
}

}  // namespace

std::vector<std::string> NormalizeFlagNames(std::vector<std::string> args) {
  for (std::string& arg : args) {
    if (arg == "--") break;
    if (arg.size() < 3 || !arg.starts_with("--")) continue;
    const size_t name_end = std::min(arg.find('='), arg.size());
    std::replace(arg.begin() + 2, arg.begin() + ptrdiff_t(name_end), '-', '_');
  }
  return args;
}

std::vector<std::string> MergeListFlags(std::vector<std::string> args,
                                        const std::vector<std::string>& lists, char separator) {
  for (const std::string& name : lists) {
    const std::string bare = "--" + name, with_value = bare + "=";
    std::vector<std::string> out;
    std::string merged;
    size_t merged_count = 0;
    size_t at = std::string::npos;  // where the merged flag goes in `out`
    for (size_t i = 0; i < args.size(); ++i) {
      if (args[i] == "--") {
        out.insert(out.end(), args.begin() + ptrdiff_t(i), args.end());
        break;
      }
      std::optional<std::string> value;
      if (args[i].starts_with(with_value)) {
        value = args[i].substr(with_value.size());
      } else if (args[i] == bare && i + 1 < args.size()) {
        value = args[++i];
      }
      if (!value) {
        out.push_back(args[i]);
        continue;
      }
      if (at == std::string::npos) {
        at = out.size();
        out.emplace_back();
      }
      if (merged_count++ > 0) merged += separator;
      merged += *value;
    }
    if (at != std::string::npos) out[at] = with_value + merged;
    args = std::move(out);
  }
  return args;
}

bool WantsHelp(const std::vector<std::string>& args) {
  for (const std::string& arg : args) {
    if (arg == "--") return false;
    if (arg == "--help" || arg == "-h" || arg == "-help") return true;
  }
  return false;
}

namespace {

std::string HelpOf(std::string_view usage, std::vector<const absl::CommandLineFlag*> flags) {
  std::sort(flags.begin(), flags.end(), [](auto* a, auto* b) { return a->Name() < b->Name(); });
  std::string out(usage);
  if (!out.empty() && out.back() != '\n') out += '\n';
  out += "\nFlags (--name value or --name=value; a name may use - for _):\n";
  for (const absl::CommandLineFlag* flag : flags) {
    const std::string def = flag->DefaultValue();
    absl::StrAppendFormat(&out, "  --%s (default %s)\n", flag->Name(), def.empty() ? "\"\"" : def);
    // The help text, wrapped at 100 columns.
    std::string line = "     ";
    for (absl::string_view word : absl::StrSplit(flag->Help(), ' ', absl::SkipEmpty())) {
      if (line.size() + 1 + word.size() > 100 && line.size() > 6) {
        out += line + "\n";
        line = "     ";
      }
      absl::StrAppend(&line, " ", word);
    }
    out += line + "\n";
  }
  return out;
}

}  // namespace

std::string FlagsHelp(std::string_view usage, bool (*ours)(std::string_view file)) {
  std::vector<const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (ours(flag->Filename())) flags.push_back(flag);
  }
  return HelpOf(usage, std::move(flags));
}

std::string FlagsHelpFor(std::string_view usage,
                         const std::function<bool(std::string_view name)>& shown) {
  std::vector<const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (NotAbseils(flag->Filename()) && shown(std::string_view(name.data(), name.size()))) {
      flags.push_back(flag);
    }
  }
  return HelpOf(usage, std::move(flags));
}

FlagParse TryParseFlags(std::vector<std::string> args, const std::vector<std::string>& lists,
                        const std::vector<std::string>& repeated) {
  FlagParse result;
  if (WantsHelp(args)) {
    result.help = true;
    return result;
  }
  args = MergeListFlags(NormalizeFlagNames(std::move(args)), lists);
  args = MergeListFlags(std::move(args), repeated, '\n');
  std::string error;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!NotAbseils(flag->Filename())) continue;
    if (!flag->ParseFrom(flag->DefaultValue(), &error)) {
      result.error = absl::StrCat("--", name, ": its default does not parse: ", error);
      return result;
    }
  }
  for (size_t i = 0; i < args.size(); ++i) {
    std::string_view arg = args[i];
    if (arg == "--") {
      result.positional.insert(result.positional.end(), args.begin() + ptrdiff_t(i) + 1,
                               args.end());
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') {
      result.positional.emplace_back(arg);
      continue;
    }
    arg.remove_prefix(arg.starts_with("--") ? 2 : 1);
    std::optional<std::string> value;
    if (const size_t eq = arg.find('='); eq != std::string_view::npos) {
      value = std::string(arg.substr(eq + 1));
      arg = arg.substr(0, eq);
    }
    std::string name(arg);
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if ((flag == nullptr || !NotAbseils(flag->Filename())) && name.starts_with("no") && !value) {
      // --noverbose: a bool set to false.
      absl::CommandLineFlag* negated = absl::FindCommandLineFlag(name.substr(2));
      if (negated != nullptr && negated->IsOfType<bool>() && NotAbseils(negated->Filename())) {
        flag = negated;
        name = name.substr(2);
        value = "false";
      }
    }
    if (flag == nullptr || !NotAbseils(flag->Filename())) {
      result.error = absl::StrCat("Unknown command line flag '", name, "' (see --help)");
      return result;
    }
    if (!value) {
      if (flag->IsOfType<bool>()) {
        value = "true";
      } else if (i + 1 < args.size()) {
        value = args[++i];
      } else {
        result.error = absl::StrCat("Missing the value for the flag '", name, "'");
        return result;
      }
    }
    if (!flag->ParseFrom(*value, &error)) {
      result.error = error;  // Abseil's "Illegal value 'v' specified for flag 'name'; why"
      return result;
    }
    result.given.push_back(name);
  }
  return result;
}

bool AbslParseFlag(absl::string_view text, Repeated* out, std::string* /*error*/) {
  out->values.clear();
  if (text.empty()) return true;
  for (absl::string_view v : absl::StrSplit(text, '\n')) {
    out->values.emplace_back(v);
  }
  return true;
}

std::string AbslUnparseFlag(const Repeated& r) { return absl::StrJoin(r.values, "\n"); }

std::vector<std::string> ParseFlags(int argc, char** argv, std::string_view usage,
                                    const std::vector<std::string>& lists,
                                    const std::vector<std::string>& repeated) {
  absl::SetProgramUsageMessage(absl::string_view(usage.data(), usage.size()));
  const std::string program = argc > 0 ? argv[0] : "";
  FlagParse parsed = TryParseFlags(std::vector<std::string>(argv + std::min(argc, 1), argv + argc),
                                   lists, repeated);
  if (parsed.help) {
    const std::string help = FlagsHelp(usage, NotAbseils);
    std::fwrite(help.data(), 1, help.size(), stdout);
    std::exit(0);
  }
  if (!parsed.error.empty()) {
    std::fprintf(stderr, "%s: %s\n", program.substr(program.rfind('/') + 1).c_str(),
                 parsed.error.c_str());
    std::exit(2);
  }
  parsed.positional.insert(parsed.positional.begin(), program);
  return std::move(parsed.positional);
}

void ParseFlagsNoArguments(int argc, char** argv, std::string_view usage,
                           const std::vector<std::string>& lists,
                           const std::vector<std::string>& repeated) {
  const std::vector<std::string> rest = ParseFlags(argc, argv, usage, lists, repeated);
  if (rest.size() <= 1) return;
  const std::string& program = rest[0];
  std::fprintf(stderr, "%s: unexpected argument '%s' (see --help)\n",
               program.substr(program.rfind('/') + 1).c_str(), rest[1].c_str());
  std::exit(2);
}

}  // namespace pdlib_tools
