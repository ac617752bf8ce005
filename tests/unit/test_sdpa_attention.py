"""The megatron local spec's fused core attention (miles.backends.megatron_backend.sdpa_attention) on
the CPU: the attention megatron's unfused DotProductAttention computes (scores, causal or given mask,
softmax, grouped query heads repeated), in megatron's [s, b, heads, d] layout, fp64."""

from __future__ import annotations

import dataclasses
import enum
import math
from types import SimpleNamespace

import pytest
import torch

from miles.backends.megatron_backend.sdpa_attention import SDPACoreAttention, sdpa_context, with_core_attention


def _unfused(query, key, value, scale, mask):
    """DotProductAttention's math: repeat kv heads, scores, masked_fill(mask, -inf), softmax, @ value."""
    heads, groups = query.shape[2], key.shape[2]
    key, value = (t.repeat_interleave(heads // groups, dim=2) for t in (key, value))
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    scores = (q @ k.transpose(-1, -2)) * scale
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    return (probs @ v).permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def _qkv(seq=7, batch=3, heads=4, groups=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(seq, batch, heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(seq, batch, groups, dim, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(seq, batch, groups, dim, generator=g, dtype=torch.float64, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_causal_gqa_equals_the_unfused_attention(groups):
    q, k, v = _qkv(groups=groups)
    causal = torch.ones(7, 7, dtype=torch.bool).triu(1)
    expected = _unfused(q, k, v, 0.3, causal)
    ours = sdpa_context(q, k, v, scale=0.3, causal=True)
    assert ours.shape == (7, 3, 4 * 8)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    upstream = torch.randn_like(expected)
    for a, b in zip(torch.autograd.grad((ours * upstream).sum(), (q, k, v)),
                    torch.autograd.grad((expected * upstream).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


def test_a_given_mask_replaces_the_causal_one():
    q, k, v = _qkv()
    mask = torch.zeros(3, 1, 7, 7, dtype=torch.bool)
    mask[1, :, :, 5:] = True  # row 1: keys 5 and 6 are padding
    torch.testing.assert_close(sdpa_context(q, k, v, scale=0.5, causal=True, mask=mask),
                               _unfused(q, k, v, 0.5, mask), rtol=1e-12, atol=1e-12)


def test_right_padding_does_not_reach_real_tokens_under_the_causal_mask():
    q, k, v = _qkv()
    full = sdpa_context(q, k, v, scale=0.4, causal=True)
    short = sdpa_context(q[:4], k[:4], v[:4], scale=0.4, causal=True)  # the same rows without 3 trailing positions
    torch.testing.assert_close(full[:4], short, rtol=1e-13, atol=1e-13)


class _MaskType(enum.Enum):  # megatron's AttnMaskType members by name
    causal = 2
    no_mask = 3


def _config(**kw):
    base = dict(attention_dropout=0.0, context_parallel_size=1, window_size=None, softmax_type="vanilla",
                kv_channels=8)
    return SimpleNamespace(**{**base, **kw})


def test_module_takes_dot_product_attentions_arguments():
    attention = SDPACoreAttention(config=_config(), layer_number=3, attn_mask_type=_MaskType.causal,
                                  attention_type="self", softmax_scale=None, cp_comm_type=None, pg_collection=None)
    assert attention.softmax_scale == pytest.approx(1 / math.sqrt(8))
    assert list(attention.parameters()) == []
    q, k, v = _qkv()
    causal = torch.ones(7, 7, dtype=torch.bool).triu(1)
    out = attention(q, k, v, None, attn_mask_type=_MaskType.causal, attention_bias=None, packed_seq_params=None)
    torch.testing.assert_close(out, _unfused(q, k, v, 1 / math.sqrt(8), causal), rtol=1e-12, atol=1e-12)
    no_mask = attention(q, k, v, None, attn_mask_type=_MaskType.no_mask)
    torch.testing.assert_close(no_mask, _unfused(q, k, v, 1 / math.sqrt(8), torch.zeros(7, 7, dtype=torch.bool)))
    with pytest.raises(ValueError, match="no packed sequences"):
        attention(q, k, v, None, packed_seq_params=object())


@pytest.mark.parametrize("field,value,words", [("context_parallel_size", 2, "context parallelism"),
                                               ("window_size", (128, 0), "sliding-window"),
                                               ("softmax_type", "learnable", "softmax_type 'learnable'"),
                                               ("attention_dropout", 0.1, "attention dropout 0.1")])
def test_what_one_fused_call_cannot_do_is_refused(field, value, words):
    with pytest.raises(ValueError, match=words):
        SDPACoreAttention(_config(**{field: value}), 1, _MaskType.causal, "self")


def test_with_core_attention_replaces_it_in_every_layer_and_nothing_else():
    @dataclasses.dataclass
    class Spec:
        module: object
        submodules: object = None

    @dataclasses.dataclass
    class Attention:
        linear_qkv: object
        core_attention: object

    @dataclasses.dataclass
    class Layer:
        self_attention: object
        mlp: object

    @dataclasses.dataclass
    class Block:
        layer_specs: list
        layer_norm: object

    layer = Spec("TransformerLayer", Layer(Spec("SelfAttention", Attention("qkv", "DotProductAttention")), "mlp"))
    other = Spec("TransformerLayer", Layer("IdentityOp", "mlp"))
    block = Block([layer, other, layer], "norm")
    swapped = with_core_attention(block, SDPACoreAttention)
    cores = [s.submodules.self_attention.submodules.core_attention for s in swapped.layer_specs if s is not other]
    assert cores == [SDPACoreAttention, SDPACoreAttention] and swapped.layer_specs[1] is other
    assert swapped.layer_norm == "norm" and swapped.layer_specs[0].submodules.mlp == "mlp"
    assert layer.submodules.self_attention.submodules.core_attention == "DotProductAttention"  # a copy
