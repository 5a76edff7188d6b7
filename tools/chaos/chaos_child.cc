#include "tools/chaos/chaos_child.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

extern char** environ;

namespace pdlib_chaos {

ChildProcess::ChildProcess(const std::vector<std::string>& args,
                           const std::vector<std::string>& extra_env, const std::string& log_path)
    : log_path_(log_path) {
  int in[2], out[2];
  if (::pipe2(in, O_CLOEXEC) != 0) {
    error_ = std::string("pipe2: ") + std::strerror(errno);
    return;
  }
  if (::pipe2(out, O_CLOEXEC) != 0) {
    error_ = std::string("pipe2: ") + std::strerror(errno);
    ::close(in[0]);
    ::close(in[1]);
    return;
  }
  const int log = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  if (log >= 0) posix_spawn_file_actions_adddup2(&actions, log, STDERR_FILENO);

  std::vector<std::string> argv_s = {"pdlib-chaos"};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : argv_s) argv.push_back(s.data());
  argv.push_back(nullptr);
  // Our environment, with `extra_env` replacing variables of the same name.
  std::vector<std::string> env_s;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view var(*e);
    bool replaced = false;
    for (const auto& x : extra_env) {
      replaced |= var.substr(0, var.find('=')) == std::string_view(x).substr(0, x.find('='));
    }
    if (!replaced) env_s.emplace_back(var);
  }
  env_s.insert(env_s.end(), extra_env.begin(), extra_env.end());
  std::vector<char*> envp;
  for (auto& s : env_s) envp.push_back(s.data());
  envp.push_back(nullptr);

  pid_t pid = -1;
  const int err = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (log >= 0) ::close(log);
  ::close(in[0]);
  ::close(out[1]);
  in_ = in[1];
  out_ = out[0];
  // Neither end ever blocks the driver: a frozen child stops reading its input.
  ::fcntl(in_, F_SETFL, ::fcntl(in_, F_GETFL) | O_NONBLOCK);
  ::fcntl(out_, F_SETFL, ::fcntl(out_, F_GETFL) | O_NONBLOCK);
  if (err != 0) {
    error_ = std::string("posix_spawn /proc/self/exe: ") + std::strerror(err);
    return;
  }
  pid_ = pid;
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0) KillAndReap(std::chrono::milliseconds(10000));
  if (in_ >= 0) ::close(in_);
  if (out_ >= 0) ::close(out_);
}

void ChildProcess::Send(std::string_view line) {
  pending_.append(line);
  pending_ += '\n';
  Flush();
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
    pending_.clear();                      // EPIPE: the child is gone; its status tells the rest
    return;
  }
}

bool ChildProcess::ReadLines(std::vector<std::string>* lines) {
  if (out_ < 0) return false;
  char buf[8192];
  while (true) {
    const ssize_t n = ::read(out_, buf, sizeof(buf));
    if (n > 0) {
      partial_.append(buf, size_t(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    const bool open = n < 0 && errno == EAGAIN;
    for (size_t nl; (nl = partial_.find('\n')) != std::string::npos;) {
      lines->push_back(partial_.substr(0, nl));
      partial_.erase(0, nl + 1);
    }
    if (!open) {
      ::close(out_);
      out_ = -1;
    }
    return open;
  }
}

void ChildProcess::Signal(int signal_number) {
  if (pid_ > 0) ::kill(pid_, signal_number);
}

std::optional<int> ChildProcess::Reap() {
  if (exited_) return status_;
  if (pid_ <= 0) return std::nullopt;
  int status = 0;
  const pid_t r = ::waitpid(pid_, &status, WNOHANG);
  if (r != pid_) return std::nullopt;
  exited_ = true;
  pid_ = -1;
  status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return status_;
}

int ChildProcess::KillAndReap(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  Signal(SIGKILL);
  while (true) {
    if (auto status = Reap()) return *status;
    if (std::chrono::steady_clock::now() > deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

std::string TailOfFile(const std::string& path, size_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  std::ostringstream all;
  all << in.rdbuf();
  std::string text = all.str();
  return text.size() > max_bytes ? text.substr(text.size() - max_bytes) : text;
}

}  // namespace pdlib_chaos
