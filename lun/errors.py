"""The error a user's config raises, apart from the config code so that every module that checks
a config (lun.config, lun.legacy's translations) can raise it without importing the other."""


class ConfigError(ValueError):
    """A mistake in the user's config: the message is one line naming the key or file."""


def first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0]
