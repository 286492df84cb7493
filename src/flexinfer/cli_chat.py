"""`flexinfer chat`: an interactive multi-turn conversation on a terminal or
piped stdin, with the reply streamed token by token.

Lines starting with "/" are commands and never reach the model: /exit,
/reset, /help. Ctrl-C during a reply stops it and keeps the conversation as it
was before that message; Ctrl-C at the prompt only gives a fresh prompt;
Ctrl-D (end of input) ends the chat.
"""

from __future__ import annotations

import sys

from flexinfer.detokenizer import IncrementalText
from flexinfer.errors import FlexInferError, InvalidArgument
from flexinfer.llm import LLM
from flexinfer.sampling import SamplingParams

HELP = ("commands: /exit ends the chat (so does Ctrl-D), /reset starts a new conversation (the system "
        "message stays), /help shows this; Ctrl-C stops a reply, which is then not kept")


def utf8_problem(text: str) -> str | None:
    """Why `text` is not UTF-8 text the tokenizer can read, or None. Bytes
    that are not UTF-8 reach Python as lone surrogates (surrogateescape, the
    way argv and our stdin decode them): name the first such byte."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as exc:
        try:
            raw = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate that stands for no byte
            return f"not valid Unicode text ({exc.reason} at index {exc.start})"
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as bad:
            return f"not valid UTF-8 (byte {raw[bad.start]:#04x} at offset {bad.start})"
        return f"not valid Unicode text ({exc.reason} at index {exc.start})"


class ChatSession:
    """One conversation with an LLM, driven by lines of input.

    Invariants: `messages` is the optional system message followed by
    completed user/assistant pairs, oldest first; a turn that fails or is
    stopped leaves it as it was before the turn. Every prompt sent fits
    `llm.max_model_len` with room for `params.max_tokens`: the oldest pairs
    are dropped (and the user told) until it does.
    """

    def __init__(self, llm: LLM, params: SamplingParams, system: str | None = None):
        self.llm = llm
        self.params = params
        self.system = [{"role": "system", "content": system}] if system else []
        self.messages: list[dict[str, str]] = list(self.system)

    def run(self) -> list[Exception]:
        """Chat until /exit or end of input; returns the errors of the turns that failed."""
        errors: list[Exception] = []
        # Bytes that are not UTF-8 become lone surrogates, caught per line,
        # instead of a UnicodeDecodeError that would end the chat.
        if hasattr(sys.stdin, "reconfigure"):
            sys.stdin.reconfigure(errors="surrogateescape")
        print("flexinfer chat: type a message; /help for commands, /exit or Ctrl-D to quit.", file=sys.stderr)
        while True:
            try:
                line = input("you> ").strip()
            except EOFError:
                print()  # end the prompt's line, so the shell's prompt starts on its own
                return errors
            except KeyboardInterrupt:
                print()
                print("(/exit or Ctrl-D to quit)", file=sys.stderr)
                continue
            if not line:
                continue
            if line.startswith("/"):
                if self._command(line):
                    return errors
                continue
            error = self._turn(line)
            if error is not None:
                errors.append(error)

    def _command(self, line: str) -> bool:
        """Run a /command; True means end the chat."""
        name = line.split()[0]
        if name == "/exit":
            return True
        if name == "/reset":
            self.messages = list(self.system)
            print("[conversation reset]", file=sys.stderr)
        elif name == "/help":
            print(HELP, file=sys.stderr)
        else:
            print(f"unknown command {name} (not sent to the model); {HELP}", file=sys.stderr)
        return False

    def _turn(self, line: str) -> Exception | None:
        """One user message and its streamed reply; the error if the turn failed."""
        problem = utf8_problem(line)
        if problem is not None:
            return _report(InvalidArgument(f"this message is {problem}; it was not sent"))
        try:
            kept, prompt = self._fit(self.messages + [{"role": "user", "content": line}])
        except FlexInferError as exc:
            return _report(exc)
        dropped = len(self.messages) + 1 - len(kept)
        if dropped:
            print(f"[dropped the oldest {dropped} messages: the conversation outgrew max_model_len "
                  f"{self.llm.max_model_len} (with room for {self.params.max_tokens} new tokens)]", file=sys.stderr)
        handle = None
        text = IncrementalText(self.llm.tokenizer, self.params.stop, self.params.min_tokens,
                               self.params.stop_token_ids)
        try:
            print("assistant> ", end="", flush=True)
            handle = self.llm.submit(prompt, self.params)
            for event in handle:
                piece = text.push(event.token_ids)
                if piece:
                    print(piece, end="", flush=True)
            print(text.finish(), flush=True)
        except KeyboardInterrupt:
            # Stop the reply and free its KV; the conversation stays as it
            # was, so the next message is answered without this exchange.
            if handle is not None:
                handle.cancel()
                handle.wait()
            tokens = handle.result().metrics.output_tokens if handle is not None else 0
            print()
            print(f"  [stopped after {tokens} tokens: this message and the partial reply are not kept "
                  f"in the conversation]", flush=True)
            return None
        out = handle.result()
        if out.error is not None:
            return _report(out.error)
        self.messages = kept + [{"role": "assistant", "content": out.text}]
        m = out.metrics
        ttft = f"TTFT {m.ttft_s * 1000:.0f} ms, " if m.ttft_s is not None else ""
        print(f"  [prompt {m.prompt_tokens} tokens, {m.prefix_hit_tokens} reused from the prefix cache, "
              f"{ttft}{m.output_tokens} tokens"
              + (f" at {m.decode_tokens_per_s:.1f} tok/s" if m.decode_tokens_per_s else "") + "]", flush=True)
        return None

    def _fit(self, messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], list[int]]:
        """The messages to send (oldest pairs dropped as needed) and their prompt ids."""
        budget = self.llm.max_model_len - self.params.max_tokens
        system, rest = messages[:len(self.system)], messages[len(self.system):]
        while True:
            prompt = self.llm.chat_prompt(system + rest)
            if len(prompt) <= budget:
                return system + rest, prompt
            if len(rest) == 1:
                raise InvalidArgument(
                    f"this message ({len(prompt)} tokens with the chat template"
                    + (" and the system message" if system else "")
                    + f") + max_tokens ({self.params.max_tokens}) exceeds max_model_len {self.llm.max_model_len}; "
                    "it was not sent")
            rest = rest[2:]  # the oldest user message and its reply


def _report(error: Exception) -> Exception:
    print(f"flexinfer: error: {error}", file=sys.stderr, flush=True)
    return error
