"""Errors a user can meet. Each says what was wrong, what was expected and what to do."""


class EngramRayError(Exception):
    """Base class: the CLI prints these as one line and exits with code 2."""


class ConfigError(EngramRayError, ValueError):
    """A config field (model config.json, deployment YAML, CLI argument) is missing or invalid."""

    def __init__(self, field: str, problem: str, expected: str | None = None):
        self.field = field
        message = f"{field}: {problem}"
        if expected:
            message += f" (expected {expected})"
        super().__init__(message)
