// Backend registry: name -> factory. Built-in backends are registered by the generated
// RegisterBuiltinBackends() the first time anyone asks (std::call_once), so linking order and
// static initialisers play no part.
#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_join.h"
#include "lib/base/mutex.h"
#include "pdlib/backends.h"
#include "pdlib/spi/transport.h"

namespace pdlib {
inline namespace v1 {
namespace internal {
void RegisterBuiltinBackends();
std::vector<std::string> BuiltinBackendNames();
}  // namespace internal

namespace {

struct Registry {
  Mutex mu;
  absl::flat_hash_map<std::string, spi::TransportFactory> factories ABSL_GUARDED_BY(mu);
};

Registry& RawRegistry() {
  static Registry* registry = new Registry();  // never destroyed: used until exit
  return *registry;
}

Registry& GetRegistry() {
  static std::once_flag once;
  std::call_once(once, [] { internal::RegisterBuiltinBackends(); });
  return RawRegistry();
}

std::vector<std::string> SortedNames(Registry& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(r.mu) {
  std::vector<std::string> names;
  names.reserve(r.factories.size());
  for (const auto& [name, factory] : r.factories) names.push_back(name);
  std::sort(names.begin(), names.end());
  return names;
}

Status AddFactory(Registry& r, std::string_view name, spi::TransportFactory factory,
                  uint32_t spi_version) {
  if (name.empty()) return Status::InvalidArgument("backend name must not be empty");
  if (!factory)
    return Status::InvalidArgument("backend '" + std::string(name) + "' has no factory");
  if (spi_version != spi::kTransportSpiVersion) {
    return Status::FailedPrecondition(
        "backend '" + std::string(name) + "' was built against transport SPI version " +
        std::to_string(spi_version) + " but this pdlib implements version " +
        std::to_string(spi::kTransportSpiVersion));
  }
  MutexLock lock(&r.mu);
  auto [it, inserted] = r.factories.try_emplace(std::string(name), std::move(factory));
  if (!inserted) {
    return Status::AlreadyExists("backend '" + std::string(name) + "' is already registered");
  }
  return Status::OK();
}

}  // namespace

namespace internal {
// Used by the built-in backends' RegisterXxxBackend() while the registry is being initialised
// (GetRegistry() would re-enter its own call_once).
Status RegisterBuiltinTransport(std::string_view name, spi::TransportFactory factory) {
  return AddFactory(RawRegistry(), name, std::move(factory), spi::kTransportSpiVersion);
}
}  // namespace internal

namespace spi {

Status RegisterTransport(std::string_view name, TransportFactory factory, uint32_t spi_version) {
  return AddFactory(GetRegistry(), name, std::move(factory), spi_version);
}

StatusOr<std::unique_ptr<Transport>> CreateTransport(std::string_view name,
                                                     const TransportOptions& options) {
  Registry& r = GetRegistry();
  TransportFactory factory;
  {
    MutexLock lock(&r.mu);
    auto it = r.factories.find(std::string(name));
    if (it == r.factories.end()) {
      return Status::NotFound("unknown backend '" + std::string(name) +
                              "'; known backends: " + absl::StrJoin(SortedNames(r), ", "));
    }
    factory = it->second;
  }
  auto transport = factory(options);
  if (!transport.ok()) {
    return transport.status().WithPrefix("creating backend '" + std::string(name) + "'");
  }
  if (*transport == nullptr) {
    return Status::Internal("backend '" + std::string(name) + "' factory returned null");
  }
  return transport;
}

}  // namespace spi

std::vector<std::string> ListBackends() {
  Registry& r = GetRegistry();
  MutexLock lock(&r.mu);
  return SortedNames(r);
}

std::vector<std::string> BuiltinBackends() { return internal::BuiltinBackendNames(); }

}  // namespace v1
}  // namespace pdlib
