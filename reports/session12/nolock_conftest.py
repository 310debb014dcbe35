# ruff: noqa
# fmt: off
# Loaded with -p: replaces the stream counters' lock by a no-op, to see whether the thread test
# can fail without it (session 12 check; not part of the suite).
import contextlib
from batchinv.gpu import rms_norm as g

class _NoLock:
    def acquire(self): return True
    def release(self): pass

_orig = g._StreamCounters.__init__
def _init(self, counters):
    _orig(self, counters)
    self.lock = _NoLock()
g._StreamCounters.__init__ = _init
