"""The error every layer of the local Hub raises: an HTTP status, a message and the Hub's error code."""

from __future__ import annotations

# The start of every refusal of something the real Hub does and this server does not.
NOT_SUPPORTED = "Not supported by this local Hub"


class HubError(Exception):
    """An error with the HTTP status and the `X-Error-Code` huggingface_hub maps to its exceptions."""

    def __init__(self, status: int, message: str, code: str | None = None, commit: str | None = None):
        # A message quoting a client's lone surrogate must still encode as UTF-8 in the answer.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.commit = commit

