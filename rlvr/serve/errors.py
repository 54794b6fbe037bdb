"""The error answers of ``rlvr serve``: JSON ``{"error": {"message", "type", "param", "code"}}``, as vLLM's."""

from __future__ import annotations

from fastapi.responses import JSONResponse

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 408: "RequestTimeoutError",
               413: "RequestTooLargeError", 503: "ServiceUnavailableError", 500: "InternalServerError"}


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": None,
                                   "code": status}}, status_code=status, headers=headers)


class Refused(Exception):
    """Carries a finished error answer out of the helpers that prepare a request, to the route that answers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.response = error(status, message, headers)
