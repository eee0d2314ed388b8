"""Errors: the one base class of every error a user can cause.

A bad path, a truncated file, a wrong model id, a refused key, a full disk,
a seeder that is gone: each is raised as a ``UserError`` subclass whose message
is one line that says what to do.  The CLI prints exactly that line as
``p2pw: error: ...`` and exits 1; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """An error the user can cause and fix; ``str(e)`` is the whole message."""


class P2PError(UserError, RuntimeError):
    """A seed or join that cannot go on; the message says why, in one line."""


class LoaderOptionError(UserError, ValueError):
    """A bad option of an engine's load format (vLLM's ``--model-loader-extra-config`` or its ``P2PW_*``
    variable): the message names the option, its value and what it takes."""
