"""Byte sizes as people type them, one parser for every command line and
file that takes one (vtmd, vtmctl, the quota file), and as they read them
(format_size, in the same units).

Accepted: a whole number of bytes (`4096`), or a number with a binary suffix
KiB, MiB, GiB or TiB, in any case, a space allowed before it (`512MiB`,
`8 GiB`, `0.5GiB`), whose value is a whole number of bytes. Refused, with a
message saying what is accepted: decimal or one-letter suffixes (`1.5GB`,
`512M`: is a GB 10^9 or 2^30 bytes? memory comes in binary units, so we ask
for them), negative numbers, fractions of a byte, and sizes of 2^63 bytes
or more (no machine has them, and they overflow the broker's 64-bit fields).
"""

from __future__ import annotations

import re
from fractions import Fraction

UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
ACCEPTED = "a byte count (4096) or a number with a binary suffix KiB, MiB, GiB or TiB (512MiB, 0.5GiB)"
MAX_SIZE = (1 << 63) - 1
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)", re.IGNORECASE)


def parse_size(text: str) -> int:
    """The bytes `text` stands for; ValueError (saying what is accepted) otherwise."""
    found = _SIZE.fullmatch(text.strip()) if isinstance(text, str) else None
    unit = UNITS.get(found.group(2).lower()) if found else None
    if unit is None:
        hint = ""
        if found and found.group(2).lower() in ("k", "m", "g", "t", "kb", "mb", "gb", "tb"):
            hint = f" ({found.group(2)} is ambiguous: write {found.group(1)}{found.group(2)[0].upper()}iB)"
        raise ValueError(f"expected {ACCEPTED}, got {text!r}{hint}")
    value = Fraction(found.group(1)) * unit
    if value.denominator != 1:
        raise ValueError(f"{text!r} is not a whole number of bytes ({float(value):g}); expected {ACCEPTED}")
    if value > MAX_SIZE:
        raise ValueError(f"{text!r} is more than the largest size, {MAX_SIZE} bytes (2^63 - 1); expected {ACCEPTED}")
    return int(value)



def format_size(nbytes: int) -> str:
    """`nbytes` in the largest binary unit it fills, as parse_size reads
    it back when exact: 65536 is `64KiB`, 3 << 29 is `1.5GiB`, 1000 is
    `1000B`; at most two decimals, so an odd size is rounded (`95.37MiB`)."""
    for suffix in ("TiB", "GiB", "MiB", "KiB"):
        unit = UNITS[suffix.lower()]
        if nbytes >= unit:
            return f"{nbytes / unit:.2f}".rstrip("0").rstrip(".") + suffix
    return f"{nbytes}B"
