"""pdlib.Error and one subclass per StatusCode.

Every failed pdlib call raises the subclass of its status code; str(error) is the status as
pdlib prints it ("DEADLINE_EXCEEDED: room 7: timed out ..."), error.reason the message alone.
A few subclasses also derive from the builtin exception Python code would expect (ValueError
for a bad argument, IndexError for an index out of range, TimeoutError for a deadline), so
generic handlers keep working.
"""

from __future__ import annotations

from typing import Dict, Optional, Type

from ._enums import StatusCode


class Error(Exception):
    """A pdlib failure: code (StatusCode) and reason (pdlib's message, unchanged)."""

    code: StatusCode = StatusCode.Unknown

    def __init__(self, status: str, code: Optional[int] = None, reason: Optional[str] = None):
        super().__init__(status)
        if code is not None:
            self.code = StatusCode(code)
        self.reason = status if reason is None else reason

    @property
    def status(self) -> str:
        return str(self)


class CancelledError(Error):
    code = StatusCode.Cancelled


class UnknownError(Error):
    code = StatusCode.Unknown


class InvalidArgumentError(Error, ValueError):
    code = StatusCode.InvalidArgument


class DeadlineExceededError(Error, TimeoutError):
    code = StatusCode.DeadlineExceeded


class NotFoundError(Error, LookupError):
    code = StatusCode.NotFound


class AlreadyExistsError(Error):
    code = StatusCode.AlreadyExists


class PermissionDeniedError(Error, PermissionError):
    code = StatusCode.PermissionDenied


class ResourceExhaustedError(Error):
    code = StatusCode.ResourceExhausted


class FailedPreconditionError(Error):
    code = StatusCode.FailedPrecondition


class AbortedError(Error):
    code = StatusCode.Aborted


class OutOfRangeError(Error, IndexError):
    code = StatusCode.OutOfRange


class UnimplementedError(Error, NotImplementedError):
    code = StatusCode.Unimplemented


class InternalError(Error):
    code = StatusCode.Internal


class UnavailableError(Error, ConnectionError):
    code = StatusCode.Unavailable


class DataLossError(Error):
    code = StatusCode.DataLoss


class UnauthenticatedError(Error):
    code = StatusCode.Unauthenticated


class ClosedError(FailedPreconditionError):
    """A manager, handle or server was used after close()."""


ERROR_BY_CODE: Dict[StatusCode, Type[Error]] = {
    cls.code: cls
    for cls in (
        CancelledError,
        UnknownError,
        InvalidArgumentError,
        DeadlineExceededError,
        NotFoundError,
        AlreadyExistsError,
        PermissionDeniedError,
        ResourceExhaustedError,
        FailedPreconditionError,
        AbortedError,
        OutOfRangeError,
        UnimplementedError,
        InternalError,
        UnavailableError,
        DataLossError,
        UnauthenticatedError,
    )
}
