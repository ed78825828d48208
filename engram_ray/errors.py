"""Errors a user can meet. Each says what was wrong, what was expected and what to do."""


class EngramRayError(Exception):
    """Base class: the CLI prints these as one line and exits with code 2."""


class ConfigError(EngramRayError, ValueError):
    """A config field (model config.json, deployment YAML, CLI argument) is missing or invalid."""

    def __init__(self, field: str, problem: str, expected: str | None = None):
        self.field, self.problem, self.expected = field, problem, expected
        message = f"{field}: {problem}"
        if expected:
            message += f" (expected {expected})"
        super().__init__(message)

    def __reduce__(self):
        # Raised in Ray actors and Serve replicas: it must unpickle at the caller intact.
        return type(self), (self.field, self.problem, self.expected)
