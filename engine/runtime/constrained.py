"""JSON mode (ChatRequest.response_format "json_object" or "json_schema"): the answer is one JSON
object, because each of its tokens is chosen among those whose text continues it: any object
(json_constraint.py checks) or one that follows the request's schema (schema_constraint.py).

A JSON row's token is chosen on the host, every step: its candidates are ranked in the order its
sampler would take them (greedy: by logit; sampled: the same penalties, temperature and top-k /
top-p / min-p filters and the same exponential race from the request's own generator as the
other rows, so a seed reproduces the answer), the first CANDIDATES of them come to the host, and
the first whose text continues the object is taken. When none of them does (the model wants to
write something JSON does not allow there), the rest of the vocabulary is searched in logit order
and the most likely token that continues the object is taken, whatever the filters said: the
filters shape a distribution that no longer holds once most of it is forbidden.

Special and added tokens (markup such as `<think>`, `<|channel|>`, `<tool_call>`, end-of-turn
ids) never continue an object, and neither does whitespace before the object opens or
whitespace that would make a run of more than MAX_BLANK_RUN characters between JSON tokens. The
answer ends, finish reason "stop", with the token that closes the object (whitespace after it in
the same token is allowed), so no end-of-turn token is needed.
The other rows of the batch are sampled together as before, unchanged by the JSON rows.
"""
from __future__ import annotations

import torch

from .json_constraint import JSON_OBJECT
from .glm_arguments import MARKUP, glm_arguments_grammar
from .json_schema import SchemaError, compile_schema
from .logprobs import byte_of_symbol, token_bytes
from .request import ChatRequest
from .schema_constraint import SchemaGrammar
from .sampling import Sampler, ranked_tokens, to_device

CANDIDATES = 64  # candidates checked in the sampler's order before the whole vocabulary is searched
# Whitespace characters in a row between JSON tokens: a line break and the indentation of an
# object nested nine deep at two spaces a level, or four deep at four; a model caught writing
# blank space (a tab a token, for as long as it may) must go on with the object instead.
MAX_BLANK_RUN = 20
_WHITESPACE = " \t\n\r"
_SEARCH_CHUNK = 1024  # tokens brought to the host at a time by that search
_BYTES = 256  # first-character codes: a token's first byte (its text is read one character a byte)
_NEVER = 256  # first-character code of a token that never continues an object

# What the prompt ends with in JSON mode, after the generation prompt: gpt-oss goes straight to its
# final channel (no analysis); GLM-4.5V's template closes an empty think block itself when thinking
# is off (ChatFormatter.thinks).
_JSON_ANSWER_PREFIX = {"glm4v_moe": "", "gpt_oss": "<|channel|>final<|message|>"}


def json_answer_prefix(family: str) -> str:
    """The start of a JSON-mode answer that the prompt already holds."""
    if family not in _JSON_ANSWER_PREFIX:
        raise ValueError(f"JSON mode is not supported for the {family} family")
    return _JSON_ANSWER_PREFIX[family]


def check_json_request(request: ChatRequest) -> None:
    """Raises ValueError, saying what to change, for what cannot be combined with JSON mode."""
    if request.tools or request.forced_call is not None:
        raise ValueError("JSON mode cannot be combined with tools: the answer must be one JSON object, and a "
                         "function call is not one; leave the tools out, or force a call to a function whose "
                         "parameters are the object you want instead of JSON mode")
    if request.sampling.stop:
        raise ValueError("JSON mode cannot be combined with stop strings: the answer ends when its object "
                         "closes, and a stop string would cut the object short; leave the stop strings out")


class JsonVocabulary:
    """Each token id's text as the JSON automaton reads it: its exact bytes, one character per byte
    (Latin-1), so that a piece of a multi-byte character is a non-ASCII character like the whole
    one (allowed inside strings only). None for tokens that never continue an object: special and
    added tokens, the `excluded` ids (end-of-turn), ids past the tokenizer's vocabulary (the
    embedding's padding) and tokens without text. Built on first use (`build`), once per engine:
    it decodes the whole vocabulary."""

    def __init__(self, tokenizer, vocab_size: int, excluded: tuple[int, ...], device: torch.device):
        self.tokenizer, self.vocab_size, self.excluded, self.device = tokenizer, vocab_size, excluded, device
        self.texts: list[str | None] | None = None
        self.first_codes: torch.Tensor | None = None  # [V] int64: each token's first-character code
        # GLM's argument tags, special tokens that a grammar reading markup takes as their text
        self.markup: dict[int, str] = {}
        self.markup_first_codes: torch.Tensor | None = None

    def build(self) -> "JsonVocabulary":
        if self.texts is None:
            texts = _token_texts(self.tokenizer, self.vocab_size, self.excluded)
            codes = [_NEVER if t is None else ord(t[0]) for t in texts]
            self.first_codes = torch.tensor(codes).to(self.device)
            added = self.tokenizer.added_tokens_decoder
            self.markup = {i: t.content for i, t in added.items() if t.content in MARKUP and i < self.vocab_size}
            for i, text in self.markup.items():
                codes[i] = ord(text[0])
            self.markup_first_codes = torch.tensor(codes).to(self.device)
            self.texts = texts
        return self

    def text(self, token: int, markup: bool = False) -> str | None:
        if markup and token in self.markup:
            return self.markup[token]
        return self.texts[token] if 0 <= token < len(self.texts) else None

    def first_character_allowed(self, grammar, state) -> torch.Tensor:
        """[V] bool on the device: whether each token's first character may come next in `grammar`
        from `state`. Necessary for the token to continue the object, not sufficient (the rest of
        its text must too)."""
        allowed = [grammar.advance(state, chr(c)) is not None for c in range(_BYTES)] + [False]
        codes = self.markup_first_codes if grammar.reads_markup else self.first_codes
        return to_device(self.device, allowed, torch.bool)[codes]


def _token_texts(tokenizer, vocab_size: int, excluded: tuple[int, ...]) -> list[str | None]:
    known = min(len(tokenizer), vocab_size)
    ids = list(range(known))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        decoded = backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
    else:
        decoded = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False)
    symbols = tokenizer.convert_ids_to_tokens(ids)
    never = set(tokenizer.added_tokens_decoder) | set(tokenizer.all_special_ids) | set(excluded)
    byte_of = byte_of_symbol()
    texts: list[str | None] = [None] * vocab_size
    for i in ids:
        if i not in never:
            raw = token_bytes(symbols[i], decoded[i], byte_of)
            texts[i] = raw.decode("latin-1") if raw else None
    return texts


class NoValidToken(RuntimeError):
    pass


class JsonAnswer:
    """One request's answer in JSON mode: the grammar (JSON_OBJECT, or a SchemaGrammar), its state
    after the tokens chosen so far (and how many whitespace characters between JSON tokens end
    it), and the choice of the next token."""

    def __init__(self, vocabulary: JsonVocabulary, grammar=JSON_OBJECT):
        self.vocabulary = vocabulary.build()
        self.grammar = grammar
        self.state = grammar.start
        self.blank_run = 0

    @property
    def complete(self) -> bool:
        return self.grammar.is_complete(self.state)

    def after(self, token: int) -> tuple[tuple, int] | None:
        """(state, blank run) after `token`, or None when it does not continue the object."""
        text = self.vocabulary.text(token, self.grammar.reads_markup)
        if text is None or (self.state is self.grammar.start and text[0] in _WHITESPACE):
            return None  # the answer starts with its "{"
        state = self.grammar.advance(self.state, text)
        if state is None:
            return None
        run = _blank_run(self.blank_run, text, self.grammar.between_tokens(state))
        return (state, run) if run <= MAX_BLANK_RUN else None

    def take(self, text: str) -> bool:
        """Reads text written before the grammar took over (a GLM call's line after its name);
        False, leaving the state as it was, when the grammar cannot continue with it."""
        state = self.grammar.advance(self.state, text) if text else self.state
        if state is None:
            return False
        self.state = state
        return True

    def append(self, token: int) -> None:
        after = self.after(token)
        if after is None:
            raise ValueError(f"token {token} does not continue the JSON answer")
        self.state, self.blank_run = after

    def choose(self, logits: torch.Tensor, sampler: Sampler, context: torch.Tensor | None) -> int:
        """logits [V]: the row's raw logits; context: the ids the penalties read (None: none). The
        first candidate in the sampler's order that continues the object, else the most likely
        token anywhere that does."""
        logits = logits.to(torch.float32)
        if context is not None and sampler.penalised:
            logits = sampler.penalise(logits, context)
        for token in ranked_tokens(logits, sampler, CANDIDATES):
            if self.after(token) is not None:
                return token
        return self._most_likely_valid(logits)

    def _most_likely_valid(self, logits: torch.Tensor) -> int:
        """logits [V] float32. Searches only the tokens whose first character may come next, most
        likely first, a chunk at a time."""
        ids = self.vocabulary.first_character_allowed(self.grammar, self.state).nonzero()[:, 0]
        order = ids.index_select(0, torch.argsort(logits.index_select(0, ids), descending=True))
        for start in range(0, order.numel(), _SEARCH_CHUNK):
            for token in order[start:start + _SEARCH_CHUNK].tolist():
                if self.after(token) is not None:
                    return token
        raise NoValidToken("no token of the vocabulary continues the JSON answer here; the tokenizer lacks the "
                           "characters JSON needs")


def _blank_run(before: int, text: str, ends_between_tokens: bool) -> int:
    """The whitespace run between JSON tokens that ends the answer once `text` is read, given the
    run `before` it; ends_between_tokens: whether the text read ends between JSON tokens. Trailing
    whitespace that ends between tokens was read between tokens: a string, number or literal ends
    on another character."""
    if not ends_between_tokens:
        return 0
    trailing = len(text) - len(text.rstrip(_WHITESPACE))
    return before + trailing if trailing == len(text) else trailing


def choose_rows(logits: torch.Tensor, samplers: list[Sampler], contexts: list[torch.Tensor | None],
                answers: list[JsonAnswer | None], sample_free) -> list[int]:
    """logits [B, V]; samplers[b], contexts[b] (penalty ids or None) and answers[b] (None for a
    row in free text) belong to row b. The free rows are chosen together by
    sample_free(logits [F, V], samplers, contexts) (sampling.sample_tokens), exactly as in a batch
    of their own; each JSON row by its JsonAnswer. Returns the B chosen ids."""
    chosen = [0] * len(samplers)
    free = [b for b, answer in enumerate(answers) if answer is None]
    if free:
        rows = logits if len(free) == len(samplers) else logits.index_select(0, to_device(logits.device, free))
        for b, token in zip(free, sample_free(rows, [samplers[b] for b in free], [contexts[b] for b in free])):
            chosen[b] = token
    for b, answer in enumerate(answers):
        if answer is not None:
            chosen[b] = answer.choose(logits[b], samplers[b], contexts[b])
    return chosen


def json_answer_for(request: ChatRequest, vocabulary: JsonVocabulary, family: str) -> JsonAnswer | None:
    """A new answer state for a JSON-mode request (checked: check_json_request) or for the
    arguments of a named forced call (forced_arguments_grammar), None otherwise."""
    if request.response_format == "text":
        grammar = forced_arguments_grammar(request, family)
        return None if grammar is None else JsonAnswer(vocabulary, grammar)
    check_json_request(request)
    if request.response_format == "json_schema":
        return JsonAnswer(vocabulary, SchemaGrammar(request.response_schema))
    return JsonAnswer(vocabulary)


def forced_arguments_grammar(request: ChatRequest, family: str):
    """The grammar a named forced call's arguments are held to, or None where they are the model's
    own: the function's `parameters` schema (compiled strictly when the function says `"strict":
    true`), as one JSON object for gpt-oss (written after the forced start, up to `<|message|>`;
    a schema that cannot be compiled without strict keeps them to a JSON object) and as GLM-4.5V's
    tagged key / value pairs (glm_arguments.py). A call whose function the model picks is not held.
    Raises ValueError for a strict function whose schema cannot be held to."""
    forced = request.forced_call
    if forced is None or forced.function is None:
        return None
    return arguments_grammar(request.tools, forced.function, family)


def arguments_grammar(tools: tuple[dict, ...], name: str, family: str, lenient: bool = False):
    """The grammar for the arguments of a call to `name` among `tools` in `family`'s format, or
    None (not one of the tools, or a family whose calls no grammar holds). A strict function whose
    schema cannot be held to in full raises ValueError, or with `lenient` is held to what can be."""
    if family not in ("gpt_oss", "glm4v_moe"):
        return None
    function = next((t["function"] for t in tools if t["function"]["name"] == name), None)
    if function is None:
        return None  # not a call the engine makes: forced_call_prefix says why
    parameters = function.get("parameters") or {"type": "object"}
    # Held in full: compiled strictly. Leniently, what strict compiling refuses as not enforced is
    # what compiling without it accepts and leaves to the model.
    in_full = function.get("strict") is True and not lenient
    try:
        schema = compile_schema(parameters, name, strict=in_full)
    except SchemaError as e:
        if in_full:
            raise ValueError(f"the parameters of the strict function {name!r} cannot be held to: {e}") from None
        return JSON_OBJECT if family == "gpt_oss" else None
    return SchemaGrammar(schema) if family == "gpt_oss" else glm_arguments_grammar(schema.root, parameters)


def strict_calls(request: ChatRequest, vocabulary: JsonVocabulary, family: str):
    """For a request whose model may call functions marked `"strict": true` (tools offered, no
    call forced, free text), the JsonAnswer that holds the arguments of a call the model begins
    to one of them, by name (None for another function); None when no call can be strict. A call
    the model decides on is held to what of its schema can be (keywords the engine does not
    enforce are left to the model), where a forced one is refused."""
    if request.forced_call is not None or request.response_format != "text":
        return None
    grammars = {t["function"]["name"]: arguments_grammar(request.tools, t["function"]["name"], family, lenient=True)
                for t in request.tools if t["function"].get("strict") is True}
    grammars = {name: g for name, g in grammars.items() if g is not None}
    if not grammars:
        return None
    return lambda name: JsonAnswer(vocabulary, grammars[name]) if name in grammars else None
