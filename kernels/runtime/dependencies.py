"""What a loaded kernel needs besides torch. The Hub's `python-depends` cannot name jax (kernels
0.17.2 allows a short list) and torch-tpu does not bring it, so the kernel says it on import."""

import warnings

TESTED_VERSIONS = {"jax": "0.10.2", "jaxlib": "0.10.2"}
TESTED_JAX = " ".join(f"{name}=={version}" for name, version in TESTED_VERSIONS.items())
_warned: set[str] = set()


def require_jax(kernel: str) -> None:
    """Raises ImportError saying what to install when jax is missing; warns once per kernel
    when the installed jax or jaxlib is not the tested one (Pallas TPU APIs change between
    releases). Imports nothing else."""
    try:
        import jax
        import jaxlib
    except ModuleNotFoundError as err:
        raise ImportError(f"{kernel} runs its Pallas TPU kernels through JAX, which is not installed "
                          f"(torch-tpu does not bring it): pip install {TESTED_JAX}") from err
    found = {"jax": jax.__version__, "jaxlib": jaxlib.__version__}
    if found != TESTED_VERSIONS and kernel not in _warned:
        _warned.add(kernel)
        installed = " ".join(f"{name}=={version}" for name, version in found.items())
        warnings.warn(f"{kernel} was tested with {TESTED_JAX}, found {installed}: Pallas TPU APIs change "
                      f"between jax releases, so its kernels may fail to compile; pip install {TESTED_JAX}",
                      stacklevel=3)
