"""The two errors a `target:` / `params:` config raises when it is wrong (ldm.util builds,
ldm.compat translates): the launcher reports both as one config-error line."""


class TargetError(ValueError):
    """A `target:` that does not name an importable object; the message says what is near."""


class ParamError(TargetError, TypeError):
    """`params:` that the target's signature does not take (unknown or missing names)."""
