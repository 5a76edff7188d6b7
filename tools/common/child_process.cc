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
#include <string_view>
#include <thread>

extern char** environ;

namespace pdlib_tools {

ChildProcess::ChildProcess(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {"pdlib-transfer-bench"};
  argv.insert(argv.end(), args.begin(), args.end());
  Start("/proc/self/exe", false, argv, environ, false);
}

ChildProcess::ChildProcess(const std::string& program, const std::vector<std::string>& args,
                           const std::vector<std::string>& env, const std::string& stderr_path) {
  std::vector<std::string> argv = {program};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<std::string> merged;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const std::string_view name = entry.substr(0, entry.find('='));
    const bool overridden = std::any_of(env.begin(), env.end(), [&](const std::string& o) {
      return o.size() > name.size() && o.compare(0, name.size(), name) == 0 &&
             o[name.size()] == '=';
    });
    if (!overridden) merged.emplace_back(entry);
  }
  merged.insert(merged.end(), env.begin(), env.end());
  std::vector<char*> envp;
  for (auto& e : merged) envp.push_back(e.data());
  envp.push_back(nullptr);
  Start(program.c_str(), true, argv, envp.data(), stderr_path.empty(), stderr_path);
}

void ChildProcess::Start(const char* path, bool search_path, const std::vector<std::string>& argv,
                         char* const* envp, bool merge_stderr, const std::string& stderr_path) {
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
  if (merge_stderr) {
    posix_spawn_file_actions_adddup2(&actions, out[1], STDERR_FILENO);
  } else if (!stderr_path.empty() && stderr_path != "-") {
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, stderr_path.c_str(),
                                     O_WRONLY | O_CREAT | O_APPEND, 0644);
  }
  std::vector<std::string> args = argv;
  std::vector<char*> raw;
  for (auto& s : args) raw.push_back(s.data());
  raw.push_back(nullptr);
  pid_t pid = -1;
  const int rc = search_path ? posix_spawnp(&pid, path, &actions, nullptr, raw.data(), envp)
                             : posix_spawn(&pid, path, &actions, nullptr, raw.data(), envp);
  if (rc == 0) pid_ = pid;
  posix_spawn_file_actions_destroy(&actions);
  ::close(in[0]);
  ::close(out[1]);
  in_ = in[1];
  out_ = out[0];
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  if (in_ >= 0) ::close(in_);
  if (out_ >= 0) ::close(out_);
}

std::optional<std::string> ChildProcess::Expect(std::string_view prefix,
                                                Clock::time_point deadline) {
  while (true) {
    for (size_t nl; (nl = buf_.find('\n')) != std::string::npos;) {
      std::string line = buf_.substr(0, nl);
      buf_.erase(0, nl + 1);
      if (line.starts_with(prefix)) return line;
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return std::nullopt;
    pollfd p{out_, POLLIN, 0};
    const int r = ::poll(&p, 1, int(std::min<int64_t>(left, 1000)));
    if (r < 0 && errno != EINTR) return std::nullopt;
    if (r <= 0) continue;
    char tmp[4096];
    const ssize_t n = ::read(out_, tmp, sizeof(tmp));
    if (n <= 0) return std::nullopt;
    buf_.append(tmp, size_t(n));
  }
}

void ChildProcess::Signal(int signal_number) {
  if (pid_ > 0) ::kill(pid_, signal_number);
}

void ChildProcess::Send(std::string_view line) {
  std::string s(line);
  s += '\n';
  if (::write(in_, s.data(), s.size()) < 0) {
    // The child is gone; its exit status tells the rest.
  }
}

int ChildProcess::Wait(Clock::time_point deadline) {
  while (pid_ > 0) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    if (Clock::now() > deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return -1;
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

}  // namespace pdlib_tools
