"""The operator's word on each client: its priority, guarantee and limit
(docs/design.md §6, "Trust model"). They come from vtmd's configuration, keyed by
the name a client connects under, never from the client: a client may ask
for less (a lower priority, a smaller guarantee, a tighter limit), never
for more.

The quota file (vtmd --quota-file PATH), TOML:

    [default]                    # every client whose name has no table below
    priority = 0
    guaranteed_bytes = 0
    limit_bytes = 0              # 0: no limit but the pool's capacity
    host_tier_limit_bytes = 0    # of vtmd --host-tier-bytes; 0: no limit but the tier's

    [clients."llama-a"]          # the clients named llama-a
    priority = 10
    guaranteed_bytes = "8GiB"    # a byte count, or a string as src/vtm/sizes.py reads
    limit_bytes = 34359738368
    host_tier_limit_bytes = "16GiB"

host_tier_limit_bytes caps the broker's host tier memory that the prefixes
recorded by the clients of a name keep (rounded down to whole chunks, and
that is the value stored and shown; a limit under one chunk is refused,
since it would keep nothing while 0 means no limit): at
the limit, their spills drop their own least recently used prefixes on the
host, never another name's. It is charged per name, not per session, since
a prefix outlives the session that recorded it, and a client cannot ask for
another value. Without a host tier it has no effect.

A field missing from a table is 0; no file means every client gets the
[default] above. `vtmctl set-quota NAME ...` changes or adds a table while
vtmd runs (the file is not rewritten).

Invariants (Quotas): every quota is valid (priority an int32, byte counts in
[0, 2^62), a guarantee within the limit); the guarantees of the named tables
sum to at most the capacity, and the default's is at most the capacity.
Each session's granted guarantee counts again (service.py checks that the
sessions' guarantees never sum past the capacity either).
"""

from __future__ import annotations

import tomllib
from typing import NamedTuple

from vtm import errors
from vtm.sizes import parse_size

_MAX_BYTES = 1 << 62
_FIELDS = ("priority", "guaranteed_bytes", "limit_bytes", "host_tier_limit_bytes")


class Quota(NamedTuple):
    priority: int = 0
    guaranteed_bytes: int = 0
    limit_bytes: int = 0  # 0: none
    host_tier_limit_bytes: int = 0  # 0: none


class Ask(NamedTuple):
    """What a client asked for in Hello; None: the operator's value."""

    priority: int | None = None
    guaranteed_bytes: int | None = None
    limit_bytes: int | None = None  # 0: no limit of its own


def grant(offered: Quota, asked: Ask) -> Quota:
    """The operator's quota, lowered where the client asked for less."""
    priority = offered.priority if asked.priority is None else min(asked.priority, offered.priority)
    guaranteed = offered.guaranteed_bytes if asked.guaranteed_bytes is None else min(asked.guaranteed_bytes,
                                                                                     offered.guaranteed_bytes)
    limits = [b for b in (offered.limit_bytes, asked.limit_bytes) if b]
    limit = min(limits) if limits else 0
    return Quota(priority, min(guaranteed, limit) if limit else guaranteed, limit, offered.host_tier_limit_bytes)


def check(quota: Quota, what: str, chunk_bytes: int = 1) -> Quota:
    """`quota` if valid, its host tier limit in whole chunks of
    `chunk_bytes` (what the tier enforces), else InvalidArgument naming
    `what`."""
    for field, value in zip(_FIELDS, quota):
        if not isinstance(value, int) or isinstance(value, bool):
            raise errors.InvalidArgument(f"{what}: {field} must be an integer, got {value!r}")
    if not -(1 << 31) <= quota.priority < 1 << 31:
        raise errors.InvalidArgument(f"{what}: priority {quota.priority} is out of range")
    for field, value in zip(_FIELDS[1:], quota[1:]):
        if not 0 <= value < _MAX_BYTES:
            raise errors.InvalidArgument(f"{what}: {field} {value} is out of range")
    if quota.limit_bytes and quota.guaranteed_bytes > quota.limit_bytes:
        raise errors.InvalidArgument(f"{what}: guaranteed_bytes {quota.guaranteed_bytes} exceed limit_bytes "
                                     f"{quota.limit_bytes}")
    if 0 < quota.host_tier_limit_bytes < chunk_bytes:
        raise errors.InvalidArgument(f"{what}: host_tier_limit_bytes {quota.host_tier_limit_bytes} is less than one "
                                     f"chunk ({chunk_bytes} bytes): the tier keeps whole chunks; give at least one, "
                                     f"or 0 for no limit")
    return quota._replace(host_tier_limit_bytes=quota.host_tier_limit_bytes // chunk_bytes * chunk_bytes)


class Quotas:
    def __init__(self, capacity_bytes: int, default: Quota = Quota(), named: dict[str, Quota] | None = None,
                 chunk_bytes: int = 1):
        self.capacity_bytes = capacity_bytes
        self.chunk_bytes = chunk_bytes
        self.default = check(default, "the default quota", chunk_bytes)
        self.named = {name: check(q, f"the quota of '{name}'", chunk_bytes) for name, q in (named or {}).items()}
        self._check_sum(self.named)
        if self.default.guaranteed_bytes > capacity_bytes:
            raise errors.InvalidArgument(f"the default guarantee of {self.default.guaranteed_bytes} bytes is past "
                                         f"the capacity of {capacity_bytes}")

    @classmethod
    def load(cls, path: str, capacity_bytes: int, chunk_bytes: int = 1) -> "Quotas":
        """The quotas of a quota file; InvalidArgument says what is wrong with it."""
        try:
            with open(path, "rb") as f:
                table = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise errors.InvalidArgument(f"quota file {path}: {exc}") from None
        unknown = set(table) - {"default", "clients"}
        if unknown:
            raise errors.InvalidArgument(f"quota file {path}: unknown tables {sorted(unknown)} "
                                         f"(expected [default] and [clients.NAME])")
        clients = table.get("clients", {})
        if not isinstance(clients, dict) or not all(isinstance(v, dict) for v in clients.values()):
            raise errors.InvalidArgument(f"quota file {path}: [clients] must hold one table per client name")
        try:
            return cls(capacity_bytes, _entry(table.get("default", {}), f"quota file {path}, [default]"),
                       {name: _entry(entry, f"quota file {path}, [clients.{name}]") for name, entry in clients.items()},
                       chunk_bytes)
        except errors.InvalidArgument as exc:
            if str(exc).startswith("quota file"):
                raise
            raise errors.InvalidArgument(f"quota file {path}: {exc}") from None

    def offered(self, name: str) -> Quota:
        return self.named.get(name, self.default)

    def store(self, name: str, quota: Quota | None) -> None:
        """Sets the entry of `name` to a quota with_entry() returned; None
        removes it (its clients get the default)."""
        if quota is None:
            self.named.pop(name, None)
        else:
            self.named[name] = quota

    def with_entry(self, name: str, reset: bool = False, **fields) -> Quota | None:
        """The entry of `name` with the given fields changed (the others as
        offered now, or, with `reset`, as the default offers them), checked
        against the capacity but not stored; None for a reset that sets no
        field (the name's entry goes)."""
        unknown = set(fields) - set(_FIELDS)
        if unknown:
            raise errors.InvalidArgument(f"unknown quota fields {sorted(unknown)}")
        changes = {f: v for f, v in fields.items() if v is not None}
        if reset and not changes:
            return None
        old = self.default if reset else self.offered(name)
        new = check(old._replace(**changes), f"the quota of '{name}'", self.chunk_bytes)
        self._check_sum({**self.named, name: new})
        return new

    def _check_sum(self, named: dict[str, Quota]) -> None:
        total = sum(q.guaranteed_bytes for q in named.values())
        if total > self.capacity_bytes:
            raise errors.InvalidArgument(f"the clients' guarantees would sum to {total} bytes, past the capacity "
                                         f"of {self.capacity_bytes}")


def _entry(entry, what: str) -> Quota:
    if not isinstance(entry, dict):
        raise errors.InvalidArgument(f"{what}: must be a table")
    unknown = set(entry) - set(_FIELDS)
    if unknown:
        raise errors.InvalidArgument(f"{what}: unknown fields {sorted(unknown)} (expected {', '.join(_FIELDS)})")
    sized = {}
    for field, value in entry.items():
        if field != "priority" and isinstance(value, str):
            try:
                value = parse_size(value)
            except ValueError as exc:
                raise errors.InvalidArgument(f"{what}: {field}: {exc}") from None
        sized[field] = value
    return check(Quota(**sized), what)
