// ChildProcess: a program (or this binary again, in another role) started with pipes on its
// stdin and stdout, for the tools, benchmarks, examples and multi-process tests (target
// pdlib_tool_process; not part of the pdlib library). The one child-process helper of the tree:
// the transfer bench's ranks, ucx_perftest, pd-demo's hosts, pdlib-chaos's peers and the test
// peers all run through it.
//
// Two ways to drive it, mixable:
// - blocking with a deadline: ReadLine / Expect / Wait (benchmarks, tests, the demo);
// - never blocking, from a poll() loop over many children: output_fd / input_fd_if_pending,
//   ReadLines, Flush, Reap (pdlib-chaos, where a frozen child must not stall the driver).
// Input is queued and written as far as the pipe takes it, in both ways; ReadLine writes the
// rest while it waits.
//
// Constructing one ignores SIGPIPE in this process, so that writing to a child that died fails
// with EPIPE instead of killing the parent.
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

struct ChildOptions {
  // The program: looked up on PATH unless it holds a '/'. Empty: this binary
  // (/proc/self/exe), with `self_name` as its argv[0].
  std::string program{};
  std::string self_name = "pdlib-child";
  std::vector<std::string> args{};
  // "NAME=value" entries added to this process's environment, replacing those of the same name.
  std::vector<std::string> env{};
  enum class Stderr {
    kInherit,       // this process's stderr
    kMerge,         // where its stdout goes (read back by ReadLine)
    kAppendToFile,  // appended to `stderr_path`
  };
  Stderr stderr_mode = Stderr::kInherit;
  std::string stderr_path{};
};

class ChildProcess {
 public:
  using Clock = std::chrono::steady_clock;

  // Starts the child; check started(), and error() for why it did not.
  explicit ChildProcess(ChildOptions options);
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  bool started() const { return pid_ > 0 || exited_; }
  const std::string& error() const { return error_; }
  pid_t pid() const { return pid_; }

  // --- Input ---
  // Queues one line for its stdin and writes what the pipe takes now. False once its stdin is
  // closed (the child is gone: its exit status tells the rest).
  bool Send(std::string_view line);
  // Writes queued input as far as the pipe takes it.
  void Flush();

  // --- Output, blocking ---
  // The next line (without '\n'), or nullopt at `deadline` or the end of its output.
  std::optional<std::string> ReadLine(Clock::time_point deadline);
  // The next line starting with `prefix` (others are skipped), or nullopt as ReadLine.
  std::optional<std::string> Expect(std::string_view prefix, Clock::time_point deadline);

  // --- Output, never blocking ---
  // File descriptors for a poll() loop: output to read (-1 once closed), input to write (-1
  // when nothing is queued).
  int output_fd() const { return out_; }
  int input_fd_if_pending() const { return pending_.empty() ? -1 : in_; }
  // Reads what is available and appends the complete lines to `lines`. False once its output
  // is closed (the child exited or was killed).
  bool ReadLines(std::vector<std::string>* lines);

  // --- Lifetime ---
  // Sends `signal_number` while the child runs (not yet reaped).
  void Signal(int signal_number);
  // The exit status once the child is gone (0..255, or 128 + n when killed by signal n);
  // nullopt while it runs. Never blocks.
  std::optional<int> Reap();
  // The exit status, or -1 when it still runs at `deadline`.
  int Wait(Clock::time_point deadline);
  // SIGKILL, then reaps, waiting at most `timeout`: the status, or -1 if it would not die.
  int KillAndReap(std::chrono::milliseconds timeout);

 private:
  // Reads what the pipe holds into `partial_`; closes the output at its end. False then.
  bool ReadAvailable();

  pid_t pid_ = -1;
  bool exited_ = false;
  int status_ = -1;
  int in_ = -1, out_ = -1;
  std::string pending_;  // queued input
  std::string partial_;  // output read after the last newline
  std::string error_;
};

// A port on 127.0.0.1 that nothing listens on right now (bound to 0, then closed); 0 on error.
uint16_t UnusedLocalPort();
// The same on the IPv4 address `ipv4` (a bridge's or a namespace host's); 0 on error.
uint16_t UnusedPort(const std::string& ipv4);

// "TSAN_OPTIONS=ignore_noninstrumented_modules=1[:<this process's TSAN_OPTIONS>]", for
// ChildOptions::env: what a TSan-built child needs with Debian's uninstrumented gRPC and Abseil
// (other builds ignore the variable).
std::string TsanOptionsForChild();

// The last `max_bytes` of the file at `path` (empty when unreadable): a child's log.
std::string TailOfFile(const std::string& path, size_t max_bytes);

// A program run to its end: its exit status (as ChildProcess::Wait; -1 when it could not start)
// and everything it printed, stdout and stderr merged. A child still running at `limit` is
// killed and reaped. For tests of a binary's command line.
struct ExitedChild {
  int status = -1;
  std::string output;
};
ExitedChild RunToExit(const std::string& program, std::vector<std::string> args,
                      std::chrono::milliseconds limit);

}  // namespace pdlib_tools

#endif  // PDLIB_TOOLS_COMMON_CHILD_PROCESS_H_
