// The progress thread of a backend: the one thread that drives the wire (posts writes, reads
// completions), and the hand-over to it from API threads.
//
// API threads queue commands (a validated batch, or a function to run there) and wake the
// thread through an eventfd, written only while the thread sleeps or is about to (so a busy
// thread costs no system call per batch). The thread loops: take the commands, drive the wire,
// run completions; when a pass did nothing it keeps polling for `busy_poll` (IdlePolicy), then
// arms the wire's notification (ucp_worker_arm, ibv_req_notify_cq: the backend's part) and
// sleeps in epoll on the wake fd and the wire's fds until either fires or a timeout passes.
//
// What the backend writes: its loop body, its arming (and the re-poll after it that catches
// what arrived before arming), and what to do with each command. What it gets here: the queue,
// the wake fd, the epoll set, the lost-wake-up-free sleep, the thread's start and stop, and
// Run() (a call executed on the thread, inline when already there).
//
// Threads: Enqueue/Post/Run/Wake from any thread; TakeCommands and Sleep from the progress
// thread only. A backend whose own lock must cover "make a peer visible" and "queue its setup
// command" together may call Enqueue under that lock (this class's lock is taken inside it).
#ifndef PDLIB_BACKENDS_COMMON_PROGRESS_THREAD_H_
#define PDLIB_BACKENDS_COMMON_PROGRESS_THREAD_H_

#include <sys/epoll.h>

#include <chrono>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>

#include "lib/base/mutex.h"
#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace toolkit {

// When a loop that found nothing to do should sleep: after `busy_poll` without work. Pure.
class IdlePolicy {
 public:
  using Clock = std::chrono::steady_clock;
  explicit IdlePolicy(std::chrono::microseconds busy_poll) : busy_poll_(busy_poll) {}

  // After one pass of the loop at `now`; true when the thread should sleep now.
  bool ShouldSleep(Clock::time_point now, bool worked) {
    if (worked) {
      spin_until_ = now + busy_poll_;
      last_work_ = now;
      return false;
    }
    return now >= spin_until_;
  }
  // When the loop last did something (for backends that poll longer while writes are out).
  Clock::time_point last_work() const { return last_work_; }

 private:
  const std::chrono::microseconds busy_poll_;
  Clock::time_point spin_until_{};
  Clock::time_point last_work_{};
};

// The wake eventfd and the epoll set (wake fd + the wire's fds). Owned by a ProgressThread.
class WakeSet {
 public:
  WakeSet() = default;
  ~WakeSet();
  WakeSet(const WakeSet&) = delete;
  WakeSet& operator=(const WakeSet&) = delete;

  // Creates the eventfd and the epoll set watching it and `fds` (EPOLLIN). Errors name `backend`.
  Status Open(const std::string& backend, std::span<const int> fds);
  // Makes the next (or current) epoll_wait return. Safe from any thread, any number of times.
  void Wake() const;
  // epoll_wait on the set; then consumes any pending wake. Returns epoll_wait's result.
  int Wait(std::span<epoll_event> events, int timeout_ms) const;
  bool is_wake_event(const epoll_event& e) const { return e.data.fd == wake_fd_; }
  // Adds a wire fd to the set (EPOLLIN) / removes it, for wires that come and go (a UCX worker
  // per connection). Call Unwatch before the fd is closed.
  Status Watch(const std::string& backend, int fd);
  void Unwatch(int fd);

 private:
  int wake_fd_ = -1;
  int epoll_fd_ = -1;
};

template <typename Batch>
class ProgressThread {
 public:
  // What the thread is handed: a batch (accepted by the backend's AcceptBatch), or a function.
  struct Command {
    std::unique_ptr<Batch> batch;
    std::function<void()> fn;
  };

  // `backend` ("ucx") names the errors.
  explicit ProgressThread(std::string backend) : backend_(std::move(backend)) {}
  ~ProgressThread() { Stop(); }
  ProgressThread(const ProgressThread&) = delete;
  ProgressThread& operator=(const ProgressThread&) = delete;

  // Sets up the wake fd and the epoll set over `wire_fds`.
  Status Open(std::span<const int> wire_fds) { return wake_.Open(backend_, wire_fds); }
  // Progress thread (or before Start): adds or removes a wire fd after Open.
  Status Watch(int fd) { return wake_.Watch(backend_, fd); }
  void Unwatch(int fd) { wake_.Unwatch(fd); }
  // Starts the thread running `loop`, which returns once TakeCommands reported stopping.
  void Start(std::function<void()> loop) {
    MutexLock lock(&mu_);  // publishes id_ to the thread through mu_ (it takes mu_ first thing)
    thread_ = std::thread(std::move(loop));
    id_ = thread_.get_id();
  }
  // Refuses new commands, wakes the thread and joins it (its loop ends after the commands queued
  // before this point). Idempotent. Never call it from the progress thread.
  void Stop() {
    if (!thread_.joinable()) return;
    {
      MutexLock lock(&mu_);
      stopping_ = true;
    }
    wake_.Wake();
    thread_.join();
  }
  // Drops commands left after Stop() (the owner's destructor, before it frees what they name).
  void ClearCommands() {
    std::deque<Command> dropped;
    MutexLock lock(&mu_);
    dropped.swap(commands_);
  }

  bool OnThread() const { return std::this_thread::get_id() == id_; }

  // Queues `command`; false (and `command` dropped) once stopping.
  bool Enqueue(Command command) {
    bool wake = false;
    {
      MutexLock lock(&mu_);
      if (stopping_) return false;
      commands_.push_back(std::move(command));
      wake = sleeping_;
    }
    if (wake) wake_.Wake();
    return true;
  }
  bool Post(std::function<void()> fn) { return Enqueue(Command{nullptr, std::move(fn)}); }

  // Runs `fn` on the progress thread and returns its result; inline when called there. R is a
  // Status or StatusOr: a stopping thread yields kCancelled.
  template <typename R>
  R Run(const std::function<R()>& fn) {
    if (OnThread()) return fn();
    std::promise<R> promise;
    std::future<R> result = promise.get_future();
    if (!Post([&] { promise.set_value(fn()); })) {
      return R(Status::Cancelled(backend_ + ": the transport is shutting down"));
    }
    return result.get();
  }

  // Progress thread: moves the queued commands to *out; returns true once stopping (the commands
  // queued before Stop() are still handed out).
  bool TakeCommands(std::deque<Command>* out) {
    MutexLock lock(&mu_);
    out->swap(commands_);
    return stopping_;
  }

  // Progress thread: runs the queued commands in order, a batch through `accept` (called with
  // its unique_ptr), a function in place. Returns whether there were any; *stop is set once the
  // thread is stopping (the commands queued before Stop() still run).
  // The loop calls this on every pass, busy-polling included: the taken commands go into a
  // deque the thread keeps, so that an idle pass allocates nothing (a new std::deque does).
  template <typename Accept>
  bool RunCommands(Accept&& accept, bool* stop) {
    *stop = TakeCommands(&taken_);
    if (taken_.empty()) return false;
    for (Command& command : taken_) {
      if (command.batch) {
        accept(std::move(command.batch));
      } else {
        command.fn();
      }
    }
    taken_.clear();
    return true;
  }

  // Progress thread, after arming the wire: sleeps in epoll up to `timeout_ms` unless a command
  // is queued or the thread is stopping. Returns the number of events (0: timed out), or -1
  // when it did not sleep.
  int Sleep(int timeout_ms, std::span<epoll_event> events) {
    {
      MutexLock lock(&mu_);
      if (stopping_ || !commands_.empty()) return -1;
      sleeping_ = true;  // from here on, Enqueue writes the wake fd
    }
    const int n = wake_.Wait(events, timeout_ms);
    MutexLock lock(&mu_);
    sleeping_ = false;
    return n < 0 ? 0 : n;
  }

  void Wake() const { wake_.Wake(); }
  bool is_wake_event(const epoll_event& e) const { return wake_.is_wake_event(e); }
  const std::string& backend() const { return backend_; }

 private:
  const std::string backend_;
  WakeSet wake_;
  Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool sleeping_ ABSL_GUARDED_BY(mu_) = false;  // the thread is (about to be) in epoll
  std::deque<Command> commands_ ABSL_GUARDED_BY(mu_);
  std::deque<Command> taken_;  // progress thread only: RunCommands' batch, emptied after each
  std::thread thread_;
  std::thread::id id_;
};

}  // namespace toolkit
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_COMMON_PROGRESS_THREAD_H_
