"""``source_commit``: a result names a commit only when the checkout that holds the project
root is the project itself (a copy staged inside another checkout gets None, not that
checkout's commit), marks uncommitted tracked changes, and defers to BATCHINV_GIT_COMMIT."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from batchinv.provenance import source_commit

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(cwd, *args):
    command = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args]
    return subprocess.run(command, cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.delenv("BATCHINV_GIT_COMMIT", raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "kernel.cu").write_text("// v1\n")
    _git(tmp_path, "add", "kernel.cu")
    _git(tmp_path, "commit", "-q", "-m", "v1")
    return tmp_path


def test_the_projects_own_checkout_names_its_head(repo):
    assert source_commit(repo) == _git(repo, "rev-parse", "HEAD").strip()


def test_uncommitted_tracked_changes_are_marked_dirty(repo):
    (repo / "kernel.cu").write_text("// v2\n")
    assert source_commit(repo) == _git(repo, "rev-parse", "HEAD").strip() + "+dirty"


def test_a_copy_inside_another_checkout_names_no_commit(repo):
    staged = repo / ".carry" / "copy"
    staged.mkdir(parents=True)
    (staged / "kernel.cu").write_text("// other code\n")
    assert source_commit(staged) is None


def test_a_directory_outside_git_names_no_commit(tmp_path, monkeypatch):
    monkeypatch.delenv("BATCHINV_GIT_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert source_commit(tmp_path) is None


def test_the_environment_variable_wins(repo, monkeypatch):
    monkeypatch.setenv("BATCHINV_GIT_COMMIT", "abc1234")
    assert source_commit(repo / "nowhere") == "abc1234"
