"""Next-token choice for a whole step at once: greedy, or temperature with top-k / top-p / min-p
filters, and the repetition, presence and frequency penalties, each row with its own settings and
its own seeded generator.

The rows of a step are filtered together on the device and the chosen ids come back to the host
in one transfer, so a step of 32 sequences costs one synchronisation, not 32.
"""
from __future__ import annotations

import torch

from .request import SamplingParams


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits [V]; seen: ids already in the context. Positive logits are divided by the penalty,
    negative ones multiplied (the CTRL convention, Keskar et al. 2019)."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    picked = logits[seen]
    logits = logits.clone()
    logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def apply_presence_frequency(logits: torch.Tensor, generated: torch.Tensor, presence: float,
                             frequency: float) -> torch.Tensor:
    """logits [V]; generated: the ids sampled so far. OpenAI's penalties: logit_j - c_j * frequency
    - (c_j > 0) * presence, c_j how often token j was sampled before this position
    (platform.openai.com/docs/api-reference/parameter-details)."""
    if (presence == 0.0 and frequency == 0.0) or generated.numel() == 0:
        return logits
    counts = torch.bincount(generated, minlength=logits.shape[-1]).to(logits.dtype)
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence


def filter_sorted(sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """sorted_logits [B, V] float32, each row in descending order and already divided by its
    temperature; top_k [B] (0: off), top_p [B] (1.0: off), min_p [B] (0.0: off). Returns the
    rows with excluded entries at -inf. Filters apply in the order top-k, top-p, min-p."""
    vocab = sorted_logits.shape[-1]
    rank = torch.arange(vocab, device=sorted_logits.device)
    keep_k = torch.where(top_k > 0, top_k, vocab)
    x = sorted_logits.masked_fill(rank[None, :] >= keep_k[:, None], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = probs.cumsum(-1) - probs
    x = x.masked_fill((mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    return x.masked_fill(probs < min_p[:, None] * probs[:, :1], float("-inf"))


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] float32, already divided by the temperature -> logits with excluded ids at -inf."""
    sorted_logits, order = torch.sort(logits[None], dim=-1, descending=True)
    dev = logits.device
    kept = filter_sorted(sorted_logits, torch.tensor([params.top_k], device=dev),
                         torch.tensor([params.top_p], device=dev), torch.tensor([params.min_p], device=dev))
    return torch.empty_like(logits).scatter_(0, order[0], kept[0])


class Sampler:
    """One per request: its settings and its random generator (seeded when the request says so).
    prompt_len: how many leading context ids are the prompt (not counted by the presence and
    frequency penalties)."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu", prompt_len: int = 0):
        self.params = params
        self.prompt_len = prompt_len
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None  # logit_bias as (ids, values) on the logits' device
        self.generator = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=device)
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    @property
    def greedy(self) -> bool:
        return self.params.temperature <= 0

    @property
    def penalised(self) -> bool:
        """Whether the logits change before the choice: penalties over the context, or a logit bias."""
        p = self.params
        return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                or bool(p.logit_bias))

    def penalise(self, logits: torch.Tensor, context_ids: torch.Tensor) -> torch.Tensor:
        """logits [V] float32 -> with this request's penalties over context_ids (prompt, then
        generated) and its logit bias."""
        p = self.params
        logits = apply_repetition_penalty(logits, context_ids, p.repetition_penalty)
        logits = apply_presence_frequency(logits, context_ids[self.prompt_len:], p.presence_penalty,
                                          p.frequency_penalty)
        if p.logit_bias:
            if self._bias is None:  # once per request: the same on every step
                ids, biases = zip(*p.logit_bias)
                self._bias = (to_device(logits.device, list(ids)),
                              to_device(logits.device, list(biases), torch.float32))
            logits = logits.index_add(0, *self._bias)
        return logits

    def __call__(self, logits: torch.Tensor, context_ids: torch.Tensor) -> int:
        """logits [V] float32; context_ids: prompt and generated ids so far."""
        return sample_tokens(logits[None], [self], [context_ids])[0]


def sample_tokens(logits: torch.Tensor, samplers: list[Sampler], contexts: list[torch.Tensor | None]) -> list[int]:
    """logits [B, V] (any float dtype); samplers[b] and contexts[b] (the ids so far, for the
    penalties, or None) belong to row b. Returns the B chosen ids."""
    return choose_tokens(logits, samplers, contexts).tolist()


def to_device(device: torch.device, values: list, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list on `device` without waiting for the work queued there (a blocking
    host-to-device copy would wait for the step in flight)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def choose_tokens(logits: torch.Tensor, samplers: list[Sampler], contexts: list[torch.Tensor | None]) -> torch.Tensor:
    """sample_tokens, leaving the chosen ids [B] int64 on the logits' device: every operation is
    queued behind the step that produces the logits, and nothing waits for it. `logits` itself is
    left as it was (penalties work on a copy): logprobs.py reads the raw values after."""
    logits = logits.to(torch.float32)
    penalised = [b for b, s in enumerate(samplers) if s.penalised and contexts[b] is not None]
    if penalised:
        logits = logits.clone()
        for b in penalised:
            logits[b] = samplers[b].penalise(logits[b], contexts[b])
    rows = [b for b, s in enumerate(samplers) if not s.greedy]
    choice = logits.argmax(dim=-1) if len(rows) < len(samplers) else None
    if rows:
        picked_rows = to_device(logits.device, rows) if len(rows) < len(samplers) else None
        scores, order = race_scores(logits if picked_rows is None else logits.index_select(0, picked_rows),
                                    [samplers[b] for b in rows])
        picked = order.gather(1, scores.argmax(dim=-1, keepdim=True))[:, 0]
        choice = picked if picked_rows is None else choice.index_copy(0, picked_rows, picked)
    return choice


def race_scores(logits: torch.Tensor, samplers: list[Sampler]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] float32 of sampled rows (temperature > 0), samplers[r] row r's. Returns
    (scores [R, V], order [R, V]): scores[r, j] belongs to token order[r, j], the row's j-th most
    likely after its temperature; the row's draw is the token of its highest score, and ranking
    by score gives the order in which the draw would have taken the tokens one after another.

    argmax(p / E) with E ~ Exp(1) draws index i with probability p_i (the exponential race); each
    row draws from its own request's generator so a seed reproduces its answer. Tokens the
    top-k / top-p / min-p filters exclude score 0."""
    dev = logits.device
    params = [s.params for s in samplers]
    temps = to_device(dev, [p.temperature for p in params], torch.float32)
    sorted_logits, order = torch.sort(logits / temps[:, None], dim=-1, descending=True)
    kept = filter_sorted(sorted_logits, to_device(dev, [p.top_k for p in params]),
                         to_device(dev, [p.top_p for p in params], torch.float32),
                         to_device(dev, [p.min_p for p in params], torch.float32))
    probs = torch.softmax(kept, dim=-1)
    race = torch.empty_like(probs)
    for r, sampler in enumerate(samplers):
        race[r].exponential_(generator=sampler.generator)
    return probs / race, order


def ranked_tokens(logits: torch.Tensor, sampler: Sampler, count: int) -> list[int]:
    """logits [V] float32, one row with its penalties applied. Up to `count` token ids in the order
    the row's sampler would take them: greedy by logit; sampled by race_scores (one draw from
    the row's generator, as choose_tokens makes), leaving out the tokens the filters exclude."""
    if sampler.greedy:
        top = torch.topk(logits, min(count, logits.shape[-1]))
        return top.indices[top.values > float("-inf")].tolist()
    scores, order = race_scores(logits[None], [sampler])
    top = torch.topk(scores[0], min(count, scores.shape[-1]))
    return order[0].index_select(0, top.indices[top.values > 0]).tolist()
