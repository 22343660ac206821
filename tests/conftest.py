"""Test-wide setup. The environment must be set before torch or jax is imported."""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # torch_tpu would autoload on `import torch`
os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import kernels  # noqa: E402

# Our kernels/ folder has no __init__.py, so Hugging Face's library wins.
assert hasattr(kernels, "get_kernel"), f"`import kernels` found {kernels!r}, not Hugging Face's kernels"
