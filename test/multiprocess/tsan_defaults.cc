// Default ThreadSanitizer options for the multi-process tests and pdlib_test_peer: Debian's
// gRPC, protobuf and Abseil are not TSan-instrumented (see test/tsan_suppressions.txt).
// TSAN_OPTIONS from the environment is applied on top. Weak, so that a project-wide definition
// takes precedence instead of clashing.
#if defined(__SANITIZE_THREAD__)
extern "C" __attribute__((weak, visibility("default"))) const char* __tsan_default_options() {
  return "ignore_noninstrumented_modules=1:suppressions=" PDLIB_TSAN_SUPPRESSIONS;
}
#endif
