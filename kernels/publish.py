"""Uploads the built Hub repo trees (`make publish`; `--dry-run` only prints).

Each kernel goes to a Hub repo of type "kernel": its card and charts to `main`, its
tree to branch `v<version>`, the branch `get_kernel(..., version=N)` reads.
Needs a token (HF_TOKEN or `hf auth login`) unless --dry-run.

A published version is built from a git tag, `<repo>-v<version>`, so it can be rebuilt as it
was: a version whose tag exists is rebuilt from that tag's sources (a change meant for users
needs a new version in build.toml); a new version is tagged at HEAD, which must be committed
and have passed `make test` (which records the commit it passed at: `--tests-passed`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from build_collection import REPO_ROOT, build_kernel, build_release, git, load_manifest, release_tag, tag_commit

TESTS_PASSED = REPO_ROOT / "build" / "tests-passed"  # the commit `make test` last passed at, clean


def operations(trees: dict[str, Path]) -> list[tuple[str, dict]]:
    """The API calls a publish makes, in order, as (HfApi method, kwargs)."""
    kernels = load_manifest()["kernels"]
    ops = []
    for key, tree in trees.items():
        repo_id, branch = kernels[key]["repo-id"], f"v{kernels[key]['version']}"
        common = dict(repo_id=repo_id, repo_type="kernel")
        ops += [
            ("create_repo", dict(**common, exist_ok=True)),
            # The card and the charts it shows (media/), which the Hub resolves on main.
            ("upload_folder", dict(**common, folder_path=str(tree), allow_patterns=["README.md", "media/*"],
                                   revision="main", commit_message="Update card")),
            ("create_branch", dict(**common, branch=branch, exist_ok=True)),
            # The branch becomes the tree: files the tree no longer has are deleted in the same commit.
            ("upload_folder", dict(**common, folder_path=str(tree), revision=branch, delete_patterns="*",
                                   commit_message=f"Build {branch}")),
        ]
    return ops


def _head(root: Path) -> tuple[str, bool] | None:
    """(HEAD's commit, whether tracked files have uncommitted changes), or None where `root` is no
    git checkout."""
    try:
        return git("rev-parse", "HEAD", root=root), bool(git("status", "--porcelain", "--untracked-files=no", root=root))
    except (OSError, subprocess.CalledProcessError):
        return None


def head_refusal(stamp: Path = TESTS_PASSED, root: Path = REPO_ROOT) -> str | None:
    """Why HEAD may not be tagged as a release, or None: not a git checkout, uncommitted changes to
    tracked files, or no `make test` passed at HEAD (as `stamp` records)."""
    if (state := _head(root)) is None:
        return "not a git checkout: a release is tagged in git"
    head, changes = state
    if changes:
        return "the tree has uncommitted changes: commit them and run make test"
    passed = stamp.read_text().strip() if stamp.exists() else None
    if passed != head:
        return f"make test has not passed at HEAD {head[:12]} (last passed at: {passed[:12] if passed else 'none'})"
    return None


def record_tests_passed(tested: str, stamp: Path = TESTS_PASSED, root: Path = REPO_ROOT) -> str:
    """After a passing `make test` of commit `tested` (HEAD when it started): records it for publishing
    if HEAD is still that commit with no uncommitted change (a commit made during the run was not
    what ran)."""
    if (state := _head(root)) is None:
        return "not a git checkout: nothing recorded"
    head, changes = state
    if changes or head != tested:
        return "HEAD moved or has uncommitted changes: the pass is not recorded for publishing"
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(head + "\n")
    return f"make test passed at {head[:12]}: recorded for make publish"


def releases(keys: list[str], out: Path) -> tuple[dict[str, Path], list[str], list[str]]:
    """Each kernel's tree to publish, built from git: from its version's tag where the tag exists,
    else from HEAD's committed sources (uncommitted and untracked files are not released); the lines
    saying which; the tags to make at HEAD once the uploads succeed."""
    kernels = load_manifest()["kernels"]
    trees, lines, new_tags = {}, [], []
    for key in keys:
        tag = release_tag(kernels[key])
        commit = tag_commit(tag)
        try:
            trees[key] = build_release(tag if commit else "HEAD", key, out / "releases")
        except (OSError, subprocess.CalledProcessError):
            if commit or head_refusal() is None:
                raise  # a release that does not build is never replaced by the working tree's
            trees[key] = build_kernel(kernels[key], out)  # no git, or HEAD not publishable: refused below
        version = json.loads((trees[key] / "build" / "torch-universal" / "metadata.json").read_text())["version"]
        if version != kernels[key]["version"]:
            raise ValueError(f"{tag} builds version {version} of {key}, not {kernels[key]['version']}")
        lines.append(f"release {key}: rebuilt from tag {tag} ({commit[:12]})" if commit
                     else f"release {key}: new tag {tag} at HEAD")
        new_tags += [] if commit else [tag]
    return trees, lines, new_tags


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the operations, upload nothing")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build")
    parser.add_argument("--tests-passed", metavar="COMMIT", help="record COMMIT as tested (make test does)")
    parser.add_argument("kernels", nargs="*", help="manifest keys (default: all)")
    args = parser.parse_args(argv)
    if args.tests_passed is not None:
        print(record_tests_passed(args.tests_passed))
        return 0

    trees, lines, new_tags = releases(args.kernels or list(load_manifest()["kernels"]), args.out)
    refusal = head_refusal() if new_tags else None
    ops = operations(trees)
    if args.dry_run:
        print(*lines, sep="\n")
        if refusal:
            print(f"refused: {refusal}")
        for method, kwargs in ops:
            print(method, " ".join(f"{k}={v}" for k, v in kwargs.items()))
        return 0
    if refusal:
        print(f"publish refused: {refusal}", file=sys.stderr)
        return 2

    from huggingface_hub import HfApi, get_token

    token = get_token()
    if not token:
        print("publish needs a Hugging Face token: set HF_TOKEN or run `hf auth login`", file=sys.stderr)
        return 2
    api = HfApi(token=token)
    for method, kwargs in ops:
        print(method, kwargs["repo_id"], kwargs.get("revision", kwargs.get("branch", "")), flush=True)
        getattr(api, method)(**kwargs)
    for tag in new_tags:  # only once every upload succeeded: a failed publish leaves no release tagged
        git("tag", tag, "HEAD")
    if new_tags:
        print(f"tagged {', '.join(new_tags)}: push them (git push origin {' '.join(new_tags)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
