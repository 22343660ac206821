"""MXFP4 checkpoints (gpt-oss's releases) loaded on TPU with their experts kept in MXFP4.

transformers 5.22 runs MXFP4 experts only through Triton kernels on CUDA, XPU or CPU, and
dequantizes them to bf16 at load anywhere else, so on TPU gpt-oss's experts would take four times
the bytes of the file (gpt-oss-20b no longer fits one v6e chip's HBM). `mxfp4_checkpoint_config`
hands `from_pretrained` the checkpoint's config under a quantization method of ours, registered
through transformers' public `register_quantization_config` / `register_quantizer` (as
`fp8_checkpoint_config` does for fp8 checkpoints): the load keeps the model's own experts modules,
whose weights become the stored fp4 codes and e8m0 exponents laid out for the kernel (half a byte
per weight, once, at load: `ops.mxfp4_weights`), and `experts_forward`, registered in
`ALL_EXPERTS_FUNCTIONS`, reads them as held. Everything else loads as transformers loads it.

transformers is imported only when a function here is called: importing the kernel does not.
"""

from __future__ import annotations

from .fp8_checkpoints import checkpoint_quantization

QUANT_METHOD = "mxfp4_experts_tpu"  # the quantization method name we register with transformers
PROJECTIONS = ("gate_up_proj", "down_proj")  # stored as <name>_blocks and <name>_scales
SCALES = "_scales"  # the module's scales: <weight>_scales, e8m0 exponents as the kernel reads them


def mxfp4_checkpoint_config(pretrained_model_name_or_path, **kwargs):
    """The config of an MXFP4 checkpoint (quant_method "mxfp4", gpt-oss's), to pass as
    `from_pretrained(..., config=...)` so that its experts load and stay in MXFP4 on TPU (the module
    docstring says how).

    `kwargs` go to `AutoConfig.from_pretrained`. The model must be loaded with an
    `experts_implementation` registered in `ALL_EXPERTS_FUNCTIONS` to this kernel's
    `experts_forward`; the load refuses any other, before reading a weight. The experts are frozen:
    gradients flow through them to the rest of the model (adapters, attention)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(pretrained_model_name_or_path, **kwargs)
    holder, quantization = checkpoint_quantization(config)
    method = (quantization or {}).get("quant_method")
    if method != "mxfp4":
        raise ValueError(f"{pretrained_model_name_or_path}: quantization_config's quant_method is {method!r}: "
                         "mxfp4_checkpoint_config reads MXFP4 checkpoints (quant_method 'mxfp4')")
    _register_with_transformers()
    holder.quantization_config = dict(quantization, quant_method=QUANT_METHOD)
    return config


def kernel_layout(blocks, scales):
    """gpt-oss's stored projection (`blocks` uint8 [E, N, K / 32, 16], `scales` uint8 [E, N, K / 32])
    as torch tensors in the layout experts_forward reads, `ops.mxfp4_weights`' (which JAX users
    call; a test holds the two equal): in torch, on the tensors' device, so a load needs no JAX
    backend but the one the model runs on."""
    import torch

    from . import ops

    experts, n, k_blocks, pairs = blocks.shape
    weights = blocks.reshape(experts, n, k_blocks * pairs).transpose(1, 2).contiguous()
    rows = ops.mxfp4_scale_rows(k_blocks * ops.MX_BLOCK)
    bits = scales.view(torch.uint8) if scales.dtype == torch.float8_e8m0fnu else scales  # e8m0 as its bits
    exponents = torch.nn.functional.pad(bits.transpose(1, 2), (0, 0, 0, rows - k_blocks))
    return weights, exponents.contiguous()


def _register_with_transformers():
    from transformers.quantizers import auto
    from transformers.quantizers import register_quantization_config, register_quantizer

    if QUANT_METHOD in auto.AUTO_QUANTIZER_MAPPING:  # registered by this or another load of the kernel
        return

    import torch
    from transformers.core_model_loading import ConversionOps, WeightConverter
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module
    from transformers.utils.quantization_config import Mxfp4Config

    from . import ops, torch_ops

    @register_quantization_config(QUANT_METHOD)
    class Mxfp4ExpertsTpuConfig(Mxfp4Config):
        """Mxfp4Config whose quantizer keeps the experts in MXFP4 on TPU."""

        def __init__(self, **kwargs):
            kwargs.pop("quant_method", None)
            super().__init__(**kwargs)
            self.quant_method = QUANT_METHOD

    class ToKernelLayout(ConversionOps):
        """A projection's stored blocks and scales -> the module's <name> and <name>_scales."""

        def __init__(self, hf_quantizer):
            self.hf_quantizer = hf_quantizer

        def convert(self, input_dict, full_layer_name=None, **kwargs):
            found = {key.rpartition("_")[2]: value[0] if isinstance(value, list) else value
                     for key, value in input_dict.items()}
            weights, scales = kernel_layout(found["blocks"], found["scales"])
            return {full_layer_name: weights, full_layer_name + SCALES: scales}

    @register_quantizer(QUANT_METHOD)
    class Mxfp4ExpertsTpuQuantizer(HfQuantizer):
        """Loads MXFP4 experts as stored, laid out for ragged-dot-tpu's experts_forward."""

        requires_calibration = False

        def validate_environment(self, *args, **kwargs):
            if not self.pre_quantized:
                raise ValueError("mxfp4_checkpoint_config loads checkpoints saved in MXFP4")
            if self.quantization_config.dequantize:
                raise ValueError("quantization_config.dequantize is True: mxfp4_checkpoint_config keeps the experts "
                                 "in MXFP4 (load without it to dequantize)")

        def param_needs_quantization(self, model, param_name, **kwargs) -> bool:
            return False  # the checkpoint's experts arrive quantized; nothing is quantized at load

        def _process_model_before_weight_loading(self, model, **kwargs):
            implementation = model.config._experts_implementation
            if ALL_EXPERTS_FUNCTIONS.get(implementation) is not torch_ops.experts_forward:  # the codes, as held
                raise ValueError(
                    f"experts_implementation={implementation!r}: MXFP4 experts on TPU need ragged-dot-tpu's "
                    "experts_forward, registered with ALL_EXPERTS_FUNCTIONS.register(name, "
                    "kernel.experts_forward) and passed as from_pretrained(..., experts_implementation=name)")
            self.modules_to_not_convert = self.get_modules_to_not_convert(
                model, self.quantization_config.modules_to_not_convert, model._keep_in_fp32_modules)
            for name, module in model.named_modules():
                if not name.endswith(".experts") or not should_convert_module(name, self.modules_to_not_convert):
                    continue
                if not getattr(module, "is_transposed", False):  # gpt-oss's [E, K, N]: the layout MXFP4 takes
                    raise ValueError(f"{name}: {type(module).__name__} is not held transposed; MXFP4 experts are "
                                     "read as gpt-oss holds them")
                for projection in PROJECTIONS:
                    experts, k, n = getattr(module, projection).shape
                    if k % ops.MX_BLOCK:
                        raise ValueError(f"{name}.{projection}: K = {k} is not a multiple of {ops.MX_BLOCK}")
                    frozen = lambda *shape: torch.nn.Parameter(
                        torch.empty(*shape, dtype=torch.uint8, device="meta"), requires_grad=False)
                    setattr(module, projection, frozen(experts, k // 2, n))
                    setattr(module, projection + SCALES, frozen(experts, ops.mxfp4_scale_rows(k), n))

        def get_weight_conversions(self):
            return [WeightConverter([f"{p}_blocks", f"{p}_scales"], p, [ToKernelLayout(self)]) for p in PROJECTIONS]

        def is_serializable(self):
            return False  # saved, the kernel's layout would not be a checkpoint transformers reads

        @property
        def is_trainable(self) -> bool:
            return True  # the experts stay frozen; adapters and the other layers train
