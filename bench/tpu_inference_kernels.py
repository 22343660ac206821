"""tpu-inference's kernels (vLLM's TPU backend, tpu-inference 0.32.0), loaded from its files.

Its package imports vLLM, which the bench does not install, and its kernels ask the device they run
on for its TPU generation (to pick their tuned blocks and VMEM limit), where this machine has a CPU.
`module(name, generation)` loads one of its modules with both answered: an empty package, a
logger, and the generation the bench compiles for. One name differs under this jax
(`pltpu.reciprocal` is `pl.reciprocal` here, the same op): it is aliased.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import types

# What its `get_device_name` / `get_tpu_version` return on each generation (its tuned tables' keys).
DEVICE_NAMES = {"v5e": "TPU v5e", "v5p": "TPU v5p", "v6e": "TPU v6e", "tpu7x": "TPU v7"}
VERSIONS = {"v5e": 5, "v5p": 5, "v6e": 6, "tpu7x": 7}
_target = {"generation": "v6e"}


def installed() -> bool:
    if "tpu_inference.logger" in sys.modules:  # loaded already, through `_package`
        return True
    spec = importlib.util.find_spec("tpu_inference")
    return spec is not None and spec.submodule_search_locations is not None


def _package() -> None:
    if "tpu_inference.logger" in sys.modules:
        return
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    if not hasattr(pltpu, "reciprocal"):  # its head_dim 64 kernel's name for it; this jax has it in pl
        pltpu.reciprocal = pl.reciprocal
    spec = importlib.util.find_spec("tpu_inference")
    package = types.ModuleType("tpu_inference")
    package.__path__ = list(spec.submodule_search_locations)
    logger = types.ModuleType("tpu_inference.logger")

    def init_logger(name):  # vLLM's logger adds warning_once and info_once
        log = logging.getLogger(name)
        log.warning_once, log.info_once = log.warning, log.info
        return log

    logger.init_logger = init_logger
    utils = types.ModuleType("tpu_inference.utils")
    utils.get_device_name = lambda num_devices=None: DEVICE_NAMES[_target["generation"]]
    utils.align_to = lambda x, multiple: -(-x // multiple) * multiple  # its flash attention's one helper
    sys.modules.update({"tpu_inference": package, "tpu_inference.logger": logger, "tpu_inference.utils": utils})


def _tpu_version() -> int:
    return VERSIONS[_target["generation"]]


def module(name: str, generation: str = "v6e"):
    """tpu_inference.<name>, answering for `generation` from now on."""
    _package()
    _target["generation"] = generation
    loaded = importlib.import_module(f"tpu_inference.{name}")
    for other in list(sys.modules.values()):  # each module imported `get_tpu_version` by name
        if getattr(other, "__name__", "").startswith("tpu_inference.") and hasattr(other, "get_tpu_version"):
            other.get_tpu_version = _tpu_version
    return loaded
