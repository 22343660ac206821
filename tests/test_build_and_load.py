"""Layer 4: the built Hub tree loads the way users load it, offline."""

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
sys.path.insert(0, str(TESTS.parent / "kernels"))

import build_collection  # noqa: E402
import publish  # noqa: E402
from sampling import sample  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("build")
    trees = build_collection.build_all(out)
    cache = tmp_path_factory.mktemp("hub-cache")
    commits = build_collection.make_hub_cache(trees, cache)
    return trees, cache, commits


KERNELS = list(build_collection.load_manifest()["kernels"])


@pytest.mark.parametrize("key", KERNELS)
def test_tree_layout_and_metadata(built, key):
    trees, _, _ = built
    kernel = build_collection.load_manifest()["kernels"][key]
    tree = trees[key]
    hub_toml = tomllib.loads((tree / "build.toml").read_text())
    assert hub_toml["general"] == {
        "name": kernel["repo"], "version": kernel["version"], "license": kernel["license"],
        "backends": ["tpu"], "hub": {"repo-id": kernel["repo-id"]},
    }
    assert "torch-noarch" in hub_toml
    card = (tree / "README.md").read_text()
    assert kernel["repo-id"] in card and "{" + "repo_id}" not in card
    # Hub metadata from the manifest: license, tags, generations, dtypes.
    meta = card.split("---\n")[1]
    assert card.startswith("---\n") and f"license: {kernel['license']}\n" in meta
    assert all(f"  - {tag}\n" in meta for tag in ["kernel", "tpu", "pallas", *kernel["tags"]])
    assert "tpu_generations: [v5e, v5p, v6e, tpu7x]\n" in meta and f"dtypes: [{', '.join(kernel['dtypes'])}]" in meta
    # The bench's charts of the kernel: in the tree's media/ and shown by the card, every one.
    charts = sorted((REPO / "bench" / "results").glob(f"{kernel['folder']}_*.png"))
    assert sorted(p.name for p in (tree / "media").glob("*")) == [c.name for c in charts]
    assert sorted(re.findall(r"!\[[^]]*\]\(media/([^)]+)\)", card)) == [c.name for c in charts]
    if key != "gated_delta_rule":  # no anchors benched yet: no chart
        assert charts
    for variant in build_collection.VARIANTS:
        meta = json.loads((tree / "build" / variant / "metadata.json").read_text())
        assert meta["name"] == kernel["repo"] and meta["python-depends"] == []
        assert meta["backend"] == {"type": "tpu"} and meta["version"] == kernel["version"]
        package = tree / "build" / variant / kernel["package"]
        assert (package / "_shared" / "bridge.py").is_file(), "shared runtime must be vendored"
        assert not (package / "_shared").is_symlink() and not (package / "CARD.md").exists()
        assert meta["id"] in (package / "_build.py").read_text()
        # Only relative imports inside a published kernel.
        for source in package.rglob("*.py"):
            for line in source.read_text().splitlines():
                assert not line.lstrip().startswith((f"from {kernel['folder']}", f"import {kernel['folder']}")), (
                    source, line)


def _load(cache, key, *flags, version=None):
    kernel = build_collection.load_manifest()["kernels"][key]
    result = subprocess.run(
        [sys.executable, str(TESTS / "offline_get_kernel.py"), str(cache), kernel["repo-id"],
         str(version or kernel["version"]), *flags],
        capture_output=True, text=True, timeout=600,
        env={k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "KERNELS_CACHE")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# Every kernel as kernels 0.17.2 loads it with torch_tpu 0.2.0 (torch-universal); the torch-tpu variant
# (a torch_tpu that sets torch.backends.tpu) for one kernel in `make test`, every one in `make test-all`.
@pytest.mark.parametrize("key,flags,variant", [(key, (), "torch-universal") for key in KERNELS] + [
    (key, ("--torch-backends-tpu",), "torch-tpu") for key in sample(KERNELS, {"ragged_dot"})])
def test_get_kernel_offline(built, key, flags, variant):
    _, cache, commits = built
    kernel = build_collection.load_manifest()["kernels"][key]
    loaded = _load(cache, key, *flags)
    assert loaded["variant"] == variant
    assert f"/snapshots/{commits[kernel['repo-id']]}/build/{variant}/" in loaded["file"]
    assert loaded["all"] == sorted(kernel["entry-points"])
    assert len(loaded["op_namespaces"]) == 1 and loaded["op_namespaces"][0].startswith(f"_{kernel['package']}_")
    # fp32: sums of 128 products of N(0,1) (ragged_dot), softmax-weighted means of N(0,1) (attention).
    assert loaded["max_abs_error"] < 1e-3


# A modeled figure (a time, a ratio, a percentage) typed into a card or the README goes stale with the
# next run: cards include the bench's own sections instead ({results[<file>.md#<heading>]}, resolved
# by the build from bench/results/), and the README points to the cards and charts.
TYPED_FIGURE = re.compile(r"\b\d+(?:\.\d+)?(?:\s?(?:us|ms)\b|x\b(?!\d)|%)")


@pytest.mark.parametrize("doc", [*(f"{k['folder']}/CARD.md" for k in build_collection.load_manifest()["kernels"].values()),
                                 "README.md"])
def test_no_figure_is_typed_in(doc):
    prose = re.sub(r"```.*?```", "", (REPO / doc).read_text(), flags=re.S)  # code: inputs, not figures
    assert not TYPED_FIGURE.findall(prose), f"{doc} types in figures: {TYPED_FIGURE.findall(prose)}"


@pytest.mark.parametrize("key", KERNELS)
def test_cards_link_the_files_and_targets_they_name_to_the_source_repository(built, key):
    """With build.toml's source-repo set, every file or folder git tracks and every make target a
    card names in code quotes links to it at the version's release tag; code blocks stay as
    written. (The URL is empty until the sources are public: the built cards have no such link.)"""
    trees, _, _ = built
    kernel = build_collection.load_manifest()["kernels"][key]
    card = (trees[key] / "README.md").read_text()
    link = re.compile(r"\[`([^`]+)`\]\(([^)]+)\)")
    assert kernel["source-repo"] or not link.findall(card)
    source, tag = "https://example.org/owner/name", build_collection.release_tag(kernel)
    linked = build_collection.link_sources(card, source, tag)
    assert re.findall(r"```.*?```", linked, re.S) == re.findall(r"```.*?```", card, re.S)
    links = link.findall(linked)
    assert links  # every card names some file or target
    for name, url in links:
        path = build_collection.source_target(name)
        assert url == f"{source}/{'tree' if (REPO / path).is_dir() else 'blob'}/{tag}/{path}", (name, url)
    prose = link.sub("", re.sub(r"```.*?```", "", linked, flags=re.S))
    assert not [name for name in re.findall(r"`([^`\n]+)`", prose) if build_collection.source_target(name)]


def test_source_targets_are_what_git_tracks():
    target = build_collection.source_target
    assert target("bench/results/headline.md") == "bench/results/headline.md" and target("bench/") == "bench"
    assert target("make check-compile") == "Makefile" and target("make no-such-target") is None
    assert target("/etc/passwd") is None and target(".venv/bin/python") is None and target("build/") is None
    linked = build_collection.link_sources("see [`x`](u) and `bench/results/headline.md`", "https://e.org/s", "t")
    assert linked == "see [`x`](u) and [`bench/results/headline.md`](https://e.org/s/blob/t/bench/results/headline.md)"


def test_cards_include_the_results_sections_they_name(built):
    trees, _, _ = built
    for key, kernel in build_collection.load_manifest()["kernels"].items():
        source = (REPO / kernel["folder"] / "CARD.md").read_text()
        card = (trees[key] / "README.md").read_text()
        for where in re.findall(r"\{results\[([^]]+)\]\}", source):
            assert build_collection.ResultSections()[where] in card
    with pytest.raises(KeyError, match="sections headed"):
        build_collection.ResultSections()["headline.md#No such heading"]


def test_an_earlier_version_rebuilds_from_its_tag_and_loads_beside_the_current(built, tmp_path):
    """ragged-dot-tpu version 1, rebuilt from its tag's sources by that commit's own build script,
    and version 2 from this tree, in one Hub cache: each loads with get_kernel(version=N) and
    computes. (A clone without tags, `git clone --no-tags`, cannot rebuild a release: skipped.)"""
    _, cache, commits = built
    kernel = build_collection.load_manifest()["kernels"]["ragged_dot"]
    tag = build_collection.release_tag(dict(kernel, version=1))
    if build_collection.tag_commit(tag) is None:
        pytest.skip(f"this clone has no tag {tag} (git fetch --tags)")
    tree = build_collection.build_release(tag, "ragged_dot", tmp_path)
    assert json.loads((tree / "build" / "torch-universal" / "metadata.json").read_text())["version"] == 1
    v1 = build_collection.add_to_hub_cache(tree, kernel["repo-id"], 1, cache)
    assert v1 != commits[kernel["repo-id"]]
    for version, commit in ((1, v1), (kernel["version"], commits[kernel["repo-id"]])):
        loaded = _load(cache, "ragged_dot", version=version)
        assert f"/snapshots/{commit}/build/torch-universal/" in loaded["file"]
        assert loaded["max_abs_error"] < 1e-3


def test_publishing_a_new_version_needs_a_committed_tree_that_passed_make_test(tmp_path):
    """A git repository of its own: HEAD is publishable only once `make test` recorded a pass at it
    with nothing uncommitted; a later commit, or an uncommitted change, needs another pass."""
    git = lambda *args: build_collection.git(*args, root=tmp_path)
    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / "f").write_text("1")
    git("add", "f")
    git("commit", "-qm", "one")
    stamp, one = tmp_path / "build" / "tests-passed", git("rev-parse", "HEAD")
    assert "has not passed" in publish.head_refusal(stamp, tmp_path)
    assert "recorded for make publish" in publish.record_tests_passed(one, stamp, tmp_path)
    assert publish.head_refusal(stamp, tmp_path) is None
    (tmp_path / "f").write_text("2")
    assert "uncommitted" in publish.head_refusal(stamp, tmp_path)
    assert "not recorded" in publish.record_tests_passed(one, stamp, tmp_path)
    git("commit", "-qam", "two")  # made while make test ran on commit one: that pass is not two's
    assert "has not passed" in publish.head_refusal(stamp, tmp_path)
    assert "not recorded" in publish.record_tests_passed(one, stamp, tmp_path)
    no_git = tmp_path.parent / f"{tmp_path.name}-no-git"
    no_git.mkdir()
    assert "not a git checkout" in publish.head_refusal(stamp, no_git)


def test_publish_dry_run(built, capsys, tmp_path):
    assert publish.main(["--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    # Each kernel's source first: its version's tag, rebuilt from, or to be made at HEAD.
    kernels = build_collection.load_manifest()["kernels"]
    assert [line for line in out if line.startswith("release ")] == [
        f"release {key}: " + (f"rebuilt from tag {tag} ({commit[:12]})" if commit else f"new tag {tag} at HEAD")
        for key, tag in ((key, build_collection.release_tag(k)) for key, k in kernels.items())
        for commit in [build_collection.tag_commit(tag)]]
    lines = [line for line in out if not line.startswith(("release ", "refused: "))]
    methods = [line.split()[0] for line in lines]
    assert methods == ["create_repo", "upload_folder", "create_branch", "upload_folder"] * len(KERNELS)
    assert all("repo_type=kernel" in line for line in lines)
    manifest = build_collection.load_manifest()["kernels"]
    for key, first in zip(KERNELS, range(0, len(lines), 4)):  # card on main, then the v<version> branch
        branch = f"v{manifest[key]['version']}"
        assert f"repo_id={manifest[key]['repo-id']}" in lines[first]
        assert "revision=main" in lines[first + 1] and "allow_patterns=['README.md', 'media/*']" in lines[first + 1]
        assert f"branch={branch}" in lines[first + 2]
        assert f"revision={branch}" in lines[first + 3] and "delete_patterns=*" in lines[first + 3]
        # Nothing else is written: earlier versions' branches stay as published, still loadable.
        assert set(re.findall(r"(?:revision|branch)=(\S+)", "\n".join(lines[first:first + 4]))) == {"main", branch}


def test_import_kernels_is_hugging_face_kernels():
    """Our kernels/ folder holds tools and shared code, never the name `kernels`."""
    import kernels

    assert Path(kernels.__file__).parent.parent.name == "site-packages"
    assert not (TESTS.parent / "kernels" / "__init__.py").exists()


@pytest.mark.parametrize("key", KERNELS)
def test_missing_jax_says_what_to_install(key):
    """torch-tpu does not bring jax and the Hub's metadata cannot name it: the kernel says it."""
    kernel = build_collection.load_manifest()["kernels"][key]
    code = (f"import sys; sys.modules['jax'] = None; sys.path.insert(0, {str(build_collection.REPO_ROOT)!r}); "
            f"import {kernel['folder']}")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert f"ImportError: {kernel['repo']} runs its Pallas TPU kernels through JAX" in result.stderr
    from runtime import dependencies

    pins = (build_collection.REPO_ROOT / "requirements.txt").read_text().split()
    assert all(pin in pins for pin in dependencies.TESTED_JAX.split()), "the message names the tested pins"
    assert f"pip install {dependencies.TESTED_JAX}" in result.stderr


def test_untested_jax_warns_once(monkeypatch):
    """Another jax than the tested one warns once per kernel, naming both; the tested one is silent."""
    import warnings

    import jax
    from runtime import dependencies

    monkeypatch.setattr(dependencies, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dependencies.require_jax("some-kernel")  # the pinned jax: no warning
    monkeypatch.setattr(jax, "__version__", "0.9.0")
    with pytest.warns(UserWarning) as caught:
        dependencies.require_jax("some-kernel")
        dependencies.require_jax("some-kernel")
    assert len(caught) == 1
    assert "tested with jax==0.10.2 jaxlib==0.10.2, found jax==0.9.0 jaxlib==0.10.2" in str(caught[0].message)


def test_docs_name_only_files_in_the_repo():
    """README.md and docs/ stand alone: no link out of the repo, and every file path they name
    exists here."""
    import re

    root = build_collection.REPO_ROOT
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = doc.read_text()
        assert "../" not in text, f"{doc.name} points outside the repo"
        for path in re.findall(r"`((?:[\w.-]+/)+[\w.-]+\.(?:md|py|json|toml|txt))", text):
            if "<" not in path:
                assert (root / path).exists(), f"{doc.name} names {path}, which is not in the repo"


def test_make_help_lists_every_target_with_its_time():
    """`make help` (also plain `make`) names every phony target with what it does and how long."""
    import subprocess

    root = build_collection.REPO_ROOT
    phony = next(line for line in (root / "Makefile").read_text().splitlines() if line.startswith(".PHONY:"))
    listed = subprocess.run(["make", "--no-print-directory", "-C", str(root)], capture_output=True, text=True,
                            check=True).stdout.splitlines()
    described = {line.split()[1] for line in listed if line.startswith("make ") and len(line.split()) > 2}
    assert described == set(phony.split()[1:])


def test_trust_check_runs_online_and_the_readme_opt_in_passes_it(built, tmp_path):
    """Online, kernels asks the Hub whether the publisher is trusted (offline it skips that).
    With a Hub on localhost answering from the built tree: the bare call is refused, the
    README's call with trust_remote_code=[repo] loads and computes, and so does the bare call
    once the organization is a trusted publisher."""
    from local_hub import LocalHub

    trees, _, commits = built
    kernel = build_collection.load_manifest()["kernels"]["ragged_dot"]
    repo_id = kernel["repo-id"]
    with LocalHub({repo_id: (trees["ragged_dot"], kernel["version"], commits[repo_id])}) as hub:
        refused = _load(tmp_path / "bare", "ragged_dot", "--hub", hub.url)
        assert "is not from a trusted publisher" in refused["refused"]
        assert f"GET /api/organizations/{repo_id.split('/')[0]}/overview" in hub.requests
        assert not any("/resolve/" in request for request in hub.requests), "refused before any download"
        loaded = _load(tmp_path / "opted-in", "ragged_dot", "--hub", hub.url, "--trust")
        assert f"/snapshots/{commits[repo_id]}/build/torch-universal/" in loaded["file"]
        assert loaded["max_abs_error"] < 1e-3
        hub.trusted.add(repo_id.split("/")[0])
        assert "file" in _load(tmp_path / "trusted", "ragged_dot", "--hub", hub.url)


def test_flash_tree_vendors_the_paged_kernel(built):
    """flash-attn-tpu's flash_attn_with_kvcache runs paged-attention-tpu's JAX kernel: the built
    package holds a copy of it as `_paged` (with its own `_shared`), byte for byte the paged
    folder's files, and nothing in the package imports outside it."""
    trees, _, _ = built
    manifest = build_collection.load_manifest()["kernels"]
    for variant in build_collection.VARIANTS:
        package = trees["flash_attention"] / "build" / variant / manifest["flash_attention"]["package"]
        for name in ("ops.py", "kernel.py", "tuning.py", "tuned_blocks.py"):
            copied = package / "_paged" / name
            assert copied.is_file() and not copied.is_symlink()
            assert copied.read_bytes() == (REPO / "paged_attention" / name).read_bytes()
        assert (package / "_paged" / "_shared" / "generations.py").is_file()
        build_collection.check_self_contained(package, ("paged_attention", "flash_attention", "ragged_dot"))


@pytest.mark.parametrize("source,error", [
    ("from ...elsewhere import x\n", "leaves the package"),
    ("from .missing import x\n", "resolves to nothing"),
    ("import paged_attention.ops\n", "another kernel's folder"),
    ("from paged_attention import ops\n", "another kernel's folder"),
])
def test_a_package_that_is_not_self_contained_is_refused(tmp_path, source, error):
    (tmp_path / "__init__.py").write_text("from .ops import f\n")
    (tmp_path / "ops.py").write_text("def f():\n    pass\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "__init__.py").write_text(source)
    with pytest.raises(ValueError, match=error):
        build_collection.check_self_contained(tmp_path, ("paged_attention",))
    (tmp_path / "sub" / "__init__.py").write_text("from ..ops import f\n")
    build_collection.check_self_contained(tmp_path, ("paged_attention",))
    (tmp_path / "link.py").symlink_to(tmp_path / "ops.py")
    with pytest.raises(ValueError, match="is a link"):
        build_collection.check_self_contained(tmp_path, ("paged_attention",))
