// pd-prefill: the prefill host of the example deployment. See examples/hosts/README.md or
// `pd-prefill --help`.
#include "examples/hosts/host_flags.h"

int main(int argc, char** argv) {
  return pdlib::hosts::HostMain(pdlib::hosts::Role::kPrefill, argc, argv);
}
