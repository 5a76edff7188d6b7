#include "json.h"

#include <iterator>
#include <string>
#include <utility>
#include <vector>

namespace pdlib::json {
namespace {

using nlohmann::json;

// A char iterator that records how far the parser has read, so that the errors the builder
// finds itself (a duplicate key, too deep nesting) name a byte offset as the library's own do.
class TrackedIterator {
 public:
  using iterator_category = std::forward_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;

  TrackedIterator() = default;
  TrackedIterator(const char* p, const char** read_to) : p_(p), read_to_(read_to) {}
  reference operator*() const { return *p_; }
  TrackedIterator& operator++() {
    *read_to_ = ++p_;
    return *this;
  }
  TrackedIterator operator++(int) {
    TrackedIterator old = *this;
    ++*this;
    return old;
  }
  bool operator==(const TrackedIterator& o) const { return p_ == o.p_; }

 private:
  const char* p_ = nullptr;
  const char** read_to_ = nullptr;
};

// nlohmann's messages start "[json.exception.parse_error.101] parse error at line 1, column 5: "
// ahead of what went wrong; the byte offset replaces both.
std::string Describe(std::string_view what) {
  if (size_t p = what.find("] "); p != std::string_view::npos) what.remove_prefix(p + 2);
  if (what.rfind("parse error", 0) == 0) {
    if (size_t p = what.find(": "); p != std::string_view::npos) what.remove_prefix(p + 2);
  }
  return std::string(what);
}

// A SAX handler that builds the document (as nlohmann's own DOM parser does) and enforces the
// limits above.
class StrictBuilder {
 public:
  StrictBuilder(int max_depth, const char* begin, const char* const* read_to)
      : max_depth_(max_depth), begin_(begin), read_to_(read_to) {}

  bool null() { return Place(nullptr) != nullptr; }
  bool boolean(bool v) { return Place(v) != nullptr; }
  bool number_integer(json::number_integer_t v) { return Place(v) != nullptr; }
  bool number_unsigned(json::number_unsigned_t v) { return Place(v) != nullptr; }
  bool number_float(json::number_float_t v, const json::string_t& /*literal*/) {
    return Place(v) != nullptr;
  }
  bool string(json::string_t& s) { return Place(std::move(s)) != nullptr; }
  bool binary(json::binary_t& /*b*/) { return Fail("binary value"); }  // never in JSON text
  bool start_object(std::size_t /*size*/) { return Open(json::value_t::object); }
  bool end_object() { return Close(); }
  bool start_array(std::size_t /*size*/) { return Open(json::value_t::array); }
  bool end_array() { return Close(); }
  bool key(json::string_t& k) {
    json& object = *open_.back();
    if (object.contains(k)) return Fail("duplicate key \"" + k.substr(0, 64) + "\"");
    slot_ = &object[std::move(k)];
    return true;
  }
  bool parse_error(std::size_t position, const std::string& /*last_token*/,
                   const nlohmann::detail::exception& e) {
    error_ = Status::InvalidArgument("malformed JSON at byte " + std::to_string(position) + ": " +
                                     Describe(e.what()));
    return false;
  }

  json TakeRoot() { return std::move(root_); }
  const Status& error() const { return error_; }

 private:
  // Puts `v` where the document expects the next value; returns where it now lives.
  json* Place(json v) {
    if (open_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    json& parent = *open_.back();
    if (parent.is_array()) {
      auto& items = parent.get_ref<json::array_t&>();
      items.push_back(std::move(v));
      return &items.back();
    }
    *slot_ = std::move(v);
    return slot_;
  }

  bool Open(json::value_t type) {
    if (static_cast<int>(open_.size()) >= max_depth_) {
      return Fail("nesting deeper than " + std::to_string(max_depth_) + " levels");
    }
    // The parent's later elements are placed only after this container closes, so the pointer
    // stays valid while it is open.
    open_.push_back(Place(json(type)));
    return true;
  }

  bool Close() {
    open_.pop_back();
    return true;
  }

  bool Fail(const std::string& what) {
    error_ = Status::InvalidArgument("malformed JSON at byte " +
                                     std::to_string(*read_to_ - begin_) + ": " + what);
    return false;
  }

  const int max_depth_;
  const char* const begin_;
  const char* const* const read_to_;
  json root_;
  std::vector<json*> open_;  // the containers being filled, innermost last
  json* slot_ = nullptr;     // the value slot of the last key
  Status error_;
};

}  // namespace

StatusOr<json> ParseStrict(std::string_view text, int max_depth) {
  const char* read_to = text.data();
  StrictBuilder builder(max_depth, text.data(), &read_to);
  const bool ok = json::sax_parse(TrackedIterator(text.data(), &read_to),
                                  TrackedIterator(text.data() + text.size(), &read_to), &builder);
  if (!ok) {
    if (!builder.error().ok()) return builder.error();
    return Status::InvalidArgument("malformed JSON");  // not reached: every failure says why
  }
  return builder.TakeRoot();
}

std::optional<int64_t> AsInt64(const json& value) {
  if (value.is_number_unsigned()) {
    const uint64_t u = value.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX)) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (value.is_number_integer()) return value.get<int64_t>();
  return std::nullopt;
}

}  // namespace pdlib::json
