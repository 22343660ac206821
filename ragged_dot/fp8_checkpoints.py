"""FineGrainedFP8 checkpoints (Qwen3-*-FP8 and the like) loaded on TPU with their experts in fp8.

transformers 5.22 loads such a checkpoint dequantized to bf16 on any device that is neither
CUDA nor XPU (its fp8 quantizer's environment check), so on TPU the experts would take twice
the bytes of the file and decode would read twice the bytes per step. `fp8_checkpoint_config`
hands `from_pretrained` the checkpoint's config under a quantization method of ours, registered
through transformers' public `register_quantization_config` / `register_quantizer`: the load
then builds transformers' own FP8 experts modules (a byte per weight and a float32 scale per
128 x 128 block, as stored) and dequantizes every other fp8 projection to the model's dtype
(transformers' FP8Linear calls a CUDA/XPU Triton kernel; in MoE models the experts hold nearly
all the weights). The experts run through `experts_forward` registered in transformers'
`ALL_FP8_EXPERTS_FUNCTIONS`, which reads the fp8 weights and block scales as stored.

transformers is imported only when a function here is called: importing the kernel does not.
"""

from __future__ import annotations

QUANT_METHOD = "fp8_experts_tpu"  # the quantization method name we register with transformers
BLOCK = [128, 128]  # the block scales experts_forward reads (ops.check_rhs_scale)


def fp8_checkpoint_config(pretrained_model_name_or_path, **kwargs):
    """The config of a FineGrainedFP8 checkpoint, to pass as `from_pretrained(..., config=...)`
    so that its experts load and stay in fp8 on TPU (the module docstring says how).

    `kwargs` go to `AutoConfig.from_pretrained`. The model must be loaded with an
    `experts_implementation` registered in `ALL_FP8_EXPERTS_FUNCTIONS` to this kernel's
    `experts_forward`; the load refuses any other, before reading a weight.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(pretrained_model_name_or_path, **kwargs)
    holder, quantization = checkpoint_quantization(config)
    method = (quantization or {}).get("quant_method")
    if method != "fp8":
        raise ValueError(f"{pretrained_model_name_or_path}: quantization_config's quant_method is {method!r}: "
                         "fp8_checkpoint_config reads FineGrainedFP8 checkpoints (quant_method 'fp8')")
    _register_with_transformers()
    holder.quantization_config = dict(quantization, quant_method=QUANT_METHOD)
    return config


def checkpoint_quantization(config):
    """(the config holding the quantization_config, it as a dict or None): where transformers looks
    for it, the config, else its text config."""
    holder = config if getattr(config, "quantization_config", None) else config.get_text_config(decoder=True)
    quantization = getattr(holder, "quantization_config", None)
    if quantization is not None and not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    return holder, quantization


def _register_with_transformers():
    from transformers.quantizers import auto
    from transformers.quantizers import register_quantization_config, register_quantizer

    if QUANT_METHOD in auto.AUTO_QUANTIZER_MAPPING:  # registered by this or another load of the kernel
        return

    import torch
    from transformers.core_model_loading import WeightConverter
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts, Fp8Dequantize
    from transformers.integrations.moe import use_experts_implementation
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module
    from transformers.utils.quantization_config import FineGrainedFP8Config

    @register_quantization_config(QUANT_METHOD)
    class Fp8ExpertsTpuConfig(FineGrainedFP8Config):
        """FineGrainedFP8Config whose quantizer keeps the experts in fp8 on TPU."""

        def __init__(self, **kwargs):
            kwargs.pop("quant_method", None)
            super().__init__(**kwargs)
            self.quant_method = QUANT_METHOD

    @register_quantizer(QUANT_METHOD)
    class Fp8ExpertsTpuQuantizer(FineGrainedFP8HfQuantizer):
        """transformers' fp8 quantizer with two changes: no dequantization forced off CUDA/XPU
        for the experts, and every other fp8 weight dequantized at load."""

        def validate_environment(self, *args, **kwargs):
            config = self.quantization_config
            if not self.pre_quantized:
                raise ValueError("fp8_checkpoint_config loads checkpoints saved in fp8; to quantize a model's "
                                 "experts after loading, call quantize_experts(model)")
            unsupported = {"weight_block_size": (config.weight_block_size, BLOCK),
                           "activation_scheme": (config.activation_scheme, "dynamic"),
                           "scale_fmt": (config.scale_fmt, "float"), "expert_dtype": (config.expert_dtype, "fp8"),
                           "dequantize": (config.dequantize, False)}
            for name, (value, supported) in unsupported.items():
                if (list(value) if isinstance(value, tuple) else value) != supported:
                    raise ValueError(f"quantization_config.{name} is {value!r}: ragged-dot-tpu's fp8 experts "
                                     f"read {supported!r}")

        def _process_model_before_weight_loading(self, model, **kwargs):
            implementation = model.config._experts_implementation
            # transformers' own fp8 experts functions (and its eager loop) call CUDA/XPU kernels
            if (implementation not in ALL_FP8_EXPERTS_FUNCTIONS
                    or ALL_FP8_EXPERTS_FUNCTIONS[implementation].__module__.startswith("transformers.")):
                raise ValueError(
                    f"experts_implementation={implementation!r}: fp8 experts on TPU need ragged-dot-tpu's "
                    "experts_forward, registered with ALL_FP8_EXPERTS_FUNCTIONS.register(name, "
                    "kernel.experts_forward) and passed as from_pretrained(..., experts_implementation=name)")
            self._normalize_modules_to_not_convert(model)
            self.modules_to_not_convert = self.get_modules_to_not_convert(
                model, self.quantization_config.modules_to_not_convert, model._keep_in_fp32_modules)
            for name, module in list(model.named_modules()):
                if not name.endswith(".experts") or not should_convert_module(name, self.modules_to_not_convert):
                    continue
                if getattr(module, "has_bias", False):
                    raise ValueError(f"{name}: transformers' fp8 experts have no biases ({type(module).__name__} has)")
                has_gate = getattr(module, "has_gate", True)
                experts_class = use_experts_implementation(experts_class=FP8Experts,
                                                           experts_interface=ALL_FP8_EXPERTS_FUNCTIONS,
                                                           has_bias=False, has_gate=has_gate)
                with torch.device("meta"):
                    experts = experts_class(config=getattr(module, "config", model.config.get_text_config()),
                                            block_size=self.quantization_config.weight_block_size,
                                            has_gate=has_gate)
                model.set_submodule(name, experts)

        def get_weight_conversions(self):
            # Every weight the model's own converters do not take (the experts' merges do, keeping
            # their scales): dequantized with its scales, as transformers does for the whole model.
            return [WeightConverter(names, param, [Fp8Dequantize(self)])
                    for param, names in self.serialized_names.items()]

