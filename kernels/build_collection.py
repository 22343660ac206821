"""Builds the Hub repo trees of the collection from build.toml (`make build`).

For each kernel in the manifest, writes build/<repo>/:
  build.toml                      the Hub builder's manifest for this repo
  README.md                       the kernel's card (from <folder>/CARD.md)
  media/                          the card's charts (bench/results/<folder>_<generation>.png)
  build/torch-tpu/                the package + metadata.json
  build/torch-universal/          the same package again: kernels 0.17.2
                                  picks torch-tpu only when torch.backends.tpu
                                  exists, which torch_tpu 0.2.0 does not set

The package is the kernel folder with the shared runtime vendored in as
`_shared` (flash-attn-tpu also vendors paged-attention-tpu's JAX kernel as
`_paged`, with its own `_shared`: both are symlinks in the source tree, copied
here) and `_build.py` rewritten with an op namespace unique to the build's
content. The staged package must be self-contained (`check_self_contained`):
no link left, every relative import resolving inside it, no import of another
kernel folder. Also makes an offline Hub cache from the trees
(`make_hub_cache`), which is how tests and the demo load what users load.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MANIFEST = REPO_ROOT / "build.toml"
VARIANTS = ("torch-tpu", "torch-universal")
NOT_SHIPPED = ("__pycache__", "*.pyc", "CARD.md")


def load_manifest(path: Path = MANIFEST) -> dict:
    manifest = tomllib.loads(path.read_text())
    org = manifest["collection"]["hub-org"]
    kernels = {}
    for key, entry in manifest["kernels"].items():
        kernels[key] = {
            **entry,
            "license": entry.get("license", manifest["collection"]["license"]),
            "repo-id": f"{org}/{entry['repo']}",
            "package": entry["repo"].replace("-", "_"),
            "source-repo": manifest["collection"].get("source-repo", ""),
        }
    return {"org": org, "kernels": kernels}


def _tree_digest(root: Path) -> str:
    digest = hashlib.sha1()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def check_self_contained(package: Path, kernel_folders=()) -> None:
    """Raises if the staged package is not self-contained: a symlink left in it, a relative
    import that resolves outside it or to no module in it, or an absolute import of one of
    `kernel_folders` (a sibling kernel that a Hub user does not have)."""
    for path in sorted(package.rglob("*")):
        if path.is_symlink():
            raise ValueError(f"{path} is a link: the build must copy what it points to")
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        here = parts[:-1]  # the package the module is in
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                if node.level - 1 > len(here):
                    raise ValueError(f"{path}: `from {'.' * node.level}{node.module or ''}` leaves the package")
                base = list(here[:len(here) - (node.level - 1)])
                names = [node.module.split(".")] if node.module else [[a.name] for a in node.names]
                for name in names:
                    target = package.joinpath(*base, *name)
                    if not (target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()):
                        raise ValueError(f"{path}: `from {'.' * node.level}{node.module or ''} import ...` "
                                         f"resolves to nothing in the package ({target})")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                for module in modules:
                    if module.split(".")[0] in kernel_folders:
                        raise ValueError(f"{path}: imports {module}, another kernel's folder: vendor it instead")


def _stage_package(kernel: dict, dest: Path) -> str:
    """Copies the kernel folder (symlinks resolved, so `_shared` is vendored)
    and stamps the build's op namespace. Returns the namespace."""
    source = REPO_ROOT / kernel["folder"]
    shutil.copytree(source, dest, symlinks=False, ignore=shutil.ignore_patterns(*NOT_SHIPPED))
    check_self_contained(dest, tuple(k["folder"] for k in load_manifest()["kernels"].values()))
    namespace = f"_{kernel['package']}_{_tree_digest(dest)[:10]}"
    (dest / "_build.py").write_text(
        "# Written by kernels/build_collection.py: this build's op namespace.\n"
        f'OP_NAMESPACE = "{namespace}"\n'
    )
    return namespace


def _hub_build_toml(kernel: dict) -> str:
    return (
        "[general]\n"
        f'name = "{kernel["repo"]}"\n'
        f"version = {kernel['version']}\n"
        f'license = "{kernel["license"]}"\n'
        'backends = ["tpu"]\n\n'
        "[general.hub]\n"
        f'repo-id = "{kernel["repo-id"]}"\n\n'
        "[torch-noarch]\n"
    )


def build_kernel(kernel: dict, out_root: Path) -> Path:
    tree = out_root / kernel["repo"]
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    for variant in VARIANTS:
        variant_dir = tree / "build" / variant
        namespace = _stage_package(kernel, variant_dir / kernel["package"])
        metadata = {
            "id": namespace,
            "name": kernel["repo"],
            "version": kernel["version"],
            "license": kernel["license"],
            "python-depends": [],
            "backend": {"type": "tpu"},
        }
        (variant_dir / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    (tree / "build.toml").write_text(_hub_build_toml(kernel))
    card = (REPO_ROOT / kernel["folder"] / "CARD.md").read_text()
    card = card.format(repo_id=kernel["repo-id"], version=kernel["version"], package=kernel["package"],
                       charts=chart_section(kernel, tree / "media"), results=ResultSections())
    (tree / "README.md").write_text(front_matter(kernel) + link_sources(card, kernel["source-repo"],
                                                                        release_tag(kernel)))
    return tree


def source_target(name: str) -> str | None:
    """The file or folder of the source repository that a name quoted in a card stands for: a path
    git tracks (a folder: one holding tracked files), or the Makefile for `make <target>` of one of
    its targets; None for any other name."""
    target = re.fullmatch(r"make ([a-z-]+)", name)
    if target:
        makefile = (REPO_ROOT / "Makefile").read_text()
        return "Makefile" if re.search(rf"^{target.group(1)}:", makefile, re.M) else None
    path = name.rstrip("/")
    if "/" not in name or name.startswith("/") or not path:
        return None
    tracked = _tracked_files()
    if tracked is None:  # no git here: what the tree holds
        return path if (REPO_ROOT / path).exists() else None
    return path if path in tracked or any(f.startswith(path + "/") for f in tracked) else None


@functools.cache
def _tracked_files() -> frozenset[str] | None:
    try:
        return frozenset(git("ls-files").splitlines())
    except (OSError, subprocess.CalledProcessError):
        return None


def link_sources(card: str, source: str, ref: str) -> str:
    """Each name a card quotes in code that stands for a file, folder or make target of the source
    repository (`source_target`) as a link to it at `ref`; code blocks, names already a link's text
    and every other name stay as written, and so does every name when there is no `source`."""
    if not source:
        return card

    def link(match):
        quoted, name = match.group(0), match.group(1)
        path = None if quoted.startswith("[") or quoted.endswith("]") else source_target(name)
        if path is None:
            return quoted
        kind = "tree" if (REPO_ROOT / path).is_dir() else "blob"
        return f"[`{name}`]({source.rstrip('/')}/{kind}/{ref}/{path})"

    parts = re.split(r"(```.*?```)", card, flags=re.S)  # odd parts: code blocks
    return "".join(part if i % 2 else re.sub(r"\[?`([^`\n]+)`\]?", link, part) for i, part in enumerate(parts))


class ResultSections:
    """`{results[<file>.md#<heading>]}` in a card: that section of a bench's table in bench/results/
    (the heading's first words are enough), as the bench last wrote it: the figures a card quotes
    come from the results, never typed in. A section or file that is not there fails the build."""

    def __getitem__(self, where: str) -> str:
        name, _, heading = where.partition("#")
        lines = (REPO_ROOT / "bench" / "results" / name).read_text().splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith("## ") and line[3:].startswith(heading)]
        if len(starts) != 1:
            raise KeyError(f"bench/results/{name} has {len(starts)} sections headed {heading!r}, not one")
        end = next((i for i in range(starts[0] + 1, len(lines)) if lines[i].startswith("#")), len(lines))
        return "\n".join(lines[starts[0] + 1:end]).strip()


def chart_section(kernel: dict, media: Path) -> str:
    """The card's `{charts}`: the bench's charts of the kernel, one per generation, copied into the
    tree's media/ and shown (relative links, which the Hub resolves in the card's repo), after the
    paragraph that says how to read them."""
    from runtime.generations import GENERATIONS

    charts = [c for g in GENERATIONS if (c := REPO_ROOT / "bench" / "results" / f"{kernel['folder']}_{g}.png").exists()]
    images = []
    for chart in charts:
        media.mkdir(exist_ok=True)
        shutil.copyfile(chart, media / chart.name)
        images.append(f"![{chart.stem.replace('_', ' ')}, MODELED](media/{chart.name})")
    return "\n".join([
        "Per TPU generation: ours over the fastest other kernel that compiled (the anchors, each at the",
        "configuration its bench rates it at) and over the chip's limit (roofline), per model and case.",
        "Modeled from libtpu's compiled schedules on a CPU machine, not measured on a TPU; drawn from the",
        "bench's results.", "", *images]) if images else ""


def front_matter(kernel: dict) -> str:
    """The card's Hub metadata, from the manifest: license, tags, the TPU generations every kernel
    is compiled for, and the dtypes its tests cover."""
    from runtime.generations import GENERATIONS

    tags = ["kernel", "tpu", "pallas", *kernel["tags"]]
    lines = ["---", f"license: {kernel['license']}", "tags:", *(f"  - {t}" for t in tags),
             f"tpu_generations: [{', '.join(GENERATIONS)}]", f"dtypes: [{', '.join(kernel['dtypes'])}]", "---", ""]
    return "\n".join(lines) + "\n"


def build_all(out_root: Path = REPO_ROOT / "build", only: list[str] | None = None) -> dict[str, Path]:
    kernels = load_manifest()["kernels"]
    return {key: build_kernel(kernels[key], out_root) for key in (only or kernels)}


def make_hub_cache(trees: dict[str, Path], cache: Path) -> dict[str, str]:
    """Lays the built trees out as the Hub cache `get_kernel` reads offline
    (`kernels--<org>--<repo>/refs/v<version>` -> snapshots/<commit>/...), one version per repo.
    The commit is the tree's content digest. Returns repo-id -> commit."""
    kernels = load_manifest()["kernels"]
    commits = {}
    for key, tree in trees.items():
        kernel = kernels[key]
        shutil.rmtree(cache / ("kernels--" + kernel["repo-id"].replace("/", "--")), ignore_errors=True)
        commits[kernel["repo-id"]] = add_to_hub_cache(tree, kernel["repo-id"], kernel["version"], cache)
    return commits


def add_to_hub_cache(tree: Path, repo_id: str, version: int, cache: Path) -> str:
    """One version's tree into the Hub cache, beside the repo's other versions: its commit."""
    commit = _tree_digest(tree)
    repo_dir = cache / ("kernels--" + repo_id.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / f"v{version}").write_text(commit)
    shutil.copytree(tree, repo_dir / "snapshots" / commit, dirs_exist_ok=True)
    return commit


def release_tag(kernel: dict) -> str:
    """The git tag of the source a kernel's version is published from: `<repo>-v<version>`."""
    return f"{kernel['repo']}-v{kernel['version']}"


def git(*args: str, root: Path = REPO_ROOT) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout.strip()


def tag_commit(tag: str) -> str | None:
    """The commit a tag names, or None where this clone has no such tag (or is no git checkout)."""
    try:
        return git("rev-parse", "--verify", "--quiet", f"{tag}^{{commit}}")
    except (OSError, subprocess.CalledProcessError):
        return None


def build_release(tag: str, key: str, out_root: Path) -> Path:
    """The Hub tree of kernel `key` as published from git tag (or commit) `tag`: that commit's own
    sources, manifest and build script (an earlier version is rebuilt as it was, not by today's
    tools; files git does not hold are not released)."""
    source = out_root / f"{tag}-source"
    shutil.rmtree(source, ignore_errors=True)
    source.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", tag], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    built = subprocess.run([sys.executable, str(source / "kernels" / "build_collection.py"), "--out",
                            str(out_root / tag), key], capture_output=True, text=True, env=env)
    if built.returncode:
        raise subprocess.CalledProcessError(built.returncode, built.args, built.stdout, built.stderr[-3000:])
    repo = tomllib.loads((source / "build.toml").read_text())["kernels"][key]["repo"]
    return out_root / tag / repo


def load_from_hub(keys: list[str], out_root: Path) -> dict:
    """Builds the kernels `keys` into out_root, lays them out as the Hub cache that `kernels` reads
    (KERNELS_CACHE, set before `kernels` is first imported) and loads each with get_kernel at its
    manifest's version, offline, as users load it: {key: module}."""
    make_hub_cache(build_all(out_root, keys), Path(os.environ["KERNELS_CACHE"]))
    from kernels import get_kernel

    manifest = load_manifest()["kernels"]
    return {key: get_kernel(manifest[key]["repo-id"], version=manifest[key]["version"]) for key in keys}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build")
    parser.add_argument("kernels", nargs="*", help="manifest keys (default: all)")
    args = parser.parse_args()
    for key, tree in build_all(args.out, args.kernels or None).items():
        files = sum(1 for p in tree.rglob("*") if p.is_file())
        print(f"{key}: {tree} ({files} files)")


if __name__ == "__main__":
    main()
