// Rail selection (lib/rails/rails.h) on sysfs trees written under a temporary directory, laid out
// as the kernel lays out /sys: devices under devices/pci*/..., and class/, bus/pci/devices/ and
// each NIC's `device` as relative symlinks into it.
#include "lib/rails/rails.h"

#include <stdlib.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "lib/core/manager_common.h"
#include "test/support/sysfs_tree.h"

namespace {

namespace fs = std::filesystem;
using pdlib::StatusCode;
using pdlib::rails::Affinity;
using pdlib::rails::MemoryLocation;
using pdlib::rails::NicKind;
using pdlib::rails::Rail;
using pdlib::rails::RailChoice;
using pdlib::rails::RailQuery;
using pdlib::rails::SelectRails;
using pdlib_test::SysfsTree;

pdlib::StatusOr<RailChoice> Query(const SysfsTree& tree, MemoryLocation memory, NicKind kind,
                                  std::vector<std::string> names) {
  RailQuery q;
  q.sysfs_root = tree.root();
  q.memory = std::move(memory);
  q.kind = kind;
  q.explicit_names = std::move(names);
  return SelectRails(q);
}

RailChoice Select(const SysfsTree& tree, MemoryLocation memory, NicKind kind = NicKind::kRdma,
                  std::vector<std::string> names = {}) {
  auto choice = Query(tree, std::move(memory), kind, std::move(names));
  INFO(choice.status().ToString());
  REQUIRE(choice.ok());
  return *choice;
}

pdlib::Status SelectError(const SysfsTree& tree, MemoryLocation memory,
                          std::vector<std::string> names, NicKind kind = NicKind::kRdma) {
  auto choice = Query(tree, std::move(memory), kind, std::move(names));
  REQUIRE_FALSE(choice.ok());
  return choice.status();
}

std::vector<std::string> Names(const std::vector<Rail>& rails) {
  std::vector<std::string> names;
  for (const Rail& r : rails) names.push_back(r.name);
  return names;
}

std::vector<Affinity> Affinities(const std::vector<Rail>& rails) {
  std::vector<Affinity> out;
  for (const Rail& r : rails) out.push_back(r.affinity);
  return out;
}

using Strings = std::vector<std::string>;

// Two PCIe switches, each with a GPU and NICs, on two NUMA nodes (a DGX-like node, shrunk):
//
//  NUMA 0: pci0000:00 - 00:01.0 - switch 01:00.0 -+- 02:00.0 - switch 03:00.0 -+- 04:00.0 - GPU0
//  05:00.0
//                                                 |                            +- 04:01.0 - mlx5_1
//                                                 06:00.0
//                                                 +- 02:01.0 - mlx5_0 07:00.0
//  NUMA 1: pci0000:80 - 80:01.0 - switch 81:00.0 -+- 82:00.0 - GPU1 83:00.0
//                                                 +- 82:01.0 - mlx5_2 84:00.0
//                                                 +- 82:02.0 - mlx5_3 85:00.0
// mlx5_1 shares four bridges with GPU0, mlx5_0 two. Each NIC has a netdev (ens<n>np0); lo and a
// bridge are virtual.
void BuildTwoSwitches(SysfsTree& t) {
  const std::string a = "pci0000:00/0000:00:01.0/0000:01:00.0";
  t.AddPci("pci0000:00/0000:00:01.0", "0");
  t.AddPci(a, "0");
  t.AddPci(a + "/0000:02:00.0/0000:03:00.0/0000:04:00.0/0000:05:00.0", "0");  // GPU0
  t.AddPci(a + "/0000:02:00.0/0000:03:00.0/0000:04:01.0/0000:06:00.0", "0");
  t.AddRdma(a + "/0000:02:00.0/0000:03:00.0/0000:04:01.0/0000:06:00.0", "mlx5_1", 1, "ens6np0");
  t.AddPci(a + "/0000:02:01.0/0000:07:00.0", "0");
  t.AddRdma(a + "/0000:02:01.0/0000:07:00.0", "mlx5_0", 1, "ens7np0");
  const std::string b = "pci0000:80/0000:80:01.0/0000:81:00.0";
  t.AddPci(b + "/0000:82:00.0/0000:83:00.0", "1");  // GPU1
  t.AddPci(b + "/0000:82:01.0/0000:84:00.0", "1");
  t.AddRdma(b + "/0000:82:01.0/0000:84:00.0", "mlx5_2", 2, "ens84np0");
  t.AddPci(b + "/0000:82:02.0/0000:85:00.0", "1");
  t.AddRdma(b + "/0000:82:02.0/0000:85:00.0", "mlx5_3", 1, "ens85np0");
  t.AddVirtualNet("lo");
  t.AddVirtualNet("docker0");
}

}  // namespace

TEST_CASE("rails: 2 GPUs x 4 NICs on two PCIe switches") {
  SysfsTree t;
  BuildTwoSwitches(t);

  SECTION("GPU0: the NICs behind its switch, the one sharing the deeper bridge first") {
    const RailChoice c = Select(t, MemoryLocation::Pci("0000:05:00.0"));
    CHECK(Names(c.rails) == Strings{"mlx5_1", "mlx5_0"});
    CHECK(Affinities(c.rails) ==
          std::vector<Affinity>{Affinity::kSamePcieSwitch, Affinity::kSamePcieSwitch});
    CHECK(c.rails[0].pci_address == "0000:06:00.0");
    CHECK(c.rails[0].numa_node == 0);
    CHECK(Names(c.others) == Strings{"mlx5_2", "mlx5_3"});
    CHECK(Affinities(c.others) == std::vector<Affinity>{Affinity::kAny, Affinity::kAny});
  }
  SECTION("GPU1: its switch's NICs; the other NUMA node's NICs are no closer than any") {
    const RailChoice c = Select(t, MemoryLocation::Pci("0000:83:00.0"));
    CHECK(Names(c.rails) == Strings{"mlx5_2", "mlx5_3"});
    CHECK(Names(c.others) == Strings{"mlx5_0", "mlx5_1"});
    CHECK(c.others[0].affinity == Affinity::kAny);
  }
  SECTION("the GPU's address as nvidia-smi prints it, in upper case, or without a domain") {
    CHECK(Names(Select(t, MemoryLocation::Pci("00000000:83:00.0")).rails) ==
          Strings{"mlx5_2", "mlx5_3"});
    CHECK(Names(Select(t, MemoryLocation::Pci("0000:05:00.0")).rails) ==
          Names(Select(t, MemoryLocation::Pci("05:00.0")).rails));
    auto upper = pdlib::rails::NormalizePciAddress("0000:8A:0F.7");
    REQUIRE(upper.ok());
    CHECK(*upper == "0000:8a:0f.7");
  }
  SECTION("host memory on NUMA node 1: that node's NICs") {
    const RailChoice c = Select(t, MemoryLocation::Host(1));
    CHECK(Names(c.rails) == Strings{"mlx5_2", "mlx5_3"});
    CHECK(Affinities(c.rails) == std::vector<Affinity>{Affinity::kSameNuma, Affinity::kSameNuma});
    CHECK(Names(c.others) == Strings{"mlx5_0", "mlx5_1"});
  }
  SECTION("host memory on an unknown node: every NIC, by name") {
    const RailChoice c = Select(t, MemoryLocation::Host(-1));
    CHECK(Names(c.rails) == Strings{"mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"});
    CHECK(c.others.empty());
  }
  SECTION("network interfaces: the same rules; virtual ones (lo, bridges) are no candidates") {
    const RailChoice c = Select(t, MemoryLocation::Pci("0000:05:00.0"), NicKind::kNet);
    CHECK(Names(c.rails) == Strings{"ens6np0", "ens7np0"});
    CHECK(Names(c.others) == Strings{"ens84np0", "ens85np0"});
  }
  SECTION("an explicit list wins, in its order, and the rest follow for failover") {
    const RailChoice c =
        Select(t, MemoryLocation::Pci("0000:05:00.0"), NicKind::kRdma, {"mlx5_3", "mlx5_2:2"});
    CHECK(Names(c.rails) == Strings{"mlx5_3", "mlx5_2:2"});
    CHECK(Affinities(c.rails) == std::vector<Affinity>{Affinity::kExplicit, Affinity::kExplicit});
    CHECK(c.rails[1].pci_address == "0000:84:00.0");
    CHECK(c.rails[1].numa_node == 1);
    CHECK(Names(c.others) == Strings{"mlx5_1", "mlx5_0"});
    CHECK(c.others[0].affinity == Affinity::kSamePcieSwitch);
  }
  SECTION("explicit virtual interfaces are taken as they are") {
    const RailChoice c = Select(t, MemoryLocation::Host(0), NicKind::kNet, {"docker0", "lo"});
    CHECK(Names(c.rails) == Strings{"docker0", "lo"});
    CHECK(c.rails[0].pci_address.empty());
    CHECK(c.rails[0].numa_node == -1);
  }
}

TEST_CASE("rails: an explicit list with an unknown or malformed or repeated name is refused") {
  SysfsTree t;
  BuildTwoSwitches(t);
  const MemoryLocation gpu0 = MemoryLocation::Pci("0000:05:00.0");

  pdlib::Status s = SelectError(t, gpu0, {"mlx5_0", "mlx5_9"});
  CHECK(s.code() == StatusCode::kNotFound);
  CHECK(s.message().find("'mlx5_9' is not an RDMA device") != std::string::npos);
  CHECK(s.message().find("(there: mlx5_0, mlx5_1, mlx5_2, mlx5_3)") != std::string::npos);

  s = SelectError(t, gpu0, {"mlx5_0:2"});
  CHECK(s.code() == StatusCode::kNotFound);
  CHECK(s.message().find("'mlx5_0' has no port 2 (ports: 1)") != std::string::npos);

  for (const char* bad : {"mlx5_0:0", "mlx5_0:256", "mlx5_0:", "mlx5_0:x"}) {
    s = SelectError(t, gpu0, {bad});
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK(s.message().find("bad port") != std::string::npos);
  }
  for (const std::string& bad : Strings{"", "a/b", "..", "mlx 5", std::string(65, 'm')}) {
    s = SelectError(t, gpu0, {bad});
    INFO(bad);
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK(s.message().find("is not a device name") != std::string::npos);
  }
  s = SelectError(t, gpu0, {"mlx5_2", "mlx5_2:1"});
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("names device 'mlx5_2' a second time") != std::string::npos);

  s = SelectError(t, gpu0, {"ens6np0:1"}, NicKind::kNet);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("takes no port") != std::string::npos);

  // An RDMA name where interfaces are asked for, and the other way round.
  CHECK(SelectError(t, gpu0, {"mlx5_0"}, NicKind::kNet).code() == StatusCode::kNotFound);
  CHECK(SelectError(t, gpu0, {"ens6np0"}, NicKind::kRdma).code() == StatusCode::kNotFound);
}

TEST_CASE("rails: a NUMA-only machine (no shared switch) picks by NUMA node") {
  // Every NIC and the GPU on a root port of its own: no bridge shared below the host bridge.
  SysfsTree t;
  t.AddPci("pci0000:00/0000:00:03.0", "0");
  t.AddRdma("pci0000:00/0000:00:03.0", "mlx5_1");
  t.AddPci("pci0000:00/0000:00:04.0", "0");
  t.AddRdma("pci0000:00/0000:00:04.0", "mlx5_0");
  t.AddPci("pci0000:40/0000:40:01.0", "1");
  t.AddRdma("pci0000:40/0000:40:01.0", "mlx5_2");
  t.AddPci("pci0000:40/0000:40:02.0", "1");  // the GPU, on mlx5_2's host bridge

  const RailChoice gpu = Select(t, MemoryLocation::Pci("0000:40:02.0"));
  CHECK(Names(gpu.rails) == Strings{"mlx5_2"});
  CHECK(gpu.rails[0].affinity == Affinity::kSameNuma);
  CHECK(Names(gpu.others) == Strings{"mlx5_0", "mlx5_1"});

  const RailChoice host0 = Select(t, MemoryLocation::Host(0));
  CHECK(Names(host0.rails) == Strings{"mlx5_0", "mlx5_1"});
  CHECK(Names(host0.others) == Strings{"mlx5_2"});

  // A node with no NIC: all of them, by name.
  const RailChoice host3 = Select(t, MemoryLocation::Host(3));
  CHECK(Names(host3.rails) == Strings{"mlx5_0", "mlx5_1", "mlx5_2"});
  CHECK(host3.rails[0].affinity == Affinity::kAny);
}

TEST_CASE("rails: no NICs at all is an empty choice and a virtual one counts only when named") {
  SysfsTree t;
  t.AddPci("pci0000:00/0000:00:02.0", "0");
  SECTION("no class directories") {
    const RailChoice c = Select(t, MemoryLocation::Pci("0000:00:02.0"));
    CHECK(c.rails.empty());
    CHECK(c.others.empty());
    CHECK(Select(t, MemoryLocation::Host(0), NicKind::kNet).rails.empty());
    const pdlib::Status s = SelectError(t, MemoryLocation::Host(0), {"mlx5_0"});
    CHECK(s.code() == StatusCode::kNotFound);
    CHECK(s.message().find("(there: none)") != std::string::npos);
  }
  SECTION("only Soft-RoCE and lo") {
    t.AddVirtualRdma("rxe0");
    t.AddVirtualNet("lo");
    CHECK(Select(t, MemoryLocation::Host(0)).rails.empty());
    CHECK(Select(t, MemoryLocation::Host(0), NicKind::kNet).rails.empty());
    const RailChoice c = Select(t, MemoryLocation::Host(0), NicKind::kRdma, {"rxe0:1"});
    CHECK(Names(c.rails) == Strings{"rxe0:1"});
    CHECK(c.rails[0].affinity == Affinity::kExplicit);
    CHECK(c.others.empty());
  }
}

TEST_CASE("rails: missing or unreadable or malformed numa_node files") {
  SysfsTree t;
  // The NICs share no bridge with the GPU: only NUMA could order them.
  t.AddPci("pci0000:00/0000:00:01.0", "");  // GPU without a numa_node file
  t.AddPci("pci0000:00/0000:00:02.0", "0");
  t.AddRdma("pci0000:00/0000:00:02.0", "mlx5_1");
  const fs::path nic0 = t.AddPci("pci0000:00/0000:00:03.0", "");
  t.AddRdma("pci0000:00/0000:00:03.0", "mlx5_0");

  SECTION("a GPU whose node is unknown: no NIC is closer than another") {
    const RailChoice c = Select(t, MemoryLocation::Pci("0000:00:01.0"));
    CHECK(Names(c.rails) == Strings{"mlx5_0", "mlx5_1"});
    CHECK(Affinities(c.rails) == std::vector<Affinity>{Affinity::kAny, Affinity::kAny});
  }
  SECTION("a NIC without a numa_node file is on an unknown node") {
    const RailChoice c = Select(t, MemoryLocation::Host(0));
    CHECK(Names(c.rails) == Strings{"mlx5_1"});
    CHECK(Names(c.others) == Strings{"mlx5_0"});
    CHECK(c.others[0].numa_node == -1);
  }
  SECTION("a numa_node that cannot be read (here: a directory) is unknown too") {
    fs::create_directory(nic0 / "numa_node");
    const RailChoice c = Select(t, MemoryLocation::Host(0));
    CHECK(Names(c.rails) == Strings{"mlx5_1"});
    CHECK(c.others[0].numa_node == -1);
  }
  SECTION("a NIC below its PCI function (virtio) has the function's node") {
    const fs::path virtio = nic0 / "virtio1";
    fs::create_directories(virtio / "net" / "ens5");
    fs::create_directory_symlink("../../../virtio1", virtio / "net" / "ens5" / "device");
    fs::create_directories(fs::path(t.root()) / "class" / "net");
    fs::create_directory_symlink(
        fs::relative(virtio / "net" / "ens5", fs::path(t.root()) / "class" / "net"),
        fs::path(t.root()) / "class" / "net" / "ens5");
    t.Write(nic0 / "numa_node", "0\n");
    const RailChoice c = Select(t, MemoryLocation::Host(0), NicKind::kNet);
    CHECK(Names(c.rails) == Strings{"ens5"});
    CHECK(c.rails[0].pci_address == "0000:00:03.0");
    CHECK(c.rails[0].numa_node == 0);
    CHECK(c.rails[0].affinity == Affinity::kSameNuma);
  }
  SECTION("-1 is unknown") {
    t.Write(nic0 / "numa_node", "-1\n");
    CHECK(Names(Select(t, MemoryLocation::Host(0)).rails) == Strings{"mlx5_1"});
  }
  SECTION("contents that are no node number are an error naming the file") {
    for (const char* bad : {"abc\n", "\n", "0x1\n", "4096\n", "-2\n", "1 2\n"}) {
      t.Write(nic0 / "numa_node", bad);
      INFO(bad);
      RailQuery q;
      q.sysfs_root = t.root();
      q.memory = MemoryLocation::Host(0);
      auto c = SelectRails(q);
      REQUIRE_FALSE(c.ok());
      CHECK(c.status().code() == StatusCode::kDataLoss);
      CHECK(c.status().message().find("0000:00:03.0/numa_node holds") != std::string::npos);
      CHECK(c.status().message().find("not a NUMA node") != std::string::npos);
    }
  }
}

TEST_CASE("rails: the KV pool's memory is checked") {
  SysfsTree t;
  BuildTwoSwitches(t);
  pdlib::Status s = SelectError(t, MemoryLocation::Pci("0000:zz:00.0"), {});
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("'0000:zz:00.0' is not [DOMAIN:]BUS:DEVICE.FUNCTION") !=
        std::string::npos);
  for (const char* bad :
       {"0000:05:00.8", "0000:05:00", "5:00.0", "0000:05:00.0x", "g000:05:00.0"}) {
    INFO(bad);
    CHECK(SelectError(t, MemoryLocation::Pci(bad), {}).code() == StatusCode::kInvalidArgument);
  }
  s = SelectError(t, MemoryLocation::Pci("0000:99:00.0"), {});
  CHECK(s.code() == StatusCode::kNotFound);
  CHECK(s.message().find("no PCI device 0000:99:00.0") != std::string::npos);
  CHECK(SelectError(t, MemoryLocation::Host(-2), {}).code() == StatusCode::kInvalidArgument);
  CHECK(SelectError(t, MemoryLocation::Host(5000), {}).code() == StatusCode::kInvalidArgument);
}

TEST_CASE("rails: RankRails is pure and does not depend on the order of its input") {
  using pdlib::rails::MemoryTopology;
  using pdlib::rails::NicTopology;
  const MemoryTopology gpu{{"pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:00.0"}, 0};
  std::vector<NicTopology> nics = {
      {"d", {"pci0000:00", "0000:00:01.0", "0000:01:01.0"}, 0},  // shares 00:01.0 only
      {"c", {"pci0000:00", "0000:00:01.0", "0000:01:02.0"}, 0},  // likewise
      {"b", {"pci0000:00", "0000:00:05.0"}, 0},                  // same host bridge, NUMA 0
      {"a", {"pci0000:00", "0000:00:06.0"}, 1},                  // NUMA 1
      {"e", {}, -1},                                             // not on PCI
  };
  std::mt19937 rng(7);
  for (int i = 0; i < 20; ++i) {
    std::shuffle(nics.begin(), nics.end(), rng);
    const RailChoice c = pdlib::rails::RankRails(gpu, nics);
    CHECK(Names(c.rails) == Strings{"c", "d"});
    CHECK(Names(c.others) == Strings{"b", "a", "e"});
    CHECK(Affinities(c.others) ==
          std::vector<Affinity>{Affinity::kSameNuma, Affinity::kAny, Affinity::kAny});
  }
  // Host memory has no PCI chain: never the switch tier.
  const RailChoice host = pdlib::rails::RankRails({{}, 1}, nics);
  CHECK(Names(host.rails) == Strings{"a"});
  CHECK(pdlib::rails::RankRails(gpu, {}).rails.empty());
}

// The core tells the backends where the KV pool lives. A CUDA pool's GPU is asked of the CUDA
// driver only if the process has loaded it (this one has not: a CUDA pool here has no place, and
// the host's NUMA node is not asked for it); cuda_ipc_transport_test checks a real GPU's address.
TEST_CASE("rails: the core passes a CUDA pool's GPU only when the CUDA driver is loaded") {
  std::vector<uint8_t> pool(1 << 16, 1);
  pdlib::KVManagerOptions options;
  options.args.kv.ptrs = {reinterpret_cast<uint64_t>(pool.data())};
  options.args.kv.lens = {pool.size()};
  options.args.kv.item_lens = {4096};
  options.args.memory_kind = pdlib::MemoryKind::kCuda;
  const pdlib::spi::TransportOptions cuda = pdlib::TransportOptionsFor(options);
  CHECK(cuda.memory_pci_address.empty());
  CHECK(cuda.memory_numa_node == -1);
  CHECK(pdlib::PciAddressOfCudaMemory(reinterpret_cast<uint64_t>(pool.data())).empty());
  CHECK(pdlib::PciAddressOfCudaMemory(0).empty());
  options.args.memory_kind = pdlib::MemoryKind::kHost;
  CHECK(pdlib::TransportOptionsFor(options).memory_pci_address.empty());
}
