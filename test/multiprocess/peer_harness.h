// PeerProcess: a pdlib_test_peer child process (peer_main.cc, started through
// pdlib_tools::ChildProcess) that a test drives over its line protocol, with a transcript of
// every line; and helpers shared by the multi-process tests.
//
// Ownership: the test owns each PeerProcess; its destructor kills (SIGKILL) and reaps a child
// that is still running, so a failed REQUIRE never leaves a process behind.
// Threads: one thread per PeerProcess (Catch2 assertions are not thread-safe anyway); nothing
// here starts a thread.
#ifndef PDLIB_TEST_MULTIPROCESS_PEER_HARNESS_H_
#define PDLIB_TEST_MULTIPROCESS_PEER_HARNESS_H_

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tools/common/child_process.h"

namespace pdlib_test {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Sanitizer builds start a gRPC process slowly on a busy 2-core machine.
inline constexpr milliseconds kStartTimeout{20000};
// Anything a healthy pair of peers should finish well within.
inline constexpr milliseconds kStepTimeout{15000};

// One ROOM line: the room's terminal state, its reason, and when the test read it.
struct RoomOutcome {
  std::string state;   // KVPoll name: "Success" or "Failed"
  std::string reason;  // "OK" or the failure's Status::ToString()
  Clock::time_point at;
};

class PeerProcess {
 public:
  // Starts `binary` (by default pdlib_test_peer) with `args`; `name` prefixes its lines in
  // transcript(). Check started() (and the transcript) after construction.
  PeerProcess(std::string name, std::vector<std::string> args,
              std::string binary = PDLIB_TEST_PEER_BINARY);
  ~PeerProcess() = default;  // child_ kills and reaps a child still running
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;

  bool started() const { return child_.started(); }
  pid_t pid() const { return child_.pid(); }

  // Waits for the READY line; returns its fields (role, port, endpoint), empty on failure.
  std::map<std::string, std::string> WaitReady(milliseconds timeout = kStartTimeout);
  // Writes one command line. False when the child no longer reads its stdin.
  bool Send(std::string_view line);
  // Reads lines until one starts with `prefix` and returns it; nullopt at the timeout or EOF.
  // Every line read is kept in the transcript; ROOM lines are recorded in rooms().
  std::optional<std::string> Expect(std::string_view prefix, milliseconds timeout = kStepTimeout);
  // Waits until every room in [first, first + count) has its ROOM line.
  bool WaitRooms(uint64_t first, uint64_t count, milliseconds timeout = kStepTimeout);
  // RUN first count hold, then waits for DONE; returns the DONE line's ok= (or -1).
  int64_t RunBatch(uint64_t first, uint64_t count, milliseconds timeout = kStepTimeout);
  // Sends METRICS and returns the answer's counters (empty on timeout).
  std::map<std::string, uint64_t> Metrics(milliseconds timeout = kStepTimeout);
  // Sends QUIT and waits for the process to exit: its status (see Wait).
  int Quit(milliseconds timeout = kStepTimeout);

  void Kill(int signal_number);
  // 0..255: exit code; 128 + n: killed by signal n; -1: still running after `timeout`.
  int Wait(milliseconds timeout);

  const std::map<uint64_t, RoomOutcome>& rooms() const { return rooms_; }
  const std::string& transcript() const { return transcript_; }

 private:
  // One line (without '\n') or nullopt at `deadline` / EOF.
  std::optional<std::string> ReadLine(Clock::time_point deadline);
  void Record(const std::string& line);

  std::string name_;
  pdlib_tools::ChildProcess child_;
  bool eof_ = false;  // "end of output" is in the transcript
  std::string transcript_;
  std::map<uint64_t, RoomOutcome> rooms_;
};

// The processes of one test, kept until its end so that a failure can show every transcript.
class Scene {
 public:
  // Starts a process (see PeerProcess) and keeps it; check started() on the result.
  PeerProcess& Start(std::string name, std::vector<std::string> args,
                     std::string binary = PDLIB_TEST_PEER_BINARY);
  // Every process's transcript, in start order.
  std::string Transcripts() const;

 private:
  std::vector<std::unique_ptr<PeerProcess>> processes_;
};

// Assertions that show every transcript of `scene` when they fail (and nothing when they pass).
#define SCENE_REQUIRE(scene, ...)                                            \
  do {                                                                       \
    if (!(__VA_ARGS__)) FAIL(#__VA_ARGS__ << "\n" << (scene).Transcripts()); \
  } while (0)
#define SCENE_CHECK(scene, ...)                                                    \
  do {                                                                             \
    if (!(__VA_ARGS__)) FAIL_CHECK(#__VA_ARGS__ << "\n" << (scene).Transcripts()); \
  } while (0)

// "key=value" tokens of a line; tokens without '=' are skipped.
std::map<std::string, std::string> ParseFields(std::string_view line);
// Like ParseFields, with the numeric values only.
std::map<std::string, uint64_t> ParseCounters(std::string_view line);

// A port on 127.0.0.1 that nothing listens on right now (bound to 0, then closed).
using pdlib_tools::UnusedLocalPort;

// Flags of a peer in role `role` on bootstrap port `bootstrap_port`, with short timeouts fit for
// tests (liveness 1 s), followed by `extra`.
std::vector<std::string> PeerArgs(std::string_view role, uint16_t bootstrap_port,
                                  std::vector<std::string> extra = {});

}  // namespace pdlib_test

#endif  // PDLIB_TEST_MULTIPROCESS_PEER_HARNESS_H_
