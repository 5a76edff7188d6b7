// verbs_target_peer: the target (memory owner) half of a verbs connection in a process of its
// own, driven over stdin/stdout by verbs_device_test, which kills it mid-transfer.
//
//   verbs_target_peer BYTES [KEY=VALUE ...]     (backend options, e.g. verbs.timeout=12)
//
// Lines it prints (flushed after each):
//   READY endpoint=<hex> key=<hex> addr=<address> len=<BYTES>   registered and listening
//   CONNECTED                                                   after REPLY
//   OK | BAD <what>                                             after CHECK
//   ERROR <message>
// Commands: REPLY <hex reply blob>; CHECK <seed> (every byte of the buffer holds
// verbs_test::PatternByte(seed, offset)). End of stdin exits. The process dies with its parent.
#include <signal.h>
#include <sys/prctl.h>

#include <cstdio>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "pdlib/backends.h"
#include "pdlib/spi/transport.h"
#include "test/verbs/verbs_test_util.h"

int main(int argc, char** argv) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (argc < 2) {
    std::fprintf(stderr, "usage: verbs_target_peer BYTES [KEY=VALUE ...]\n");
    return 2;
  }
  const size_t bytes = std::stoull(argv[1]);
  pdlib::spi::TransportOptions options;
  for (int i = 2; i < argc; ++i) {
    std::string kv = argv[i];
    const size_t eq = kv.find('=');
    if (eq != std::string::npos) options.options[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  auto say = [](const std::string& line) {
    std::fwrite(line.data(), 1, line.size(), stdout);
    std::fputc('\n', stdout);
    std::fflush(stdout);
  };
  auto transport = pdlib::spi::CreateTransport("verbs", options);
  if (!transport.ok()) {
    say("ERROR " + transport.status().ToString());
    return 1;
  }
  std::vector<uint8_t> buffer(bytes, 0);
  pdlib::spi::Blob key;
  auto region = (*transport)->RegisterMemory({buffer.data(), bytes}, &key);
  auto endpoint = (*transport)->CreateTargetEndpoint();
  if (!region.ok() || !endpoint.ok()) {
    say("ERROR " + (region.ok() ? endpoint.status() : region.status()).ToString());
    return 1;
  }
  say("READY endpoint=" + verbs_test::ToHex(endpoint->blob) + " key=" + verbs_test::ToHex(key) +
      " addr=" + std::to_string(reinterpret_cast<uint64_t>(buffer.data())) +
      " len=" + std::to_string(bytes));
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line.rfind("REPLY ", 0) == 0) {
      auto reply = verbs_test::FromHex(line.substr(6));
      pdlib::Status s = reply ? (*transport)->CompleteTargetEndpoint(endpoint->id, *reply)
                              : pdlib::Status::InvalidArgument("bad hex");
      say(s.ok() ? "CONNECTED" : "ERROR " + s.ToString());
    } else if (line.rfind("CHECK ", 0) == 0) {
      const uint32_t seed = static_cast<uint32_t>(std::stoul(line.substr(6)));
      auto bad = verbs_test::FindMismatch(buffer.data(), bytes, seed);
      say(bad ? "BAD " + *bad : "OK");
    } else {
      say("ERROR unknown command: " + line);
    }
  }
  return 0;
}
