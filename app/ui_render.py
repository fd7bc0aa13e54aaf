"""Stored conversations -> gr.Chatbot messages, and the per-answer status line.

One stored message can become several chatbot messages (thinking panel, answer, status line,
image notes), so `render` also returns, for every chatbot index, the stored position it came
from; edit and retry events carry chatbot indices and map them back through it.
"""
from __future__ import annotations

from localchat.app.history import DONE, ERROR, INTERRUPTED, PARTIAL, STOPPED, History, StoredMessage
from localchat.app.ui_boxes import boxes_message, label_answer
from localchat.engine.runtime.request import Final, ModelInfo


def render(messages: list[StoredMessage], history: History) -> tuple[list[dict], list[int]]:
    """Returns (chatbot value, stored position per chatbot index)."""
    out: list[dict] = []
    positions: list[int] = []

    def add(msg: dict, pos: int) -> None:
        out.append(msg)
        positions.append(pos)

    turn_images: list[str] = []  # images of the user turn the next answer replies to
    earlier_images: list[str] = []  # images of the user turns before that one
    for m in messages:
        if m.role == "user":
            earlier_images += turn_images
            turn_images = list(m.images)
            content: list = [{"path": str(history.image_path(s))} for s in m.images]
            if m.text:
                content.append(m.text)
            add({"role": "user", "content": content or [""]}, m.position)
            for note in m.stats.get("notes", []):
                add({"role": "assistant", "content": note, "metadata": {"title": "Image downscaled",
                                                                       "status": "done"}}, m.position)
            continue
        live = m.status == PARTIAL
        if m.reasoning:
            meta = {"title": "Thinking", "status": "pending" if live and not m.text else "done"}
            if m.stats.get("thinking_s"):
                meta["duration"] = round(m.stats["thinking_s"], 1)
            add({"role": "assistant", "content": m.reasoning, "metadata": meta}, m.position)
        text, boxes = label_answer(m.text, live=live)
        if m.status == ERROR and m.stats.get("error"):
            # Shown in the answer's place, not only inside the collapsed status line. Words, not an
            # emoji: emoji fonts are missing on many Linux desktops.
            text = (text + "\n\n" if text else "") + f"**Error:** {m.stats['error']}"
        if text or not m.reasoning:
            add({"role": "assistant", "content": text or ("…" if live else _EMPTY.get(m.status, "(no answer)"))},
                m.position)
        elif not live and m.stats.get("finish_reason") == "length":
            add({"role": "assistant", "content": CUT_WHILE_THINKING}, m.position)
        # Drawn once the answer is complete: mid-stream the box list is still growing.
        drawn = None if live else boxes_message(history, boxes, turn_images, earlier_images)
        if drawn is not None:
            add(drawn, m.position)
        if not live:
            summary, details = status_line(m)
            add({"role": "assistant", "content": details, "metadata": {"title": summary, "status": "done"}},
                m.position)
    return out, positions


_EMPTY = {STOPPED: "(stopped before the answer began)", INTERRUPTED: "(interrupted before the answer began)"}
CUT_WHILE_THINKING = ("(The answer's token limit ran out while the model was still thinking, before its answer "
                      "began: raise Max answer tokens in Settings, then Retry.)")


def answer_stats(final: Final | None, context_length: int, thinking_s: float | None) -> dict:
    """What the status line shows, stored with the answer so it renders the same after a restart."""
    if final is None:
        return {"finish_reason": "abort"}
    t = final.timings
    return {"finish_reason": final.finish_reason, "prompt_tokens": final.prompt_tokens,
            "completion_tokens": final.completion_tokens, "context_length": context_length,
            "image_encode_s": t.image_encode, "prefill_s": t.prefill, "first_token_s": t.first_token,
            "decode_s": t.decode, "queued_s": getattr(t, "queued", 0.0), "tokens_per_s": t.decode_tokens_per_s, "thinking_s": thinking_s,
            "error": final.error, "dropped_messages": final.dropped_messages, "cached_tokens": final.cached_tokens}


def status_line(m: StoredMessage) -> tuple[str, str]:
    """(one-line summary shown as the collapsed title, the TTFT split shown when opened)."""
    s = m.stats
    # Words, not symbols: emoji fonts are missing on many Linux desktops.
    mark = {DONE: "", STOPPED: "stopped · ", INTERRUPTED: "interrupted · ", ERROR: "error · "}
    head = mark.get(m.status, "")
    if m.stats.get("finish_reason") == "length":
        head += "cut at max tokens · "
    if "prompt_tokens" not in s:
        return head.rstrip(" ·") or "no statistics", "The answer ended before the engine reported timings."
    ttft = s["image_encode_s"] + s["prefill_s"] + s["first_token_s"]
    used = s["prompt_tokens"] + s["completion_tokens"]
    summary = (f"{head}{s['tokens_per_s']:.1f} tok/s · TTFT {ttft:.2f} s · "
               f"context {used:,} / {s['context_length']:,}")
    details = (f"TTFT {ttft:.3f} s = image encode {s['image_encode_s']:.3f} s + prompt "
               f"{s['prefill_s']:.3f} s + first token {s['first_token_s']:.3f} s  \n"
               f"{s['prompt_tokens']:,} prompt tokens{_cached(s)}, {s['completion_tokens']:,} answer tokens, "
               f"decode {s['decode_s']:.2f} s, queued {s.get('queued_s', 0.0):.2f} s, "
               f"finish: {s['finish_reason']}")
    dropped = s.get("dropped_messages", 0)
    if dropped:
        summary += f" · {dropped} oldest message{'s' if dropped > 1 else ''} left out"
        details += (f"  \nThe chat no longer fits the context: the model answered without its {dropped} oldest "
                    "message" + ("s" if dropped > 1 else "") + " (the system prompt stays). A new chat starts "
                    "with the whole context free.")
    if s.get("error"):
        details += f"  \nerror: {s['error']}"
    return summary, details


def _cached(stats: dict) -> str:
    """How many prompt tokens the prefix cache held (stats stored before it was counted have none)."""
    cached = stats.get("cached_tokens") or 0
    return f" ({cached:,} of them from the prefix cache)" if cached else ""


def model_markdown(info: ModelInfo) -> str:
    """The model panel: which model, where it runs (as the engine reports its placement over
    devices, one line per entry), and the memory its weights and KV cache take. Facts the engine
    does not know (a remote backend's memory) are left out rather than shown as 0."""
    reasoning = "thinking on/off (GLM)" if info.reasoning == "thinking" else "reasoning effort low/medium/high"
    parts = [p.strip() for p in str(info.placement).replace(";", "\n").splitlines() if p.strip()] or ["unknown"]
    placement = parts[0] if len(parts) == 1 else "".join(f"\n- {p}" for p in parts)
    lines = [f"**{info.name}** ({info.family})",
             f"context {info.context_length:,} tokens · images {'yes' if info.supports_images else 'no'} · "
             f"reasoning: {reasoning}"]
    held = f" ({info.weights_format})" if info.weights_format else ""
    if info.weights_bytes:
        lines.append(f"weights in memory: {_bytes(info.weights_bytes)}{held}")
    elif info.weights_format:
        lines.append(f"weights: {info.weights_format}")
    # Sliding-window layers keep only each chat's recent tokens, in a pool of their own.
    window = f" (sliding-window layers: {info.kv_window_tokens:,} recent tokens)" if info.kv_window_tokens else ""
    if info.kv_cache_bytes:
        holds = f", holds {info.kv_cache_tokens:,} tokens over all chats{window}" if info.kv_cache_tokens else ""
        lines.append(f"KV cache: {_bytes(info.kv_cache_bytes)}{holds}")
    elif info.kv_cache_tokens:
        lines.append(f"KV cache: holds {info.kv_cache_tokens:,} tokens over all chats{window}")
    lines.append(f"placement: {placement}")
    return "  \n".join(lines)


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
