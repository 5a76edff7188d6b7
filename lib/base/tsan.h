// Happens-before edges that ThreadSanitizer cannot see on its own.
//
// gRPC's callback API runs a reactor's reactions on its own threads, ordered by its completion
// queues, which live in Debian's uninstrumented libgrpc. TSan therefore sees a reactor built on
// one thread and its reactions on another as unordered. Reactors call PdlibTsanRelease(this)
// before every call that hands work to gRPC and PdlibTsanAcquire(this) first thing in every
// reaction, which restores exactly the ordering gRPC guarantees. No-ops outside TSan builds.
#ifndef PDLIB_LIB_BASE_TSAN_H_
#define PDLIB_LIB_BASE_TSAN_H_

#if defined(__SANITIZE_THREAD__)
#define PDLIB_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define PDLIB_TSAN 1
#endif
#endif

#ifdef PDLIB_TSAN
#include <sanitizer/tsan_interface.h>
inline void PdlibTsanAcquire(void* addr) { __tsan_acquire(addr); }
inline void PdlibTsanRelease(void* addr) { __tsan_release(addr); }
#else
inline void PdlibTsanAcquire(void*) {}
inline void PdlibTsanRelease(void*) {}
#endif

#endif  // PDLIB_LIB_BASE_TSAN_H_
