"""Folders the project makes are 0700 and this user's; one found in their place that is not
(another user's, open to others, a symlink, a file) is refused with what to do. Real folders."""

import os
import stat

import pytest

from engram_ray import private_dirs
from engram_ray.private_dirs import UnsafeFolderError, check_private, private_dir


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path, follow_symlinks=False).st_mode)


@pytest.fixture
def project_tmp(tmp_path, monkeypatch):
    root = tmp_path / "engram-ray"
    monkeypatch.setattr(private_dirs, "PROJECT_TMP", str(root))
    return root


def test_missing_folders_are_made_0700_whatever_the_umask(project_tmp):
    old = os.umask(0)
    try:
        made = private_dir(str(project_tmp / "a" / "b"), "test folder")
    finally:
        os.umask(old)
    assert made == str(project_tmp / "a" / "b")
    for folder in (project_tmp, project_tmp / "a", project_tmp / "a" / "b"):
        assert mode(folder) == 0o700 and os.stat(folder).st_uid == os.getuid()
    assert private_dir(made, "test folder") == made  # an existing private one is fine


def test_a_folder_open_to_others_is_refused_with_what_to_do(project_tmp):
    project_tmp.mkdir(mode=0o700)
    open_one = project_tmp / "engine-shm"
    open_one.mkdir()
    os.chmod(open_one, 0o755)
    with pytest.raises(UnsafeFolderError, match=r"test folder .*engine-shm has mode 0755, "
                                                r"expected 0700 .* run `chmod 700 "):
        private_dir(str(open_one), "test folder")
    assert mode(open_one) == 0o755  # refused, not changed behind the operator's back


def test_an_open_parent_in_the_project_tmp_is_refused(project_tmp):
    project_tmp.mkdir()
    os.chmod(project_tmp, 0o777)  # anyone could rename engine-shm away and plant their own
    with pytest.raises(UnsafeFolderError, match="has mode 0777"):
        private_dir(str(project_tmp / "engine-shm"), "test folder")
    assert not (project_tmp / "engine-shm").exists()


def test_outside_the_project_tmp_only_the_folder_itself_is_checked(tmp_path, project_tmp):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)  # e.g. /mnt/shared: the operator's
    assert mode(private_dir(str(shared / "store"), "test folder")) == 0o700


def test_a_symlink_or_file_in_its_place_is_refused(project_tmp, tmp_path):
    project_tmp.mkdir(mode=0o700)
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (project_tmp / "link").symlink_to(target)
    with pytest.raises(UnsafeFolderError, match="is not a plain directory .found a symlink"):
        private_dir(str(project_tmp / "link"), "test folder")
    (project_tmp / "file").write_text("")
    with pytest.raises(UnsafeFolderError, match="found a file"):
        private_dir(str(project_tmp / "file"), "test folder")


def test_another_users_folder_is_refused(tmp_path):
    st = os.stat(tmp_path)
    foreign = os.stat_result((stat.S_IFDIR | 0o700, *st[1:4], st.st_uid + 1, *st[5:]))
    with pytest.raises(UnsafeFolderError, match=f"belongs to uid {os.getuid() + 1}, not this "
                                                f"user .{os.getuid()}.; another user made it"):
        check_private(str(tmp_path), "test folder", st=foreign)


def test_a_folder_never_reused_can_ask_that_it_is_new(project_tmp):
    path = str(project_tmp / "generation")
    private_dir(path, "test folder", exist_ok=False)
    with pytest.raises(FileExistsError):
        private_dir(path, "test folder", exist_ok=False)


def test_a_callers_error_class_is_raised(project_tmp):
    class StoreError(Exception):
        pass

    project_tmp.mkdir(mode=0o755)
    os.chmod(project_tmp, 0o755)
    with pytest.raises(StoreError, match="has mode 0755"):
        private_dir(str(project_tmp), "store", StoreError)
