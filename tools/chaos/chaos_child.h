// ChildProcess: this binary started again in a peer role, talked to over pipes without ever
// blocking the driver: input is queued and written as far as the pipe takes it (a frozen child
// stops reading), output is read when poll() says so, and the exit status is collected with
// WNOHANG. The child's stderr goes to a log file.
//
// Ownership: the driver owns each ChildProcess; the destructor kills (SIGKILL) and reaps a
// child still running. Threads: one thread (the driver's loop) per object.
#ifndef PDLIB_TOOLS_CHAOS_CHAOS_CHILD_H_
#define PDLIB_TOOLS_CHAOS_CHAOS_CHILD_H_

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace pdlib_chaos {

class ChildProcess {
 public:
  // Starts /proc/self/exe with `args` and `extra_env` added to this process's environment,
  // its stderr appended to `log_path`. Check started(); error() says why it did not.
  ChildProcess(const std::vector<std::string>& args, const std::vector<std::string>& extra_env,
               const std::string& log_path);
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  bool started() const { return pid_ > 0 || exited_; }
  const std::string& error() const { return error_; }
  pid_t pid() const { return pid_; }
  const std::string& log_path() const { return log_path_; }

  // File descriptors for the driver's poll(): output to read, input to write (-1 when nothing
  // is queued).
  int output_fd() const { return out_; }
  int input_fd_if_pending() const { return pending_.empty() ? -1 : in_; }

  // Queues one line for the child's stdin and writes what the pipe takes now.
  void Send(std::string_view line);
  // Writes queued input as far as the pipe takes it.
  void Flush();
  // Reads what is available without blocking and appends the complete lines to `lines`.
  // False once the output is closed (the child exited or was killed).
  bool ReadLines(std::vector<std::string>* lines);

  void Signal(int signal_number);
  // The exit status once the child is gone (0..255, or 128 + n when killed by signal n);
  // nullopt while it runs. Never blocks.
  std::optional<int> Reap();
  // SIGKILL, then reaps, waiting at most `timeout`. The status (or -1 if it would not die).
  int KillAndReap(std::chrono::milliseconds timeout);

 private:
  pid_t pid_ = -1;
  bool exited_ = false;
  int status_ = -1;
  int in_ = -1, out_ = -1;
  std::string pending_;  // queued input
  std::string partial_;  // output read after the last newline
  std::string log_path_;
  std::string error_;
};

// The last `max_bytes` of the file at `path` (empty when unreadable).
std::string TailOfFile(const std::string& path, size_t max_bytes);

}  // namespace pdlib_chaos

#endif  // PDLIB_TOOLS_CHAOS_CHAOS_CHILD_H_
