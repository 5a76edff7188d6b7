// HostMain (host_flags.h): what pd-prefill and pd-decode run.
#include <signal.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "examples/hosts/host_flags.h"
#include "examples/hosts/host_service.h"
#include "pdlib/log.h"

namespace pdlib::hosts {

int HostMain(Role program, int argc, char** argv) {
  const char* name = program == Role::kPrefill ? "pd-prefill" : "pd-decode";
  std::vector<std::string_view> args(argv + 1, argv + argc);
  auto flags = ParseHostFlags(program, args);
  if (!flags.ok()) {
    std::fprintf(stderr, "%s: %s\n", name, std::string(flags.status().message()).c_str());
    return 2;
  }
  if (flags->help) {
    std::fputs(HostUsage(program).c_str(), stdout);
    return 0;
  }
  if (flags->verbose) SetLogLevel(LogLevel::kInfo);

  // Block the stop signals before any thread starts (threads inherit the mask) and wait for them
  // synchronously below: no async-signal-safety concerns, no thread killed holding a lock.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  if (const int err = pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr); err != 0) {
    std::fprintf(stderr, "%s: pthread_sigmask: %s\n", name, std::strerror(err));
    return 1;
  }

  const HostOptions& o = flags->host;
  const std::string role(RoleName(o.role));
  auto host = Host::Create(o);
  if (!host.ok()) {
    std::fprintf(stderr, "%s: %s\n", name, host.status().ToString().c_str());
    return 1;
  }
  auto service =
      HostService::Start({.host = flags->grpc_host, .port = flags->grpc_port}, host->get());
  if (!service.ok()) {
    std::fprintf(stderr, "%s: %s\n", name, service.status().ToString().c_str());
    return 1;
  }
  const std::string device = o.device == kernels::Device::kCuda
                                 ? "cuda:" + std::to_string(o.cuda_device)
                                 : std::string("cpu");
  std::fprintf(stderr,
               "%s: role %s, model %s seed %llu, tp %d pp %d, device %s, backend %s, %d "
               "pages/rank\n",
               name, role.c_str(), o.model.c_str(), static_cast<unsigned long long>(o.seed),
               o.tp_size, o.pp_size, device.c_str(),
               o.role == Role::kColocated ? "none" : o.backend.c_str(), o.num_pages);
  std::string ready = "READY role=" + role + " port=" + std::to_string((*service)->port());
  if (o.role == Role::kPrefill) {
    const BootstrapAddress b = (*host)->bootstrap();
    ready += " bootstrap=" + b.host + ":" + std::to_string(b.port);
  }
  std::printf("%s\n", ready.c_str());
  std::fflush(stdout);

  int signal_number = 0;
  while (true) {
    const int err = sigwait(&stop_signals, &signal_number);
    if (err == 0) break;
    if (err != EINTR) {
      std::fprintf(stderr, "%s: sigwait: %s\n", name, std::strerror(err));
      break;
    }
  }
  std::fprintf(stderr, "%s: %s received, shutting down\n", name,
               signal_number == SIGINT ? "SIGINT" : "SIGTERM");
  // The host first: every open stream gets its request's result (failed, with the reason), then
  // the service lets the streams finish.
  (*host)->Shutdown();
  (*service)->Shutdown();
  service->reset();
  host->reset();
  return 0;
}

}  // namespace pdlib::hosts
