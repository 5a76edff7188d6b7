#include "backends/common/backend_options.h"

#include <cctype>
#include <charconv>

namespace pdlib {
inline namespace v1 {
namespace toolkit {
namespace {

// The shift of a binary unit letter (k, m, g, either case), -1 for any other character.
int UnitShift(char c) {
  switch (std::tolower(static_cast<unsigned char>(c))) {
    case 'k': return 10;
    case 'm': return 20;
    case 'g': return 30;
    default: return -1;
  }
}

}  // namespace

StatusOr<uint64_t> ParseByteSize(const std::string& text) {
  uint64_t value = 0;
  const char* begin = text.data();
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(begin, end, value);
  if (ec != std::errc() || p == begin) {
    return Status::InvalidArgument("'" + text + "' is not a byte size (e.g. 65536, 64k, 4M)");
  }
  int shift = 0;
  if (p != end) {
    shift = UnitShift(*p);
    if (shift < 0) return Status::InvalidArgument("'" + text + "' has an unknown unit (k, m or g)");
    ++p;
    if (p != end && std::tolower(static_cast<unsigned char>(*p)) == 'b') ++p;
    if (p != end) return Status::InvalidArgument("'" + text + "' is not a byte size");
  }
  if (shift > 0 && value > (~uint64_t{0} >> shift)) {
    return Status::InvalidArgument("'" + text + "' does not fit in 64 bits");
  }
  return value << shift;
}

StatusOr<uint64_t> ParseNumber(std::string_view backend, const std::string& key,
                               const std::string& text, uint64_t min, uint64_t max, Units units) {
  uint64_t value = 0;
  const char* begin = text.data();
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(begin, end, value);
  int shift = 0;
  if (ec == std::errc() && p != begin && p != end && units == Units::kBinary) {
    shift = UnitShift(*p);
    ++p;
  }
  if (ec != std::errc() || p == begin || p != end || shift < 0 ||
      (shift > 0 && value > (max >> shift)) || (value << shift) < min || (value << shift) > max) {
    return Status::InvalidArgument(std::string(backend) + ": option " + key + "='" + text +
                                   "' is not a number in [" + std::to_string(min) + ", " +
                                   std::to_string(max) + "]");
  }
  return value << shift;
}

OptionParser::OptionParser(std::string backend)
    : backend_(std::move(backend)), prefix_(backend_ + ".") {}

void OptionParser::On(std::string key, Handler handler) {
  std::string shown = key;
  entries_.push_back(Entry{std::move(key), std::move(shown), false, std::move(handler)});
}

void OptionParser::OnPrefix(std::string key_prefix, std::string shown, Handler handler) {
  entries_.push_back(Entry{std::move(key_prefix), std::move(shown), true, std::move(handler)});
}

void OptionParser::Bytes(std::string key, uint64_t* out) {
  On(std::move(key), [this, out](const std::string& k, const std::string& v) {
    auto bytes = ParseByteSize(v);
    if (!bytes.ok()) return bytes.status().WithPrefix(backend_ + ": option " + k);
    if (*bytes == 0) return Status::InvalidArgument(backend_ + ": option " + k + " must not be 0");
    *out = *bytes;
    return Status::OK();
  });
}

Status OptionParser::BadChoice(const std::string& key, const std::string& value,
                               const std::vector<std::string>& names) const {
  std::string allowed;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) allowed += i + 1 == names.size() ? " or " : ", ";
    allowed += "'" + names[i] + "'";
  }
  return Status::InvalidArgument(backend_ + ": option " + key + "='" + value + "' must be " +
                                 allowed);
}

std::string OptionParser::KnownKeys() const {
  std::string known;
  for (const Entry& e : entries_) known += (known.empty() ? "" : ", ") + e.shown;
  return known;
}

Status OptionParser::Parse(const std::map<std::string, std::string>& options) const {
  for (const auto& [key, value] : options) {
    if (key.compare(0, prefix_.size(), prefix_) != 0) continue;  // another backend's
    const Entry* match = nullptr;
    for (const Entry& e : entries_) {
      if (e.prefix ? key.compare(0, e.key.size(), e.key) == 0 : key == e.key) {
        match = &e;
        break;
      }
    }
    if (match == nullptr) {
      return Status::InvalidArgument(backend_ + ": unknown backend option '" + key +
                                     "' (known: " + KnownKeys() + ")");
    }
    if (Status s = match->handler(key, value); !s.ok()) return s;
  }
  return Status::OK();
}

}  // namespace toolkit
}  // namespace v1
}  // namespace pdlib
