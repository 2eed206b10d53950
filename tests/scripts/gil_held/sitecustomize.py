"""On PYTHONPATH with ``MPDDP_TEST_HOLD_GIL=SECONDS``: this process's first import of torch holds the GIL that long
first, as loading torch's libraries did on a starved machine (measured: 3.4 s at a time, 20 busy processes on 2
cores). Taken out of the environment here, so the processes this one starts import torch at their own pace."""

import os

_HOLD = os.environ.pop("MPDDP_TEST_HOLD_GIL", None)

if _HOLD:
    import builtins
    import ctypes

    _real_import = builtins.__import__

    def _import(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002 - __import__'s own names
        if name == "torch" or name.startswith("torch."):
            builtins.__import__ = _real_import
            import signal

            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())  # a signal ends sleep() early
            ctypes.PyDLL(None).sleep(int(_HOLD))  # a PyDLL call keeps the GIL: no other thread runs meanwhile
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return _real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = _import
