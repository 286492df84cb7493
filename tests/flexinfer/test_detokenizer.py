"""Token ids to text at the end of a request and while it streams: a reply cut
inside a multi-byte character (max_tokens, Ctrl-C) ends before it, never in
U+FFFD, whichever way it is read."""

from __future__ import annotations

import types

import pytest

from flexinfer.detokenizer import IncrementalText, final_text
from flexinfer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory, smollm2_hf_tokenizer) -> Tokenizer:
    """SmolLM2's byte-level BPE: characters outside its merges take one token per byte or two."""
    folder = tmp_path_factory.mktemp("byte-level")
    smollm2_hf_tokenizer.save_pretrained(folder)
    return Tokenizer.from_hf_folder(folder, [smollm2_hf_tokenizer.eos_token_id])


@pytest.mark.parametrize("text, cut, want", [
    ("café 😀", 1, "café "),  # the emoji's last byte missing
    ("日本", 2, ""),  # "日" is two tokens: its first alone is no character
    ("日本", 1, "日"),
    ("a€b", 0, "a€b"),
])
def test_a_reply_cut_inside_a_character_ends_before_it(byte_level, text, cut, want):
    ids = byte_level.encode(text)
    ids = ids[:len(ids) - cut]
    assert final_text(byte_level, ids, []) == want
    for batch in (1, 2, len(ids) or 1):  # streamed in batches of tokens of several sizes
        stream = IncrementalText(byte_level, [])
        pieces = [stream.push(ids[i:i + batch]) for i in range(0, len(ids), batch)] + [stream.finish()]
        assert "".join(pieces) == want and all("\ufffd" not in p for p in pieces)


def test_a_replacement_character_inside_the_text_stays(byte_level):
    """Only the end is held back: an invalid byte earlier is the model's output, shown as U+FFFD."""
    ids = byte_level.encode("日本")
    ids = ids[:1] + byte_level.encode(" ok")
    assert final_text(byte_level, ids, []) == "\ufffd ok"


def test_a_stop_string_completed_by_a_token_that_ends_inside_a_character_stops_there(byte_level):
    """SmolLM2 has " 😀" as " " plus the emoji's first bytes, then its last byte: the first token
    completes the stop string "café " (its text " " is output text), so the engine stops at it,
    with reason "stop" even at max_tokens, instead of waiting for the character to be whole."""
    from flexinfer.engine import Engine
    from flexinfer.sampling import SamplingParams
    from flexinfer.sequence import Sequence

    ids = byte_level.encode("café 😀")
    assert byte_level.decode(ids[:-1]) == "café \ufffd"  # the last token completes the emoji
    params = SamplingParams(max_tokens=len(ids) - 1, stop=["café "])
    seq = Sequence(0, 0, 0, [0], params, 0, byte_level.eos_token_ids)
    engine = types.SimpleNamespace(tokenizer=byte_level)
    reasons = []
    for token in ids[:-1]:
        seq.output_ids.append(token)
        reasons.append(Engine._stop_reason(engine, seq, token))
    assert reasons == [None] * (len(ids) - 2) + ["stop"]
    assert final_text(byte_level, ids[:-1], params.stop) == ""
