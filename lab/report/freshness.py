"""Is a figure current? It must come from a run at a commit no older than the newest engine change that affects it.

"Affects": any file under minisgl/ except the server (a figure of the offline engine does not see it), the
command line and prose; a figure of a Qwen3 model does not see the hybrid model's own files either. The check is
git's: the newest such commit must be an ancestor of (or equal to) the run's commit. A run of an uncommitted tree,
or at a commit git does not know, fails. In a shallow clone that lacks the history to decide, `check` says so
(`Unknown`) rather than guessing: the CI test skips then, naming the missing commit.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

from lab import REPO

ENGINE = ["minisgl"]
NOT_ENGINE = [":(exclude)minisgl/server", ":(exclude)minisgl/__main__.py", ":(exclude,glob)minisgl/**/*.md"]
# files only the hybrid model (Qwen3.5) runs; a test checks each still exists, so a move cannot hide a change
HYBRID_ONLY = ["minisgl/models/qwen3_5.py", "minisgl/kernels/gdn.py", "minisgl/kernels/gdn_ref.py",
               "minisgl/kvcache/state_pool.py", "minisgl/scheduler/hybrid.py", "minisgl/engine/hybrid.py"]


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)


def engine_paths(hybrid: bool) -> list[str]:
    return ENGINE + NOT_ENGINE + ([] if hybrid else [f":(exclude){p}" for p in HYBRID_ONLY])


def newest_engine_change(hybrid: bool, rev: str = "HEAD", paths: list[str] | None = None) -> str:
    """The newest commit (from `rev` back) that changed a file the figures of such a model depend on (or, given
    `paths`, a file under those git pathspecs)."""
    out = git("log", "-1", "--format=%H", rev, "--", *(paths or engine_paths(hybrid)))
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip())
    return out.stdout.strip()


def is_shallow() -> bool:
    return git("rev-parse", "--is-shallow-repository").stdout.strip() == "true"


def known(commit: str) -> bool:
    return git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0


@dataclass(frozen=True)
class Verdict:
    ok: bool
    unknown: bool  # the history here cannot decide (a shallow clone)
    why: str


def check(commit: str, dirty: bool, hybrid: bool, paths: list[str] | None = None) -> Verdict:
    """Whether a run at `commit` measured the engine as it is now for a model of this kind (given `paths`: the
    files under those pathspecs as they are now, e.g. the server too for a serving figure)."""
    if dirty:
        return Verdict(False, False, f"measured on an uncommitted tree (commit {commit[:10]} plus changes)")
    try:
        newest = newest_engine_change(hybrid, paths=paths)
    except RuntimeError as exc:
        return Verdict(False, is_shallow(), f"git log failed: {exc}")
    if not known(commit):
        if is_shallow():
            return Verdict(False, True, f"the lease's commit {commit[:10]} is not in this shallow clone's history")
        return Verdict(False, False, f"the lease's commit {commit[:10]} is not in this repository's history")
    r = git("merge-base", "--is-ancestor", newest, commit)
    if r.returncode == 0:
        return Verdict(True, False, f"{commit[:10]} contains the newest engine change {newest[:10]}")
    if r.returncode == 1:
        subject = git("log", "-1", "--format=%h %s", newest).stdout.strip()
        return Verdict(False, False, f"measured at {commit[:10]}, before the engine change {subject[:70]}")
    return Verdict(False, is_shallow(), f"git merge-base failed: {r.stderr.strip()}")
