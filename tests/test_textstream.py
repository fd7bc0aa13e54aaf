import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from localchat.engine.runtime.detokenize import IncrementalDetokenizer
from localchat.engine.runtime.textstream import TextAssembler


def byte_tokenizer(specials=("<think>", "</think>", "<|endoftext|>")):
    """One token per byte, so every non-ASCII character spans several tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def test_never_splits_a_multibyte_character():
    tok = byte_tokenizer()
    text = "Grüße, 世界! 🙂 done"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text)  # multi-byte characters really span several ids
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_backend_decode_gives_the_wrapper_text():
    # random bytes (invalid UTF-8 runs included) and special tokens: the Rust backend the
    # detokenizer calls directly must give exactly what transformers' decode gives
    tok = byte_tokenizer()
    rng = random.Random(0)
    ids = [rng.randrange(len(tok)) for _ in range(400)]
    fast, wrapped = IncrementalDetokenizer(tok), IncrementalDetokenizer(tok)
    assert fast.backend is not None
    wrapped.backend = None
    assert [fast.push(i) for i in ids] + [fast.flush()] == [wrapped.push(i) for i in ids] + [wrapped.flush()]


def test_assembler_splits_reasoning_and_honours_stop_strings():
    tok = byte_tokenizer()
    ids = tok("<think>hmm é</think>The answer is 42. STOP here", add_special_tokens=False)["input_ids"]
    asm = TextAssembler(tok, "glm4v_moe", thinking=True, stop=("STOP",))
    answer = reasoning = ""
    for i in ids:
        a, r = asm.push(i)
        answer, reasoning = answer + a, reasoning + r
        if asm.stopped:
            break
    a, r = asm.finish()
    assert (answer + a, reasoning + r) == ("The answer is 42. ", "hmm é")
    assert asm.stopped


def test_assembler_hides_end_of_text_markers():
    tok = byte_tokenizer()
    ids = tok("hi<|endoftext|>", add_special_tokens=False)["input_ids"]
    asm = TextAssembler(tok, "glm4v_moe", thinking=False)
    out = "".join(asm.push(i)[0] for i in ids) + asm.finish()[0]
    assert out == "hi"
