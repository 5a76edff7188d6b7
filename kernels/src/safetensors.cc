#include "pdlib_kernels/safetensors.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>

#include "half_float.h"
#include "json.h"

namespace pdlib::kernels {
namespace {

using nlohmann::json;

Status BadHeader(const std::string& what) {
  return Status::InvalidArgument("safetensors header: " + what);
}

// Multiplies with an overflow check; false on overflow.
bool MulU64(uint64_t a, uint64_t b, uint64_t* out) {
  if (a != 0 && b > UINT64_MAX / a) return false;
  *out = a * b;
  return true;
}

// The member `key` of an object, or nullptr.
const json* Member(const json& object, const char* key) {
  auto it = object.find(key);
  return it == object.end() ? nullptr : &*it;
}

Status ParseTensorEntry(const std::string& name, const json& entry, uint64_t data_bytes,
                        SafetensorsTensor* out) {
  if (!entry.is_object()) return BadHeader("entry '" + name + "' is not an object");
  const json* dtype = Member(entry, "dtype");
  const json* shape = Member(entry, "shape");
  const json* offsets = Member(entry, "data_offsets");
  if (dtype == nullptr || !dtype->is_string()) {
    return BadHeader("tensor '" + name + "' has no string 'dtype'");
  }
  const std::string& dtype_name = dtype->get_ref<const std::string&>();
  size_t elem_bytes = SafetensorsDtypeBytes(dtype_name);
  if (elem_bytes == 0) {
    return BadHeader("tensor '" + name + "' has unknown dtype '" + dtype_name + "'");
  }
  if (shape == nullptr || !shape->is_array()) {
    return BadHeader("tensor '" + name + "' has no 'shape' array");
  }
  if (offsets == nullptr || !offsets->is_array() || offsets->size() != 2) {
    return BadHeader("tensor '" + name + "' needs 'data_offsets' = [begin, end]");
  }
  out->name = name;
  out->dtype = dtype_name;
  uint64_t numel = 1;
  for (const json& dim : *shape) {
    if (!dim.is_number_unsigned() || dim.get<uint64_t>() > INT64_MAX) {
      return BadHeader("tensor '" + name +
                       "' has a shape entry that is not a non-negative integer");
    }
    if (!MulU64(numel, dim.get<uint64_t>(), &numel)) {
      return BadHeader("tensor '" + name + "' has a shape whose element count overflows");
    }
    out->shape.push_back(static_cast<int64_t>(dim.get<uint64_t>()));
  }
  for (const json& off : *offsets) {
    if (!off.is_number_unsigned()) {
      return BadHeader("tensor '" + name +
                       "' has a data offset that is not a non-negative integer");
    }
  }
  out->data_begin = (*offsets)[0].get<uint64_t>();
  out->data_end = (*offsets)[1].get<uint64_t>();
  if (out->data_begin > out->data_end) {
    return BadHeader("tensor '" + name + "' has data_offsets begin " +
                     std::to_string(out->data_begin) + " > end " + std::to_string(out->data_end));
  }
  if (out->data_end > data_bytes) {
    return Status::DataLoss("safetensors: tensor '" + name + "' ends at byte " +
                            std::to_string(out->data_end) + " but the data section has only " +
                            std::to_string(data_bytes) + " bytes (truncated file?)");
  }
  uint64_t expected = 0;
  if (!MulU64(numel, elem_bytes, &expected) || expected != out->data_end - out->data_begin) {
    return BadHeader("tensor '" + name + "' spans " +
                     std::to_string(out->data_end - out->data_begin) + " bytes but its shape and " +
                     out->dtype + " dtype need " + std::to_string(numel) + " x " +
                     std::to_string(elem_bytes));
  }
  return Status::OK();
}

}  // namespace

uint64_t SafetensorsTensor::num_elements() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

size_t SafetensorsDtypeBytes(std::string_view dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" ||
      dtype == "F8_E5M2") {
    return 1;
  }
  return 0;
}

StatusOr<SafetensorsFile> SafetensorsFile::Parse(std::vector<uint8_t> bytes) {
  if (bytes.size() < 8) {
    return Status::InvalidArgument("safetensors: file has " + std::to_string(bytes.size()) +
                                   " bytes, fewer than the 8-byte header length");
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[static_cast<size_t>(i)];
  if (header_len > kMaxHeaderBytes) {
    return BadHeader("length " + std::to_string(header_len) + " exceeds the 100 MB limit");
  }
  if (header_len > bytes.size() - 8) {
    return Status::DataLoss("safetensors: header length " + std::to_string(header_len) +
                            " exceeds the " + std::to_string(bytes.size() - 8) +
                            " bytes after the length field (truncated file?)");
  }
  std::string_view header(reinterpret_cast<const char*>(bytes.data()) + 8,
                          static_cast<size_t>(header_len));
  // The format pads the header with trailing spaces to align the data section.
  StatusOr<json> root = pdlib::json::ParseStrict(header);
  if (!root.ok()) return root.status().WithPrefix("safetensors header");
  if (!root->is_object()) return BadHeader("top level is not an object");

  SafetensorsFile file;
  file.data_start_ = 8 + header_len;
  const uint64_t data_bytes = bytes.size() - file.data_start_;
  // Tensors come in name order (a JSON object's members have none of their own).
  for (const auto& [key, value] : root->items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) return BadHeader("__metadata__ is not an object");
      for (const auto& [meta_key, meta_value] : value.items()) {
        if (!meta_value.is_string()) {
          return BadHeader("__metadata__ value of '" + meta_key + "' is not a string");
        }
        file.metadata_[meta_key] = meta_value.get<std::string>();
      }
      continue;
    }
    SafetensorsTensor tensor;
    Status s = ParseTensorEntry(key, value, data_bytes, &tensor);
    if (!s.ok()) return s;
    file.tensors_.push_back(std::move(tensor));
  }

  // Byte ranges must not overlap. (Names are unique: ParseStrict rejects a duplicate key.)
  std::vector<const SafetensorsTensor*> order;
  for (const SafetensorsTensor& t : file.tensors_) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const SafetensorsTensor* a, const SafetensorsTensor* b) {
    return a->data_begin != b->data_begin ? a->data_begin < b->data_begin
                                          : a->data_end < b->data_end;
  });
  for (size_t i = 1; i < order.size(); ++i) {
    if (order[i]->data_begin < order[i - 1]->data_end) {
      return BadHeader("tensors '" + order[i - 1]->name + "' and '" + order[i]->name + "' overlap");
    }
  }
  file.bytes_ = std::move(bytes);
  return file;
}

StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound("safetensors: cannot open '" + path + "'");
  in.seekg(0, std::ios::end);
  std::streamoff size = in.tellg();
  if (size < 0) return Status::DataLoss("safetensors: cannot size '" + path + "'");
  in.seekg(0, std::ios::beg);
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  if (size > 0 && !in.read(reinterpret_cast<char*>(bytes.data()), size)) {
    return Status::DataLoss("safetensors: short read of '" + path + "'");
  }
  StatusOr<SafetensorsFile> file = Parse(std::move(bytes));
  if (!file.ok()) return file.status().WithPrefix(path);
  return file;
}

const SafetensorsTensor* SafetensorsFile::Find(std::string_view name) const {
  for (const SafetensorsTensor& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

StatusOr<std::vector<float>> SafetensorsFile::ReadFloat32(std::string_view name) const {
  const SafetensorsTensor* t = Find(name);
  if (t == nullptr)
    return Status::NotFound("safetensors: no tensor named '" + std::string(name) + "'");
  // Parse() proved data_start_ + data_end <= bytes_.size() and the span matches the shape.
  const uint8_t* src = bytes_.data() + data_start_ + t->data_begin;
  const size_t n = static_cast<size_t>(t->num_elements());
  std::vector<float> out(n);
  if (t->dtype == "F32") {
    for (size_t i = 0; i < n; ++i) {
      uint32_t u = static_cast<uint32_t>(src[4 * i]) | static_cast<uint32_t>(src[4 * i + 1]) << 8 |
                   static_cast<uint32_t>(src[4 * i + 2]) << 16 |
                   static_cast<uint32_t>(src[4 * i + 3]) << 24;
      out[i] = internal::FloatFromBits(u);
    }
  } else if (t->dtype == "BF16" || t->dtype == "F16") {
    const bool bf16 = t->dtype == "BF16";
    for (size_t i = 0; i < n; ++i) {
      uint16_t h = static_cast<uint16_t>(src[2 * i] | (src[2 * i + 1] << 8));
      out[i] = bf16 ? internal::Bf16ToFloat(h) : internal::HalfToFloat(h);
    }
  } else {
    return Status::Unimplemented("safetensors: tensor '" + t->name + "' has dtype " + t->dtype +
                                 "; only F32, F16 and BF16 can be read as fp32");
  }
  return out;
}

}  // namespace pdlib::kernels
