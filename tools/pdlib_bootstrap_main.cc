// pdlib-bootstrap: a standalone bootstrap server for one prefill deployment (SPEC R6.1).
//
//   pdlib-bootstrap [--host H] [--port N] [--auth-secret-file F] [--tls-cert F --tls-key F
//                   [--tls-ca F]] [--verbose]
//
// Prints "pdlib-bootstrap listening on HOST:PORT" once it serves (with --port 0, PORT is the
// port it picked), and exits 0 after SIGINT or SIGTERM once in-flight calls are done.
#include <signal.h>

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>

#include "lib/control/bootstrap_server.h"
#include "pdlib/log.h"

namespace {

constexpr char kUsage[] =
    "usage: pdlib-bootstrap [--host HOST] [--port PORT] [--auth-secret-file FILE]\n"
    "                       [--tls-cert FILE --tls-key FILE [--tls-ca FILE]] [--verbose]\n"
    "\n"
    "Serves the pdlib bootstrap service for one prefill deployment: prefill ranks register\n"
    "where they listen, decode ranks look them up. Health: grpc.health.v1.Health/Check.\n"
    "\n"
    "  --host HOST   address to bind (default 0.0.0.0)\n"
    "  --port PORT   port to listen on, 0 picks a free one (default 8998)\n"
    "  --auth-secret-file FILE  require the shared secret in FILE (trailing newline ignored)\n"
    "                from every caller: the KVManagerOptions::auth_secret of the deployment\n"
    "  --tls-cert FILE, --tls-key FILE  serve TLS with this PEM certificate and key\n"
    "  --tls-ca FILE  also require client certificates signed by these PEM roots\n"
    "  --verbose     log registrations (same as PDLIB_LOG_LEVEL=info)\n"
    "  --help        print this help\n"
    "\n"
    "Stops cleanly on SIGINT or SIGTERM.\n";

struct Args {
  std::string host = "0.0.0.0";
  int port = pdlib::control::kDefaultBootstrapPort;
  bool verbose = false;
  bool help = false;
  std::string secret_file, tls_cert, tls_key, tls_ca;
};

bool ParsePort(std::string_view text, int* port) {
  int value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < 0 || value > 65535) {
    return false;
  }
  *port = value;
  return true;
}

// Accepts "--flag value" and "--flag=value". Returns false (after printing why) on bad input.
bool ParseArgs(int argc, char** argv, Args* args) {
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    std::string_view value;
    bool has_value = false;
    if (const size_t eq = arg.find('='); arg.starts_with("--") && eq != std::string_view::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    auto take_value = [&]() -> bool {
      if (has_value) return true;
      if (i + 1 >= argc) {
        std::fprintf(stderr, "pdlib-bootstrap: %.*s needs a value\n%s",
                     static_cast<int>(arg.size()), arg.data(), kUsage);
        return false;
      }
      value = argv[++i];
      return true;
    };
    if (arg == "--help" || arg == "-h") {
      args->help = true;
    } else if (arg == "--verbose" && !has_value) {
      args->verbose = true;
    } else if (arg == "--host") {
      if (!take_value()) return false;
      if (value.empty()) {
        std::fprintf(stderr, "pdlib-bootstrap: --host is empty\n");
        return false;
      }
      args->host = std::string(value);
    } else if (arg == "--port") {
      if (!take_value()) return false;
      if (!ParsePort(value, &args->port)) {
        std::fprintf(stderr, "pdlib-bootstrap: --port '%.*s' is not a port in [0, 65535]\n",
                     static_cast<int>(value.size()), value.data());
        return false;
      }
    } else if (arg == "--auth-secret-file" || arg == "--tls-cert" || arg == "--tls-key" ||
               arg == "--tls-ca") {
      if (!take_value()) return false;
      std::string* to = arg == "--auth-secret-file" ? &args->secret_file
                        : arg == "--tls-cert"       ? &args->tls_cert
                        : arg == "--tls-key"        ? &args->tls_key
                                                    : &args->tls_ca;
      *to = std::string(value);
    } else {
      std::fprintf(stderr, "pdlib-bootstrap: unknown argument '%s'\n%s", argv[i], kUsage);
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (!ParseArgs(argc, argv, &args)) return 2;
  if (args.help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
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
      std::fprintf(stderr, "pdlib-bootstrap: --auth-secret-file '%s': %s\n",
                   args.secret_file.c_str(), std::strerror(errno));
      return 2;
    }
    char buf[4096];
    size_t n = std::fread(buf, 1, sizeof(buf), f);
    std::fclose(f);
    std::string secret(buf, n);
    while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r')) secret.pop_back();
    if (secret.empty()) {
      std::fprintf(stderr, "pdlib-bootstrap: --auth-secret-file '%s' is empty\n",
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
