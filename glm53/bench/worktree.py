"""An earlier commit's code beside this one: a temporary git worktree of it, with its compiled library, and its
own `glm53` run there in a subprocess. Comparisons with an earlier design run that design's code (bench host-step
--baseline, bench decode --baseline) instead of keeping it alive as a switch on the product's classes."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


class BaselineError(RuntimeError):
    """The baseline tree could not be made (not a commit, worktree refused, library not built)."""


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def git(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


def resolve(rev: str, root: Path) -> str | None:
    """rev's full commit id in the repository at root, or None when it names no commit."""
    sha = git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", cwd=root)
    return None if sha.returncode else sha.stdout.strip()


def first_file(commit: str, paths: Sequence[str], root: Path) -> str | None:
    """The first of `paths` that exists in commit (a file moved between versions), or None."""
    return next((p for p in paths if not git("cat-file", "-e", f"{commit}:{p}", cwd=root).returncode), None)


def show(commit: str, path: str, root: Path) -> str:
    got = git("show", f"{commit}:{path}", cwd=root)
    return got.stdout if got.returncode == 0 else ""


@contextmanager
def baseline_tree(commit: str, root: Path | None = None) -> Iterator[Path]:
    """A detached worktree of commit, with its compiled library (git ignores it), removed on exit."""
    root = root or repo_root()
    tmp = Path(tempfile.mkdtemp(prefix="glm53-baseline-"))
    tree = tmp / "tree"
    try:
        added = git("worktree", "add", "--detach", str(tree), commit, cwd=root)
        if added.returncode:
            raise BaselineError(f"git worktree add failed: {added.stderr.strip()}")
        built = baseline_library(root, tree)
        if built:
            raise BaselineError(built)
        yield tree
    finally:
        git("worktree", "remove", "--force", str(tree), cwd=root)
        shutil.rmtree(tmp, ignore_errors=True)
        git("worktree", "prune", cwd=root)


def tree_env(tree: Path) -> dict[str, str]:
    """The environment for a process running tree's code: `-m` puts the cwd first on sys.path, and PYTHONPATH
    keeps the tree ahead of the installed (editable) glm53 in the processes it starts too, ahead of what PYTHONPATH
    already held (where exllamav3 may be installed, as on the GPU machine)."""
    rest = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), *([rest] if rest else [])]))


def run_glm53(tree: Path, args: Sequence[str], **kw) -> subprocess.CompletedProcess:
    """`python -m glm53 ARGS` on tree's code."""
    return subprocess.run([sys.executable, "-m", "glm53", *args], cwd=tree, env=tree_env(tree), capture_output=True,
                          text=True, **kw)


def baseline_library(root: Path, tree: Path) -> str | None:
    """Give the baseline worktree its compiled library: without it the baseline would run its pure-Python fallbacks
    (the store read on Python threads) and compare unlike with like. This tree's library where the kernel's sources
    are the same (their hash is compiled in and checked at load), else one built from the baseline's own sources.
    None when it has one, else why not."""
    here = sorted((root / "glm53" / "cpu_lane").glob("_expert_kernel*.so"))
    if not here:
        return None  # this tree has none either: both run the same fallbacks
    from glm53.cpu_lane import buildinfo
    from store import native_build

    same = True  # both libraries (the CPU kernel's, the store's) built from the same sources as this tree's
    for rel, ours in (("glm53/cpu_lane/buildinfo.py", buildinfo), ("store/native_build.py", native_build)):
        info = tree / rel
        if not info.exists():
            same = False
            break
        spec = importlib.util.spec_from_file_location(f"_glm53_baseline_{info.stem}", info)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        same = same and mod.source_hash(info.parent) == ours.source_hash()
    if same:
        for lib in here + sorted((root / "store").glob("_native*.so")):
            shutil.copyfile(lib, tree / lib.relative_to(root))
        return None
    print("building the baseline's compiled library from its own sources (a minute or more)", file=sys.stderr,
          flush=True)
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree,
                          capture_output=True, text=True)
    if proc.returncode:
        return f"its compiled library did not build: {proc.stderr.strip()[-1000:]}"
    return None
