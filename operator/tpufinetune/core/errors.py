"""Error types the core names: an invalid spec (the one a user sees), a refused create,
and the status-write conflict the driver and its backends share."""


class SpecError(ValueError):
    """An invalid spec: `field` is the full path (`spec.tpu.topology`), `message` the reason.

    `str()` is one line, `<field>: <message>`, the same shape `kubectl apply` prints for a
    schema or CEL refusal, so the CLI, the operator's status message and admission agree.
    """

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class CreateRefused(RuntimeError):
    """The API server refused to create the RayCluster (an admission webhook or policy, a
    ResourceQuota, a malformed object): not transient. `str()` is the server's message."""


class StatusConflict(RuntimeError):
    """A status write was refused because the object changed since its resourceVersion was
    read (409 Conflict): another writer (kopf's status.kopf, a spec edit, another operator
    replica) came first. The writer re-reads the status before it decides again."""
