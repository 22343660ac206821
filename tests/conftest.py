"""Test-wide setup. The environment must be set before torch or jax is imported."""

import atexit
import os
import shutil
import sys
import tempfile

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # torch_tpu would autoload on `import torch`
os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
# CPU XLA may otherwise skip a rounding to bf16 that a TPU performs, hiding a bf16 accumulator.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false").strip()
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



import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Reading a tensor's value in Python: on a TPU each one drains torch_tpu's queue (a sync).
VALUE_READS = ("item", "tolist", "__int__", "__bool__", "__float__", "__index__")


@pytest.fixture
def device_branch(monkeypatch):
    """Our torch layers take, on CPU tensors, the branch TPU tensors take (`values_on_host` is
    False), and every read of a tensor's value in Python is recorded: the list returned must stay
    empty for the path to be free of host syncs."""
    for kernel in ("ragged_dot", "flash_attention", "paged_attention"):
        for module in (f"{kernel}.torch_ops", f"{kernel}._shared.bridge"):
            monkeypatch.setattr(importlib.import_module(module), "values_on_host", lambda tensor: False)
    reads = []
    for name in VALUE_READS:
        def counted(self, *args, _read=getattr(torch.Tensor, name), _name=name, **kwargs):
            reads.append(_name)
            return _read(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """After each test module, jax's compiled programs and traces are dropped: a worker that runs
    dozens of modules would otherwise keep every one, next to the other worker, in the machine's
    24 GiB. Later modules compile what they need."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


# Left to itself, transformers' continuous batching sizes its cache by the device's free memory,
# here the host's, shared by both test workers: one generate_batch took 14 GiB and a full run ran
# out of the machine's 24 GiB. The tests' models are tiny: they get a cache sized for 2 GiB.
TEST_CACHE_BUDGET = 2 << 30


@pytest.fixture(autouse=True, scope="session")
def _continuous_batching_within_budget():
    from transformers.generation.continuous_batching import cache

    real = cache.get_device_and_memory_breakdown

    def within_budget():  # (device, total, reserved, allocated)
        return real()[0], TEST_CACHE_BUDGET, 0, 0

    cache.get_device_and_memory_breakdown = within_budget
    yield
    cache.get_device_and_memory_breakdown = real
