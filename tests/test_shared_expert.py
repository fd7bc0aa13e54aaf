"""GLM's shared expert folded into the routed-expert stacks: the store's new layout, and the MoE
block's output unchanged by it."""
import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from localchat.engine import model_configs
from localchat.engine.layers.moe import MoeBlock
from localchat.engine.spec import ModelSpec, MoeSpec
from localchat.engine.weights.formats import DenseWeight, Fp8Weight
from localchat.engine.weights.shared_expert import fold_shared_experts

E, I, H = 6, 32, 48
P = "model.language_model.layers.1.mlp"


def _spec():
    """GLM-4.5V's spec cut to two layers (the second MoE) of small experts."""
    moe = MoeSpec(num_experts=E, top_k=2, intermediate_size=I, num_shared_experts=1, router="sigmoid_bias",
                  activation="silu_glu", norm_topk_prob=True, routed_scaling_factor=1.5)
    config = json.loads((Path(model_configs.__file__).parent / "glm-4.5v.json").read_text())
    return replace(ModelSpec.from_config(config), hidden_size=H, num_layers=2, first_moe_layer=1, moe=moe)


def _fp8(w, block):
    if block is None:
        scale = w.abs().amax(-1, keepdim=True) / 448
        return Fp8Weight((w / scale).to(torch.float8_e4m3fn), scale)
    bn, bk = block
    s = w.unflatten(-2, (-1, bn)).unflatten(-1, (-1, bk)).abs().amax((-3, -1)) / 448
    full = s.repeat_interleave(bn, -2).repeat_interleave(bk, -1)
    return Fp8Weight((w / full).to(torch.float8_e4m3fn), s, block)


def _store(fmt):
    """One MoE layer's weights: routed stacks and the shared expert in the format fmt."""
    def make(*shape):
        w = torch.randn(*shape) / shape[-1] ** 0.5
        return DenseWeight(w) if fmt == "dense" else _fp8(w, None if fmt == "channel" else (16, 16))
    out = {f"{P}.gate.weight": torch.randn(E, H), f"{P}.gate.e_score_correction_bias": torch.randn(E) * 0.1}
    for proj, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        out[f"{P}.experts.{proj}.weight"] = make(E, n, k)
        out[f"{P}.shared_experts.{proj}.weight"] = make(n, k)
    return out


@pytest.mark.parametrize("fmt", ["dense", "channel", "block"])
def test_fold_moves_the_shared_expert_last(fmt):
    spec, store = _spec(), _store(fmt)
    shared = {p: store[f"{P}.shared_experts.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")}
    assert fold_shared_experts(spec, store) == [1]
    for proj, one in shared.items():
        assert f"{P}.shared_experts.{proj}.weight" not in store
        stack = store[f"{P}.experts.{proj}.weight"]
        assert stack.shape[0] == E + 1
        assert torch.equal(stack[E].dequantize() if fmt != "dense" else stack[E].weight,
                           one.dequantize() if fmt != "dense" else one.weight)
    assert fold_shared_experts(spec, store) == []  # already folded: left alone


def test_fold_leaves_a_layer_whose_formats_differ():
    spec, store = _spec(), _store("channel")
    store[f"{P}.shared_experts.up_proj.weight"] = DenseWeight(torch.randn(I, H))
    before = dict(store)
    assert fold_shared_experts(spec, store) == []
    assert store.keys() == before.keys() and all(store[k] is before[k] for k in store)


@pytest.mark.parametrize("fmt", ["dense", "channel"])
def test_moe_block_output_is_the_same_folded(fmt):
    spec, store = _spec(), _store(fmt)
    separate = MoeBlock(spec, copy.copy(store), P)
    fold_shared_experts(spec, store)
    folded = MoeBlock(spec, store, P)
    assert separate.shared is not None and separate.shared_slot is None
    assert folded.shared is None and folded.shared_slot == E
    x = torch.randn(5, H)
    torch.testing.assert_close(folded(x), separate(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 4])
def test_step_bytes_count_the_folded_shared_expert(batch):
    # the benchmark's byte floor: the shared expert read every step, folded or not
    from localchat.app.bench import step_bytes

    spec, store = _spec(), _store("channel")
    before = step_bytes(spec, store, batch, 0)
    fold_shared_experts(spec, store)
    assert step_bytes(spec, store, batch, 0) == pytest.approx(before, rel=1e-6)
