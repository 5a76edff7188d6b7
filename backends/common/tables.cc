#include "backends/common/tables.h"

#include <string>

namespace pdlib {
inline namespace v1 {
namespace toolkit {

namespace {

// "<backend>: write <index>" (or "read"), built only for an error.
std::string WriteName(std::string_view backend, size_t index, OpKind kind) {
  return std::string(backend) + (kind == OpKind::kRead ? ": read " : ": write ") +
         std::to_string(index);
}

}  // namespace

Status CheckWrite(std::string_view backend, size_t index, const spi::WriteOp& op, spi::PeerId peer,
                  std::optional<uint64_t> local_length, std::optional<uint64_t> remote_length,
                  OpKind kind) {
  if (!local_length) {
    return Status::InvalidArgument(WriteName(backend, index, kind) +
                                   " names unregistered local region " +
                                   std::to_string(op.local_region));
  }
  if (!remote_length) {
    return Status::InvalidArgument(
        WriteName(backend, index, kind) + " names unknown remote region " +
        std::to_string(op.remote_region) + " of peer " + std::to_string(peer));
  }
  if (op.length > *local_length || op.local_offset > *local_length - op.length) {
    return Status::OutOfRange(WriteName(backend, index, kind) + " of " + std::to_string(op.length) +
                              " bytes at offset " + std::to_string(op.local_offset) +
                              " leaves local region " + std::to_string(op.local_region) + " of " +
                              std::to_string(*local_length) + " bytes");
  }
  if (op.length > *remote_length || op.remote_offset > *remote_length - op.length) {
    return Status::OutOfRange(WriteName(backend, index, kind) + " of " + std::to_string(op.length) +
                              " bytes at offset " + std::to_string(op.remote_offset) +
                              " leaves remote region " + std::to_string(op.remote_region) + " of " +
                              std::to_string(*remote_length) + " bytes");
  }
  return Status::OK();
}

Status CheckRemoteRegion(std::string_view backend, const spi::RemoteRegion& region) {
  if (region.length == 0) {
    return Status::InvalidArgument(std::string(backend) + ": empty remote region");
  }
  if (region.addr + region.length < region.addr) {
    return Status::InvalidArgument(std::string(backend) + ": remote region wraps around");
  }
  return Status::OK();
}

}  // namespace toolkit
}  // namespace v1
}  // namespace pdlib
