"""The Engine's own constructor over on-disk checkpoints (spec, template, tokenizer and weights
through the loader), against transformers."""
import pytest
import torch

from fixtures import load_oracle, open_fixture
from localchat.engine.runtime.engine import Engine
from tiny_models import chat, collect


@pytest.mark.parametrize("name", ["gpt-oss-mxfp4", "glm-fp8-block"])
def test_engine_from_a_checkpoint_directory_matches_transformers(name):
    engine = Engine(open_fixture(name), device="cpu", dtype="float32", block_size=4, max_batch_tokens=8)
    request = chat(("user", "Hello, who are you?"), max_tokens=8)
    ids, _, _, final = collect(engine.submit(request))
    assert final.finish_reason == "length" and len(ids) == 8, final.error
    oracle = load_oracle(name)
    prompt = torch.tensor(final.prompt_token_ids)[None]
    with torch.no_grad():
        out = oracle.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=list(engine.spec.eos_token_ids))
    expected = out[0, prompt.shape[1]:].tolist()
    assert ids == expected
    info = engine.info()
    assert info.weights_bytes > 0 and info.context_length > 0
    assert info.weights_format == {"glm-fp8-block": "FP8, 128x128 block scales; float32 elsewhere",
                                   "gpt-oss-mxfp4": "MXFP4 experts; float32 elsewhere"}.get(name, "float32")
    engine.shutdown()


def test_engine_quantizes_a_bf16_checkpoint_while_loading():
    plain = Engine(open_fixture("glm-bf16"), device="cpu", dtype="float32", block_size=4, max_batch_tokens=8)
    fp8 = Engine(open_fixture("glm-bf16"), device="cpu", dtype="float32", block_size=4, max_batch_tokens=8,
                 quantize="fp8")
    assert fp8.info().weights_format == ("FP8, a scale per row, made from the bf16 checkpoint while loading; "
                                         "float32 elsewhere")
    assert fp8.info().weights_bytes < plain.info().weights_bytes
    request = chat(("user", "Hello, who are you?"), max_tokens=8)
    ids, _, _, final = collect(fp8.submit(request))
    assert ids and final.finish_reason in ("stop", "length"), final.error
    plain.shutdown()
    fp8.shutdown()
