"""bench/machine.py: which commit a result names."""
from __future__ import annotations


def test_a_tree_that_is_not_its_own_checkout_names_the_commit_it_was_archived_from(tmp_path):
    """bench/gpu_clean_copy.sh's copy sits inside another checkout: its results must not carry that one's commit."""
    import subprocess

    from bench.machine import REPO, tree_commit

    outer = tmp_path / "outer"
    copy = outer / ".device" / "clean"
    copy.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    assert tree_commit(copy) == (None, False)  # no stamp: unknown, not the enclosing checkout's
    (copy / "COMMIT").write_text("0123abc\n")
    assert tree_commit(copy) == ("0123abc", False)
    commit, _ = tree_commit(REPO)  # this checkout is its own
    assert commit and len(commit) == 40
