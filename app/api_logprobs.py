"""Log probabilities on /v1/chat/completions: the request's `logprobs` and `top_logprobs` in, each
choice's `logprobs` out, in the shapes of OpenAI's Chat Completions reference
(https://platform.openai.com/docs/api-reference/chat/object).

A choice's logprobs are {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
"logprob", "bytes"}]}], "refusal": null}, one entry per generated token (engine/runtime/logprobs.py
says which distribution the values come from).
"""
from __future__ import annotations

from localchat.app.api_errors import ApiError
from localchat.engine.runtime.request import TokenLogprob

MAX_TOP_LOGPROBS = 20  # OpenAI's limit
# OpenAI's value for a token the model gives no probability (JSON has no -Infinity).
LEAST_LOGPROB = -9999.0


def parse_logprobs(body: dict) -> int | None:
    """SamplingParams.logprobs from `logprobs` (true or false) and `top_logprobs` (an integer 0 to
    20, only with logprobs true): None when not asked, else how many alternatives per token."""
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError(400, f"'logprobs' must be true or false (got {wanted!r}).", param="logprobs")
    top = body.get("top_logprobs")
    if top is None:
        return 0 if wanted else None
    if isinstance(top, bool) or not isinstance(top, (int, float)) or not float(top).is_integer() \
            or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS} (got {top!r}).",
                       param="top_logprobs")
    if not wanted:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    return int(top)


def logprobs_json(entries: list[TokenLogprob]) -> dict:
    """A choice's `logprobs` for these tokens' entries."""
    return {"content": [_token_json(e, with_top=True) for e in entries], "refusal": None}


def _token_json(entry: TokenLogprob, *, with_top: bool) -> dict:
    out = {"token": entry.token, "logprob": max(entry.logprob, LEAST_LOGPROB),
           "bytes": None if entry.bytes is None else list(entry.bytes)}
    if with_top:
        out["top_logprobs"] = [_token_json(t, with_top=False) for t in entry.top]
    return out
