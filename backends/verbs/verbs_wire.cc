#include "backends/verbs/verbs_wire.h"

#include <algorithm>
#include <string>

#include "backends/verbs/verbs_options.h"

namespace pdlib {
inline namespace v1 {
namespace verbs {
namespace {

constexpr size_t kHeader = 8;
constexpr size_t kQpEntry = 32;
constexpr size_t kKeyEntry = 4;
constexpr uint8_t kFlagGlobal = 1;

void PutLe(spi::Blob& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<uint8_t>(value >> (8 * i)));
}

uint64_t GetLe(const uint8_t* p, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= uint64_t{p[i]} << (8 * i);
  return value;
}

void PutHeader(spi::Blob& out, uint32_t magic, size_t count) {
  PutLe(out, magic, 4);
  PutLe(out, kWireVersion, 2);
  PutLe(out, count, 2);
}

std::string MagicName(uint32_t magic) {
  if (magic == kEndpointMagic) return "a verbs endpoint blob";
  if (magic == kReplyMagic) return "a verbs reply blob";
  if (magic == kKeyMagic) return "a verbs key blob";
  return "not a verbs blob (made by another backend?)";
}

// Checks the header and returns the entry count.
StatusOr<size_t> CheckHeader(const spi::Blob& blob, uint32_t magic, size_t entry_size,
                             const char* what) {
  if (blob.size() < kHeader) {
    return Status::InvalidArgument("verbs: " + std::string(what) + " blob of " +
                                   std::to_string(blob.size()) + " bytes is too short");
  }
  const uint32_t got = static_cast<uint32_t>(GetLe(blob.data(), 4));
  if (got != magic) {
    return Status::InvalidArgument("verbs: expected a verbs " + std::string(what) + " blob, got " +
                                   MagicName(got));
  }
  const uint16_t version = static_cast<uint16_t>(GetLe(blob.data() + 4, 2));
  if (version != kWireVersion) {
    return Status::InvalidArgument("verbs: " + std::string(what) + " blob has version " +
                                   std::to_string(version) + ", this pdlib reads version " +
                                   std::to_string(kWireVersion));
  }
  const size_t count = GetLe(blob.data() + 6, 2);
  if (count < 1 || count > kMaxDevices) {
    return Status::InvalidArgument("verbs: " + std::string(what) + " blob has " +
                                   std::to_string(count) + " entries, expected 1.." +
                                   std::to_string(kMaxDevices));
  }
  if (blob.size() != kHeader + count * entry_size) {
    return Status::InvalidArgument("verbs: " + std::string(what) + " blob of " +
                                   std::to_string(blob.size()) + " bytes does not hold " +
                                   std::to_string(count) + " entries of " +
                                   std::to_string(entry_size) + " bytes");
  }
  return count;
}

}  // namespace

spi::Blob EncodeQpAddresses(uint32_t magic, const std::vector<QpAddress>& qps) {
  spi::Blob out;
  out.reserve(kHeader + qps.size() * kQpEntry);
  PutHeader(out, magic, qps.size());
  for (const QpAddress& qp : qps) {
    PutLe(out, qp.qp_num, 4);
    PutLe(out, qp.psn, 4);
    PutLe(out, qp.lid, 2);
    PutLe(out, qp.mtu, 1);
    PutLe(out, qp.global ? kFlagGlobal : 0, 1);
    PutLe(out, qp.port, 1);
    PutLe(out, qp.rd_atomic, 1);
    PutLe(out, 0, 2);
    out.insert(out.end(), qp.gid.begin(), qp.gid.end());
  }
  return out;
}

StatusOr<std::vector<QpAddress>> DecodeQpAddresses(const spi::Blob& blob, uint32_t magic,
                                                   const char* what) {
  auto count = CheckHeader(blob, magic, kQpEntry, what);
  if (!count.ok()) return count.status();
  std::vector<QpAddress> qps(*count);
  for (size_t i = 0; i < *count; ++i) {
    const uint8_t* p = blob.data() + kHeader + i * kQpEntry;
    QpAddress& qp = qps[i];
    qp.qp_num = static_cast<uint32_t>(GetLe(p, 4));
    qp.psn = static_cast<uint32_t>(GetLe(p + 4, 4));
    qp.lid = static_cast<uint16_t>(GetLe(p + 8, 2));
    qp.mtu = p[10];
    const uint8_t flags = p[11];
    qp.port = p[12];
    qp.rd_atomic = p[13];
    std::copy(p + 16, p + 32, qp.gid.begin());
    const std::string where = "verbs: " + std::string(what) + " blob entry " + std::to_string(i);
    if (std::all_of(p, p + kQpEntry, [](uint8_t b) { return b == 0; })) {
      qp = QpAddress::Absent();  // a rail without a QP
      continue;
    }
    // QP numbers 0 and 1 are the management QPs; numbers and PSNs are 24-bit on the wire.
    if (qp.qp_num < 2 || qp.qp_num > 0xffffff) {
      return Status::InvalidArgument(where + ": qp_num " + std::to_string(qp.qp_num) +
                                     " out of range [2, 16777215] (an entry of zero bytes marks a "
                                     "rail without a QP)");
    }
    if (qp.psn > 0xffffff) {
      return Status::InvalidArgument(where + ": psn " + std::to_string(qp.psn) +
                                     " out of range [0, 16777215]");
    }
    if (qp.mtu < 1 || qp.mtu > 5) {
      return Status::InvalidArgument(where + ": mtu " + std::to_string(qp.mtu) +
                                     " out of range [1, 5] (IBV_MTU_256..IBV_MTU_4096)");
    }
    if (qp.rd_atomic == 0) {
      return Status::InvalidArgument(where + ": rd_atomic 0 out of range [1, 255]");
    }
    if ((flags & ~kFlagGlobal) != 0 || p[14] != 0 || p[15] != 0) {
      return Status::InvalidArgument(where + ": unknown flags " + std::to_string(flags) +
                                     " or non-zero reserved bytes");
    }
    qp.global = (flags & kFlagGlobal) != 0;
    if (qp.port < 1) {
      return Status::InvalidArgument(where + ": port 0 (ports are numbered from 1)");
    }
    if (!qp.global && (qp.lid == 0 || qp.lid >= 0xc000)) {
      return Status::InvalidArgument(where + ": LID " + std::to_string(qp.lid) +
                                     " is not a unicast LID [1, 49151] and no GID routing is set");
    }
  }
  return qps;
}

spi::Blob EncodeKeys(const std::vector<uint32_t>& rkeys) {
  spi::Blob out;
  out.reserve(kHeader + rkeys.size() * kKeyEntry);
  PutHeader(out, kKeyMagic, rkeys.size());
  for (uint32_t rkey : rkeys) PutLe(out, rkey, 4);
  return out;
}

StatusOr<std::vector<uint32_t>> DecodeKeys(const spi::Blob& blob) {
  auto count = CheckHeader(blob, kKeyMagic, kKeyEntry, "key");
  if (!count.ok()) return count.status();
  std::vector<uint32_t> rkeys(*count);
  for (size_t i = 0; i < *count; ++i) {
    rkeys[i] = static_cast<uint32_t>(GetLe(blob.data() + kHeader + i * kKeyEntry, 4));
  }
  return rkeys;
}

}  // namespace verbs
}  // namespace v1
}  // namespace pdlib
