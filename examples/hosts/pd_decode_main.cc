// pd-decode: the decode host of the example deployment (--colocated: the no-transfer baseline).
// See examples/hosts/README.md or `pd-decode --help`.
#include "examples/hosts/host_flags.h"

int main(int argc, char** argv) {
  return pdlib::hosts::HostMain(pdlib::hosts::Role::kDecode, argc, argv);
}
