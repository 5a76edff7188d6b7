#include "test/multiprocess/peer_harness.h"

#include <charconv>
#include <cstdlib>
#include <sstream>

namespace pdlib_test {
namespace {

// What the child's environment changes: TSAN_OPTIONS for a TSan-built child, and pdlib's log
// level at "error" unless the test runs with PDLIB_LOG_LEVEL set: the ROOM lines in the
// transcript carry every failure's reason, and the fault tests fail rooms by the dozen on purpose.
std::vector<std::string> ChildEnvironment() {
  std::vector<std::string> env = {pdlib_tools::TsanOptionsForChild()};
  if (std::getenv("PDLIB_LOG_LEVEL") == nullptr) env.push_back("PDLIB_LOG_LEVEL=error");
  return env;
}

}  // namespace

PeerProcess::PeerProcess(std::string name, std::vector<std::string> args, std::string binary)
    : name_(std::move(name)), child_({.program = binary, .args = args, .env = ChildEnvironment()}) {
  transcript_ += name_ + " $ " + binary.substr(binary.rfind('/') + 1);
  for (const std::string& arg : args) transcript_ += " " + arg;
  transcript_ += child_.started() ? "\n" : "\n" + name_ + " ! " + child_.error() + "\n";
}

std::optional<std::string> PeerProcess::ReadLine(Clock::time_point deadline) {
  auto line = child_.ReadLine(deadline);
  if (line) {
    Record(*line);
  } else if (child_.output_fd() < 0 && !eof_) {
    eof_ = true;
    transcript_ += name_ + " ! end of output\n";
  }
  return line;
}

void PeerProcess::Record(const std::string& line) {
  transcript_ += name_ + " > " + line + "\n";
  if (!line.starts_with("ROOM ")) return;
  std::istringstream in(line.substr(5));
  uint64_t room = 0;
  RoomOutcome outcome;
  if (!(in >> room >> outcome.state)) return;
  std::getline(in >> std::ws, outcome.reason);
  outcome.at = Clock::now();
  rooms_[room] = std::move(outcome);
}

std::map<std::string, std::string> PeerProcess::WaitReady(milliseconds timeout) {
  auto line = Expect("READY ", timeout);
  if (!line) return {};
  return ParseFields(*line);
}

bool PeerProcess::Send(std::string_view line) {
  transcript_ += name_ + " < " + std::string(line) + "\n";
  return child_.Send(line);
}

std::optional<std::string> PeerProcess::Expect(std::string_view prefix, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (auto line = ReadLine(deadline)) {
    if (line->starts_with(prefix)) return line;
  }
  transcript_ += name_ + " ! no '" + std::string(prefix) + "' line within " +
                 std::to_string(timeout.count()) + " ms\n";
  return std::nullopt;
}

bool PeerProcess::WaitRooms(uint64_t first, uint64_t count, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  auto all_in = [&] {
    for (uint64_t r = first; r < first + count; ++r) {
      if (!rooms_.contains(r)) return false;
    }
    return true;
  };
  while (!all_in()) {
    if (!ReadLine(deadline)) {
      transcript_ += name_ + " ! rooms [" + std::to_string(first) + ", " +
                     std::to_string(first + count) + ") not all terminal within " +
                     std::to_string(timeout.count()) + " ms\n";
      return false;
    }
  }
  return true;
}

int64_t PeerProcess::RunBatch(uint64_t first, uint64_t count, milliseconds timeout) {
  const std::string tag = "DONE first=" + std::to_string(first) + " ";
  if (!Send("RUN " + std::to_string(first) + " " + std::to_string(count))) return -1;
  auto line = Expect(tag, timeout);
  if (!line) return -1;
  auto counters = ParseCounters(*line);
  return counters.contains("ok") ? int64_t(counters["ok"]) : -1;
}

std::map<std::string, uint64_t> PeerProcess::Metrics(milliseconds timeout) {
  if (!Send("METRICS")) return {};
  auto line = Expect("METRICS ", timeout);
  return line ? ParseCounters(*line) : std::map<std::string, uint64_t>{};
}

int PeerProcess::Quit(milliseconds timeout) {
  Send("QUIT");
  Expect("BYE", timeout);
  return Wait(timeout);
}

void PeerProcess::Kill(int signal_number) {
  child_.Signal(signal_number);
  transcript_ += name_ + " ! sent signal " + std::to_string(signal_number) + "\n";
}

int PeerProcess::Wait(milliseconds timeout) {
  if (!child_.started()) return -1;
  const bool running = child_.pid() > 0;
  const int code = child_.Wait(Clock::now() + timeout);
  if (running && code >= 0) {
    transcript_ += name_ + " ! exited with status " + std::to_string(code) + "\n";
  }
  return code;
}

PeerProcess& Scene::Start(std::string name, std::vector<std::string> args, std::string binary) {
  processes_.push_back(
      std::make_unique<PeerProcess>(std::move(name), std::move(args), std::move(binary)));
  return *processes_.back();
}

std::string Scene::Transcripts() const {
  std::string out;
  for (const auto& p : processes_) out += p->transcript();
  return out;
}

std::map<std::string, std::string> ParseFields(std::string_view line) {
  std::map<std::string, std::string> fields;
  std::istringstream in{std::string(line)};
  for (std::string token; in >> token;) {
    if (size_t eq = token.find('='); eq != std::string::npos) {
      fields[token.substr(0, eq)] = token.substr(eq + 1);
    }
  }
  return fields;
}

std::map<std::string, uint64_t> ParseCounters(std::string_view line) {
  std::map<std::string, uint64_t> counters;
  for (const auto& [key, value] : ParseFields(line)) {
    uint64_t n = 0;
    const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), n);
    if (ec == std::errc() && end == value.data() + value.size()) counters[key] = n;
  }
  return counters;
}

std::vector<std::string> PeerArgs(std::string_view role, uint16_t bootstrap_port,
                                  std::vector<std::string> extra) {
  std::vector<std::string> args = {"--role",
                                   std::string(role),
                                   "--bootstrap-port",
                                   std::to_string(bootstrap_port),
                                   "--liveness-ms",
                                   "1000",
                                   "--connect-timeout-ms",
                                   "3000",
                                   "--max-seconds",
                                   "60"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

}  // namespace pdlib_test
