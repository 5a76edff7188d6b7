// Default ThreadSanitizer options for the control-plane tests (see test/tsan_suppressions.txt).
// TSAN_OPTIONS from the environment is applied on top. Weak, so that a project-wide definition
// (e.g. in test_main.cc) takes precedence instead of clashing.
#if defined(__SANITIZE_THREAD__)
extern "C" __attribute__((weak, visibility("default"))) const char* __tsan_default_options() {
  // Debian's gRPC, protobuf and Abseil are not TSan-instrumented.
  return "ignore_noninstrumented_modules=1";
}
#endif
