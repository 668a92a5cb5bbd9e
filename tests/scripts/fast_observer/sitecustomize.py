"""Start-up hook for tests: Lightning's child-process observer polls every 20 ms instead of every 5 s.

The observer SIGKILLs the launching process as soon as one of its launched ranks has exited
non-zero. Polling fast turns "it may fire before the launching rank has reported its error"
from a rare race into a certainty, so a test run with this hook fails on code that has the race.
"""

import lightning.fabric.strategies.launchers.subprocess_script as _launcher

_init = _launcher._ChildProcessObserver.__init__


def _fast(self, main_pid, child_processes, sleep_period=5):
    _init(self, main_pid, child_processes, sleep_period=0.02)


_launcher._ChildProcessObserver.__init__ = _fast
