"""JSON mode (response_format "json_object"): how a constrained row's token is chosen
(engine/runtime/constrained.py) on crafted logits, and the engine on the tiny checkpoints of both
families, whose answers must parse as one JSON object."""
import json

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from fixtures import open_fixture
from localchat.engine.runtime import constrained
from localchat.engine.runtime.constrained import JsonAnswer, JsonVocabulary, choose_rows
from localchat.engine.runtime.engine import Engine
from localchat.engine.runtime.json_constraint import START_STATE, advance, is_complete
from localchat.engine.runtime.request import ChatRequest, Delta, Final, Message, SamplingParams
from localchat.engine.runtime.sampling import Sampler, sample_tokens
from localchat.engine.runtime.textstream import TextAssembler

MERGED = ('{"', '":', '"}')
PADDING = 3  # embedding rows past the tokenizer's vocabulary


def json_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level: one token per byte, a few merged tokens, two special tokens and one added
    (non-special) markup token."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet + list(MERGED))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(m[0], m[1:]) for m in MERGED]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<think>"])
    tok.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def vocab():
    tok = json_tokenizer()
    return JsonVocabulary(tok, len(tok) + PADDING, (tok.eos_token_id,), torch.device("cpu")).build()


def ids_of(vocab, *texts) -> list[int]:
    return [vocab.tokenizer.convert_tokens_to_ids(t) for t in texts]


def answer_after(vocab, text: str) -> JsonAnswer:
    answer = JsonAnswer(vocab)
    answer.state = advance(START_STATE, text)
    return answer


def logits_favouring(vocab, ranked: dict[int, float]) -> torch.Tensor:
    """[V] logits: -10 everywhere but the given ids."""
    logits = torch.full((vocab.vocab_size,), -10.0)
    for token, value in ranked.items():
        logits[token] = value
    return logits


def most_likely_valid(vocab, text: str, logits: torch.Tensor) -> int:
    """The oracle: the highest-logit token whose text continues `text`, checked one by one."""
    state = advance(START_STATE, text)
    valid = [t for t in range(vocab.vocab_size) if vocab.texts[t] is not None and advance(state, vocab.texts[t])]
    return max(valid, key=lambda t: logits[t].item())


def test_token_texts_leave_out_markup_and_padding(vocab):
    tok = vocab.tokenizer
    for token in ("<|endoftext|>", "<think>", "<tool_call>"):
        assert vocab.text(tok.convert_tokens_to_ids(token)) is None
    assert all(vocab.text(t) is None for t in range(len(tok), len(tok) + PADDING))
    assert vocab.text(ids_of(vocab, '{"')[0]) == '{"' and vocab.text(ids_of(vocab, "Ġ")[0]) == " "
    # a lone byte of a multi-byte character reads as one non-ASCII character: string-only
    piece = ids_of(vocab, "Ã")[0]
    assert vocab.text(piece) == "\xc3"
    assert answer_after(vocab, '{"a": "').after(piece) is not None
    assert answer_after(vocab, '{"a": ').after(piece) is None


def test_greedy_takes_the_most_likely_valid_token(vocab):
    close, think, eos, letter, quote, one = ids_of(vocab, "}", "<think>", "<|endoftext|>", "x", '"', "1")
    logits = logits_favouring(vocab, {close: 10, think: 9, eos: 8, letter: 7, one: 5, quote: 4})
    answer = answer_after(vocab, '{"a": ')
    assert logits.argmax().item() == close  # what the model wants cannot stand there
    chosen = answer.choose(logits, Sampler(SamplingParams(temperature=0)), None)
    assert chosen == one == most_likely_valid(vocab, '{"a": ', logits)
    # at the start only an object may open: the merged '{"' beats a lone brace it outranks
    start = JsonAnswer(vocab)
    opener, brace = ids_of(vocab, '{"', "{")
    logits = logits_favouring(vocab, {one: 9, quote: 8, opener: 3, brace: 2})
    assert start.choose(logits, Sampler(SamplingParams(temperature=0)), None) == opener


def test_beyond_the_candidates_the_whole_vocabulary_is_searched(vocab, monkeypatch):
    # after '-' only a digit may come; every letter and sign outranks the digits
    text = '{"a": -'
    logits = torch.full((vocab.vocab_size,), 5.0) + torch.rand(vocab.vocab_size)
    digits = ids_of(vocab, *"0123456789")
    logits[digits] = torch.linspace(-3, -1, 10)
    expected = most_likely_valid(vocab, text, logits)
    assert expected == digits[-1]
    for sampler in (Sampler(SamplingParams(temperature=0)), Sampler(SamplingParams(temperature=1.0, top_k=5, seed=1))):
        assert answer_after(vocab, text).choose(logits, sampler, None) == expected
    monkeypatch.setattr(constrained, "CANDIDATES", 1)
    assert answer_after(vocab, text).choose(logits, Sampler(SamplingParams(temperature=0)), None) == expected


def test_sampling_draws_what_the_free_sampler_draws_when_it_is_valid(vocab):
    # inside a string almost everything is valid: the constrained draw is the free draw, seed for seed
    compared = 0
    for seed in range(40):
        logits = torch.randn(vocab.vocab_size) * 3
        params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=seed)
        free = sample_tokens(logits[None], [Sampler(params)], [None])[0]
        answer = answer_after(vocab, '{"a": "')
        if answer.after(free) is None:  # markup, a raw control character
            continue
        assert answer.choose(logits, Sampler(params), None) == free
        compared += 1
    assert compared > 20


def test_sampling_keeps_to_the_filters_and_a_seed_reproduces_it(vocab):
    close, letter, one, two = ids_of(vocab, "}", "x", "1", "2")
    logits = logits_favouring(vocab, {close: 6, letter: 5.9, one: 5.8, two: 5.7})
    draws = {answer_after(vocab, '{"a": ').choose(logits, Sampler(SamplingParams(temperature=1.0, top_k=3, seed=s)),
                                                  None) for s in range(30)}
    assert draws == {one}  # the only valid token among the three the filter keeps

    def run(seed: int) -> list[int]:
        answer, sampler, out = JsonAnswer(vocab), Sampler(SamplingParams(temperature=1.0, seed=seed)), []
        gen = torch.Generator().manual_seed(99)
        for _ in range(40):
            token = answer.choose(torch.randn(vocab.vocab_size, generator=gen) * 2, sampler, None)
            answer.append(token)
            out.append(token)
            if answer.complete:
                break
        return out

    assert run(5) == run(5) and run(5) != run(6)


def test_free_rows_in_the_batch_are_chosen_as_without_the_json_row(vocab):
    logits = torch.randn(4, vocab.vocab_size) * 2

    def samplers():
        return [Sampler(SamplingParams(temperature=0.8, seed=1)), Sampler(SamplingParams(temperature=0)),
                Sampler(SamplingParams(temperature=1.2, top_p=0.9, seed=2)), Sampler(SamplingParams(temperature=0))]

    answers = [None, JsonAnswer(vocab), None, None]
    mixed = choose_rows(logits, samplers(), [None] * 4, answers, sample_tokens)
    free = samplers()
    alone = sample_tokens(logits[[0, 2, 3]], [free[0], free[2], free[3]], [None] * 3)
    assert [mixed[0], mixed[2], mixed[3]] == alone
    all_free = sample_tokens(logits, samplers(), [None] * 4)
    assert [all_free[0], all_free[2], all_free[3]] == alone
    assert vocab.text(mixed[1]) is not None and advance(START_STATE, vocab.text(mixed[1])) is not None


def test_whitespace_between_tokens_is_capped(vocab):
    space, brace = ids_of(vocab, "Ġ", "}")
    answer = answer_after(vocab, "{")
    for _ in range(constrained.MAX_BLANK_RUN):
        answer.append(space)
    assert answer.after(space) is None and answer.after(brace) is not None
    logits = logits_favouring(vocab, {space: 10, brace: 1})
    assert answer.choose(logits, Sampler(SamplingParams(temperature=0)), None) == brace
    inside = answer_after(vocab, '{"a": "')  # inside a string, spaces are text
    for _ in range(constrained.MAX_BLANK_RUN + 5):
        inside.append(space)


def test_markup_spelled_inside_a_json_string_stays_answer_text():
    tok = json_tokenizer()
    text = '{"a": "<think> and </think> <|endoftext|>"}'
    ids = [i for c in text for i in tok(c, add_special_tokens=False)["input_ids"]]  # character by character
    assert not set(ids) & set(tok.all_special_ids)
    for family in ("glm4v_moe", "gpt_oss"):
        assembler = TextAssembler(tok, family, thinking=False, prefix="<|channel|>final<|message|>", plain=True)
        pieces = [assembler.push(i) for i in ids] + [assembler.finish()]
        assert "".join(a for a, _ in pieces) == text and not "".join(r for _, r in pieces)


# ---- the engine on the tiny checkpoints ---------------------------------------------------------

FIXTURES = ("glm-bf16", "gpt-oss-mxfp4")
QUESTION = (Message.text("user", "Describe a cat as JSON."),)


@pytest.fixture(scope="module")
def engines():
    made = {}

    def get(name: str, **serving) -> Engine:
        key = (name, tuple(sorted(serving.items())))
        if key not in made:
            made[key] = Engine(open_fixture(name), device="cpu", dtype="float32", block_size=4, **serving)
        return made[key]

    yield get
    for engine in made.values():
        engine.shutdown()


def json_request(max_tokens: int = 300, **sampling) -> ChatRequest:
    sampling.setdefault("temperature", 0.0)
    return ChatRequest(QUESTION, SamplingParams(max_tokens=max_tokens, **sampling), response_format="json_object")


def answer_of(engine: Engine, request: ChatRequest) -> tuple[list[int], str, Final]:
    return answer_of_stream(engine.submit(request))


def answer_of_stream(stream) -> tuple[list[int], str, Final]:
    """(generated ids, answer text, Final); JSON mode never streams reasoning."""
    items = list(stream)
    deltas = [d for d in items if isinstance(d, Delta)]
    assert not "".join(d.reasoning for d in deltas)
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), items[-1]


def lean_towards(engine: Engine, monkeypatch, tokens: tuple[str, ...], per_token: float) -> None:
    """Every step adds per_token x (tokens generated so far) to the logits of `tokens`: a random
    model writes a string forever, and one pushed this way must close it, sooner or later."""
    ids = [engine.formatter.tokenizer.convert_tokens_to_ids(t) for t in tokens]
    run = engine.runner.run

    def leaning(plan):
        seqs, logits = run(plan)
        if logits is not None:
            push = torch.tensor([len(seq.generated) * per_token for seq in seqs], dtype=logits.dtype)
            logits = logits.clone()
            logits[:, ids] += push[:, None]
        return seqs, logits

    monkeypatch.setattr(engine.runner, "run", leaning)


def assert_valid_start(text: str) -> None:
    state = advance(START_STATE, text)
    assert state is not None and not is_complete(state), text


@pytest.mark.parametrize("name", FIXTURES)
def test_the_prompt_answers_at_once(engines, name):
    formatter = engines(name).formatter
    json_prompt = formatter.render(json_request())
    if name.startswith("glm"):  # thinking off: the think block closed empty
        assert json_prompt == formatter.render(ChatRequest(QUESTION, thinking=False))
    else:  # straight into the final channel, no analysis
        assert json_prompt == formatter.render(ChatRequest(QUESTION)) + "<|channel|>final<|message|>"
        assert formatter.build(json_request()).input_ids[-1] == formatter.tokenizer.convert_tokens_to_ids("<|message|>")


@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 1}, {"temperature": 0.7, "seed": 2},
                                      {"temperature": 1.0, "top_p": 0.9, "seed": 3}])
def test_answers_are_one_json_object(engines, name, sampling, monkeypatch):
    engine = engines(name)
    lean_towards(engine, monkeypatch, ('"', "}"), 0.3)
    lean_towards(engine, monkeypatch, ("]",), 0.2)
    ids, text, final = answer_of(engine, json_request(**sampling))
    assert final.finish_reason == "stop", (final, text)
    assert isinstance(json.loads(text), dict), text
    assert text == engine.formatter.tokenizer.decode(ids) and final.completion_tokens == len(ids)
    if sampling:  # the seed reproduces the answer
        assert answer_of(engine, json_request(**sampling))[0] == ids


@pytest.mark.parametrize("name", FIXTURES)
def test_the_models_own_answers_are_valid_json_as_far_as_they_go(engines, name):
    specials = set(engines(name).formatter.tokenizer.all_special_ids)
    for seed in range(4):
        ids, text, final = answer_of(engines(name), json_request(max_tokens=120, temperature=1.0, seed=seed))
        assert not set(ids) & specials
        if final.finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
        else:
            assert final.finish_reason == "length" and len(ids) == 120
            assert_valid_start(text)


@pytest.mark.parametrize("name", FIXTURES)
def test_an_answer_cut_off_ends_with_length(engines, name, monkeypatch):
    engine = engines(name)
    lean_towards(engine, monkeypatch, ("}", "]"), -100.0)  # never closes
    for sampling in ({}, {"temperature": 1.0, "seed": 4}):
        ids, text, final = answer_of(engine, json_request(max_tokens=6, **sampling))
        assert final.finish_reason == "length" and len(ids) == 6
        assert_valid_start(text)


@pytest.mark.parametrize("name", FIXTURES)
def test_a_free_request_beside_a_json_one_gets_its_tokens_as_alone(engines, name):
    engine = engines(name, cuda_graphs=True)  # the launched-ahead path (static buffers on the CPU)
    free = ChatRequest((Message.text("user", "Tell me a story."),), SamplingParams(max_tokens=30, temperature=0.8,
                                                                                   seed=9))
    alone = answer_of(engine, free)[0]
    before = engine.counters()
    assert before["ahead_steps"] > 0  # alone, it ran ahead
    streams = [engine.submit(free), engine.submit(json_request(max_tokens=30, temperature=1.0, seed=5))]
    (together, _, _), (_, text, final) = [answer_of_stream(s) for s in streams]
    assert together == alone
    assert final.finish_reason == "stop" and isinstance(json.loads(text), dict) or \
        final.finish_reason == "length" and advance(START_STATE, text) is not None
    # a JSON request alone never runs ahead: its every token is chosen on the host
    mark = engine.counters()
    answer_of(engine, json_request(max_tokens=20))
    after = engine.counters()
    assert after["graph_steps"] > mark["graph_steps"] and after["ahead_steps"] == mark["ahead_steps"]


@pytest.mark.parametrize("fields,message", [
    ({"tools": ({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},)},
     "cannot be combined with tools"),
    ({"sampling": SamplingParams(stop=("}",))}, "cannot be combined with stop strings"),
])
def test_the_engine_refuses_what_json_mode_cannot_keep(engines, fields, message):
    request = ChatRequest(QUESTION, response_format="json_object", **fields)
    final = list(engines("gpt-oss-mxfp4").submit(request))[-1]
    assert final.finish_reason == "error" and message in final.error
