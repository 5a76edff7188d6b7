// Which transport backends this build of pdlib knows.
#ifndef PDLIB_BACKENDS_H_
#define PDLIB_BACKENDS_H_

#include <string>
#include <vector>

#include "pdlib/export.h"

namespace pdlib {
inline namespace v1 {

// Names of every registered backend, sorted: the built-in ones enabled at configure time plus
// any registered with spi::RegisterTransport.
PDLIB_EXPORT std::vector<std::string> ListBackends();

// The backends compiled into this library, as chosen at configure time.
PDLIB_EXPORT std::vector<std::string> BuiltinBackends();

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_H_
