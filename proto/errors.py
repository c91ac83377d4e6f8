"""The project's own error types."""


class InvalidRequestError(ValueError):
    """A request that can never be served as given. `field` names the culprit
    so that the HTTP and gRPC fronts can report it (400 / INVALID_ARGUMENT)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class LoRAAdapterError(InvalidRequestError):
    """A runtime adapter load or unload refused: `kind` is 'not_found' (no
    adapter by that name: 404) or 'conflict' (loaded already, or in use: 409)."""

    def __init__(self, message: str, kind: str, field: str | None = "lora_name"):
        super().__init__(message, field)
        self.kind = kind


class EngineDeadError(RuntimeError):
    """The engine cannot go on: its loop failed, made no progress for the
    stall timeout while it had work, or lost a tensor-parallel rank. Its
    requests end with it; the worker reports them unavailable, and the
    router sends them to another worker (router/routing/failover.py)."""


class RequestMoved(Exception):
    """A waiting request the worker handed back before it ran (a newer
    worker has room; router/routing/rebalance.py). The worker reports it 'moved' and
    the router sends it again, to another worker, at no cost to its retries."""


class EngineFaultError(RuntimeError):
    """A failure inside a step that no one request can be blamed for (a
    kernel fault, a lost device): the engine cannot go on and dies."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (while staging, sampling or
    detokenizing it) and was ended alone; the others went on. The worker
    reports it 'failed' (500) and the router never sends it elsewhere."""
