// pdlib-bootstrap: a standalone bootstrap server for one prefill deployment (SPEC R6.1).
//
//   pdlib-bootstrap [--host H] [--port N] [--auth_secret_file F] [--tls_cert F --tls_key F
//                   [--tls_ca F]] [--verbose]      (--help: every flag; - works for _)
//
// Prints "pdlib-bootstrap listening on HOST:PORT" once it serves (with --port 0, PORT is the
// port it picked), and exits 0 after SIGINT or SIGTERM once in-flight calls are done.
#include <signal.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "lib/control/bootstrap_server.h"
#include "pdlib/log.h"
#include "tools/common/flags.h"

ABSL_FLAG(std::string, host, "0.0.0.0", "address to bind");
ABSL_FLAG(int32_t, port, pdlib::control::kDefaultBootstrapPort,
          "port to listen on; 0 picks a free one (printed on the listening line)");
ABSL_FLAG(std::string, auth_secret_file, "",
          "require the shared secret in this file (trailing newline ignored) from every caller: "
          "the KVManagerOptions::auth_secret of the deployment");
ABSL_FLAG(std::string, tls_cert, "", "serve TLS with this PEM certificate (needs --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "the PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "", "also require client certificates signed by these PEM roots");
ABSL_FLAG(bool, verbose, false, "log registrations (same as PDLIB_LOG_LEVEL=info)");

namespace {

constexpr char kUsage[] =
    "usage: pdlib-bootstrap [--host HOST] [--port PORT] [--auth_secret_file FILE]\n"
    "                       [--tls_cert FILE --tls_key FILE [--tls_ca FILE]] [--verbose]\n"
    "\n"
    "Serves the pdlib bootstrap service for one prefill deployment: prefill ranks register\n"
    "where they listen, decode ranks look them up. Health: grpc.health.v1.Health/Check.\n"
    "Stops cleanly on SIGINT or SIGTERM.\n";

struct Args {
  std::string host, secret_file, tls_cert, tls_key, tls_ca;
  int port = 0;
  bool verbose = false;
};

// The flags, checked. False (after printing why, naming the flag) on bad input.
bool ParseArgs(int argc, char** argv, Args* args) {
  pdlib_tools::ParseFlagsNoArguments(argc, argv, kUsage);
  args->host = absl::GetFlag(FLAGS_host);
  args->port = absl::GetFlag(FLAGS_port);
  args->secret_file = absl::GetFlag(FLAGS_auth_secret_file);
  args->tls_cert = absl::GetFlag(FLAGS_tls_cert);
  args->tls_key = absl::GetFlag(FLAGS_tls_key);
  args->tls_ca = absl::GetFlag(FLAGS_tls_ca);
  args->verbose = absl::GetFlag(FLAGS_verbose);
  if (args->host.empty()) {
    std::fprintf(stderr, "pdlib-bootstrap: --host is empty\n");
    return false;
  }
  if (args->port < 0 || args->port > 65535) {
    std::fprintf(stderr, "pdlib-bootstrap: --port %d is not a port in [0, 65535]\n", args->port);
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (!ParseArgs(argc, argv, &args)) return 2;
  if (args.verbose) pdlib::SetLogLevel(pdlib::LogLevel::kInfo);

  // Block the stop signals before gRPC starts its threads (they inherit the mask), then wait
  // for them synchronously here: no async-signal-safety concerns, and no thread is killed
  // while holding a lock.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  if (const int err = pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr); err != 0) {
    std::fprintf(stderr, "pdlib-bootstrap: pthread_sigmask: %s\n", std::strerror(err));
    return 1;
  }

  pdlib::control::BootstrapServerOptions options;
  options.host = args.host;
  options.port = args.port;
  options.security.tls_cert_file = args.tls_cert;
  options.security.tls_key_file = args.tls_key;
  options.security.tls_ca_file = args.tls_ca;
  if (!args.secret_file.empty()) {
    std::FILE* f = std::fopen(args.secret_file.c_str(), "rb");
    if (f == nullptr) {
      std::fprintf(stderr, "pdlib-bootstrap: --auth_secret_file '%s': %s\n",
                   args.secret_file.c_str(), std::strerror(errno));
      return 2;
    }
    char buf[4096];
    size_t n = std::fread(buf, 1, sizeof(buf), f);
    std::fclose(f);
    std::string secret(buf, n);
    while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r')) secret.pop_back();
    if (secret.empty()) {
      std::fprintf(stderr, "pdlib-bootstrap: --auth_secret_file '%s' is empty\n",
                   args.secret_file.c_str());
      return 2;
    }
    options.security.shared_secret = std::move(secret);
  }
  if (auto s = pdlib::control::ValidateSecurity(options.security); !s.ok()) {
    std::fprintf(stderr, "pdlib-bootstrap: %s\n", s.ToString().c_str());
    return 2;
  }
  auto server = pdlib::control::BootstrapServer::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "pdlib-bootstrap: %s\n", server.status().ToString().c_str());
    return 1;
  }
  std::printf("pdlib-bootstrap listening on %s\n", (*server)->address().c_str());
  std::fflush(stdout);

  int signal_number = 0;
  while (true) {
    const int err = sigwait(&stop_signals, &signal_number);
    if (err == 0) break;
    if (err != EINTR) {
      std::fprintf(stderr, "pdlib-bootstrap: sigwait: %s\n", std::strerror(err));
      break;
    }
  }
  std::fprintf(stderr, "pdlib-bootstrap: %s received, shutting down\n",
               signal_number == SIGINT ? "SIGINT" : "SIGTERM");
  (*server)->Shutdown();
  return 0;
}
