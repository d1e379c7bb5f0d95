"""The errors of the development tools: one class, in the project's error family, with a stable code.

Raised by ``devkit`` only; nothing in ``store``, ``worker`` or the client library raises or catches it.
"""

from __future__ import annotations

from store import errors


class EmbeddedError(errors.LoushoError, RuntimeError):
    """Raised when an embedded server could not be found, started or stopped (the message quotes its log).

    A ``LoushoError`` so that ``lousho dev`` and ``lousho demo`` print its stable code like any other
    error; still a ``RuntimeError``, as it was before it joined the family.
    """

    code = "LOUSHO_EMBEDDED_FAILED"
