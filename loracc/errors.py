"""The two ways loracc says no."""


class LoraccError(ValueError):
    """The user's model or arguments cannot be compiled; the message says what to change."""


class Unsupported(Exception):
    """A region cannot be compiled; it runs eagerly instead, with a warning naming the reason."""
