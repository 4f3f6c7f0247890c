"""Where a standalone job leaves its address and secret for deadpool-ctl on the same host.

One file per launcher, in a folder only its user can read
($DEADPOOL_RUN_DIR, else /tmp/deadpool-UID), removed when the job ends.

A multi-node job needs none: its operators have the settings its launchers
read (MASTER_ADDR, MASTER_PORT, DEADPOOL_SECRET); a standalone launcher
makes its secret and port up, so without this file nothing else could
reach its coordinator."""

import json
import os
import stat
import sys
import tempfile
from typing import List, Optional

from deadpool_ext.protocol import RUN_DIR_ENV, SECRET_ENV


def run_dir(environ=os.environ) -> str:
    return environ.get(RUN_DIR_ENV) or os.path.join(
        tempfile.gettempdir(), f"deadpool-{os.getuid()}"
    )


class UnsafeRunDir(Exception):
    """The folder is not this user's alone: the secret must not go there."""


def job_file(host: str, port: int) -> Optional[str]:
    """For deadpool-ctl on this host: a standalone launcher makes its job's
    secret and port up, so they go to a file only this user can read (none,
    with a line saying why, where that cannot be made sure of)."""
    try:
        return write_job(host, port, os.environ[SECRET_ENV], os.getpid())
    except (UnsafeRunDir, OSError) as error:
        print(f"deadpool-launch: deadpool-ctl will not find this job: {error}", file=sys.stderr)
        return None


def write_job(address: str, port: int, secret: str, pid: int, environ=os.environ) -> str:
    """The job's file, readable by its user alone; returns its path. The
    folder's name is predictable, so another user may have made it first or
    planted a link: it must be a real folder of this user's that no one else
    can enter, and the file is made anew, never followed through a link."""
    folder = run_dir(environ)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    check_private(folder)
    path = os.path.join(folder, f"job-{pid}.json")
    remove_job(path)  # a file a launcher of the same pid left behind
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    with os.fdopen(os.open(path, flags, 0o600), "w") as f:
        json.dump({"address": address, "port": port, "secret": secret, "pid": pid}, f)
    return path


def check_private(folder: str) -> None:
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise UnsafeRunDir(
            f"{folder} is not a folder of this user's that only it can open: set "
            f"{RUN_DIR_ENV} to one (deadpool-ctl then finds the job there)"
        )


def remove_job(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def running_jobs(environ=os.environ) -> List[dict]:
    """The standalone jobs of this user on this host whose launcher lives
    (a file a killed launcher left behind is removed)."""
    folder, jobs = run_dir(environ), []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        try:
            with open(path) as f:
                job = json.load(f)
        except (OSError, ValueError):
            continue
        if alive(int(job.get("pid", 0))):
            jobs.append(job)
        else:
            remove_job(path)
    return jobs


def alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
