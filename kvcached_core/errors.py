"""The two kinds of error the runtime raises (docs/architecture.md, principle 8).

Resource pressure is recoverable: the engine sees "no free blocks" and preempts or
retries. Unknown state is fatal: the pool refuses further work and says why. The native
extension raises these same classes (it imports this module), so callers catch one set.
"""

from __future__ import annotations


class KVCachedError(Exception):
    """Base class of every error raised by kvcached_core."""


class PoolExhausted(KVCachedError):
    """Not enough physical (or logical) capacity right now. Recoverable: retry or preempt."""


class StateConsistencyError(KVCachedError):
    """The pool no longer knows the state of its memory. Fatal: the pool rejects further work."""


class MapQuarantinedError(StateConsistencyError):
    """A map or unmap failed and its rollback was uncertain; the page was quarantined."""


class KVCachedConfigError(KVCachedError, ValueError):
    """A geometry or setting that cannot work (names the field and a fix)."""
