"""The weight store converts back into transformers' layouts: `bench --compare transformers`
runs transformers on exactly the engine's weights."""
import torch

from localchat.app.bench_compare import first_layers, hf_model, hf_tensors
from tiny_models import to_store


def _round_trip(tiny, family):
    ref = tiny.hf.state_dict()
    state = dict(hf_tensors(to_store(ref, family), family, torch.float32))
    assert set(state) == set(ref)
    assert all(torch.equal(state[k], ref[k].float()) for k in ref)
    model = hf_model(tiny.hf.config.to_dict(), tiny.spec.num_layers, state, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, tiny.hf(input_ids=ids).logits)


def test_gpt_oss_store_loads_into_transformers(oss):
    _round_trip(oss, "gpt_oss")


def test_glm_store_loads_into_transformers(glm):
    _round_trip(glm, "glm4v_moe")


def test_first_layers_keeps_the_rest_of_the_model():
    store = {"model.layers.0.x": 0, "model.layers.1.x": 1, "model.layers.12.x": 2, "model.norm.weight": 3,
             "model.visual.blocks.layers.5.x": 4, "lm_head.weight": 5}
    assert set(first_layers(store, 2)) == {"model.layers.0.x", "model.layers.1.x", "model.norm.weight",
                                           "model.visual.blocks.layers.5.x", "lm_head.weight"}
