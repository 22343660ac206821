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


def check_generate_batch(ours, reference, calls, lengths=(5, 12)):
    """`ours` served by transformers' continuous batching, our op counted, gives for each prompt
    (random, of these lengths) the greedy tokens of `reference` generating it alone."""
    import torch
    from transformers import GenerationConfig

    prompts = [torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        calls.clear()
        batched = ours.generate_batch(prompts, generation_config=config)
        assert calls, "our kernel must serve the batch"
        for prompt, result in zip(prompts, sorted(batched.values(), key=lambda r: int(r.request_id.split("_")[-1]))):
            alone = reference.generate(torch.tensor([prompt]), generation_config=config)
            assert result.generated_tokens == alone[0, len(prompt):].tolist()
