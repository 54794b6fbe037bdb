"""What can go wrong with rollout servers: the errors the server pool raises, and ``MalformedAnswer``, which it
catches (it sends the request to another server)."""


class NoServerError(RuntimeError):
    """No rollout server can be reached."""


class BadAnswerError(NoServerError):
    """No server gave a well-formed answer to a request in all its attempts."""


class PoolClosed(NoServerError):
    """The pool was closed while a request waited on it."""


class ServerRequestError(RuntimeError):
    """A server refused a request (4xx): retrying elsewhere would not help."""


class ServerAuthError(ServerRequestError):
    """A server refused the pool's API key, or the lack of one (401 / 403)."""


class AdapterSyncError(RuntimeError):
    """An adapter could not be loaded on every server; it was unloaded from those that took it."""


class MalformedAnswer(ValueError):
    """A server's answer failed validation (the pool sends the request to another server)."""
