"""Leaving the oldest turns out of a conversation longer than the context (context_fit), with a
build whose token count is the sum of its messages' word counts."""
import pytest

from localchat.engine.runtime.context_fit import fit_to_context
from localchat.engine.runtime.prompt import Prompt
from localchat.engine.runtime.request import ChatRequest, Message, SamplingParams


def _conversation(*turn_sizes: int, system: int = 0) -> tuple[Message, ...]:
    """A system prompt of `system` words (if any), then user / assistant turns of those sizes."""
    msgs = [Message.text("system", "s " * system)] if system else []
    for i, n in enumerate(turn_sizes):
        msgs.append(Message.text("user" if i % 2 == 0 else "assistant", f"m{i} " * n))
    return tuple(msgs)


class CountingBuild:
    def __init__(self):
        self.calls: list[tuple[Message, ...]] = []

    def __call__(self, request: ChatRequest) -> Prompt:
        self.calls.append(request.messages)
        return Prompt([0] * sum(len(m.content[0].text.split()) for m in request.messages))


def _request(messages, max_tokens=10, overflow="drop_oldest", hint=0) -> ChatRequest:
    return ChatRequest(messages, SamplingParams(max_tokens=max_tokens), overflow=overflow, dropped_hint=hint)


def test_a_conversation_that_fits_is_sent_whole():
    build = CountingBuild()
    msgs = _conversation(10, 10, 10)
    prompt, dropped = fit_to_context(_request(msgs), build, limit=100)
    assert (len(prompt.input_ids), dropped, build.calls) == (30, 0, [msgs])


def test_overflow_error_never_leaves_anything_out():
    msgs = _conversation(50, 50, 50)
    prompt, dropped = fit_to_context(_request(msgs, overflow="error"), CountingBuild(), limit=100)
    assert (len(prompt.input_ids), dropped) == (150, 0)


def test_the_oldest_whole_turns_go_the_system_prompt_stays_and_a_quarter_is_left_free():
    build = CountingBuild()
    msgs = _conversation(*[10] * 19, system=5)  # 195 words: 10 user turns, 9 answers
    prompt, dropped = fit_to_context(_request(msgs, max_tokens=10), build, limit=100)
    # answer share 10, headroom 25: the first cut at a user message leaving <= 65 tokens
    assert dropped % 2 == 0 and len(prompt.input_ids) <= 100 - 10 - 25
    assert len(prompt.input_ids) + 20 > 100 - 10 - 25  # and no earlier cut would have
    sent = next(c for c in build.calls if len(c) == len(msgs) - dropped)
    assert sent[0].role == "system" and sent[1].role == "user" and sent[1:] == msgs[1 + dropped:]
    assert len(build.calls) <= 2 + 4  # the whole conversation, then a binary search over 9 cuts


def test_an_earlier_cut_is_kept_while_the_rest_fits_then_moves_on():
    msgs = _conversation(*[10] * 13)
    first, cut = fit_to_context(_request(msgs), CountingBuild(), limit=100)
    assert cut > 0
    # two more turns: the rest after the same cut still fits, so the cut (and the cached prefix) stays
    longer = msgs + _conversation(10, 10)[:2]
    _, again = fit_to_context(_request(longer, hint=cut), CountingBuild(), limit=100)
    assert again == cut
    # without the hint the search would cut later (the prompt moves every turn)
    _, fresh = fit_to_context(_request(longer), CountingBuild(), limit=100)
    assert fresh > cut
    # once the rest no longer fits, a new cut is made further on
    much_longer = longer + _conversation(*[10] * 8)
    _, moved = fit_to_context(_request(much_longer, hint=cut), CountingBuild(), limit=100)
    assert moved > cut


def test_a_hint_off_a_user_message_falls_back_to_the_one_before():
    build = CountingBuild()
    msgs = _conversation(*[10] * 7)  # users at 0, 2, 4, 6
    _, dropped = fit_to_context(_request(msgs, hint=3), build, limit=200)
    assert dropped == 2 and build.calls[0] == msgs[2:]


@pytest.mark.parametrize("last", [30, 95])
def test_only_the_last_question_is_left_when_nothing_else_fits(last):
    msgs = _conversation(40, 40, last)
    prompt, dropped = fit_to_context(_request(msgs, max_tokens=4), CountingBuild(), limit=100)
    # the caller refuses a prompt that still leaves no room (95 + the answer)
    assert (dropped, len(prompt.input_ids)) == (2, last)
