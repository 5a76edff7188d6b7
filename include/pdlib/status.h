// pdlib::Status and pdlib::StatusOr<T>: how every pdlib call reports failure.
//
// A Status is one pointer, null when OK, so returning success costs nothing. Codes are numbered
// like google/rpc/code.proto (and absl::StatusCode), so they map one to one onto gRPC. Status is
// a value type: copy it, move it, compare its code. No exception ever crosses pdlib's API.
#ifndef PDLIB_STATUS_H_
#define PDLIB_STATUS_H_

#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "pdlib/export.h"

namespace pdlib {
inline namespace v1 {

enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

// "OK", "INVALID_ARGUMENT", ... as gRPC spells them.
PDLIB_EXPORT std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] PDLIB_EXPORT Status {
 public:
  Status() noexcept = default;  // OK
  Status(StatusCode code, std::string_view message);
  Status(const Status& other);
  Status& operator=(const Status& other);
  Status(Status&& other) noexcept = default;
  Status& operator=(Status&& other) noexcept = default;
  ~Status() = default;

  static Status OK() { return Status(); }
  static Status Cancelled(std::string_view msg) { return {StatusCode::kCancelled, msg}; }
  static Status Unknown(std::string_view msg) { return {StatusCode::kUnknown, msg}; }
  static Status InvalidArgument(std::string_view msg) {
    return {StatusCode::kInvalidArgument, msg};
  }
  static Status DeadlineExceeded(std::string_view msg) {
    return {StatusCode::kDeadlineExceeded, msg};
  }
  static Status NotFound(std::string_view msg) { return {StatusCode::kNotFound, msg}; }
  static Status AlreadyExists(std::string_view msg) { return {StatusCode::kAlreadyExists, msg}; }
  static Status PermissionDenied(std::string_view msg) {
    return {StatusCode::kPermissionDenied, msg};
  }
  static Status ResourceExhausted(std::string_view msg) {
    return {StatusCode::kResourceExhausted, msg};
  }
  static Status FailedPrecondition(std::string_view msg) {
    return {StatusCode::kFailedPrecondition, msg};
  }
  static Status Aborted(std::string_view msg) { return {StatusCode::kAborted, msg}; }
  static Status OutOfRange(std::string_view msg) { return {StatusCode::kOutOfRange, msg}; }
  static Status Unimplemented(std::string_view msg) { return {StatusCode::kUnimplemented, msg}; }
  static Status Internal(std::string_view msg) { return {StatusCode::kInternal, msg}; }
  static Status Unavailable(std::string_view msg) { return {StatusCode::kUnavailable, msg}; }
  static Status DataLoss(std::string_view msg) { return {StatusCode::kDataLoss, msg}; }
  static Status Unauthenticated(std::string_view msg) {
    return {StatusCode::kUnauthenticated, msg};
  }

  bool ok() const noexcept { return rep_ == nullptr; }
  StatusCode code() const noexcept { return rep_ ? rep_->code : StatusCode::kOk; }
  // Empty when OK.
  std::string_view message() const noexcept {
    return rep_ ? std::string_view(rep_->message) : std::string_view();
  }
  // "OK" or "INVALID_ARGUMENT: page index 812 out of range [0, 512) ...".
  std::string ToString() const;
  // A copy whose message is "<prefix>: <message>"; OK stays OK.
  Status WithPrefix(std::string_view prefix) const;

  // Marks a deliberately ignored status.
  void IgnoreError() const noexcept {}

 private:
  struct Rep {
    StatusCode code;
    std::string message;
  };
  std::unique_ptr<Rep> rep_;
};

inline bool operator==(const Status& a, const Status& b) {
  return a.code() == b.code() && a.message() == b.message();
}

// A value or the Status that explains why there is none.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  // Implicit from a non-OK Status; an OK Status without a value is turned into kInternal.
  StatusOr(Status status) : status_(std::move(status)) {  // NOLINT(runtime/explicit)
    if (status_.ok()) status_ = Status::Internal("StatusOr constructed from an OK Status");
  }
  StatusOr(T value) : value_(std::move(value)) {}  // NOLINT(runtime/explicit)

  bool ok() const noexcept { return status_.ok(); }
  const Status& status() const& noexcept { return status_; }
  Status status() && { return std::move(status_); }

  // Precondition: ok(). Violations abort with the status (pdlib never throws).
  T& value() & {
    CheckOk();
    return *value_;
  }
  const T& value() const& {
    CheckOk();
    return *value_;
  }
  T&& value() && {
    CheckOk();
    return std::move(*value_);
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  void CheckOk() const {
    if (!status_.ok()) AbortOnBadAccess(status_);
  }
  [[noreturn]] static void AbortOnBadAccess(const Status& status);

  Status status_;
  std::optional<T> value_;
};

namespace internal {
[[noreturn]] PDLIB_EXPORT void AbortWithStatus(const char* what, const Status& status);
}  // namespace internal

template <typename T>
void StatusOr<T>::AbortOnBadAccess(const Status& status) {
  internal::AbortWithStatus("StatusOr::value() called on an error", status);
}

}  // namespace v1
}  // namespace pdlib

#endif  // PDLIB_STATUS_H_
