"""Log probabilities on /v1/chat/completions: the request's `logprobs` and `top_logprobs` in, each
choice's `logprobs` out, in the shapes of OpenAI's Chat Completions reference
(https://platform.openai.com/docs/api-reference/chat/object); and `logit_bias`, the token ids
whose logits the request shifts.

A choice's logprobs are {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
"logprob", "bytes"}]}], "refusal": null}, one entry per generated token (engine/runtime/logprobs.py
says which distribution the values come from).
"""
from __future__ import annotations

import json

from localchat.app.api_errors import ApiError
from localchat.engine.runtime.request import TokenLogprob

MAX_TOP_LOGPROBS = 20  # OpenAI's limit
# OpenAI's value for a token the model gives no probability (JSON has no -Infinity).
LEAST_LOGPROB = -9999.0
MAX_LOGIT_BIAS = 1024  # entries in one request's logit_bias: any ban list, but bounded


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


def parse_logit_bias(body: dict, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """SamplingParams.logit_bias from `logit_bias`: {token id (as a string): bias from -100 to 100},
    the ids checked against the model's vocabulary when it is known."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    shape = "'logit_bias' maps token ids to biases from -100 to 100, e.g. {\"1734\": -100}"
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"{shape}, at most {MAX_LOGIT_BIAS} of them.", param="logit_bias")
    out = []
    for token, value in bias.items():
        if not str(token).isdigit() or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not -100 <= value <= 100:
            raise ApiError(400, f"{shape} (got {json.dumps({token: value})}).", param="logit_bias")
        if vocab_size is not None and int(token) >= vocab_size:
            raise ApiError(400, f"'logit_bias' names token id {token}, but this model's token ids run from 0 to "
                                f"{vocab_size - 1}.", param="logit_bias")
        out.append((int(token), float(value)))
    return tuple(out)


def logprobs_json(entries: list[TokenLogprob]) -> dict:
    """A choice's `logprobs` for these tokens' entries."""
    return {"content": [_token_json(e, with_top=True) for e in entries], "refusal": None}


def _token_json(entry: TokenLogprob, *, with_top: bool) -> dict:
    out = {"token": entry.token, "logprob": max(entry.logprob, LEAST_LOGPROB),
           "bytes": None if entry.bytes is None else list(entry.bytes)}
    if with_top:
        out["top_logprobs"] = [_token_json(t, with_top=False) for t in entry.top]
    return out
