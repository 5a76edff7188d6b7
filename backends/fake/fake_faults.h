// The fake backend's corruption faults (fake.corrupt, backends/fake/fake_transport.cc): how many
// it injected in this process, for KV integrity tests and pdlib-chaos to compare with what pdlib
// caught.
#ifndef PDLIB_BACKENDS_FAKE_FAKE_FAULTS_H_
#define PDLIB_BACKENDS_FAKE_FAKE_FAULTS_H_

#include <cstdint>

namespace pdlib {
inline namespace v1 {

uint64_t FakeCorruptionsInjected();
// How many ranges of kCuda regions DigestRanges digested in this process (the checksum path of
// GPU pools, with host memory standing in for the GPU's).
uint64_t FakeDeviceRangesDigested();

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_FAKE_FAKE_FAULTS_H_
