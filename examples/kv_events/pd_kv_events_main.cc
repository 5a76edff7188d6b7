// pd-kv-events: subscribes to a host's KV-event stream (SPEC R10.2) and prints one line per
// event, e.g. "seq=3 BlockStored room=7 page_size=16 pages=[4,5,6]".
//
//   pd-kv-events --target 127.0.0.1:5557 [--from_seq N] [--count N] [--idle_timeout_ms MS]
//
// Exit status 0 when --count events were printed or the server ended the stream, 1 on error.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "examples/kv_events/kv_event_server.h"
#include "tools/common/flags.h"

ABSL_FLAG(std::string, target, "", "HOST:PORT of the host's KV-event service (required)");
ABSL_FLAG(uint64_t, from_seq, 0, "replay buffered events with seq >= N first (0: all buffered)");
ABSL_FLAG(uint64_t, count, 0, "exit after N events (0: run until the stream ends)");
ABSL_FLAG(uint64_t, idle_timeout_ms, 0, "exit with an error after MS without events (0: never)");

namespace {

constexpr char kUsage[] =
    "usage: pd-kv-events --target HOST:PORT [--from_seq N] [--count N] [--idle_timeout_ms MS]\n"
    "\n"
    "Subscribes to a host's KV-event stream and prints one line per event.\n";

}  // namespace

int main(int argc, char** argv) {
  pdlib_tools::ParseFlagsNoArguments(argc, argv, kUsage);
  pdlib::sched::KVEventSubscribeOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.from_seq = absl::GetFlag(FLAGS_from_seq);
  options.idle_timeout = std::chrono::milliseconds(absl::GetFlag(FLAGS_idle_timeout_ms));
  const uint64_t count = absl::GetFlag(FLAGS_count);
  if (options.target.empty()) {
    std::fprintf(stderr, "pd-kv-events: --target HOST:PORT is required (see --help)\n");
    return 2;
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
