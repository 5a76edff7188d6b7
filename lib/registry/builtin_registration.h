// How a built-in backend adds itself to the registry. Called only from the backend's
// RegisterXxxBackend(), which the generated RegisterBuiltinBackends() calls.
#ifndef PDLIB_LIB_REGISTRY_BUILTIN_REGISTRATION_H_
#define PDLIB_LIB_REGISTRY_BUILTIN_REGISTRATION_H_

#include <string_view>

#include "pdlib/spi/transport.h"

namespace pdlib {
inline namespace v1 {
namespace internal {
Status RegisterBuiltinTransport(std::string_view name, spi::TransportFactory factory);
}  // namespace internal
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_LIB_REGISTRY_BUILTIN_REGISTRATION_H_
