"""A kernel as users get it (the built tree loaded with get_kernel from a local Hub cache), one of
its torch ops wrapped to count its calls: the model tests' proof that our kernel served a layer."""

import contextlib
import sys

import build_collection


@contextlib.contextmanager
def counted_kernel(kernel: str, op_name: str, build_dir):
    """Yields (module, calls): `calls` grows by one at each call of the module's torch_ops.<op_name>."""
    module = build_collection.load_from_hub([kernel], build_dir)[kernel]
    torch_ops = sys.modules[module.__name__ + ".torch_ops"]
    op, calls = getattr(torch_ops, op_name), []

    def counted(*args):
        calls.append(len(args))
        return op(*args)

    setattr(torch_ops, op_name, counted)
    try:
        yield module, calls
    finally:
        setattr(torch_ops, op_name, op)
