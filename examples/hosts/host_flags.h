// The command line of pd-prefill and pd-decode, parsed into HostOptions (pure: no I/O, so tests
// check it), and HostMain, the whole program both binaries run.
#ifndef PDLIB_EXAMPLES_HOSTS_HOST_FLAGS_H_
#define PDLIB_EXAMPLES_HOSTS_HOST_FLAGS_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "examples/hosts/host.h"
#include "pdlib/status.h"

namespace pdlib::hosts {

struct HostFlags {
  HostOptions host;
  std::string grpc_host = "127.0.0.1";  // --host: where service Host listens
  int32_t grpc_port = 0;                // --port
  bool verbose = false;
  bool help = false;
};

// `program` is kPrefill (pd-prefill) or kDecode (pd-decode; --colocated makes it kColocated).
// Accepts "--flag value" and "--flag=value". kInvalidArgument naming the flag on bad input,
// including a TP or PP above 1 on decode (with the reason).
StatusOr<HostFlags> ParseHostFlags(Role program, std::span<const std::string_view> args);

// The --help text.
std::string HostUsage(Role program);

// The program: parse, build the Host, serve it, print "READY role=<role> port=<port>" (and
// " bootstrap=<host>:<port>" for prefill) on stdout, serve until SIGINT or SIGTERM, shut down.
// Returns the exit status (0 clean, 1 failure to start, 2 bad command line).
int HostMain(Role program, int argc, char** argv);

}  // namespace pdlib::hosts

#endif  // PDLIB_EXAMPLES_HOSTS_HOST_FLAGS_H_
