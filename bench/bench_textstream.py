"""Host time per streamed token: TextAssembler.push (detokenize, reasoning split, stop strings)
for 32 chats x 100 random ids of the bench's word tokenizer. CPU only.

    python bench/bench_textstream.py [--family gpt_oss|glm4v_moe]
"""
import argparse
import random
import time

from localchat.app.bench_prompts import ORDINARY_IDS, word_tokenizer
from localchat.engine.runtime.textstream import TextAssembler

p = argparse.ArgumentParser()
p.add_argument("--family", default="gpt_oss")
p.add_argument("--chats", type=int, default=32)
p.add_argument("--tokens", type=int, default=100)
args = p.parse_args()
tokenizer = word_tokenizer(201088)
rng = random.Random(0)
chats = [TextAssembler(tokenizer, args.family, True) for _ in range(args.chats)]
ids = [[rng.randrange(*ORDINARY_IDS) for _ in range(args.tokens)] for _ in chats]
start = time.perf_counter()
for step in range(args.tokens):
    for chat, row in zip(chats, ids):
        chat.push(row[step])
seconds = time.perf_counter() - start
print(f"{1e6 * seconds / (args.chats * args.tokens):.1f} us per token, "
      f"{1e3 * seconds / args.tokens:.3f} ms per step of {args.chats} chats")
