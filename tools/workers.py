"""The environment in which the tools (the campaign, the benchmarks) and the
tests start this repository's processes on one machine: a job's ranks share
few cores, so each runs one OpenMP thread; warnings stay out of the output
that is read; the repository is on the path, as tools/ is not installed."""

import os
from typing import Dict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker_env(**extra: str) -> Dict[str, str]:
    """This process's environment with the above, and ``extra`` on top."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    env.update(extra)
    return env
