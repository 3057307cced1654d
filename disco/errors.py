"""Domain errors of disco-serve.

Every layer raises these; the transports map them to their own vocabulary in exactly one
place (the gRPC interceptor maps them to status codes, the CLI to one stderr line and a
non-zero exit code).
"""


class DiscoError(Exception):
    """Base class of all domain errors; the message is meant for the user."""


class InvalidRequest(DiscoError):
    """The request itself is wrong (empty prompt, bad policy spec, out-of-range value)."""


class SessionNotFound(DiscoError):
    """A service does not know (or no longer knows) a session id."""


class SessionMismatch(DiscoError):
    """A call expects the session at another length than it is (a repeated, stale or
    foreign call): refused, and the session left unchanged."""


class ResourceExhausted(DiscoError):
    """A limit was hit (too many sessions, too many tokens)."""


class ModelError(DiscoError):
    """A model could not be found, fetched, verified or loaded."""


class VocabularyMismatch(ModelError):
    """The draft model's tokenizer/vocabulary differs from the target's."""


class Unavailable(DiscoError):
    """A backend needed to serve the request is not reachable."""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty),
    for wrapping a third-party error into one of ours."""
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
