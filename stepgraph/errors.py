"""The one error type a user sees: a one-line message that says what is wrong and what to do."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user (spec, deployment, artifact, flags).

    The CLI prints ``error: <message>`` on one line and exits with status 2.
    """


class SpecError(UserError):
    """A spec file that does not parse or does not validate."""


class ArtifactError(UserError):
    """An artifact that is missing, corrupt, tampered with or from another version."""
