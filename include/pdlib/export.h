// Symbol export and ABI versioning for pdlib's public API.
#ifndef PDLIB_EXPORT_H_
#define PDLIB_EXPORT_H_

// The library is built with -fvisibility=hidden; everything an engine calls is marked.
#if defined(_WIN32)
#define PDLIB_EXPORT __declspec(dllexport)
#else
#define PDLIB_EXPORT [[gnu::visibility("default")]]
#endif

#define PDLIB_VERSION_MAJOR 0
#define PDLIB_VERSION_MINOR 2
#define PDLIB_VERSION_PATCH 0

// The version of pdlib's wire protocol (control messages and the KV layout they describe). It
// travels in every fingerprint; a peer with another version is refused when it registers.
// 3: decode prefixes and several state families in Register, RegisterAck and TransferInfo.
#define PDLIB_WIRE_VERSION 4

#endif  // PDLIB_EXPORT_H_
