import random

import pytest

from localchat.engine.runtime.reasoning import GlmReasoningParser, HarmonyParser, _TagScanner, parse_boxes


def run(parser, pieces):
    answer, reasoning = "", ""
    for p in pieces:
        a, r = parser.feed(p)
        answer, reasoning = answer + a, reasoning + r
    a, r = parser.finish()
    return answer + a, reasoning + r


GLM_OUT = "<think>The user shows a cat.</think>It is a <|begin_of_box|>[[10,20,300,400]]<|end_of_box|> cat."


def every_split(text):
    """The text cut into pieces of every small size, so each tag is split at every offset."""
    for size in (1, 2, 3, 5, 7):
        yield [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("pieces", list(every_split(GLM_OUT)) + [[GLM_OUT]])
def test_glm_split_any_piece_boundary(pieces):
    answer, reasoning = run(GlmReasoningParser(), pieces)
    assert reasoning == "The user shows a cat."
    assert answer == "It is a <|begin_of_box|>[[10,20,300,400]]<|end_of_box|> cat."
    assert "think" not in answer


def test_glm_without_thinking_is_all_answer():
    assert run(GlmReasoningParser(thinking=False), ["Plain", " answer <", "3"]) == ("Plain answer <3", "")


def test_glm_unfinished_thinking_stays_reasoning():
    assert run(GlmReasoningParser(), ["<thi", "nk>still thinking"]) == ("", "still thinking")


HARMONY = ("<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
           "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.")


@pytest.mark.parametrize("pieces", list(every_split(HARMONY)))
def test_harmony_channels(pieces):
    answer, reasoning = run(HarmonyParser(), pieces)
    assert reasoning == "User asks 2+2. Easy."
    assert answer == "2 + 2 = 4."


def test_harmony_commentary_is_not_answer():
    text = "<|channel|>commentary to=functions.x <|constrain|>json<|message|>{\"a\":1}<|call|>"
    assert run(HarmonyParser(), [text]) == ("", "{\"a\":1}")


def test_parse_boxes():
    boxes = parse_boxes("a <|begin_of_box|>[[1,2,3,4],[5,6,7,8]]<|end_of_box|> b <|begin_of_box|>[9, 10, 11, 12]<|end_of_box|>")
    assert [(b.x1, b.y1, b.x2, b.y2) for b in boxes] == [(1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)]


@pytest.mark.parametrize("make", [GlmReasoningParser, HarmonyParser])
def test_random_piece_boundaries_give_the_whole_text_result(make):
    # text with tags, partial-looking tag starts ("<|", "</thi") and plain stretches without "<",
    # fed in random pieces: the result must not depend on where the pieces break
    text = ("a<b <|chan <think>one </thi two</think> x<|channel|>analysis<|message|>r1 < r2<|end|>"
            "<|start|>assistant<|channel|>final<|message|>ans <wer> 3<|return|> tail <|")
    def run(pieces):
        p = make()
        outs = [p.feed(s) for s in pieces] + [p.finish()]
        return "".join(a for a, _ in outs), "".join(r for _, r in outs)
    whole = run([text])
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert run(pieces) == whole


def test_tag_scanner_needs_unique_openers():
    with pytest.raises(ValueError, match="opening character"):
        _TagScanner(("<a<b>",))
