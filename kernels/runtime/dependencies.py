"""What a loaded kernel needs besides torch. The Hub's `python-depends` cannot name jax (kernels
0.17.2 allows a short list) and torch-tpu does not bring it, so the kernel says it on import."""

TESTED_JAX = "jax==0.10.2 jaxlib==0.10.2"


def require_jax(kernel: str) -> None:
    """Raises ImportError saying what to install when jax is missing. Imports nothing else."""
    try:
        import jax  # noqa: F401
    except ModuleNotFoundError as err:
        raise ImportError(f"{kernel} runs its Pallas TPU kernels through JAX, which is not installed "
                          f"(torch-tpu does not bring it): pip install {TESTED_JAX}") from err
