"""The greedy choice: the first maximum of each row, NON_FINITE for a row with
a NaN or +inf or nothing finite, on the CPU kernel and torch's path alike."""

from __future__ import annotations

import pytest
import torch

from flexinfer.sampling import NON_FINITE, SamplingParams, greedy_choice, sample


def _reference(rows: torch.Tensor) -> list[int]:
    out = []
    for row in rows.double():
        finite = not torch.isnan(row).any() and not torch.isposinf(row).any() and torch.isfinite(row).any()
        out.append(int(torch.argmax(row)) if finite else NON_FINITE)  # argmax: the first maximum
    return out


@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 100, 49152])
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_greedy_choice_is_the_first_maximum(vocab, rows):
    gen = torch.Generator().manual_seed(vocab * 100 + rows)
    logits = torch.randn(rows, vocab, generator=gen)
    assert greedy_choice(logits) == _reference(logits) == logits.argmax(dim=-1).tolist()


def test_ties_and_non_finite_rows():
    logits = torch.zeros(7, 40)
    logits[0, 5] = logits[0, 37] = 2.0  # a tie across lanes: the first wins
    logits[1, 21] = logits[1, 3] = 1.0
    logits[2, 9] = float("nan")
    logits[3, 33] = float("inf")
    logits[4] = float("-inf")
    logits[5] = float("-inf")
    logits[5, 38] = -1.0  # only the tail holds a finite value
    logits[6, 39] = float("nan")  # NaN in the tail past the last 16 lanes
    want = [5, 3, NON_FINITE, NON_FINITE, NON_FINITE, 38, NON_FINITE]
    assert greedy_choice(logits) == _reference(logits) == want
    # torch's path (any tensor the kernel does not take) agrees.
    assert greedy_choice(logits.double()) == want


def test_strided_rows():
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(9, 300, generator=gen)
    rows = wide[::2, 10:250]
    assert rows.stride(-1) == 1 and rows.stride(0) == 600
    assert greedy_choice(rows) == _reference(rows)


def test_sample_bans_tokens_and_flags_non_finite_rows():
    logits = torch.zeros(3, 50)
    logits[0, 7] = 5.0
    logits[0, 8] = 4.0
    logits[1, 2] = float("nan")
    logits[2, 1] = 1.0
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, [greedy] * 3, [None] * 3, banned=[[7], None, None]) == [8, NON_FINITE, 1]
    assert logits[0, 7] == 5.0  # the caller's logits are not written
