"""The project's errors, one hierarchy, each carrying what the caller should do next.

::

    ExtprocError                    base; never raised itself
    +-- ConfigError                 bad flags or settings: fix and restart (exit code 2)
    +-- SourceError                 a catalog source cannot be read at all (file missing, not YAML)
    +-- KubeApiError                a Kubernetes API request failed; ``status`` (0: no answer)
    +-- RequestError                a client's request cannot be routed; carries an HTTP status
        +-- BadRequest              400: body is not JSON, ``model`` missing or not a string
        +-- ModelNotFound           404: no worker set serves the model name
        +-- BodyTooLarge            413: body over ``--max-body-bytes``
        +-- Overloaded              429: shed (too many bodies held, queue full or timed out)
        |   +-- Saturated           429: every candidate endpoint is saturated (flow control may queue it)
        +-- NoReadyEndpoint         503: the model exists but no endpoint can take the request

:func:`extproc.protocol.messages.error_response` is the one place that turns a RequestError into
an HTTP answer (OpenAI's error shape); anything else reaching the request path is a bug and
becomes a 500 logged once with the request id.
"""

from __future__ import annotations


class ExtprocError(Exception):
    """Base of every error this project raises on purpose."""


class ConfigError(ExtprocError):
    """Settings or flags are invalid; the message names the flag and the value."""


class SourceError(ExtprocError):
    """A catalog source cannot be read or parsed at all."""


class KubeApiError(ExtprocError):
    """A Kubernetes API request failed: ``status`` is the HTTP status, 0 when nothing answered.

    410 means the resourceVersion is too old (list again); 404 that the resource or object is not
    there; anything else is retried later with backoff.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class RequestError(ExtprocError):
    """A request that cannot be routed, with the HTTP status and OpenAI error type to answer."""

    status: int = 500
    error_type: str = "internal_error"
    #: OpenAI's machine-readable ``code`` (e.g. ``model_not_found``).
    code: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequest(RequestError):
    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class ModelNotFound(RequestError):
    status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class BodyTooLarge(RequestError):
    status = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class Overloaded(RequestError):
    status = 429
    error_type = "rate_limit_error"
    code = "overloaded"

    def __init__(self, message: str, *, retry_after: int = 1, code: str | None = None) -> None:
        super().__init__(message)
        #: Whole seconds for the ``Retry-After`` header (every 429 carries one).
        self.retry_after = max(1, retry_after)
        if code is not None:
            #: Why it was refused, e.g. ``queue_timeout`` (OpenAI's ``code``, and the metric label).
            self.code = code


class Saturated(Overloaded):
    """Every candidate endpoint of the request's pool is saturated (the scheduler's verdict):
    request control queues the request when flow control allows, else it is answered as is."""

    code = "saturated"

    def __init__(self, message: str, *, prompt_tokens: int | None = None) -> None:
        super().__init__(message)
        #: The request's prompt tokens when the decision knew them (what fair queuing charges).
        self.prompt_tokens = prompt_tokens


class NoReadyEndpoint(RequestError):
    status = 503
    error_type = "service_unavailable"
    code = "no_ready_endpoint"
