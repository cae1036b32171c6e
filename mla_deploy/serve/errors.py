"""OpenAI's error objects: the status, message, field and code of every refusal the HTTP layer sends."""

from __future__ import annotations


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers or {}

    @property
    def body(self) -> dict:
        # OpenAI's types: a request the server will not take, whatever its status, is an invalid_request_error (the
        # code says which: invalid_api_key, model_not_found, context_length_exceeded)
        kind = "invalid_request_error" if self.status in (400, 401, 404, 405, 413) else {
            429: "rate_limit_error", 503: "service_unavailable"}.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)
