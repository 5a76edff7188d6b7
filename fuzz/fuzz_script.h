// How control_fuzz reads its input: a script of decisions, one byte each from the front (easier
// to write seeds for than FuzzedDataProvider, which reads numbers from the back), and the
// hostile values a decision can turn an honest field into.
#ifndef PDLIB_FUZZ_FUZZ_SCRIPT_H_
#define PDLIB_FUZZ_FUZZ_SCRIPT_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>

namespace pdlib {
inline namespace v1 {
namespace fuzzing {

// The input as a sequence of decisions. A number in a range of at most 256 values takes one
// byte, a wider one as many bytes (little-endian) as the range needs; past the end every
// decision reads 0.
class Script {
 public:
  Script(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  size_t remaining_bytes() const { return size_ - pos_; }

  template <typename T>
  T ConsumeIntegralInRange(T lo, T hi) {
    const uint64_t span = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo);
    uint64_t v = Byte();
    for (int shift = 8; shift < 64 && (span >> shift) != 0; shift += 8) {
      v |= uint64_t{Byte()} << shift;
    }
    if (span != UINT64_MAX) v %= span + 1;
    return static_cast<T>(static_cast<uint64_t>(lo) + v);
  }
  template <typename T>
  T ConsumeIntegral() {
    return ConsumeIntegralInRange(std::numeric_limits<T>::min(), std::numeric_limits<T>::max());
  }
  bool ConsumeBool() { return (Byte() & 1) != 0; }
  std::string ConsumeBytesAsString(size_t n) {
    n = std::min(n, remaining_bytes());
    std::string out(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return out;
  }

 private:
  uint8_t Byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

template <typename T>
T Pick(Script& f, std::initializer_list<T> values) {
  return *(values.begin() + f.ConsumeIntegralInRange<size_t>(0, values.size() - 1));
}

// True about once in `n` draws: how often an honest field turns hostile. A zero byte (and the
// end of the input) is honest.
inline bool Hostile(Script& f, int n = 8) { return f.ConsumeIntegralInRange(0, n - 1) == n - 1; }

inline int32_t HostileInt(Script& f, int64_t honest) {
  switch (f.ConsumeIntegralInRange(0, 8)) {
    case 0: return -1;
    case 1: return INT32_MIN;
    case 2: return INT32_MAX;
    case 3: return 0;
    case 4: return static_cast<int32_t>(honest + 1);
    case 5: return static_cast<int32_t>(honest - 1);
    case 6: return static_cast<int32_t>(honest * 2);
    case 7: return f.ConsumeIntegralInRange(-4, 16);
    default: return f.ConsumeIntegral<int32_t>();
  }
}

inline uint64_t HostileU64(Script& f, uint64_t honest) {
  switch (f.ConsumeIntegralInRange(0, 9)) {
    case 0: return 0;
    case 1: return UINT64_MAX;
    case 2: return UINT64_MAX - honest + 1;
    case 3: return honest + 1;
    case 4: return honest - 1;
    case 5: return honest / 2;
    case 6: return honest * 2;
    case 7: return uint64_t{1} << f.ConsumeIntegralInRange(0, 63);
    case 8: return f.ConsumeIntegralInRange<uint64_t>(0, 64);
    default: return f.ConsumeIntegral<uint64_t>();
  }
}

}  // namespace fuzzing
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_FUZZ_FUZZ_SCRIPT_H_
