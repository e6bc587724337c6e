"""The two errors a `target:` / `params:` config raises when it is wrong (ldm.util builds,
ldm.compat translates): the launcher reports both as one config-error line."""


class TargetError(ValueError):
    """A `target:` that does not name an importable object; the message says what is near."""


class ParamError(TargetError, TypeError):
    """`params:` that the target's signature does not take (unknown or missing names)."""


def is_number(value) -> bool:
    """An int or a float from a config, not a bool (YAML's `true` is an int to Python)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_count(value, lowest: int) -> bool:
    """A whole number >= lowest from a config, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= lowest


def check_whole_numbers(minimum: int = 1, **values) -> None:
    """ValueError naming the first of `values` (a constructor's sizes: widths, depths, patch
    sides) that is not a whole number >= minimum - a zero width would otherwise build a model
    that fails at its first step, a zero patch a ZeroDivisionError."""
    for name, value in values.items():
        if not is_count(value, minimum):
            raise ValueError(f"{name}={value!r}: expected a whole number >= {minimum}")
