// ChildProcess: this binary started again with other flags (the transfer bench's prefill and
// decode ranks), or another program (ucx_perftest, the example hosts started by pd-demo), talked
// to over its stdin and stdout; and UnusedLocalPort for their servers. Shared by the tools,
// benchmarks and examples (target pdlib_tool_process; not part of the pdlib library).
//
// Ownership: the destructor kills (SIGKILL) and reaps a child that is still running.
// Threads: one thread per object.
#ifndef PDLIB_TOOLS_COMMON_CHILD_PROCESS_H_
#define PDLIB_TOOLS_COMMON_CHILD_PROCESS_H_

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace pdlib_tools {

class ChildProcess {
 public:
  using Clock = std::chrono::steady_clock;

  // Starts /proc/self/exe with `args`; check started().
  explicit ChildProcess(const std::vector<std::string>& args);
  // Starts `program` (looked up on PATH unless it holds a '/') with `args` and this process's
  // environment plus `env` ("NAME=value", overriding). Its stderr goes where its stdout goes
  // (`stderr_path` ""), stays this process's stderr ("-"), or is appended to the file
  // `stderr_path`. Check started().
  ChildProcess(const std::string& program, const std::vector<std::string>& args,
               const std::vector<std::string>& env, const std::string& stderr_path = "");
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  bool started() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }
  // Sends `signal_number` while the child runs (not yet reaped).
  void Signal(int signal_number);
  // The next line starting with `prefix`, or nullopt at the deadline or the end of its output.
  std::optional<std::string> Expect(std::string_view prefix, Clock::time_point deadline);
  // Writes one line to its stdin (ignored when the child is gone: its exit status tells).
  void Send(std::string_view line);
  // Exit status (128 + n when killed by signal n), or -1 when still running at the deadline.
  int Wait(Clock::time_point deadline);

 private:
  void Start(const char* path, bool search_path, const std::vector<std::string>& argv,
             char* const* envp, bool merge_stderr, const std::string& stderr_path = "");

  pid_t pid_ = -1;
  int in_ = -1, out_ = -1;
  std::string buf_;
};

// A port on 127.0.0.1 that nothing listens on right now (bound to 0, then closed); 0 on error.
uint16_t UnusedLocalPort();

}  // namespace pdlib_tools

#endif  // PDLIB_TOOLS_COMMON_CHILD_PROCESS_H_
