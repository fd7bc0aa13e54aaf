"""A conversation longer than the context: leave its oldest turns out (ChatRequest.overflow =
"drop_oldest", what the chat page asks for) instead of refusing it.

Turns are left out whole, from the first message after the system prompt up to a user message,
so what the model sees still starts with a question, and the system prompt always stays. Where
the cut falls decides what the prefix cache can reuse: a cut that moves every turn would prefill
the whole remaining conversation every turn. So a cut, once made, stays where it is for as long
as the conversation fits after it (the caller passes it back as ChatRequest.dropped_hint), and a
new cut leaves a quarter of the context free besides the answer's share, so that the turns after
it reuse the cached prefix until that quarter is used up.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from .prompt import Prompt
from .request import ChatRequest

# The answer's share of the context held free when deciding whether a conversation fits: its
# max_tokens, at most a quarter of the context.
ANSWER_SHARE = 4
# A new cut leaves this share of the context free as well, for the turns that follow it.
HEADROOM_SHARE = 4


def fit_to_context(request: ChatRequest, build: Callable[[ChatRequest], Prompt],
                   limit: int) -> tuple[Prompt, int]:
    """-> (the prompt of `request` with its oldest turns left out as needed, how many messages after
    the system prompt were left out). build: ChatRequest -> Prompt; limit: the most tokens a
    conversation may hold. With overflow "error" nothing is left out; with nothing left to drop,
    the shortest prompt is returned and the caller refuses it if it still leaves no room."""
    if request.overflow != "drop_oldest":
        return build(request), 0
    messages = request.messages
    system = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
    body = messages[system:]
    # where a kept part may start: at a user message, keeping at least the last one
    cuts = [i for i, m in enumerate(body) if m.role == "user"] or [0]
    prompts: dict[int, Prompt] = {}

    def prompt(cut: int) -> Prompt:
        if cut not in prompts:
            prompts[cut] = build(request if cut == 0 else replace(request, messages=messages[:system] + body[cut:]))
        return prompts[cut]

    answer = min(request.sampling.max_tokens, limit // ANSWER_SHARE)
    # the earlier cut, or the latest place one may start at or before it (the conversation was
    # edited since); 0 when there is none
    hint = max((c for c in cuts if c <= request.dropped_hint), default=0)
    if len(prompt(hint).input_ids) + answer <= limit:
        return prompt(hint), hint
    later = [c for c in cuts if c > hint]
    if not later:
        return prompt(hint), hint
    # the first cut leaving the headroom (the prompt shrinks as the cut moves later): binary search
    target = limit - answer - limit // HEADROOM_SHARE
    lo, hi = 0, len(later) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if len(prompt(later[mid]).input_ids) <= target:
            hi = mid
        else:
            lo = mid + 1
    return prompt(later[lo]), later[lo]
