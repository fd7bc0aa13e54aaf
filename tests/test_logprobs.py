"""Log-probabilities of the chosen tokens (engine/runtime/logprobs.py): the raw model distribution
for the rows that asked, nothing at all for a step in which no row asked, and token names whose
bytes are exact for byte-level BPE pieces of a character."""
import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from localchat.app.demo import GLM_ADDED, GLM_SPECIAL, build_tokenizer
from localchat.engine.runtime.logprobs import RowLogprobs, TokenNames, host_logprobs, token_logprobs
from localchat.engine.runtime.request import SamplingParams, TokenLogprob
from localchat.engine.runtime.sampling import Sampler, choose_tokens, sample_tokens


def _check_row(row: RowLogprobs, logits: torch.Tensor, chosen: int, n: int) -> None:
    """row's values are log_softmax(logits) at `chosen` and its n most likely tokens, in order."""
    expected = torch.log_softmax(logits.float(), dim=-1)
    assert row.logprob == pytest.approx(float(expected[chosen]), abs=1e-5)
    values, ids = torch.topk(expected, n)
    assert [i for i, _ in row.top] == ids.tolist()
    assert [lp for _, lp in row.top] == pytest.approx(values.tolist(), abs=1e-5)
    assert all(a >= b for (_, a), (_, b) in zip(row.top, row.top[1:]))


def test_logprobs_are_the_log_softmax_at_the_chosen_ids_for_the_rows_that_asked_only():
    logits = torch.randn(6, 300) * 3
    params = [SamplingParams(temperature=0, logprobs=3),
              SamplingParams(temperature=0.7, top_k=20, seed=1, logprobs=0),
              SamplingParams(temperature=0),
              SamplingParams(temperature=1.3, top_p=0.9, seed=2, logprobs=20),
              SamplingParams(temperature=0.9, seed=3),
              SamplingParams(temperature=0, logprobs=1)]
    samplers = [Sampler(p) for p in params]
    ids = choose_tokens(logits, samplers, [None] * 6)
    found = token_logprobs(logits, ids, samplers)
    assert found.rows == [0, 1, 3, 5] and found.chosen.shape == (4,) and found.top_ids.shape == (4, 20)
    rows = found.per_row(6)
    assert rows[2] is None and rows[4] is None
    chosen = ids.tolist()
    for b in (0, 1, 3, 5):
        _check_row(rows[b], logits[b], chosen[b], params[b].logprobs)
    # a greedy token is its position's most likely one; a sampled one need not be
    assert rows[0].top[0][0] == chosen[0] and rows[5].top == ((chosen[5], rows[5].logprob),)
    assert rows[1].top == ()
    # the rows asking change no choice
    assert chosen == choose_tokens(logits, [Sampler(p) for p in params], [None] * 6).tolist()


def test_values_are_the_models_distribution_before_penalties_and_temperature():
    logits = torch.tensor([[3.0, 2.875, 1.0, -1.0], [0.5, 0.0, -0.5, 2.0]])
    context = torch.tensor([0, 0])  # token 0 was generated twice
    params = [SamplingParams(temperature=0, frequency_penalty=1.0, logprobs=2),
              SamplingParams(temperature=0.2, seed=0, logprobs=4)]
    samplers = [Sampler(p) for p in params]
    tokens = sample_tokens(logits, samplers, [context, None])
    assert tokens[0] == 1  # the penalty moved the choice off token 0
    rows = host_logprobs(logits, tokens, samplers)
    raw = torch.log_softmax(logits, dim=-1)
    assert rows[0].logprob == pytest.approx(float(raw[0, 1])) and [i for i, _ in rows[0].top] == [0, 1]
    assert [lp for _, lp in rows[1].top] == pytest.approx(torch.sort(raw[1], descending=True).values.tolist())


def test_a_row_whose_sampling_failed_gets_nothing():
    logits = torch.randn(2, 50)
    samplers = [Sampler(SamplingParams(temperature=0, logprobs=2)) for _ in range(2)]
    rows = host_logprobs(logits, [ValueError("no token left"), 7], samplers)
    assert rows[0] is None and rows[1].logprob == pytest.approx(float(torch.log_softmax(logits[1], -1)[7]), abs=1e-6)


def test_a_step_in_which_no_row_asked_computes_nothing(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("log-probabilities computed for a step that did not ask")

    logits = torch.randn(3, 40)
    samplers = [Sampler(SamplingParams(temperature=0)), Sampler(SamplingParams(temperature=0.8, seed=1)),
                Sampler(SamplingParams(temperature=0))]
    ids = choose_tokens(logits, samplers, [None] * 3)
    for name in ("log_softmax", "topk"):
        monkeypatch.setattr(torch, name, forbidden)
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    assert token_logprobs(logits, ids, samplers) is None
    assert host_logprobs(logits, ids.tolist(), samplers) == [None] * 3
    with pytest.raises(AssertionError, match="did not ask"):  # the patch does catch the work when asked
        token_logprobs(logits, ids, [Sampler(SamplingParams(temperature=0, logprobs=1)), *samplers[1:]])


@pytest.fixture(scope="module")
def byte_level():
    """The demo's byte-level BPE tokenizer (every byte a symbol; GLM's special and added tokens)."""
    return PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(GLM_SPECIAL, GLM_ADDED))


def test_byte_level_tokens_give_their_exact_bytes_even_for_a_piece_of_a_character(byte_level):
    text = "héllo 😀 wörld<think>"
    ids = byte_level(text, add_special_tokens=False)["input_ids"]
    names = TokenNames(byte_level)
    named = [names.name(i) for i in ids]
    assert b"".join(bytes(raw) for _, raw in named) == text.encode()
    assert any(token == "\ufffd" for token, _ in named)  # é, ö and the emoji span several tokens
    assert named[-1] == ("<think>", tuple(b"<think>"))
    assert all(token == bytes(raw).decode() for token, raw in named if max(raw) < 0x80)


def test_tokens_that_are_not_byte_level_give_the_utf8_of_their_text():
    # 'é' is also a byte-level symbol (for byte 0xE9): only the decode check tells the two apart.
    tok = Tokenizer(models.WordLevel({"héllo": 0, "[UNK]": 1}, unk_token="[UNK]"))
    names = TokenNames(PreTrainedTokenizerFast(tokenizer_object=tok))
    assert names.name(0) == ("héllo", tuple("héllo".encode()))


def test_an_entry_names_the_token_and_its_alternatives(byte_level):
    names = TokenNames(byte_level)
    a, b = byte_level.convert_tokens_to_ids(["<think>", "</think>"])
    entry = names.entry(a, RowLogprobs(-0.5, ((a, -0.5), (b, -1.25))))
    assert entry == TokenLogprob(a, "<think>", -0.5, tuple(b"<think>"),
                                 (TokenLogprob(a, "<think>", -0.5, tuple(b"<think>")),
                                  TokenLogprob(b, "</think>", -1.25, tuple(b"</think>"))))
