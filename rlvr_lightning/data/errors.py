"""``DataError``: the one exception type of the data package, below every reader.

Its own module so the project's readers (``readers.py``, ``sources.py``) and the ``datasets``
path (``library.py``) raise the same type without importing each other.
"""

from __future__ import annotations


class DataError(ValueError):
    """A dataset the loader cannot use; the message names the file (and line) and the fix.

    A ``ValueError``, so existing handlers still catch it; a CLI can print just the message.
    """
