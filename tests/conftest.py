"""Test-wide setup. The environment must be set before torch or jax is imported."""

import atexit
import os
import shutil
import sys
import tempfile

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # torch_tpu would autoload on `import torch`
os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# kernels reads its cache directory once, at import: tests that load a built kernel in this process (as
# transformers does for attn_implementation="<org>/<repo>") lay their Hub cache out here.
HUB_CACHE = tempfile.mkdtemp(prefix="test-hub-cache-")
atexit.register(shutil.rmtree, HUB_CACHE, ignore_errors=True)
os.environ["KERNELS_CACHE"] = HUB_CACHE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The repo root for the kernel folders; kernels/ for the tools (build,
# publish, AOT compile); bench/ for the bench and tuning scripts. kernels/
# itself is never a package.
for path in (os.path.join(REPO, "bench"), os.path.join(REPO, "kernels"), REPO):
    if path not in sys.path:
        sys.path.insert(0, path)

import tpu_compile  # noqa: E402

tpu_compile.configure_environment()  # before anything loads libtpu

import kernels  # noqa: E402

# Our kernels/ folder has no __init__.py, so Hugging Face's library wins.
assert hasattr(kernels, "get_kernel"), f"`import kernels` found {kernels!r}, not Hugging Face's kernels"
