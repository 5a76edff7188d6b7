// A sysfs tree written under a temporary directory for tests of topology code (lib/rails and
// the backends that pick their NICs with it), laid out as the kernel lays out /sys: devices under
// devices/pci*/..., and class/, bus/pci/devices/ and each NIC's `device` as relative symlinks
// into it. Catch2 REQUIREs report a tree that cannot be written.
#ifndef PDLIB_TEST_SUPPORT_SYSFS_TREE_H_
#define PDLIB_TEST_SUPPORT_SYSFS_TREE_H_

#include <stdlib.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <string>

namespace pdlib_test {

namespace fs = std::filesystem;

// A sysfs tree in a temporary directory, removed with the object.
class SysfsTree {
 public:
  SysfsTree() {
    std::string tmpl = (fs::temp_directory_path() / "pdlib_rails_XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    root_ = tmpl;
    fs::create_directories(root_ / "devices" / "virtual" / "net");
  }
  ~SysfsTree() {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  SysfsTree(const SysfsTree&) = delete;
  SysfsTree& operator=(const SysfsTree&) = delete;

  std::string root() const { return root_.string(); }

  // A PCI function at `chain` ("pci0000:00/0000:00:01.0/.../0000:03:00.0") with numa_node
  // holding `numa` ("" : no file), and its bus/pci/devices link.
  fs::path AddPci(const std::string& chain, const std::string& numa) {
    const fs::path dir = root_ / "devices" / chain;
    fs::create_directories(dir);
    if (!numa.empty()) Write(dir / "numa_node", numa + "\n");
    const fs::path link = root_ / "bus" / "pci" / "devices" / dir.filename();
    fs::create_directories(link.parent_path());
    Link(dir, link);
    return dir;
  }

  // An RDMA device `name` with ports 1..ports on the PCI function at `chain` (made first with
  // AddPci), and optionally its netdev.
  void AddRdma(const std::string& chain, const std::string& name, int ports = 1,
               const std::string& netdev = "") {
    const fs::path function = root_ / "devices" / chain;
    const fs::path dir = function / "infiniband" / name;
    for (int p = 1; p <= ports; ++p) fs::create_directories(dir / "ports" / std::to_string(p));
    Link(function, dir / "device");
    fs::create_directories(root_ / "class" / "infiniband");
    Link(dir, root_ / "class" / "infiniband" / name);
    if (!netdev.empty()) AddNet(chain, netdev);
  }

  // A network interface on the PCI function at `chain`.
  void AddNet(const std::string& chain, const std::string& name) {
    const fs::path function = root_ / "devices" / chain;
    const fs::path dir = function / "net" / name;
    fs::create_directories(dir);
    Link(function, dir / "device");
    fs::create_directories(root_ / "class" / "net");
    Link(dir, root_ / "class" / "net" / name);
  }

  // A virtual interface (no `device` link): lo, a bridge, a veth.
  void AddVirtualNet(const std::string& name) {
    const fs::path dir = root_ / "devices" / "virtual" / "net" / name;
    fs::create_directories(dir);
    fs::create_directories(root_ / "class" / "net");
    Link(dir, root_ / "class" / "net" / name);
  }

  // A virtual RDMA device (Soft-RoCE: rxe0 has no `device` link).
  void AddVirtualRdma(const std::string& name) {
    const fs::path dir = root_ / "devices" / "virtual" / "infiniband" / name;
    fs::create_directories(dir / "ports" / "1");
    fs::create_directories(root_ / "class" / "infiniband");
    Link(dir, root_ / "class" / "infiniband" / name);
  }

  void Write(const fs::path& path, const std::string& text) {
    std::ofstream out(path, std::ios::trunc);
    out << text;
    REQUIRE(out.good());
  }

 private:
  // A relative symlink at `link` to `target`, as sysfs makes them.
  static void Link(const fs::path& target, const fs::path& link) {
    fs::create_directory_symlink(fs::relative(target, link.parent_path()), link);
  }

  fs::path root_;
};

}  // namespace pdlib_test

#endif  // PDLIB_TEST_SUPPORT_SYSFS_TREE_H_
