#include "pdlib_kernels/safetensors.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

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

// What the header says about one top-level key: the tensor as far as it could be read, and
// the facts the checks below need (which are made once the whole header has parsed, in name
// order, so that the first error reported is the one a document walk would find).
struct HeaderEntry {
  enum class Field : uint8_t { kMissing, kWrongType, kPresent };
  enum class ShapeError : uint8_t { kNone, kNotNonNegative, kOverflow };

  SafetensorsTensor tensor;  // tensor.name: the key
  size_t key_offset = 0;     // the bytes read when the key ended (for a duplicate's error)
  bool is_metadata = false;  // the key is "__metadata__"
  bool is_object = true;
  Field dtype = Field::kMissing;
  Field shape = Field::kMissing;
  Field offsets = Field::kMissing;
  ShapeError shape_error = ShapeError::kNone;
  bool bad_offset = false;  // an element of data_offsets is not a non-negative integer
  size_t num_offsets = 0;
  uint64_t numel = 1;
};

// The SAX handler for a safetensors header: fills HeaderEntry records directly rather than a
// document, with ParseStrict's limits (depth, duplicate keys at every level).
class HeaderReader final : public pdlib::json::SaxHandler {
 public:
  explicit HeaderReader(size_t header_bytes, std::map<std::string, std::string>* metadata)
      : metadata_(metadata) {
    // The shortest tensor entry takes ~50 bytes; the cap bounds what padding can make us reserve.
    entries_.reserve(std::min<size_t>(header_bytes / 64 + 1, 4096));
    open_.reserve(8);
  }

  bool null() override { return Other(); }
  bool boolean(bool /*v*/) override { return Other(); }
  bool number_integer(json::number_integer_t /*v*/) override { return Other(); }
  bool number_float(json::number_float_t /*v*/, const json::string_t& /*literal*/) override {
    return Other();
  }
  bool number_unsigned(json::number_unsigned_t v) override {
    const Slot slot = Next();
    if (slot == Slot::kShapeDim) {
      HeaderEntry& e = entries_.back();
      if (e.shape_error != HeaderEntry::ShapeError::kNone) return true;
      if (v > static_cast<uint64_t>(INT64_MAX)) {
        e.shape_error = HeaderEntry::ShapeError::kNotNonNegative;
      } else if (!MulU64(e.numel, v, &e.numel)) {
        e.shape_error = HeaderEntry::ShapeError::kOverflow;
      } else {
        dims_.push_back(static_cast<int64_t>(v));
      }
      return true;
    }
    if (slot == Slot::kOffset) {
      HeaderEntry& e = entries_.back();
      if (e.num_offsets == 0) e.tensor.data_begin = v;
      if (e.num_offsets == 1) e.tensor.data_end = v;
      ++e.num_offsets;
      return true;
    }
    return Other();
  }
  bool string(json::string_t& s) override {
    const Slot slot = Next();
    if (slot == Slot::kDtype) {
      entries_.back().dtype = HeaderEntry::Field::kPresent;
      entries_.back().tensor.dtype = s;
      return true;
    }
    if (slot == Slot::kMetadataValue) {
      meta_value_->second = s;
      return true;
    }
    return Other();
  }
  bool start_object(std::size_t /*size*/) override {
    switch (Next()) {
      case Slot::kTop: return Open(Frame::kRoot);
      case Slot::kTensor: return Open(Frame::kEntry);
      case Slot::kMetadata: return Open(Frame::kMetadata);
      default: Other(); return Open(Frame::kSkipObject);
    }
  }
  bool start_array(std::size_t /*size*/) override {
    switch (Next()) {
      case Slot::kShape:
        entries_.back().shape = HeaderEntry::Field::kPresent;
        dims_.clear();
        return Open(Frame::kShape);
      case Slot::kOffsets:
        entries_.back().offsets = HeaderEntry::Field::kPresent;
        return Open(Frame::kOffsets);
      default: Other(); return Open(Frame::kSkipArray);
    }
  }
  bool end_object() override { return Close(); }
  bool end_array() override { return Close(); }

  bool key(json::string_t& k) override {
    const std::string_view name = k;  // compared by length first, then inline
    Container& top = open_.back();
    switch (top.frame) {
      case Frame::kRoot: {  // duplicates are found once the parse ends (Finish)
        HeaderEntry& e = entries_.emplace_back();
        e.tensor.name = k;  // a copy: the lexer keeps its buffer for the next token
        e.key_offset = offset();
        e.is_metadata = name == "__metadata__";
        slot_ = e.is_metadata ? Slot::kMetadata : Slot::kTensor;
        return true;
      }
      case Frame::kEntry: {
        unsigned bit = 0;
        if (name == "dtype") {
          bit = 1;
          slot_ = Slot::kDtype;
        } else if (name == "shape") {
          bit = 2;
          slot_ = Slot::kShape;
        } else if (name == "data_offsets") {
          bit = 4;
          slot_ = Slot::kOffsets;
        } else {
          slot_ = Slot::kIgnored;
          return top.keys.insert(k).second || Duplicate(k);
        }
        if ((top.known_keys & bit) != 0) return Duplicate(k);
        top.known_keys |= bit;
        return true;
      }
      case Frame::kMetadata: {
        auto [it, inserted] = metadata_->try_emplace(k);
        meta_value_ = it;
        return inserted || Duplicate(k);
      }
      default: return top.keys.insert(k).second || Duplicate(k);
    }
  }

  // The checks a document walk made, on what the parse found; OK or the first error.
  // The outcome of the parse that fed this reader (`parsed`, SaxParse's Status) with the checks
  // a document walk made: OK, with the tensors appended to `tensors` in name order, or the first
  // error. A repeated tensor name comes first, as a document parse would have failed there (the
  // reader defers the check to sort the names once; every key was read before any error).
  Status Finish(const Status& parsed, uint64_t data_bytes,
                std::vector<SafetensorsTensor>* tensors) {
    // Tensors come in name order (a JSON object's members have none of their own).
    std::vector<HeaderEntry*> order;
    order.reserve(entries_.size());
    for (HeaderEntry& e : entries_) order.push_back(&e);
    std::sort(order.begin(), order.end(), [](const HeaderEntry* a, const HeaderEntry* b) {
      const int c = a->tensor.name.compare(b->tensor.name);
      return c != 0 ? c < 0 : a->key_offset < b->key_offset;
    });
    // The second of each run of equal names is a duplicate; the first in the text is reported.
    const HeaderEntry* duplicate = nullptr;
    for (size_t i = 1; i < order.size(); ++i) {
      if (order[i]->tensor.name == order[i - 1]->tensor.name &&
          (i < 2 || order[i - 2]->tensor.name != order[i]->tensor.name) &&
          (duplicate == nullptr || order[i]->key_offset < duplicate->key_offset)) {
        duplicate = order[i];
      }
    }
    if (duplicate != nullptr) {
      return Status::InvalidArgument("safetensors header: malformed JSON at byte " +
                                     std::to_string(duplicate->key_offset) + ": duplicate key \"" +
                                     duplicate->tensor.name.substr(0, 64) + "\"");
    }
    if (!parsed.ok()) return parsed.WithPrefix("safetensors header");
    if (!top_is_object_) return BadHeader("top level is not an object");

    tensors->reserve(order.size());
    for (HeaderEntry* e : order) {
      if (e->is_metadata) {
        if (!e->is_object) return BadHeader("__metadata__ is not an object");
        if (!bad_metadata_key_.empty()) {
          return BadHeader("__metadata__ value of '" + bad_metadata_key_ + "' is not a string");
        }
        continue;
      }
      Status s = Check(*e, data_bytes);
      if (!s.ok()) return s;
      tensors->push_back(std::move(e->tensor));
    }
    return Status::OK();
  }

 private:
  // What the next value is.
  enum class Slot : uint8_t {
    kTop,
    kTensor,
    kMetadata,
    kDtype,
    kShape,
    kOffsets,
    kShapeDim,
    kOffset,
    kMetadataValue,
    kIgnored
  };
  // What an open container is.
  enum class Frame : uint8_t {
    kRoot,
    kEntry,
    kMetadata,
    kShape,
    kOffsets,
    kSkipObject,
    kSkipArray
  };
  struct Container {
    Frame frame = Frame::kSkipArray;
    unsigned known_keys = 0;     // kEntry: the dtype, shape, data_offsets keys seen (bits)
    std::set<std::string> keys;  // objects: the other keys seen (for duplicates)
  };

  Slot Next() const {
    if (open_.empty()) return Slot::kTop;
    switch (open_.back().frame) {
      case Frame::kRoot:
      case Frame::kEntry: return slot_;
      case Frame::kMetadata: return Slot::kMetadataValue;
      case Frame::kShape: return Slot::kShapeDim;
      case Frame::kOffsets: return Slot::kOffset;
      default: return Slot::kIgnored;
    }
  }

  // A value (or a container) of a type the header does not expect where it stands.
  bool Other() {
    switch (Next()) {
      case Slot::kTop: top_is_object_ = false; break;
      case Slot::kTensor:
      case Slot::kMetadata: entries_.back().is_object = false; break;
      case Slot::kDtype: entries_.back().dtype = HeaderEntry::Field::kWrongType; break;
      case Slot::kShape: entries_.back().shape = HeaderEntry::Field::kWrongType; break;
      case Slot::kOffsets: entries_.back().offsets = HeaderEntry::Field::kWrongType; break;
      case Slot::kShapeDim:
        if (entries_.back().shape_error == HeaderEntry::ShapeError::kNone) {
          entries_.back().shape_error = HeaderEntry::ShapeError::kNotNonNegative;
        }
        break;
      case Slot::kOffset:
        entries_.back().bad_offset = true;
        ++entries_.back().num_offsets;
        break;
      case Slot::kMetadataValue:
        // Walked in key order, the smallest such key is the one reported.
        if (bad_metadata_key_.empty() || meta_value_->first < bad_metadata_key_) {
          bad_metadata_key_ = meta_value_->first;
        }
        break;
      case Slot::kIgnored: break;
    }
    return true;
  }

  bool Open(Frame frame) {
    if (open_.size() >= kMaxDepth) {
      return Fail("nesting deeper than " + std::to_string(kMaxDepth) + " levels");
    }
    open_.emplace_back().frame = frame;
    return true;
  }

  bool Close() {
    // One allocation of the exact size per shape.
    if (open_.back().frame == Frame::kShape) entries_.back().tensor.shape = dims_;
    open_.pop_back();
    return true;
  }

  bool Duplicate(const std::string& k) { return Fail("duplicate key \"" + k.substr(0, 64) + "\""); }

  static Status Check(const HeaderEntry& e, uint64_t data_bytes) {
    const std::string& name = e.tensor.name;
    if (!e.is_object) return BadHeader("entry '" + name + "' is not an object");
    if (e.dtype != HeaderEntry::Field::kPresent) {
      return BadHeader("tensor '" + name + "' has no string 'dtype'");
    }
    const size_t elem_bytes = SafetensorsDtypeBytes(e.tensor.dtype);
    if (elem_bytes == 0) {
      return BadHeader("tensor '" + name + "' has unknown dtype '" + e.tensor.dtype + "'");
    }
    if (e.shape != HeaderEntry::Field::kPresent) {
      return BadHeader("tensor '" + name + "' has no 'shape' array");
    }
    if (e.offsets != HeaderEntry::Field::kPresent || e.num_offsets != 2) {
      return BadHeader("tensor '" + name + "' needs 'data_offsets' = [begin, end]");
    }
    if (e.shape_error == HeaderEntry::ShapeError::kNotNonNegative) {
      return BadHeader("tensor '" + name +
                       "' has a shape entry that is not a non-negative integer");
    }
    if (e.shape_error == HeaderEntry::ShapeError::kOverflow) {
      return BadHeader("tensor '" + name + "' has a shape whose element count overflows");
    }
    if (e.bad_offset) {
      return BadHeader("tensor '" + name +
                       "' has a data offset that is not a non-negative integer");
    }
    const uint64_t begin = e.tensor.data_begin, end = e.tensor.data_end;
    if (begin > end) {
      return BadHeader("tensor '" + name + "' has data_offsets begin " + std::to_string(begin) +
                       " > end " + std::to_string(end));
    }
    if (end > data_bytes) {
      return Status::DataLoss("safetensors: tensor '" + name + "' ends at byte " +
                              std::to_string(end) + " but the data section has only " +
                              std::to_string(data_bytes) + " bytes (truncated file?)");
    }
    uint64_t expected = 0;
    if (!MulU64(e.numel, elem_bytes, &expected) || expected != end - begin) {
      return BadHeader("tensor '" + name + "' spans " + std::to_string(end - begin) +
                       " bytes but its shape and " + e.tensor.dtype + " dtype need " +
                       std::to_string(e.numel) + " x " + std::to_string(elem_bytes));
    }
    return Status::OK();
  }

  static constexpr size_t kMaxDepth = 32;  // as ParseStrict's default

  std::map<std::string, std::string>* const metadata_;
  std::map<std::string, std::string>::iterator meta_value_;  // the last metadata key's value
  std::string bad_metadata_key_;  // the smallest metadata key whose value is not a string
  bool top_is_object_ = true;
  std::vector<HeaderEntry> entries_;  // one per top-level key, in document order
  std::vector<int64_t> dims_;         // the open shape's dimensions
  std::vector<Container> open_;       // the containers open, innermost last
  Slot slot_ = Slot::kTop;            // in an object: what the value of the last key is
};

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
  SafetensorsFile file;
  HeaderReader reader(header.size(), &file.metadata_);
  file.data_start_ = 8 + header_len;
  Status checked = reader.Finish(pdlib::json::SaxParse(header, &reader),
                                 bytes.size() - file.data_start_, &file.tensors_);
  if (!checked.ok()) return checked;

  // Byte ranges must not overlap. (Names are unique: Finish() found no duplicate.)
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
