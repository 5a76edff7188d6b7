// End-to-end planner tests over UCX (shared memory): a prefill process and a decode process, each
// with all the ranks of its side as threads (pdlib_planner_peer), move patterned KV, aux and
// state through the gRPC control plane and real one-sided writes; decode checks every byte
// against the model-wide pattern (e2e_scenario.h). Test names carry `tp`, `pipeline` and `state`
// so that `ctest -R tp` (and -R pipeline, -R state) select them.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "pdlib/backends.h"
#include "pdlib/spi/transport.h"
#include "test/multiprocess/peer_harness.h"
#include "test/planner/e2e_scenario.h"

namespace {

using pdlib_test::PeerProcess;
using pdlib_test::Scene;

bool HaveUcx() {
  for (const auto& b : pdlib::BuiltinBackends()) {
    if (b == "ucx") return true;
  }
  return false;
}

// Runs scenario `name`; with `corrupt_room`, prefill spoils one byte of that room and decode must
// report exactly that room (on the ranks that own the byte) as bad. With `wrong_aux_room`,
// prefill writes that room's aux slot as another room's, and pdlib itself must fail the room.
// One transport the scenarios run over: a backend and its options, as peer flags.
struct Transport {
  std::string name;  // "ucx:shm", "ucx:tcp", "verbs"
  std::vector<std::string> flags;
};

std::optional<Transport> TransportNamed(const std::string& name) {
  if (name == "ucx:shm")
    return Transport{name, {"--backend", "ucx", "--backend-option", "ucx.tls=shm"}};
  if (name == "ucx:tcp") {
    return Transport{name,
                     {"--backend", "ucx", "--backend-option", "ucx.tls=tcp", "--backend-option",
                      "ucx.net_devices=lo"}};
  }
  if (name == "verbs") return Transport{name, {"--backend", "verbs"}};
  // cuda_ipc (issue #19): host pools (process_vm_writev; runs without a GPU) or GPU pools.
  if (name == "cuda_ipc") return Transport{name, {"--backend", "cuda_ipc"}};
  if (name == "cuda_ipc:gpu") {
    return Transport{name, {"--backend", "cuda_ipc", "--memory", "cuda"}};
  }
  return std::nullopt;
}

// Why `transport` cannot run here (empty: it can): its backend is not built in, or it needs GPU
// pools and no CUDA device is usable.
std::string CannotRun(const Transport& t) {
  const std::string backend = t.flags[1];
  const auto builtin = pdlib::BuiltinBackends();
  if (std::find(builtin.begin(), builtin.end(), backend) == builtin.end()) {
    return "this build has no " + backend + " backend";
  }
  if (std::find(t.flags.begin(), t.flags.end(), "--memory") == t.flags.end()) return "";
  auto transport = pdlib::spi::CreateTransport(backend, {});
  if (!transport.ok()) return transport.status().ToString();
  if (!(*transport)->capabilities().supports_cuda_memory) {
    return backend + " cannot reach GPU memory here (no usable CUDA device)";
  }
  return "";
}

// Runs scenario `name`; with `corrupt_room`, prefill spoils one byte of that room and decode must
// report exactly that room (on the ranks that own the byte) as bad. With `wrong_aux_room`,
// prefill writes that room's aux slot as another room's, and pdlib itself must fail the room.
// With `layerwise_seed`, prefill announces every chunk layer by layer (SendLayers).
// With `decode_prefix`, decode holds a prefix of each room (none, one page, all but the last, all:
// e2e_scenario.h PrefixPages) and checks that no page outside those it handed over is written;
// with `ignore_prefix` too, prefill sends the request's first pages instead of those after the
// prefix (negative control: the rooms with a partial prefix must fail with a bad byte).
void RunScenarioOver(const Transport& transport, const std::string& name, int64_t corrupt_room,
                     int64_t wrong_aux_room, uint64_t layerwise_seed, bool decode_prefix = false,
                     bool ignore_prefix = false, bool pull = false, int64_t misplace_room = -1) {
  auto s = pdlib_e2e::FindScenario(name);
  REQUIRE(s);
  INFO("scenario " << name << (pull ? " (pull)" : "") << " over " << transport.name
                   << (layerwise_seed ? " layer-wise, seed " + std::to_string(layerwise_seed)
                                      : std::string()));
  const std::string port = std::to_string(pdlib_test::UnusedLocalPort());
  std::vector<std::string> common = {"--scenario", name, "--bootstrap-port", port};
  if (decode_prefix) {
    common.push_back("--decode-prefix");
    common.push_back("1");
  }
  if (pull) {
    common.push_back("--direction");
    common.push_back("pull");
  }
  common.insert(common.end(), transport.flags.begin(), transport.flags.end());
  Scene scene;
  auto args = [&](const char* role) {
    std::vector<std::string> a = {"--role", role};
    a.insert(a.end(), common.begin(), common.end());
    return a;
  };
  auto pargs = args("prefill");
  if (corrupt_room >= 0) {
    pargs.push_back("--corrupt-room");
    pargs.push_back(std::to_string(corrupt_room));
  }
  if (wrong_aux_room >= 0) {
    pargs.push_back("--wrong-aux-room");
    pargs.push_back(std::to_string(wrong_aux_room));
  }
  if (layerwise_seed != 0) {
    pargs.push_back("--layerwise");
    pargs.push_back(std::to_string(layerwise_seed));
  }
  if (ignore_prefix) {
    pargs.push_back("--ignore-prefix");
    pargs.push_back("1");
  }
  if (misplace_room >= 0) {
    pargs.push_back("--misplace-room");
    pargs.push_back(std::to_string(misplace_room));
  }
  PeerProcess& prefill = scene.Start("prefill", pargs, PDLIB_PLANNER_PEER_BINARY);
  SCENE_REQUIRE(scene, prefill.started());
  SCENE_REQUIRE(scene, !prefill.WaitReady().empty());
  PeerProcess& decode = scene.Start("decode", args("decode"), PDLIB_PLANNER_PEER_BINARY);
  SCENE_REQUIRE(scene, decode.started());
  const int ranks = s->decode.tp * s->decode.pp;
  auto done = decode.Expect("DONE", std::chrono::milliseconds(90000));
  SCENE_REQUIRE(scene, done.has_value());
  const auto fields = pdlib_test::ParseCounters(*done);
  if (ignore_prefix) {
    // Rooms whose decode holds one page or all but the last get the wrong positions' bytes;
    // rooms without a prefix, or with all of it, are unaffected.
    for (const auto& [room, r] : decode.rooms()) {
      const int32_t prefix = pdlib_e2e::PrefixPages(*s, room);
      INFO("room " << room << " prefix " << prefix << " pages: " << r.state << " " << r.reason);
      if (prefix == 0 || prefix == s->pages_per_request) {
        SCENE_CHECK(scene, r.state == "Success");
      } else {
        SCENE_CHECK(scene, r.state == "Failed");
        SCENE_CHECK(scene, r.reason.find("bad-byte kv") != std::string::npos);
      }
    }
    SCENE_CHECK(scene, fields.at("failed") > 0);
    decode.Send("QUIT");
    prefill.Send("QUIT");
    SCENE_CHECK(scene, decode.Wait(std::chrono::milliseconds(20000)) == 1);
    return;
  }
  if (corrupt_room >= 0 || wrong_aux_room >= 0 || misplace_room >= 0) {
    const auto& rooms = decode.rooms();
    const int64_t failed_room = corrupt_room >= 0    ? corrupt_room
                                : misplace_room >= 0 ? misplace_room
                                                     : wrong_aux_room;
    auto bad = rooms.find(static_cast<uint64_t>(failed_room));
    SCENE_REQUIRE(scene, bad != rooms.end());
    SCENE_CHECK(scene, bad->second.state == "Failed");
    if (corrupt_room >= 0 || misplace_room >= 0) {
      SCENE_CHECK(scene, bad->second.reason.find("bad-byte kv") != std::string::npos);
    } else {
      // pdlib's own check failed it (the engine never saw Success), naming both rooms.
      SCENE_CHECK(scene, bad->second.reason.find("DATA_LOSS: room " + std::to_string(failed_room) +
                                                 ": metadata slot") != std::string::npos);
      SCENE_CHECK(scene, bad->second.reason.find("holds bootstrap_room " +
                                                 std::to_string(failed_room + 1000000)) !=
                             std::string::npos);
      // Every writer had reported its writes complete: nothing can land any more, so the
      // pages come back at once (no quarantine waiting for a drain that may never come).
      SCENE_CHECK(scene, bad->second.reason.find("[pages reusable]") != std::string::npos);
    }
    SCENE_CHECK(scene, fields.at("failed") >= 1);
    SCENE_CHECK(scene,
                fields.at("ok") + fields.at("failed") == static_cast<uint64_t>(s->rooms * ranks));
    decode.Send("QUIT");
    prefill.Send("QUIT");
    SCENE_CHECK(scene, decode.Wait(std::chrono::milliseconds(20000)) == 1);
    return;
  }
  SCENE_CHECK(scene, fields.at("ok") == static_cast<uint64_t>(s->rooms * ranks));
  SCENE_CHECK(scene, fields.at("failed") == 0);
  // Every prefill rank, dummies included, ends its rooms in Success while decode is still up.
  auto pdone = prefill.Expect("DONE", std::chrono::milliseconds(30000));
  SCENE_REQUIRE(scene, pdone.has_value());
  SCENE_CHECK(scene, pdlib_test::ParseCounters(*pdone).at("failed") == 0);
  decode.Send("QUIT");
  SCENE_CHECK(scene, decode.Wait(std::chrono::milliseconds(20000)) == 0);
  prefill.Send("QUIT");
  SCENE_CHECK(scene, prefill.Wait(std::chrono::milliseconds(20000)) == 0);
}

void RunScenario(const std::string& name, int64_t corrupt_room = -1, int64_t wrong_aux_room = -1) {
  if (!HaveUcx()) {
    WARN("SKIP: this build has no ucx backend (PDLIB_WITH_UCX=OFF or libucx-dev missing)");
    return;
  }
  RunScenarioOver(*TransportNamed("ucx:shm"), name, corrupt_room, wrong_aux_room, 0);
}

// The transports of the layer-wise tests: PDLIB_E2E_TRANSPORTS (comma-separated names, e.g.
// "verbs" in the Soft-RoCE VM), else ucx over shm and over tcp.
std::vector<Transport> LayerwiseTransports() {
  const char* env = std::getenv("PDLIB_E2E_TRANSPORTS");
  std::string list = env != nullptr ? env : "ucx:shm,ucx:tcp";
  std::vector<Transport> out;
  for (size_t at = 0; at <= list.size();) {
    size_t comma = std::min(list.find(',', at), list.size());
    std::string name = list.substr(at, comma - at);
    at = comma + 1;
    if (name.empty()) continue;
    auto t = TransportNamed(name);
    if (!t) FAIL("PDLIB_E2E_TRANSPORTS: unknown transport '" << name << "'");
    out.push_back(*t);
  }
  return out;
}

// Layer-wise streaming over every transport, with two seeds (different chunk sizes and steps).
void RunLayerwise(const std::string& name, int64_t corrupt_room = -1) {
  const std::vector<Transport> transports = LayerwiseTransports();
  for (const Transport& t : transports) {
    if (std::string why = CannotRun(t); !why.empty()) {
      WARN("SKIP " << t.name << ": " << why);
      continue;
    }
    for (uint64_t seed : {1, 2}) RunScenarioOver(t, name, corrupt_room, -1, seed);
  }
}

// Decode prefix reuse (issue #27) over every transport of the list (ucx shm and tcp here,
// verbs in the Soft-RoCE VM): each room's decode holds none, one, all but the last or all of
// its pages; Send() moves only the rest, byte-exact, and nothing else of decode is written.
void RunPrefix(const std::string& name, uint64_t layerwise_seed = 0) {
  for (const Transport& t : LayerwiseTransports()) {
    if (std::string why = CannotRun(t); !why.empty()) {
      WARN("SKIP " << t.name << ": " << why);
      continue;
    }
    RunScenarioOver(t, name, -1, -1, layerwise_seed, true);
  }
}

}  // namespace

TEST_CASE("planner e2e prefix tp 2P1D NHD: only the pages after decode's prefix move") {
  RunPrefix("tp_2p1d_nhd");
}
TEST_CASE("planner e2e prefix tp 1P2D NHD and 4P2D GQA", "[long]") {
  RunPrefix("tp_1p2d_nhd");
  RunPrefix("tp_4p2d_gqa");
}
TEST_CASE("planner e2e prefix tp MLA 4P2D: dummies learn the prefix too") { RunPrefix("mla_4p2d"); }
TEST_CASE("planner e2e prefix pipeline PP2 with state") { RunPrefix("pipeline_pp2"); }
TEST_CASE("planner e2e prefix layerwise state mamba 2P1D") { RunPrefix("state_mamba_2p1d", 3); }
TEST_CASE("planner e2e prefix state families: mamba + swa + c128_state, TP 2->1 and 1->2, PP") {
  RunPrefix("families_2p1d");
  RunPrefix("families_1p2d");
  RunPrefix("families_pp2");
}
TEST_CASE("planner e2e prefix negative control: a sender that ignores the prefix fails rooms") {
  if (!HaveUcx()) {
    WARN("SKIP: this build has no ucx backend");
    return;
  }
  RunScenarioOver(*TransportNamed("ucx:shm"), "tp_2p1d_nhd", -1, -1, 0, true, true);
}

TEST_CASE("planner e2e layerwise tp 2P1D HND: layers announced one step at a time land intact") {
  RunLayerwise("tp_2p1d_hnd");
}
TEST_CASE("planner e2e layerwise pipeline PP2: each stage announces its own layers", "[long]") {
  RunLayerwise("pipeline_pp2");
}
TEST_CASE("planner e2e layerwise tp MLA 4P2D: latent layers stream, dummies still finish",
          "[long]") {
  RunLayerwise("mla_4p2d");
}
TEST_CASE("planner e2e layerwise state mamba 2P1D: state follows the last layer") {
  RunLayerwise("state_mamba_2p1d");
}
TEST_CASE("planner e2e layerwise negative control: a spoiled byte still fails its room") {
  RunLayerwise("tp_2p1d_nhd", 1002);
}

TEST_CASE("planner e2e tp 2P1D HND: two prefill ranks' head slices fill one decode rank's pages") {
  RunScenario("tp_2p1d_hnd");
}
TEST_CASE("planner e2e tp 2P1D NHD: per-token head slices from two prefill ranks interleave") {
  RunScenario("tp_2p1d_nhd");
}
TEST_CASE("planner e2e tp 1P2D NHD: one prefill rank splits its heads over two decode ranks") {
  RunScenario("tp_1p2d_nhd");
}
TEST_CASE("planner e2e tp 4P2D GQA: replicated heads are sent once, by one replica") {
  RunScenario("tp_4p2d_gqa");
}
TEST_CASE("planner e2e tp MLA 2P2D: each decode rank gets the latent from one prefill rank") {
  RunScenario("mla_2p2d");
}
TEST_CASE("planner e2e tp MLA 4P2D: idle prefill ranks get dummy transfers and still finish") {
  RunScenario("mla_4p2d");
}
TEST_CASE("planner e2e pipeline PP2 -> PP1: decode receives each stage's layers and state") {
  RunScenario("pipeline_pp2");
}
TEST_CASE("planner e2e state mamba 2P1D: split and replicated state slots arrive intact") {
  RunScenario("state_mamba_2p1d");
}
TEST_CASE("planner e2e negative control: one spoiled prefill byte fails its room on decode") {
  RunScenario("tp_2p1d_nhd", 1002);
}
// Issue #20 / SPEC R4.4: the decode-side bootstrap_room check of the aux slot, over ucx shm.
TEST_CASE("planner e2e room check: an aux slot written for another room fails that room") {
  RunScenario("tp_2p1d_nhd", -1, 1003);
}

// Issue #19: the layouts that move differently (TP 2 -> 1 head slices in both layouts, MLA with
// dummies, PP 2 -> 1, mamba state) over cuda_ipc, two processes, every byte checked by decode.
// Host pools run everywhere cuda_ipc is built (its process_vm_writev path); GPU pools where a
// CUDA device is usable (the writes then go through IPC handles and the gather kernel), with a
// negative control so that a GPU run cannot pass without checking.
void RunOverCudaIpc(const char* transport_name) {
  const Transport t = *TransportNamed(transport_name);
  if (std::string why = CannotRun(t); !why.empty()) {
    WARN("SKIP " << t.name << ": " << why);
    return;
  }
  for (const char* scenario :
       {"tp_2p1d_hnd", "tp_2p1d_nhd", "mla_4p2d", "pipeline_pp2", "state_mamba_2p1d"}) {
    RunScenarioOver(t, scenario, -1, -1, 0);
  }
  RunScenarioOver(t, "tp_2p1d_nhd", 1002, -1, 0);  // one spoiled byte fails its room
  RunScenarioOver(t, "tp_2p1d_hnd", -1, -1, 1);    // layer-wise
  // Pull (issue #29): decode copies from prefill's pools (process_vm_readv on host pools, IPC
  // handles of prefill's allocations on GPU pools).
  for (const char* scenario : {"tp_2p1d_nhd", "mla_4p2d", "pipeline_pp2", "families_1p2d"}) {
    RunScenarioOver(t, scenario, -1, -1, 0, false, false, true);
  }
  RunScenarioOver(t, "tp_2p1d_hnd", -1, -1, 0, true, false, true);         // with a prefix
  RunScenarioOver(t, "tp_2p1d_nhd", -1, -1, 0, false, false, true, 1003);  // misplaced page
}
TEST_CASE(
    "planner e2e cuda_ipc host pools: tp 2P1D HND and NHD, MLA 4P2D, pipeline PP2, state, pull") {
  RunOverCudaIpc("cuda_ipc");
}
TEST_CASE(
    "planner e2e cuda_ipc GPU pools: tp 2P1D HND and NHD, MLA 4P2D, pipeline PP2, state, pull") {
  RunOverCudaIpc("cuda_ipc:gpu");
}

// Decode pull (issue #29): the same scenarios with decode reading prefill's published pages
// (odd rooms published before decode's TransferInfo, even ones after), over ucx shm and tcp
// (PDLIB_E2E_TRANSPORTS: verbs in the Soft-RoCE VM). Every byte of decode's pools is checked,
// the pages not handed over included.
namespace {
void RunPull(const std::string& name, bool prefix = false, uint64_t layerwise_seed = 0) {
  for (const Transport& t : LayerwiseTransports()) {
    if (std::string why = CannotRun(t); !why.empty()) {
      WARN("SKIP " << t.name << ": " << why);
      continue;
    }
    RunScenarioOver(t, name, -1, -1, layerwise_seed, prefix, false, true);
  }
}
}  // namespace

TEST_CASE("planner e2e pull tp 2P1D HND and NHD: decode reads two prefill ranks' head slices") {
  RunPull("tp_2p1d_hnd");
  RunPull("tp_2p1d_nhd");
}
TEST_CASE("planner e2e pull tp 1P2D NHD and 4P2D GQA", "[long]") {
  RunPull("tp_1p2d_nhd");
  RunPull("tp_4p2d_gqa");
}
TEST_CASE("planner e2e pull MLA 4P2D: one reader per decode rank, dummies still finish") {
  RunPull("mla_4p2d");
}
TEST_CASE("planner e2e pull pipeline PP2 with state, and state families") {
  RunPull("pipeline_pp2");
  RunPull("families_2p1d");
  RunPull("families_1p2d");
}
TEST_CASE("planner e2e pull decode prefix: decode reads only the pages after its prefix") {
  RunPull("tp_2p1d_nhd", true);
  RunPull("families_pp2", true);
}
TEST_CASE("planner e2e pull layerwise: each announced layer range is read as it is published") {
  RunPull("state_mamba_2p1d", false, 1);
  RunPull("mla_4p2d", true, 2);
}
TEST_CASE("planner e2e pull negative controls: a spoiled byte and a misplaced page fail the room") {
  if (!HaveUcx()) {
    WARN("SKIP: this build has no ucx backend");
    return;
  }
  const Transport shm = *TransportNamed("ucx:shm");
  RunScenarioOver(shm, "tp_2p1d_hnd", 1002, -1, 0, false, false, true);
  RunScenarioOver(shm, "tp_2p1d_hnd", -1, -1, 0, false, false, true, 1003);
  RunScenarioOver(shm, "state_mamba_2p1d", -1, 1001, 0, false, false, true);
}
