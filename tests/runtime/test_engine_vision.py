"""Images, M-RoPE positions and prefix reuse on a tiny GLM-4.5V; stop strings, max tokens and
end-of-sequence handling."""
import dataclasses

from localchat.engine.runtime.request import TextPart
from tiny_models import chat, collect, hf_greedy, image


def _two_images():
    return chat(("user", (TextPart("Look: "), image(0), TextPart("What is this? And this:"), image(1, 84, 56),
                          TextPart("ok?"))), max_tokens=16)


def test_images_chunked_across_steps_match_transformers(glm):
    engine = glm.engine(block_size=4, max_batch_tokens=7)  # chunk edges fall inside both images
    request = _two_images()
    ids, _, _, final = collect(engine.submit(request))
    assert ids == hf_greedy(glm, engine.formatter.build(request), 16)
    assert engine.counters()["images_encoded"] == 2
    assert final.timings.image_encode > 0
    engine.shutdown()


def test_second_turn_reuses_image_blocks_without_encoding_again(glm):
    question = (image(2, 112, 112), TextPart("Describe the picture."))
    warm = glm.engine(block_size=4, max_batch_tokens=16)
    # The random model's own reply may spell special tokens; the next turn quotes a plain one.
    ids1, _, _, f1 = collect(warm.submit(chat(("user", question), max_tokens=8)))
    second = chat(("user", question), ("assistant", "A picture."), ("user", "More detail?"))
    before = warm.counters()
    ids, _, _, f2 = collect(warm.submit(second))
    after = warm.counters()
    assert f1.finish_reason == f2.finish_reason == "length"
    cold = glm.engine(block_size=4, max_batch_tokens=16)
    assert collect(cold.submit(second))[0] == ids  # positions after the reused image are right
    assert after["images_encoded"] == before["images_encoded"]
    assert after["images_skipped"] - before["images_skipped"] == 1
    p1, p2 = list(f1.prompt_token_ids), list(f2.prompt_token_ids)
    common = next(i for i, (a, b) in enumerate(zip(p1 + ids1[:-1], p2)) if a != b)
    hit = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    assert hit == common // 4 * 4
    assert hit > len(p1) - p1[::-1].index(glm.spec.image_tokens.image)  # past the image's end
    assert after["computed_tokens"] - before["computed_tokens"] == len(p2) - hit + 7
    # A different picture of the same size shares nothing from the image on.
    other = chat(("user", (image(3, 112, 112), TextPart("Describe the picture."))), max_tokens=8)
    assert collect(warm.submit(other))[0] == collect(cold.submit(other))[0]
    assert warm.counters()["images_encoded"] == after["images_encoded"] + 1
    warm.shutdown()
    cold.shutdown()


def test_partly_cached_image_is_encoded_and_sliced(glm):
    request = chat(("user", (TextPart("Hi "), image(4, 112, 112), TextPart("What is it?"))), max_tokens=10)
    engine = glm.engine(block_size=4, max_batch_tokens=16)
    ids, _, _, final = collect(engine.submit(request))
    prompt = list(final.prompt_token_ids)
    image_id = glm.spec.image_tokens.image
    start, end = prompt.index(image_id), len(prompt) - prompt[::-1].index(image_id)
    keep = start // 4 + 2  # the cached chain will end two blocks into the image
    assert start < keep * 4 < end
    # While idle, evict everything but the first `keep` cached blocks (LRU drops chain tails first).
    pool = engine.pool
    pool.free(pool.allocate(pool.num_free - keep))
    assert pool.num_cached == keep
    before = engine.counters()
    assert collect(engine.submit(request))[0] == ids
    after = engine.counters()
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == keep * 4
    assert after["images_encoded"] - before["images_encoded"] == 1
    engine.shutdown()


def test_stop_strings_max_tokens_and_end_of_sequence(glm):
    engine = glm.engine(block_size=4)
    base = chat(("user", "Say something long."), max_tokens=30)
    ids, text, _, final = collect(engine.submit(base))
    assert final.finish_reason == "length" and final.completion_tokens == 30 == len(ids)
    stop = text[6:9]
    assert len(stop) == 3
    cut = text.index(stop)
    stopped = dataclasses.replace(base, sampling=dataclasses.replace(base.sampling, stop=(stop,)))
    _, text2, _, final2 = collect(engine.submit(stopped))
    assert text2 == text[:cut] and final2.finish_reason == "stop" and final2.completion_tokens < 30
    # An end-of-sequence id ends the answer at its first appearance; it is counted, not streamed.
    eos = ids[8]
    first = ids.index(eos)
    with_eos = dataclasses.replace(glm, spec=dataclasses.replace(glm.spec, eos_token_ids=(eos,))).engine(block_size=4)
    ids3, _, _, final3 = collect(with_eos.submit(base))
    assert final3.finish_reason == "stop" and ids3 == ids[:first] and final3.completion_tokens == first + 1
    engine.shutdown()
    with_eos.shutdown()


def test_text_only_model_refuses_images(oss):
    engine = oss.engine(block_size=4)
    final = collect(engine.submit(chat(("user", (image(0), TextPart("hi"))))))[3]
    assert final.finish_reason == "error" and "does not read images" in final.error
    engine.shutdown()


def test_preempted_image_requests_recompute_exactly(glm):
    requests = [chat(("user", (TextPart(f"Picture {i}: "), image(10 + i, 112, 84), TextPart("Describe it."))),
                     max_tokens=20) for i in range(3)]
    roomy = glm.engine(block_size=4)
    expected = [collect(roomy.submit(r))[0] for r in requests]
    tight = glm.engine(block_size=4, num_blocks=24, max_batch_tokens=8)  # ~14 blocks per request
    streams = [tight.submit(r) for r in requests]
    assert [collect(s)[0] for s in streams] == expected
    assert tight.counters()["preemptions"] > 0
    tight.pool.check()
    assert tight.pool.num_free == tight.pool.num_blocks
    roomy.shutdown()
    tight.shutdown()
