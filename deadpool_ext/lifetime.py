"""A process's life bound to its parent's: Linux's parent-death signal.

Workers die with their agent: a lost agent leaves no orphan holding a rank.
(Agents outlive their node's launcher: a launcher that hosts the coordinator
or the standby is a control-plane role, which another node takes over. A
standalone launcher is the whole control plane of its emulated nodes: the
agents it forks die with it.)
"""

import ctypes
import os
import signal
from typing import Optional

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: Optional[int]) -> bool:
    """Ask Linux to SIGKILL this process when its parent dies. False if the
    parent ``parent_pid`` is gone already (it died before the request)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    return parent_pid is None or os.getppid() == parent_pid
