// EtcdCluster: real etcd members on 127.0.0.1, for the tests of the etcd client and of etcd
// discovery (target pdlib_test_etcd; `ctest -R etcd`).
//
// Each member listens on free ports with its own data directory under one temporary directory,
// which the destructor removes after killing every member. Members run through pdlib_tools::
// ChildProcess (and `setpriv --pdeathsig KILL` where present, so that a test that crashes does not
// leave etcd running). Their logs (warnings and errors) go to files whose tail LogTail() returns.
//
// Tests skip, with the reason, where etcd is not installed:
//   if (auto why = pdlib::testing::EtcdMissing()) { WARN("skipped: " << *why); return; }
//
// Threads: one thread per object (the test's).
#ifndef PDLIB_TEST_SUPPORT_ETCD_LAUNCHER_H_
#define PDLIB_TEST_SUPPORT_ETCD_LAUNCHER_H_

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pdlib/status.h"

namespace pdlib::testing {

// Why etcd cannot run here ("etcd is not installed ..."), or nullopt when it can.
std::optional<std::string> EtcdMissing();
// The same for etcdctl (tests that enable auth or compact use it).
std::optional<std::string> EtcdctlMissing();

struct EtcdClusterOptions {
  int members = 1;
  // How long Start() and Restart() wait for the members to serve (a leader elected).
  std::chrono::milliseconds start_timeout{30000};
  // Appended to every member's command line (e.g. {"--auth-token-ttl", "1"}).
  std::vector<std::string> extra_args;
};

class EtcdCluster {
 public:
  // Starts the members and waits until each one serves and knows a leader.
  static StatusOr<std::unique_ptr<EtcdCluster>> Start(const EtcdClusterOptions& options);
  static StatusOr<std::unique_ptr<EtcdCluster>> Start() { return Start(EtcdClusterOptions{}); }

  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;
  ~EtcdCluster();  // kills every member, removes the data

  int size() const { return static_cast<int>(members_.size()); }
  // The client endpoint of one member ("127.0.0.1:port") or of all.
  const std::string& endpoint(int member) const;
  std::vector<std::string> endpoints() const;

  // SIGKILL, as a crash would; the member's data stays for Restart().
  Status Kill(int member);
  // Starts a killed member again (same name, ports and data) and waits until it serves.
  Status Restart(int member);
  bool running(int member) const;

  // Runs `etcdctl --endpoints=<all running> args...` (API v3) and returns what it printed;
  // an error with that output when it exits non-zero. `user` is "name:password" or "".
  StatusOr<std::string> Etcdctl(const std::vector<std::string>& args, const std::string& user = "");

  // The last `max_bytes` of a member's log, for failure messages.
  std::string LogTail(int member, size_t max_bytes = 2000) const;

 private:
  struct Member;
  EtcdCluster() = default;
  Status Launch(int member);
  Status WaitServing(int member, std::chrono::steady_clock::time_point deadline);

  EtcdClusterOptions options_;
  std::string dir_;  // the temporary directory holding every member's data and log
  std::string initial_cluster_;
  std::vector<std::unique_ptr<Member>> members_;
};

}  // namespace pdlib::testing

#endif  // PDLIB_TEST_SUPPORT_ETCD_LAUNCHER_H_
