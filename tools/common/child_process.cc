#include "tools/common/child_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

extern char** environ;

namespace pdlib_tools {
namespace {

// This process's environment with `overrides` ("NAME=value") replacing entries of that name.
std::vector<std::string> MergedEnvironment(const std::vector<std::string>& overrides) {
  std::vector<std::string> merged;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const std::string_view name = entry.substr(0, entry.find('='));
    const bool overridden = std::any_of(overrides.begin(), overrides.end(), [&](auto& o) {
      return std::string_view(o).substr(0, o.find('=')) == name;
    });
    if (!overridden) merged.emplace_back(entry);
  }
  merged.insert(merged.end(), overrides.begin(), overrides.end());
  return merged;
}

std::vector<char*> Pointers(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

std::string Errno(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

}  // namespace

ChildProcess::ChildProcess(ChildOptions o) {
  ::signal(SIGPIPE, SIG_IGN);
  int in[2], out[2];
  if (::pipe2(in, O_CLOEXEC) != 0) {
    error_ = Errno("pipe2");
    return;
  }
  if (::pipe2(out, O_CLOEXEC) != 0) {
    error_ = Errno("pipe2");
    ::close(in[0]);
    ::close(in[1]);
    return;
  }
  in_ = in[1];
  out_ = out[0];
  int log = -1;
  if (o.stderr_mode == ChildOptions::Stderr::kAppendToFile) {
    log = ::open(o.stderr_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (log < 0) error_ = Errno(("open " + o.stderr_path).c_str());
  }
  if (error_.empty()) {
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in[0], STDIN_FILENO);
    posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
    if (o.stderr_mode == ChildOptions::Stderr::kMerge) {
      posix_spawn_file_actions_adddup2(&actions, out[1], STDERR_FILENO);
    } else if (log >= 0) {
      posix_spawn_file_actions_adddup2(&actions, log, STDERR_FILENO);
    }
    const bool self = o.program.empty();
    std::vector<std::string> argv = {self ? o.self_name : o.program};
    argv.insert(argv.end(), o.args.begin(), o.args.end());
    std::vector<std::string> env = MergedEnvironment(o.env);
    auto argv_p = Pointers(argv), env_p = Pointers(env);
    pid_t pid = -1;
    const bool search = !self && o.program.find('/') == std::string::npos;
    const char* path = self ? "/proc/self/exe" : o.program.c_str();
    const int err = search
                        ? posix_spawnp(&pid, path, &actions, nullptr, argv_p.data(), env_p.data())
                        : posix_spawn(&pid, path, &actions, nullptr, argv_p.data(), env_p.data());
    posix_spawn_file_actions_destroy(&actions);
    if (err == 0) {
      pid_ = pid;
    } else {
      error_ = std::string("posix_spawn ") + path + ": " + std::strerror(err);
    }
  }
  if (log >= 0) ::close(log);
  ::close(in[0]);
  ::close(out[1]);
  // Neither end ever blocks this process: a frozen child stops reading its input.
  ::fcntl(in_, F_SETFL, ::fcntl(in_, F_GETFL) | O_NONBLOCK);
  ::fcntl(out_, F_SETFL, ::fcntl(out_, F_GETFL) | O_NONBLOCK);
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0) KillAndReap(std::chrono::milliseconds(10000));
  if (in_ >= 0) ::close(in_);
  if (out_ >= 0) ::close(out_);
}

bool ChildProcess::Send(std::string_view line) {
  if (in_ < 0) return false;
  pending_.append(line);
  pending_ += '\n';
  Flush();
  return in_ >= 0;
}

void ChildProcess::Flush() {
  while (!pending_.empty() && in_ >= 0) {
    const ssize_t n = ::write(in_, pending_.data(), pending_.size());
    if (n > 0) {
      pending_.erase(0, size_t(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;  // the pipe is full: poll() says when to go on
    pending_.clear();                      // EPIPE: the child is gone
    ::close(in_);
    in_ = -1;
  }
}

bool ChildProcess::ReadAvailable() {
  char buf[8192];
  while (out_ >= 0) {
    const ssize_t n = ::read(out_, buf, sizeof(buf));
    if (n > 0) {
      partial_.append(buf, size_t(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return true;
    ::close(out_);  // the end of its output (or an error reading it)
    out_ = -1;
  }
  return false;
}

std::optional<std::string> ChildProcess::ReadLine(Clock::time_point deadline) {
  while (true) {
    if (size_t nl = partial_.find('\n'); nl != std::string::npos) {
      std::string line = partial_.substr(0, nl);
      partial_.erase(0, nl + 1);
      return line;
    }
    if (out_ < 0) return std::nullopt;
    const auto now = Clock::now();
    if (now > deadline) return std::nullopt;
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - now).count();
    pollfd fds[2] = {{out_, POLLIN, 0}, {in_, POLLOUT, 0}};
    const nfds_t n = pending_.empty() || in_ < 0 ? 1 : 2;
    const int r = ::poll(fds, n, int(std::min<int64_t>(left, 1000)));
    if (r < 0 && errno != EINTR) return std::nullopt;
    if (r <= 0) continue;
    if (n == 2 && fds[1].revents != 0) Flush();
    if (fds[0].revents != 0) ReadAvailable();
  }
}

std::optional<std::string> ChildProcess::Expect(std::string_view prefix,
                                                Clock::time_point deadline) {
  while (auto line = ReadLine(deadline)) {
    if (line->starts_with(prefix)) return line;
  }
  return std::nullopt;
}

bool ChildProcess::ReadLines(std::vector<std::string>* lines) {
  const bool open = ReadAvailable();
  for (size_t nl; (nl = partial_.find('\n')) != std::string::npos;) {
    lines->push_back(partial_.substr(0, nl));
    partial_.erase(0, nl + 1);
  }
  return open;
}

void ChildProcess::Signal(int signal_number) {
  if (pid_ > 0) ::kill(pid_, signal_number);
}

std::optional<int> ChildProcess::Reap() {
  if (exited_) return status_;
  if (pid_ <= 0) return std::nullopt;
  int status = 0;
  if (::waitpid(pid_, &status, WNOHANG) != pid_) return std::nullopt;
  exited_ = true;
  pid_ = -1;
  status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return status_;
}

int ChildProcess::Wait(Clock::time_point deadline) {
  while (true) {
    if (auto status = Reap()) return *status;
    if (pid_ <= 0 || Clock::now() > deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

int ChildProcess::KillAndReap(std::chrono::milliseconds timeout) {
  Signal(SIGKILL);
  return Wait(Clock::now() + timeout);
}

uint16_t UnusedLocalPort() { return UnusedPort("127.0.0.1"); }

uint16_t UnusedPort(const std::string& ipv4) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (::inet_pton(AF_INET, ipv4.c_str(), &addr.sin_addr) != 1) return 0;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  socklen_t len = sizeof(addr);
  uint16_t port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

std::string TsanOptionsForChild() {
  std::string options = "TSAN_OPTIONS=ignore_noninstrumented_modules=1";
  if (const char* ours = std::getenv("TSAN_OPTIONS"); ours != nullptr && *ours != '\0') {
    options += std::string(":") + ours;
  }
  return options;
}

std::string TailOfFile(const std::string& path, size_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  std::ostringstream all;
  all << in.rdbuf();
  std::string text = all.str();
  return text.size() > max_bytes ? text.substr(text.size() - max_bytes) : text;
}

ExitedChild RunToExit(const std::string& program, std::vector<std::string> args,
                      std::chrono::milliseconds limit) {
  ChildProcess p(
      {.program = program, .args = std::move(args), .stderr_mode = ChildOptions::Stderr::kMerge});
  ExitedChild e;
  if (!p.started()) {
    e.output = p.error();
    return e;
  }
  const auto deadline = ChildProcess::Clock::now() + limit;
  while (auto line = p.ReadLine(deadline)) e.output += *line + "\n";
  e.status = p.Wait(deadline);
  if (e.status < 0) e.status = p.KillAndReap(std::chrono::seconds(5));
  return e;
}

}  // namespace pdlib_tools
