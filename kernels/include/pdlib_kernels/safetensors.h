// SafetensorsFile: a validated, in-memory view of one .safetensors file (the format of Hugging
// Face checkpoints: an 8-byte little-endian header length, a JSON header naming each tensor's
// dtype, shape and byte range, then the raw little-endian data).
//
// Every length, offset and shape in the header is checked against the file before anything is
// read; malformed input yields an error Status, never a crash. Owns a copy of the file's bytes.
// Immutable after Parse/Open, so any number of threads may read it.
#ifndef PDLIB_KERNELS_SAFETENSORS_H_
#define PDLIB_KERNELS_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "pdlib/status.h"

namespace pdlib::kernels {

struct SafetensorsTensor {
  std::string name;
  std::string dtype;           // as written in the header: "F32", "BF16", "F16", "I64", ...
  std::vector<int64_t> shape;  // row-major
  uint64_t data_begin = 0;     // byte range inside the data section (after the header)
  uint64_t data_end = 0;
  uint64_t num_elements() const;
};

class SafetensorsFile {
 public:
  // The header may not exceed this many bytes (the format's own limit is 100 MB).
  static constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

  // Parses a whole file held in memory. Errors: kInvalidArgument for a malformed header,
  // kDataLoss for ranges that do not fit the data.
  static StatusOr<SafetensorsFile> Parse(std::vector<uint8_t> bytes);
  // Reads `path` and parses it. kNotFound when the file cannot be opened.
  static StatusOr<SafetensorsFile> Open(const std::string& path);

  // In name order.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  // The free-form "__metadata__" string map (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // nullptr when no tensor has this name.
  const SafetensorsTensor* Find(std::string_view name) const;

  // The tensor's elements widened to fp32. F32, F16 and BF16 tensors are supported;
  // kNotFound for an unknown name, kUnimplemented for other dtypes.
  StatusOr<std::vector<float>> ReadFloat32(std::string_view name) const;

 private:
  SafetensorsFile() = default;

  std::vector<uint8_t> bytes_;
  uint64_t data_start_ = 0;  // offset of the data section in bytes_
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Bytes per element of a safetensors dtype name, or 0 when the name is unknown.
size_t SafetensorsDtypeBytes(std::string_view dtype);

}  // namespace pdlib::kernels

#endif  // PDLIB_KERNELS_SAFETENSORS_H_
