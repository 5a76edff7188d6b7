#include "examples/router/json.h"

#include <cassert>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <unordered_set>

namespace pdlib::router {
namespace {

class Parser {
 public:
  Parser(std::string_view text, int max_depth) : text_(text), max_depth_(max_depth) {}

  StatusOr<JsonValue> ParseDocument() {
    JsonValue value;
    if (Status s = ParseValue(&value, 0); !s.ok()) return s;
    SkipSpace();
    if (pos_ != text_.size()) return Error("unexpected data after the JSON value");
    return value;
  }

 private:
  Status Error(std::string_view what) const {
    return Status::InvalidArgument("malformed JSON at byte " + std::to_string(pos_) + ": " +
                                   std::string(what));
  }

  void SkipSpace() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' ||
                                   text_[pos_] == '\n' || text_[pos_] == '\r')) {
      ++pos_;
    }
  }

  bool Consume(std::string_view literal) {
    if (text_.substr(pos_, literal.size()) != literal) return false;
    pos_ += literal.size();
    return true;
  }

  Status ParseValue(JsonValue* out, int depth) {
    SkipSpace();
    if (pos_ >= text_.size()) return Error("unexpected end of input");
    const char c = text_[pos_];
    if (c == '{' || c == '[') {
      if (depth >= max_depth_) {
        return Error("nesting deeper than " + std::to_string(max_depth_) + " levels");
      }
      return c == '{' ? ParseObject(out, depth + 1) : ParseArray(out, depth + 1);
    }
    if (c == '"') {
      out->type = JsonValue::Type::kString;
      return ParseString(&out->string);
    }
    if (Consume("true")) {
      out->type = JsonValue::Type::kBool;
      out->boolean = true;
      return Status::OK();
    }
    if (Consume("false")) {
      out->type = JsonValue::Type::kBool;
      return Status::OK();
    }
    if (Consume("null")) return Status::OK();
    if (c == '-' || (c >= '0' && c <= '9')) return ParseNumber(out);
    return Error(std::string("unexpected character '") + c + "'");
  }

  Status ParseObject(JsonValue* out, int depth) {
    out->type = JsonValue::Type::kObject;
    ++pos_;  // '{'
    SkipSpace();
    if (Consume("}")) return Status::OK();
    std::unordered_set<std::string> seen;  // a hash set: a body of many keys stays linear
    while (true) {
      SkipSpace();
      if (pos_ >= text_.size() || text_[pos_] != '"') return Error("expected an object key");
      std::string key;
      if (Status s = ParseString(&key); !s.ok()) return s;
      if (!seen.insert(key).second) return Error("duplicate key \"" + key.substr(0, 64) + "\"");
      SkipSpace();
      if (!Consume(":")) return Error("expected ':' after an object key");
      JsonValue value;
      if (Status s = ParseValue(&value, depth); !s.ok()) return s;
      out->keys.push_back(std::move(key));
      out->items.push_back(std::move(value));
      SkipSpace();
      if (Consume("}")) return Status::OK();
      if (!Consume(",")) return Error("expected ',' or '}' in an object");
    }
  }

  Status ParseArray(JsonValue* out, int depth) {
    out->type = JsonValue::Type::kArray;
    ++pos_;  // '['
    SkipSpace();
    if (Consume("]")) return Status::OK();
    while (true) {
      JsonValue value;
      if (Status s = ParseValue(&value, depth); !s.ok()) return s;
      out->items.push_back(std::move(value));
      SkipSpace();
      if (Consume("]")) return Status::OK();
      if (!Consume(",")) return Error("expected ',' or ']' in an array");
    }
  }

  static void AppendUtf8(std::string* out, uint32_t cp) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xc0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xe0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    } else {
      out->push_back(static_cast<char>(0xf0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    }
  }

  Status ParseHex4(uint32_t* out) {
    if (pos_ + 4 > text_.size()) return Error("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char h = text_[pos_++];
      v <<= 4;
      if (h >= '0' && h <= '9') {
        v |= static_cast<uint32_t>(h - '0');
      } else if (h >= 'a' && h <= 'f') {
        v |= static_cast<uint32_t>(h - 'a' + 10);
      } else if (h >= 'A' && h <= 'F') {
        v |= static_cast<uint32_t>(h - 'A' + 10);
      } else {
        return Error("bad hex digit in a \\u escape");
      }
    }
    *out = v;
    return Status::OK();
  }

  Status ParseString(std::string* out) {
    ++pos_;  // opening quote
    while (true) {
      if (pos_ >= text_.size()) return Error("unterminated string");
      const char c = text_[pos_];
      if (c == '"') {
        ++pos_;
        return Status::OK();
      }
      if (static_cast<unsigned char>(c) < 0x20) return Error("control character in a string");
      if (c != '\\') {
        out->push_back(c);
        ++pos_;
        continue;
      }
      ++pos_;
      if (pos_ >= text_.size()) return Error("unterminated escape");
      const char e = text_[pos_++];
      switch (e) {
        case '"': out->push_back('"'); break;
        case '\\': out->push_back('\\'); break;
        case '/': out->push_back('/'); break;
        case 'b': out->push_back('\b'); break;
        case 'f': out->push_back('\f'); break;
        case 'n': out->push_back('\n'); break;
        case 'r': out->push_back('\r'); break;
        case 't': out->push_back('\t'); break;
        case 'u': {
          uint32_t cp = 0;
          if (Status s = ParseHex4(&cp); !s.ok()) return s;
          if (cp >= 0xd800 && cp <= 0xdbff) {  // high surrogate: a low one must follow
            uint32_t low = 0;
            if (!Consume("\\u")) return Error("unpaired surrogate in a \\u escape");
            if (Status s = ParseHex4(&low); !s.ok()) return s;
            if (low < 0xdc00 || low > 0xdfff) return Error("unpaired surrogate in a \\u escape");
            cp = 0x10000 + ((cp - 0xd800) << 10) + (low - 0xdc00);
          } else if (cp >= 0xdc00 && cp <= 0xdfff) {
            return Error("unpaired surrogate in a \\u escape");
          }
          AppendUtf8(out, cp);
          break;
        }
        default: return Error(std::string("bad escape '\\") + e + "'");
      }
    }
  }

  Status ParseNumber(JsonValue* out) {
    const size_t start = pos_;
    bool integral = true;
    if (text_[pos_] == '-') ++pos_;
    auto digits = [&] {
      const size_t from = pos_;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
      return pos_ - from;
    };
    const size_t int_start = pos_;
    const size_t int_digits = digits();
    if (int_digits == 0) return Error("expected digits in a number");
    if (int_digits > 1 && text_[int_start] == '0') return Error("leading zero in a number");
    if (pos_ < text_.size() && text_[pos_] == '.') {
      integral = false;
      ++pos_;
      if (digits() == 0) return Error("expected digits after '.' in a number");
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      integral = false;
      ++pos_;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
      if (digits() == 0) return Error("expected digits in a number's exponent");
    }
    const std::string literal(text_.substr(start, pos_ - start));
    out->type = JsonValue::Type::kNumber;
    out->number = std::strtod(literal.c_str(), nullptr);
    if (!std::isfinite(out->number)) return Error("number out of range");
    if (integral) {
      int64_t v = 0;
      auto [ptr, ec] = std::from_chars(literal.data(), literal.data() + literal.size(), v);
      if (ec == std::errc() && ptr == literal.data() + literal.size()) {
        out->is_int = true;
        out->int_value = v;
      }
    }
    return Status::OK();
  }

  std::string_view text_;
  size_t pos_ = 0;
  const int max_depth_;
};

// Length of the valid UTF-8 sequence at the start of `s`, or 0 when it is not one (overlong
// forms, surrogates and code points above U+10FFFF are invalid).
size_t ValidUtf8Prefix(std::string_view s) {
  const auto b = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xbf;  // allowed range of the second byte
  if (c >= 0xc2 && c <= 0xdf) {
    n = 2;
  } else if (c >= 0xe0 && c <= 0xef) {
    n = 3;
    if (c == 0xe0) lo = 0xa0;
    if (c == 0xed) hi = 0x9f;
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 4;
    if (c == 0xf0) lo = 0x90;
    if (c == 0xf4) hi = 0x8f;
  } else {
    return 0;
  }
  if (s.size() < n) return 0;
  if (b(1) < lo || b(1) > hi) return 0;
  for (size_t i = 2; i < n; ++i) {
    if ((b(i) & 0xc0) != 0x80) return 0;
  }
  return n;
}

}  // namespace

const JsonValue* JsonValue::Find(std::string_view key) const {
  if (type != Type::kObject) return nullptr;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i] == key) return &items[i];
  }
  return nullptr;
}

std::string_view JsonTypeName(JsonValue::Type type) {
  switch (type) {
    case JsonValue::Type::kNull: return "null";
    case JsonValue::Type::kBool: return "boolean";
    case JsonValue::Type::kNumber: return "number";
    case JsonValue::Type::kString: return "string";
    case JsonValue::Type::kArray: return "array";
    case JsonValue::Type::kObject: return "object";
  }
  return "unknown";
}

StatusOr<JsonValue> ParseJson(std::string_view text, int max_depth) {
  return Parser(text, max_depth).ParseDocument();
}

void AppendJsonString(std::string* out, std::string_view bytes) {
  static constexpr char kHex[] = "0123456789abcdef";
  out->push_back('"');
  size_t i = 0;
  while (i < bytes.size()) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    if (c >= 0x80) {
      const size_t n = ValidUtf8Prefix(bytes.substr(i));
      if (n == 0) {
        *out += "\xef\xbf\xbd";  // U+FFFD REPLACEMENT CHARACTER for one invalid byte
        ++i;
      } else {
        out->append(bytes.substr(i, n));
        i += n;
      }
      continue;
    }
    switch (c) {
      case '"': *out += "\\\""; break;
      case '\\': *out += "\\\\"; break;
      case '\n': *out += "\\n"; break;
      case '\r': *out += "\\r"; break;
      case '\t': *out += "\\t"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          *out += "\\u00";
          out->push_back(kHex[c >> 4]);
          out->push_back(kHex[c & 0xf]);
        } else {
          out->push_back(static_cast<char>(c));
        }
    }
    ++i;
  }
  out->push_back('"');
}

void JsonWriter::BeforeValue() {
  if (after_key_) {
    after_key_ = false;
    return;
  }
  if (!has_element_.empty()) {
    if (has_element_.back()) out_.push_back(',');
    has_element_.back() = true;
  }
}

JsonWriter& JsonWriter::BeginObject() {
  BeforeValue();
  out_.push_back('{');
  has_element_.push_back(false);
  return *this;
}

JsonWriter& JsonWriter::EndObject() {
  assert(!has_element_.empty() && !after_key_);
  has_element_.pop_back();
  out_.push_back('}');
  return *this;
}

JsonWriter& JsonWriter::BeginArray() {
  BeforeValue();
  out_.push_back('[');
  has_element_.push_back(false);
  return *this;
}

JsonWriter& JsonWriter::EndArray() {
  assert(!has_element_.empty() && !after_key_);
  has_element_.pop_back();
  out_.push_back(']');
  return *this;
}

JsonWriter& JsonWriter::Key(std::string_view key) {
  BeforeValue();
  AppendJsonString(&out_, key);
  out_.push_back(':');
  after_key_ = true;
  return *this;
}

JsonWriter& JsonWriter::String(std::string_view bytes) {
  BeforeValue();
  AppendJsonString(&out_, bytes);
  return *this;
}

JsonWriter& JsonWriter::Int(int64_t v) {
  BeforeValue();
  out_ += std::to_string(v);
  return *this;
}

JsonWriter& JsonWriter::Uint(uint64_t v) {
  BeforeValue();
  out_ += std::to_string(v);
  return *this;
}

JsonWriter& JsonWriter::Bool(bool v) {
  BeforeValue();
  out_ += v ? "true" : "false";
  return *this;
}

JsonWriter& JsonWriter::Null() {
  BeforeValue();
  out_ += "null";
  return *this;
}

}  // namespace pdlib::router
