"""The one error type a user sees for an invalid TPUFineTune spec."""


class SpecError(ValueError):
    """An invalid spec: `field` is the full path (`spec.tpu.topology`), `message` the reason.

    `str()` is one line, `<field>: <message>`, the same shape `kubectl apply` prints for a
    schema or CEL refusal, so the CLI, the operator's status message and admission agree.
    """

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
