"""Which prefill attention kernel the attention layer gives a step (engine/layers/attention.py),
run through the kernels in the interpreter: sequences of a few queries each take the short-chunk
kernel, long chunks the paged one, and a step with decoding sequences ahead of a long chunk is cut
in two; every form against the gathered reference of the whole step."""
import dataclasses

import pytest
import torch

from kernel_checks import TOL, prefill_case, rel_err
from localchat.engine.layers import attention as attention_layer
from localchat.engine.runtime.forward_batch import ForwardBatch
from localchat.kernels import attention_short
from localchat.kernels.attention_prefill import paged_prefill_attention_ref


@pytest.fixture
def layer_choices(monkeypatch):
    """The layer's GPU choices wherever this runs (on the CPU the interpreter runs the kernels; no
    cuDNN), with small bounds; returns the calls made: (kernel, sequences, longest chunk)."""
    calls = []
    monkeypatch.setattr(attention_layer, "_runs_kernels", lambda q: True)
    monkeypatch.setattr(attention_layer, "SHORT_CHUNK_KERNEL", True)
    monkeypatch.setattr(attention_layer, "_through_cudnn", lambda *a: None)
    monkeypatch.setattr(attention_short, "SHORT_MAX_ROWS", 12)  # 4 queries of 3 heads a KV head
    for module in (attention_layer, attention_short):  # the parts the layer asks for and their count
        monkeypatch.setattr(module, "SHORT_SPLIT_KEYS", 16)
    monkeypatch.setattr(attention_layer, "MIXED_SPLIT_MIN_KEYS", 48)
    for name, label in (("short_prefill_attention", "short"), ("paged_prefill_attention", "paged"),
                        ("paged_decode_attention", "decode")):
        kernel = getattr(attention_layer, name)

        def recorded(*args, _kernel=kernel, _label=label, **kwargs):
            calls.append((_label, args[0].shape[0], 1) if _label == "decode" else
                         (_label, args[5].numel() - 1, args[6]))
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(attention_layer, name, recorded)
    return calls


def float32_bound(q: torch.Tensor) -> float:
    """The interpreter computes float32 dots in float32, a GPU's tl.dot in tf32."""
    return TOL[torch.float32] if q.device.type == "cpu" else 3e-3


def batch_of(args) -> ForwardBatch:
    q, _, _, tables, ctx, cu = args[:6]
    t = q.shape[0]
    return ForwardBatch(torch.zeros(t), torch.zeros(t, dtype=torch.long), cu, ctx, tables, cu.tolist(), ctx.tolist())


@pytest.mark.parametrize("ctx_lens,q_lens,sinks,window,expect", [
    # decoding sequences at long contexts ahead of a chunk: cut in two
    ([60, 9, 75, 90], [1, 1, 3, 20], True, None, [("short", 3, 3), ("paged", 1, 20)]),
    # decoding sequences of one query each: the decode kernel's rows
    ([60, 9, 75, 90], [1, 1, 1, 20], True, None, [("decode", 3, 1), ("paged", 1, 20)]),
    # the same with only short contexts ahead: one paged call
    ([30, 9, 40, 90], [1, 1, 3, 20], False, None, [("paged", 4, 20)]),
    # a sliding-window layer reads few keys whatever the context: one paged call
    ([60, 9, 75, 90], [1, 1, 3, 20], True, 12, [("paged", 4, 20)]),
    # a few queries in every sequence: the short-chunk kernel alone
    ([60, 9, 75], [1, 4, 2], True, None, [("short", 3, 4)]),
    # ... but not in a sliding-window layer, nor where every context fits one part of the keys
    ([60, 9, 75], [1, 4, 2], False, 12, [("paged", 3, 4)]),
    ([10, 9, 16], [1, 4, 2], True, None, [("paged", 3, 4)]),
])
def test_layer_routes_prefill_attention(layer_choices, ctx_lens, q_lens, sinks, window, expect):
    args = prefill_case(ctx_lens, q_lens, 2, 3, 32, 8, torch.float32, sinks, window)
    q, k, v, tables, ctx, cu, longest, scale, s, window = args
    out = attention_layer.paged_attention(q, k, v, batch_of(args), scale, s, window)
    assert layer_choices == expect
    assert rel_err(out, paged_prefill_attention_ref(*args)) < float32_bound(q)


@pytest.mark.parametrize("q_lens,expect", [([1, 4, 2, 20], [("short", 3, 4), ("paged", 1, 20)]),
                                            ([1, 4, 2, 3], [("paged", 4, 4)])])
def test_switched_off_only_the_cut_takes_the_short_kernel(layer_choices, monkeypatch, q_lens, expect):
    monkeypatch.setattr(attention_layer, "SHORT_CHUNK_KERNEL", False)
    args = prefill_case([60, 9, 75, 90], q_lens, 2, 3, 32, 8, torch.float32, True, None)
    q, k, v, tables, ctx, cu, longest, scale, s, window = args
    out = attention_layer.paged_attention(q, k, v, batch_of(args), scale, s, window)
    assert layer_choices == expect
    assert rel_err(out, paged_prefill_attention_ref(*args)) < float32_bound(q)


@pytest.mark.parametrize("bound,window,shared,expect", [
    (4, None, False, [("short", 4, 4)]), (8, None, False, [("paged", 4, 8)]), (4, 12, False, [("paged", 4, 4)]),
    (8, None, True, [("short", 4, 4), ("paged", 4, 8)]), (8, 12, True, [("paged", 4, 8)])])
def test_captured_step_routes_by_its_bound(layer_choices, monkeypatch, bound, window, shared, expect):
    # a chunk graph's step: the bucket bounds every sequence's queries and the graph sees no context,
    # so full-attention layers take the short-chunk kernel up to its rows (4 queries here) whatever
    # the keys, with the parts the table's width allows; past them, shared on the device, the
    # sequences of up to 4 queries on the short-chunk kernel and the others on the paged one
    monkeypatch.setattr(attention_layer, "SHARED_CAPTURED_STEPS", shared)
    q_lens = [1, 4, 2, 0] if bound == 4 else [1, 4, 7, 2]
    args = prefill_case([60, 9, 75, 30], q_lens, 2, 3, 32, 8, torch.float32, True, window)
    q, k, v, tables, ctx, cu, longest, scale, s, window = args
    batch = dataclasses.replace(batch_of(args), captured_query_len=bound)
    out = attention_layer.paged_attention(q, k, v, batch, scale, s, window)
    assert layer_choices == expect
    assert rel_err(out, paged_prefill_attention_ref(*args)) < float32_bound(q)
