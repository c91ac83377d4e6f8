"""The error every front turns into its protocol's status: HTTP's code and
OpenAI error body, gRPC's status code."""

from __future__ import annotations


class ServingError(Exception):
    """kind: invalid (400 / INVALID_ARGUMENT), full (429 / RESOURCE_EXHAUSTED),
    unavailable (503 / UNAVAILABLE), unauthenticated (401 / UNAUTHENTICATED),
    not_found (404 / NOT_FOUND), forbidden (403 / PERMISSION_DENIED),
    conflict (409 / FAILED_PRECONDITION), internal (500 / INTERNAL)."""

    def __init__(self, kind: str, message: str, field: str | None = None, code: str | None = None):
        super().__init__(message)
        self.kind, self.message, self.field = kind, message, field
        self.code = code  # a finer reason than the kind's default code
