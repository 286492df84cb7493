"""Token ids to text: the whole output at the end of a request, or piece by
piece while it streams.

Stop strings: the text ends before the first stop string (the engine stops
at the token that completes one, and the stop string itself is not part of
the output, as in the OpenAI API). With min_tokens, only a stop string that
ends in the text of the min_tokens-th token or a later one counts. While streaming, text that could be the
start of a stop string is held back until the next tokens show it is not,
so a client never receives text that is later cut.

Stop token ids: the token that ended the output stays in its token ids,
and its text is not in the output's (as vLLM's, and as an end-of-sequence
token's). A stop token can only be the last: before min_tokens they are
banned, after it the first one sampled ends the sample.
"""

from __future__ import annotations

from collections.abc import Iterable

from flexinfer.tokenizer import Tokenizer


def cut_at_stop(text: str, stop: list[str], stops_from: int = 0) -> tuple[str, bool]:
    """`text` before the earliest stop string that ends after its first
    `stops_from` characters (see stops_from()), and whether one was found."""
    cuts = [i for i in (text.find(s, max(0, stops_from - len(s) + 1)) for s in stop) if i >= 0]
    return (text[:min(cuts)], True) if cuts else (text, False)


# An incomplete UTF-8 sequence is at most 3 bytes; decoders show it as one U+FFFD.
_MAX_INCOMPLETE = 3


def final_text(tokenizer: Tokenizer, ids: list[int], stop: list[str], min_tokens: int = 0,
               stop_token_ids: Iterable[int] = ()) -> str:
    """The text of a whole output, cut at its first stop string that counts
    (see stops_from()), without the text of a stop token that ended it."""
    if ids and ids[-1] in stop_token_ids:
        ids = ids[:-1]
    return cut_at_stop(_complete_text(tokenizer, ids), stop, stops_from(tokenizer, ids, min_tokens))[0]


def stops_from(tokenizer: Tokenizer, ids: list[int], min_tokens: int) -> int:
    """How many characters at the start of an output's text no stop string
    may end in: the text of its first min_tokens - 1 tokens. Before the
    min_tokens-th token the engine does not look for stop strings (as
    vLLM), so text they make there is output like any other."""
    return len(_complete_text(tokenizer, ids[:min_tokens - 1])) if min_tokens > 1 else 0


def held_text(tokenizer: Tokenizer, ids: list[int], prefix_offset: int, read_offset: int) -> str:
    """The whole characters of `ids[read_offset:]`, which decode_incremental
    holds back while their last token ends inside a character: that token's
    text before the split character (" " of " 😀"'s first bytes) is already
    output text for final_text, and may complete a stop string."""
    if read_offset == len(ids):
        return ""
    before = len(tokenizer.decode(ids[prefix_offset:read_offset], skip_special_tokens=True))
    return _complete_text(tokenizer, ids[prefix_offset:])[before:]


def _complete_text(tokenizer: Tokenizer, ids: list[int]) -> str:
    """The text of `ids`. One cut inside a multi-byte character (max_tokens,
    a cancel) ends before it, as the stream holds it back: the U+FFFD that
    the missing bytes decode to at the very end are dropped. Text cannot
    tell them from a U+FFFD the model wrote last, which goes too (it carries
    no text); one earlier is the model's output and stays."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    end = len(text)
    while end > 0 and len(text) - end < _MAX_INCOMPLETE and text[end - 1] == "\ufffd":
        end -= 1
    return text[:end]


class IncrementalText:
    """The text a stream of output tokens adds, one call per batch of tokens.

    Invariant: the concatenation of everything `push` and `finish` return
    equals final_text() of all the tokens pushed."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str], min_tokens: int = 0,
                 stop_token_ids: Iterable[int] = ()):
        self._tokenizer = tokenizer
        self._stop_token_ids = frozenset(stop_token_ids)
        self._stop = stop
        self._min_tokens = min_tokens
        # stops_from() of the output, known once its first min_tokens - 1
        # tokens are: until then no stop string can count.
        self._stops_from: int | None = None
        self._longest = max(map(len, stop), default=0)
        self._ids: list[int] = []
        self._prefix_offset = self._read_offset = 0
        self._text = ""  # decoded so far; holds no stop string that counts until _stopped
        self._sent = 0  # characters of _text already returned
        self._stopped = False
        # Per stop string: the length of the longest end of _text that is a
        # proper prefix of it (text that may still become that stop string).
        self._partial = [0] * len(stop)

    def push(self, token_ids: list[int]) -> str:
        """Each call searches only where a stop string can end: the new text
        and the longest-1 characters before it (constant work per token,
        however long the output)."""
        if self._stopped:
            return ""
        if token_ids and token_ids[-1] in self._stop_token_ids:  # the last of the output: its text is not shown
            token_ids = token_ids[:-1]
        self._ids.extend(token_ids)
        new, self._prefix_offset, self._read_offset = self._tokenizer.decode_incremental(
            self._ids, self._prefix_offset, self._read_offset)
        if not new:
            return ""
        # No stop string that counts lies wholly in the text before `new`:
        # one that appears now ends in `new`, so it begins at `start` or later.
        start = max(0, len(self._text) - self._longest + 1)
        self._text += new
        if self._stops_from is None and len(self._ids) >= self._min_tokens - 1:
            self._stops_from = stops_from(self._tokenizer, self._ids, self._min_tokens)
        cuts = [] if self._stops_from is None else [
            i for i in (self._text.find(s, max(start, self._stops_from - len(s) + 1)) for s in self._stop) if i >= 0]
        if cuts:
            self._stopped = True
            return self._take(self._text, min(cuts))
        return self._take(self._text, len(self._text) - self._held_back(len(new)))

    def finish(self) -> str:
        """What is left once the sample has ended: held-back text, less a final partial character."""
        text = final_text(self._tokenizer, self._ids, self._stop, self._min_tokens)
        return self._take(text, len(text))

    def _take(self, text: str, end: int) -> str:
        if end <= self._sent:
            return ""
        piece, self._sent = text[self._sent:end], end
        return piece

    def _held_back(self, added: int) -> int:
        """Length of the longest end of _text that starts some stop string,
        once `added` characters were appended. Per stop string, that end is at
        most its previous one plus `added` long (what precedes the new text in
        it was such an end before), so the search starts there."""
        longest = 0
        for i, s in enumerate(self._stop):
            n = min(len(s) - 1, self._partial[i] + added, len(self._text))
            while n > 0 and not self._text.endswith(s[:n]):
                n -= 1
            self._partial[i] = n
            longest = max(longest, n)
        return longest
