// pd-kv-events: subscribes to a host's KV-event stream (SPEC R10.2) and prints one line per
// event, e.g. "seq=3 BlockStored room=7 page_size=16 pages=[4,5,6]".
//
//   pd-kv-events --target 127.0.0.1:5557 [--from-seq N] [--count N] [--idle-timeout-ms MS]
//
// Exit status 0 when --count events were printed or the server ended the stream, 1 on error.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "examples/kv_events/kv_event_server.h"

namespace {

int Usage(const char* why) {
  if (why != nullptr) std::fprintf(stderr, "pd-kv-events: %s\n", why);
  std::fprintf(stderr,
               "usage: pd-kv-events --target HOST:PORT [--from-seq N] [--count N] "
               "[--idle-timeout-ms MS]\n"
               "  --from-seq N         replay buffered events with seq >= N first (default 0: "
               "all buffered)\n"
               "  --count N            exit after N events (default 0: run until the stream "
               "ends)\n"
               "  --idle-timeout-ms MS exit with an error after MS without events (default 0: "
               "never)\n");
  return why == nullptr ? 0 : 2;
}

bool ParseU64(const char* s, uint64_t* out) {
  char* end = nullptr;
  unsigned long long v = std::strtoull(s, &end, 10);
  if (end == s || *end != '\0' || s[0] == '-') return false;
  *out = v;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  pdlib::sched::KVEventSubscribeOptions options;
  uint64_t count = 0;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") return Usage(nullptr);
    if (i + 1 >= argc) return Usage(("missing value after " + std::string(arg)).c_str());
    const char* value = argv[++i];
    uint64_t n = 0;
    if (arg == "--target") {
      options.target = value;
    } else if (arg == "--from-seq" && ParseU64(value, &n)) {
      options.from_seq = n;
    } else if (arg == "--count" && ParseU64(value, &n)) {
      count = n;
    } else if (arg == "--idle-timeout-ms" && ParseU64(value, &n)) {
      options.idle_timeout = std::chrono::milliseconds(n);
    } else {
      return Usage(("bad option or value: " + std::string(arg) + " " + value).c_str());
    }
  }
  uint64_t printed = 0;
  pdlib::Status s = pdlib::sched::SubscribeKVEvents(
      options,
      [&](const pdlib::sched::KVEvent& e) {
        std::printf("%s\n", pdlib::sched::FormatKVEvent(e).c_str());
        std::fflush(stdout);
        return count == 0 || ++printed < count;
      },
      [](uint64_t missed) {
        if (missed > 0)
          std::printf("(missed %llu events no longer in the replay buffer)\n",
                      static_cast<unsigned long long>(missed));
      });
  if (!s.ok()) {
    std::fprintf(stderr, "pd-kv-events: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
