"""The short causal convolution around the gated delta rule (Qwen3.5's and Qwen3-Next's
`causal_conv1d_fn` and `causal_conv1d_update`): depthwise over channels, K taps (4 in the models),
bias and SiLU fused.

Plain JAX, not a Pallas kernel: K shifted multiply-adds over [B, D, T] are elementwise work that
XLA fuses into one pass over the input (read once, written once), which is what a kernel would do.
The gain over transformers' torch code on TorchTPU is that pass, one op per call, instead of a
concatenation, a convolution, a slice, an activation and a state copy each dispatched eagerly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = {None: lambda x: x, "silu": jax.nn.silu, "swish": jax.nn.silu}


def check_shapes(x, weight, bias=None, seq_idx=None, conv_state=None) -> None:
    """Shapes (tuples) that disagree raise a ValueError naming the argument."""
    if len(x) != 3:
        raise ValueError(f"causal_conv1d: hidden_states has shape {tuple(x)}, expected [batch, channels, tokens]")
    batch, channels, tokens = x
    if len(weight) != 2 or weight[0] != channels:
        raise ValueError(f"causal_conv1d: weight has shape {tuple(weight)}, expected [{channels}, taps] "
                         "(hidden_states' channels)")
    if bias is not None and tuple(bias) != (channels,):
        raise ValueError(f"causal_conv1d: bias has shape {tuple(bias)}, expected [{channels}]")
    if seq_idx is not None and tuple(seq_idx) != (batch, tokens):
        raise ValueError(f"causal_conv1d: seq_idx has shape {tuple(seq_idx)}, expected [{batch}, {tokens}]")
    if conv_state is not None and (len(conv_state) != 3 or tuple(conv_state[:2]) != (batch, channels)
                                   or conv_state[2] < weight[1] - 1):
        raise ValueError(f"causal_conv1d_update: conv_state has shape {tuple(conv_state)}, expected "
                         f"[{batch}, {channels}, at least {weight[1] - 1}]")


def check_activation(activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation {activation!r} is not one of {sorted(map(str, ACTIVATIONS))}")


def _check(x, weight, bias, activation, seq_idx=None, conv_state=None):
    check_shapes(x.shape, weight.shape, None if bias is None else bias.shape, None if seq_idx is None else seq_idx.shape,
                 None if conv_state is None else conv_state.shape)
    check_activation(activation)


def _conv(padded, weight, bias, activation, tokens: int, seq_idx=None):
    """out[t] = sum_j w[:, j] padded[t + j] over the last `tokens` positions, in weight's dtype, as
    transformers computes it; with seq_idx, taps from another sequence count as zeros."""
    taps = weight.shape[1]
    padded = padded.astype(weight.dtype)
    start = padded.shape[-1] - tokens - (taps - 1)
    out = jnp.zeros(padded.shape[:2] + (tokens,), jnp.float32)
    for j in range(taps):
        window = padded[:, :, start + j:start + j + tokens].astype(jnp.float32)
        shift = taps - 1 - j  # this tap reads `shift` tokens back
        if seq_idx is not None and 0 < shift < tokens:
            same = jnp.pad(seq_idx[:, :-shift] == seq_idx[:, shift:], ((0, 0), (shift, 0)))
            window = jnp.where(same[:, None, :], window, 0.0)
        out = out + window * weight[:, j].astype(jnp.float32)[None, :, None]
    if bias is not None:
        out = out + bias.astype(jnp.float32)[None, :, None]
    return ACTIVATIONS[activation](out.astype(weight.dtype))


def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, seq_idx=None):
    """[B, D, T] -> [B, D, T] in hidden_states' dtype: zero history before the first token, or before
    each sequence's first token where `seq_idx` [B, T] (int) says which sequence a token is in."""
    _check(hidden_states, weight, bias, activation, seq_idx=seq_idx)
    taps, tokens = weight.shape[1], hidden_states.shape[-1]
    padded = jnp.pad(hidden_states, ((0, 0), (0, 0), (taps - 1, 0)))
    return _conv(padded, weight, bias, activation, tokens, seq_idx).astype(hidden_states.dtype)


def causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None):
    """Decode: hidden_states [B, D, T] continue conv_state [B, D, S] (the last S inputs, S >= taps - 1).
    Returns (out [B, D, T] in hidden_states' dtype, the new state: the last S inputs)."""
    _check(hidden_states, weight, bias, activation, conv_state=conv_state)
    joined = jnp.concatenate([conv_state.astype(weight.dtype), hidden_states.astype(weight.dtype)], axis=-1)
    out = _conv(joined, weight, bias, activation, hidden_states.shape[-1]).astype(hidden_states.dtype)
    return out, joined[:, :, -conv_state.shape[-1]:].astype(conv_state.dtype)
