// The fake backend's corruption faults (fake.corrupt, backends/fake/fake_transport.cc): how many
// it injected in this process, for KV integrity tests and pdlib-chaos to compare with what pdlib
// caught.
#ifndef PDLIB_BACKENDS_FAKE_FAKE_FAULTS_H_
#define PDLIB_BACKENDS_FAKE_FAKE_FAULTS_H_

#include <cstdint>

namespace pdlib {
inline namespace v1 {

uint64_t FakeCorruptionsInjected();

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_FAKE_FAKE_FAULTS_H_
