// EtcdCluster for the tests: real etcd members on 127.0.0.1, for the tests of the etcd client
// and of etcd discovery (target pdlib_test_etcd; `ctest -R etcd`). The launcher itself lives in
// tools/etcd/etcd_cluster.h (pdlib_tool_etcd), where pdlib-chaos --discovery etcd uses it too;
// these names keep the tests' spelling.
//
// Tests skip, with the reason, where etcd is not installed:
//   if (auto why = pdlib::testing::EtcdMissing()) { WARN("skipped: " << *why); return; }
#ifndef PDLIB_TEST_SUPPORT_ETCD_LAUNCHER_H_
#define PDLIB_TEST_SUPPORT_ETCD_LAUNCHER_H_

#include "tools/etcd/etcd_cluster.h"

namespace pdlib::testing {

using pdlib_tools::EtcdCluster;
using pdlib_tools::EtcdClusterOptions;
using pdlib_tools::EtcdctlMissing;
using pdlib_tools::EtcdMissing;

}  // namespace pdlib::testing

#endif  // PDLIB_TEST_SUPPORT_ETCD_LAUNCHER_H_
