"""`localchat run MODEL` as a conversation in the terminal: each line is a turn, answers stream to
stdout, and the model stays loaded between turns (the prefix cache keeps the earlier turns, so a
turn costs only its own tokens). Started by `--interactive`, or by `localchat run MODEL` with no
question on a terminal.

Commands: /image PATH attaches an image to the next message, /clear starts over (the system
prompt stays), /help lists them, /exit or Ctrl+D leaves. Ctrl+C stops an answer (what was written
stays in the conversation, as on the chat page). A line ending in a backslash continues on the
next. A conversation that outgrows the context goes on without its oldest turns, as on the page.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from typing import Callable

from ..engine.runtime.request import ChatRequest, Delta, Final, ImagePart, Message, TextPart

HELP = ("Enter sends (a line ending in \\ goes on), /image PATH attaches an image to the next message, "
        "/clear starts over, /exit or Ctrl+D leaves; Ctrl+C stops an answer.")


class TerminalChat:
    """One conversation: `template` holds the sampling and model settings of every turn (its
    messages are the system prompt, if any); `load_image(path)` gives an ImagePart or raises
    ValueError saying why not."""

    def __init__(self, engine, template: ChatRequest, load_image: Callable[[str], ImagePart],
                 out=sys.stdout, err=sys.stderr, show_reasoning: bool = False):
        self.engine, self.template, self.load_image = engine, template, load_image
        self.out, self.err, self.show_reasoning = out, err, show_reasoning
        self.turns: list[Message] = []
        self.images: list[ImagePart] = []
        self.dropped = 0  # oldest messages the last answer was given without

    def run(self, read_line: Callable[[str], str], first: str | None = None) -> None:
        """Reads lines with read_line(prompt) (EOFError ends) until /exit; `first` is asked first."""
        if first is not None:
            self.ask(first)
        while True:
            try:
                line = self._read(read_line)
            except EOFError:
                break
            except KeyboardInterrupt:
                print("\n(Ctrl+D or /exit leaves)", file=self.err)
                continue
            if line is None:
                break

    def _read(self, read_line) -> str | None:
        """One line or command; None for /exit."""
        parts = [read_line(">>> ")]
        while parts[-1].endswith("\\"):
            parts[-1] = parts[-1][:-1]
            parts.append(read_line("... "))
        text = "\n".join(parts).strip()
        command, _, rest = text.partition(" ")
        if command in ("/exit", "/quit", "/bye"):
            return None
        if command == "/help":
            print(HELP, file=self.err)
        elif command == "/clear":
            self.turns, self.images, self.dropped = [], [], 0
            print("(a new conversation)", file=self.err)
        elif command == "/image":
            self._attach(rest.strip())
        elif text.startswith("/") and " " not in command:
            print(f"(unknown command {command}; /help lists them)", file=self.err)
        elif text:
            self.ask(text)
        return text

    def _attach(self, path: str) -> None:
        if not path:
            print("(/image needs a file: /image photo.jpg)", file=self.err)
            return
        try:
            self.images.append(self.load_image(path))
        except ValueError as e:
            print(f"({e})", file=self.err)
            return
        print(f"({len(self.images)} image{'s' if len(self.images) > 1 else ''} for the next message)", file=self.err)

    def ask(self, text: str) -> Final | None:
        """One turn: streams the answer and keeps it in the conversation (a refused turn is not)."""
        question = Message("user", (*self.images, TextPart(text)))
        request = replace(self.template, messages=self.template.messages + tuple(self.turns) + (question,),
                          overflow="drop_oldest", dropped_hint=self.dropped)
        self.images = []
        answer, reasoning, final = [], [], None
        stream = self.engine.submit(request)
        try:
            for item in stream:
                if isinstance(item, Delta):
                    answer.append(item.text)
                    reasoning.append(item.reasoning)
                    if item.reasoning and self.show_reasoning:
                        print(item.reasoning, end="", file=self.err, flush=True)
                    if item.text:
                        print(item.text, end="", file=self.out, flush=True)
                else:
                    final = item
        except KeyboardInterrupt:
            print(" (stopped)", end="", file=self.err, flush=True)
        finally:
            stream.close()
        print(file=self.out, flush=True)
        if final is not None and final.finish_reason == "error":
            print(f"localchat: {final.error}", file=self.err)
            return final
        self.turns += [question, Message("assistant", (TextPart("".join(answer)),), "".join(reasoning) or None)]
        if final is not None:
            self.dropped = final.dropped_messages
            if final.dropped_messages:
                print(f"(the model no longer sees the {final.dropped_messages} oldest messages)", file=self.err)
            if final.finish_reason == "length":
                print("(cut at --max-tokens)", file=self.err)
        return final
