"""Uploads the built Hub repo trees (`make publish`; `--dry-run` only prints).

Each kernel goes to a Hub repo of type "kernel": its card and charts to `main`, its
tree to branch `v<version>`, the branch `get_kernel(..., version=N)` reads.
Needs a token (HF_TOKEN or `hf auth login`) unless --dry-run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from build_collection import REPO_ROOT, build_all, load_manifest


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the operations, upload nothing")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build")
    parser.add_argument("kernels", nargs="*", help="manifest keys (default: all)")
    args = parser.parse_args(argv)

    trees = build_all(args.out, args.kernels or None)
    ops = operations(trees)
    if args.dry_run:
        for method, kwargs in ops:
            print(method, " ".join(f"{k}={v}" for k, v in kwargs.items()))
        return 0

    from huggingface_hub import HfApi, get_token

    token = get_token()
    if not token:
        print("publish needs a Hugging Face token: set HF_TOKEN or run `hf auth login`", file=sys.stderr)
        return 2
    api = HfApi(token=token)
    for method, kwargs in ops:
        print(method, kwargs["repo_id"], kwargs.get("revision", kwargs.get("branch", "")), flush=True)
        getattr(api, method)(**kwargs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
