// Two-process byte-compare tests over the cuda_ipc backend: a prefill and a decode process
// (pdlib_test_peer --verify --backend cuda_ipc) on one node, every destination byte, aux slot
// and state slot checked by decode (byte_compare_pair.h, kv_pattern.h). The peers' pools are
// host memory, so the writes are process_vm_writev into the decode process (the path cuda_ipc
// takes for host regions, and for the aux and metadata buffers with GPU pools): that runs on any
// Linux machine. GPU pools need the peer to allocate them with cudaMalloc, which
// pdlib_test_peer does not yet; backends' own cuda_ipc_transport_test runs the two-process
// GPU case (an IPC handle opened in another process) where a device is usable.
#include <catch2/catch.hpp>
#include <vector>

#include "test/multiprocess/byte_compare_pair.h"

using pdlib_test::Layout;
using pdlib_test::PairResult;
using pdlib_test::PairTransport;
using pdlib_test::RunLayouts;
using pdlib_test::RunPair;
using pdlib_test::Scene;

namespace {

constexpr uint64_t kRooms = 24;

// Small pools (a few MiB a side): the sanitizer builds run this on two busy cores.
const std::vector<Layout>& Layouts() {
  static const std::vector<Layout> layouts = {
      {1, 64, 256, 64, 3},         {16, 1024, 256, 32, 3, 0, 2, 4096, 1},
      {3, 4096, 256, 64, 2, 1024}, {64, 256, 256, 64, 4, 0, 4, 64, 3},
      {1, 262144, 16, 8, 2, 64},
  };
  return layouts;
}

}  // namespace

TEST_CASE("cuda_ipc 1P1D over host memory: every room's KV pages, aux slot and state arrive") {
  RunLayouts(PairTransport{"cuda_ipc"}, Layouts(), kRooms);
}

TEST_CASE("cuda_ipc 1P1D over host memory with cuda_ipc.copy=memcpy and no busy polling") {
  RunLayouts(PairTransport{"cuda_ipc", {"cuda_ipc.copy=memcpy", "cuda_ipc.busy_poll_us=0"}},
             {Layouts()[1], Layouts()[3]}, kRooms);
}

TEST_CASE(
    "cuda_ipc byte-compare negative control: a spoiled source byte, aux or state slot fails") {
  Scene scene;
  const Layout l{2, 1024, 256, 8, 2, 0, 2, 256, 2};
  const PairResult r =
      RunPair(scene, l, PairTransport{"cuda_ipc"}, 0, 8,
              {"--corrupt-kv-room", "3", "--corrupt-aux-room", "5", "--corrupt-state-room", "6"});
  pdlib_test::CheckSpoiledRooms(r, 8,
                                {{3, "BADBYTES buffer="},
                                 {5, "BADBYTES aux.output_ids[0]="},
                                 {6, "BADBYTES state_buffer=1,slot_pos=0,"}},
                                scene);
}
