#include "test/multiprocess/peer_harness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <sstream>
#include <thread>

extern char** environ;

namespace pdlib_test {
namespace {

// The child's environment: ours, with TSAN_OPTIONS starting with what a TSan-built child needs
// with Debian's uninstrumented gRPC (others ignore the variable), and pdlib's log level at
// "error" unless the test runs with PDLIB_LOG_LEVEL set: the ROOM lines in the transcript carry
// every failure's reason, and the fault tests fail rooms by the dozen on purpose.
std::vector<std::string> ChildEnvironment() {
  constexpr std::string_view kTsanOptions = "TSAN_OPTIONS=";
  std::string tsan_options = "TSAN_OPTIONS=ignore_noninstrumented_modules=1";
  bool log_level_set = false;
  std::vector<std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string_view var(*entry);
    if (var.starts_with(kTsanOptions)) {
      tsan_options += ":" + std::string(var.substr(kTsanOptions.size()));
    } else {
      log_level_set |= var.starts_with("PDLIB_LOG_LEVEL=");
      env.emplace_back(var);
    }
  }
  env.push_back(tsan_options);
  if (!log_level_set) env.push_back("PDLIB_LOG_LEVEL=error");
  return env;
}

}  // namespace

PeerProcess::PeerProcess(std::string name, std::vector<std::string> args, std::string binary)
    : name_(std::move(name)), binary_(std::move(binary)) {
  // A child that dies makes writes to its stdin fail with EPIPE instead of killing the test.
  ::signal(SIGPIPE, SIG_IGN);
  int in[2], out[2];
  if (::pipe2(in, O_CLOEXEC) != 0) return;
  if (::pipe2(out, O_CLOEXEC) != 0) {
    ::close(in[0]);
    ::close(in[1]);
    return;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  std::vector<char*> argv;
  argv.push_back(binary_.data());
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  std::vector<std::string> env = ChildEnvironment();
  std::vector<char*> envp;
  for (std::string& var : env) envp.push_back(var.data());
  envp.push_back(nullptr);
  pid_t pid = -1;
  const int err = posix_spawn(&pid, binary_.c_str(), &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  ::close(in[0]);
  ::close(out[1]);
  stdin_fd_ = in[1];
  stdout_fd_ = out[0];
  if (err == 0) pid_ = pid;
  transcript_ += name_ + " $ " + binary_.substr(binary_.rfind('/') + 1);
  for (size_t i = 1; i + 1 < argv.size(); ++i) transcript_ += std::string(" ") + argv[i];
  transcript_ += err == 0 ? "\n" : "\n" + name_ + " ! posix_spawn failed\n";
}

PeerProcess::~PeerProcess() {
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  if (stdin_fd_ >= 0) ::close(stdin_fd_);
  if (stdout_fd_ >= 0) ::close(stdout_fd_);
}

std::optional<std::string> PeerProcess::ReadLine(Clock::time_point deadline) {
  while (true) {
    if (size_t nl = buffer_.find('\n'); nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      Record(line);
      return line;
    }
    if (eof_ || stdout_fd_ < 0) return std::nullopt;
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count() + 1;
    if (left <= 0) return std::nullopt;
    pollfd pfd{stdout_fd_, POLLIN, 0};
    const int r = ::poll(&pfd, 1, static_cast<int>(left));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      if (Clock::now() >= deadline) return std::nullopt;
      continue;
    }
    char buf[4096];
    const ssize_t n = ::read(stdout_fd_, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      eof_ = true;
      transcript_ += name_ + " ! end of output\n";
      continue;
    }
    buffer_.append(buf, size_t(n));
  }
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
  if (stdin_fd_ < 0) return false;
  transcript_ += name_ + " < " + std::string(line) + "\n";
  std::string data(line);
  data += '\n';
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(stdin_fd_, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += size_t(n);
  }
  return true;
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
  if (pid_ > 0) ::kill(pid_, signal_number);
  transcript_ += name_ + " ! sent signal " + std::to_string(signal_number) + "\n";
}

int PeerProcess::Wait(milliseconds timeout) {
  if (pid_ <= 0) return -1;
  const auto deadline = Clock::now() + timeout;
  while (true) {
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      pid_ = -1;
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      transcript_ += name_ + " ! exited with status " + std::to_string(code) + "\n";
      return code;
    }
    if (Clock::now() >= deadline) return -1;
    std::this_thread::sleep_for(milliseconds(5));
  }
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

uint16_t UnusedLocalPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  uint16_t port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
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
