#include "examples/router/tokenizer.h"

namespace pdlib::router {
namespace {

// Bytes a UTF-8 sequence starting with `lead` has in all, or 0 for a byte that cannot start one.
size_t Utf8Length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xc2 && lead <= 0xdf) return 2;
  if (lead >= 0xe0 && lead <= 0xef) return 3;
  if (lead >= 0xf0 && lead <= 0xf4) return 4;
  return 0;
}

}  // namespace

std::vector<int32_t> Tokenize(std::string_view text) {
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  for (char c : text) ids.push_back(static_cast<unsigned char>(c));
  return ids;
}

std::string Detokenize(std::span<const int32_t> ids) {
  std::string out;
  out.reserve(ids.size());
  for (int32_t id : ids) {
    if (id >= 0 && id < 256) {
      out.push_back(static_cast<char>(id));
    } else {
      out += "<" + std::to_string(id) + ">";
    }
  }
  return out;
}

std::string StreamDetokenizer::Feed(int32_t id) {
  const int32_t ids[1] = {id};
  pending_ += Detokenize(ids);
  // Find the start of the last (possibly incomplete) multi-byte sequence within the last 3 bytes.
  size_t start = pending_.size();
  for (size_t back = 1; back <= 3 && back <= pending_.size(); ++back) {
    const auto c = static_cast<unsigned char>(pending_[pending_.size() - back]);
    if ((c & 0xc0) != 0x80) {  // not a continuation byte
      const size_t need = Utf8Length(c);
      if (need > back) start = pending_.size() - back;  // still waiting for its other bytes
      break;
    }
  }
  std::string out = pending_.substr(0, start);
  pending_.erase(0, start);
  return out;
}

std::string StreamDetokenizer::Finish() {
  std::string out;
  out.swap(pending_);
  return out;
}

}  // namespace pdlib::router
