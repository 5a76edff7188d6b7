// Parsing a backend's `backend_options` (TransportOptions::options): the keys that start with
// the backend's prefix ("ucx.", "verbs.") are the backend's; the others belong to other backends
// and are ignored, so one options map serves whichever backend the engine picks. An unknown key
// with the backend's prefix is an error that names it and lists the known ones, so that a typo
// never passes silently. Numbers may carry a binary unit (k, m, g) where the key allows it.
//
// A backend declares its keys once, each with where the value goes and its bounds; the table is
// also the "known:" list of the error. Pure: no I/O, unit-tested without a device.
//
//   OptionParser parser("verbs");
//   parser.Number("verbs.sq_depth", &out.sq_depth, 2, 1u << 20, Units::kBinary);
//   parser.Choice("verbs.mode", &out.mode, {{"a", Mode::kA}, {"b", Mode::kB}});
//   if (Status s = parser.Parse(options.options); !s.ok()) return s;
#ifndef PDLIB_BACKENDS_COMMON_BACKEND_OPTIONS_H_
#define PDLIB_BACKENDS_COMMON_BACKEND_OPTIONS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "pdlib/status.h"

namespace pdlib {
inline namespace v1 {
namespace toolkit {

// "4M", "64k", "1g", "1gb", "12345" -> bytes (binary units, as UCX spells them). The message
// names the text, not the key (callers prefix it).
StatusOr<uint64_t> ParseByteSize(const std::string& text);

enum class Units { kNone, kBinary };  // whether "64k" is accepted for a number

// A number in [min, max]; with Units::kBinary a k, m or g suffix multiplies by 2^10, 2^20, 2^30.
// The error is "<backend>: option <key>='<text>' is not a number in [<min>, <max>]".
StatusOr<uint64_t> ParseNumber(std::string_view backend, const std::string& key,
                               const std::string& text, uint64_t min, uint64_t max,
                               Units units = Units::kNone);

// One backend's option table. Not thread-safe; build, Parse, discard.
class OptionParser {
 public:
  // Called with the key and the value; returns non-OK to reject the value.
  using Handler = std::function<Status(const std::string& key, const std::string& value)>;

  // `backend` without the dot: "ucx" (keys then start with "ucx.").
  explicit OptionParser(std::string backend);

  // An exact key (with the prefix: "ucx.tls").
  void On(std::string key, Handler handler);
  // Every key starting with `key_prefix` ("ucx.config."); `shown` is how the known-keys list
  // names it ("ucx.config.<NAME>").
  void OnPrefix(std::string key_prefix, std::string shown, Handler handler);

  // A number in [min, max] into *out (any unsigned or signed integer type that holds max).
  template <typename T>
  void Number(std::string key, T* out, uint64_t min, uint64_t max, Units units = Units::kNone) {
    On(std::move(key), [this, out, min, max, units](const std::string& k, const std::string& v) {
      auto n = ParseNumber(backend_, k, v, min, max, units);
      if (!n.ok()) return n.status();
      *out = static_cast<T>(*n);
      return Status::OK();
    });
  }
  // A byte size (ParseByteSize) into *out; 0 is refused ("must not be 0").
  void Bytes(std::string key, uint64_t* out);
  // One of the named values; anything else is "... must be 'a', 'b' or 'c'".
  template <typename T>
  void Choice(std::string key, T* out, std::vector<std::pair<std::string, T>> choices) {
    std::vector<std::string> names;
    for (const auto& c : choices) names.push_back(c.first);
    On(std::move(key), [this, out, choices = std::move(choices), names = std::move(names)](
                           const std::string& k, const std::string& v) {
      for (const auto& [name, value] : choices) {
        if (name == v) {
          *out = value;
          return Status::OK();
        }
      }
      return BadChoice(k, v, names);
    });
  }

  // Applies every key with this backend's prefix, in the map's order; stops at the first error.
  Status Parse(const std::map<std::string, std::string>& options) const;

  // "ucx.tls, ucx.net_devices, ucx.config.<NAME>, ..." in declaration order.
  std::string KnownKeys() const;

 private:
  struct Entry {
    std::string key;  // exact key, or the prefix when `prefix`
    std::string shown;
    bool prefix = false;
    Handler handler;
  };
  Status BadChoice(const std::string& key, const std::string& value,
                   const std::vector<std::string>& names) const;

  const std::string backend_;
  const std::string prefix_;  // backend_ + "."
  std::vector<Entry> entries_;
};

}  // namespace toolkit
}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_BACKENDS_COMMON_BACKEND_OPTIONS_H_
