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
class StrictBuilder final : public SaxHandler {
 public:
  explicit StrictBuilder(int max_depth) : max_depth_(max_depth) {}

  bool null() override { return Place(nullptr) != nullptr; }
  bool boolean(bool v) override { return Place(v) != nullptr; }
  bool number_integer(json::number_integer_t v) override { return Place(v) != nullptr; }
  bool number_unsigned(json::number_unsigned_t v) override { return Place(v) != nullptr; }
  bool number_float(json::number_float_t v, const json::string_t& /*literal*/) override {
    return Place(v) != nullptr;
  }
  bool string(json::string_t& s) override { return Place(std::move(s)) != nullptr; }
  bool start_object(std::size_t /*size*/) override { return Open(json::value_t::object); }
  bool end_object() override { return Close(); }
  bool start_array(std::size_t /*size*/) override { return Open(json::value_t::array); }
  bool end_array() override { return Close(); }
  bool key(json::string_t& k) override {
    json& object = *open_.back();
    if (object.contains(k)) return Fail("duplicate key \"" + k.substr(0, 64) + "\"");
    slot_ = &object[std::move(k)];
    return true;
  }

  json TakeRoot() { return std::move(root_); }

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

  const int max_depth_;
  json root_;
  std::vector<json*> open_;  // the containers being filled, innermost last
  json* slot_ = nullptr;     // the value slot of the last key
};

}  // namespace

bool SaxHandler::binary(json::binary_t& /*b*/) { return Fail("binary value"); }

bool SaxHandler::parse_error(std::size_t position, const std::string& /*last_token*/,
                             const nlohmann::detail::exception& e) {
  error_ = Status::InvalidArgument("malformed JSON at byte " + std::to_string(position) + ": " +
                                   Describe(e.what()));
  return false;
}

bool SaxHandler::Fail(std::string_view what) {
  error_ = Status::InvalidArgument("malformed JSON at byte " + std::to_string(offset()) + ": " +
                                   std::string(what));
  return false;
}

Status SaxParse(std::string_view text, SaxHandler* handler) {
  const char* read_to = text.data();
  handler->begin_ = text.data();
  handler->read_to_ = &read_to;
  const bool ok = json::sax_parse(TrackedIterator(text.data(), &read_to),
                                  TrackedIterator(text.data() + text.size(), &read_to), handler);
  handler->read_to_ = &handler->begin_;  // `read_to` dies here
  if (!ok && handler->error_.ok()) {
    return Status::InvalidArgument("malformed JSON");  // not reached: every failure says why
  }
  return handler->error_;
}

StatusOr<json> ParseStrict(std::string_view text, int max_depth) {
  StrictBuilder builder(max_depth);
  Status s = SaxParse(text, &builder);
  if (!s.ok()) return s;
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
