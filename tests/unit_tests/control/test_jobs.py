"""Where a standalone job leaves its address and secret
(deadpool_ext/control/jobs.py): only in a folder of this user's alone."""

import os

import pytest

from deadpool_ext.control import jobs


def test_the_job_file_goes_only_to_a_folder_of_this_users_alone(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(jobs.UnsafeRunDir, match="only it can open"):
        jobs.write_job("127.0.0.1", 1, "s", 5, {"DEADPOOL_RUN_DIR": str(shared)})
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(private)
    with pytest.raises(jobs.UnsafeRunDir):
        jobs.write_job("127.0.0.1", 1, "s", 5, {"DEADPOOL_RUN_DIR": str(tmp_path / "link")})
    assert os.listdir(private) == [] and os.listdir(shared) == []
