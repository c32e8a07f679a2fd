"""Stable sharding of keys over Ray actors: the history workers (``verl_ext.history``, by prompt
uid) and the grouped draft server (``verl_ext.spec.dgds``, by group id) place a key with the same
hash, blake2b of its UTF-8 text, which is the same in every process and run (Python's ``hash`` of
a string is salted per process)."""

from __future__ import annotations

import hashlib


def shard_of(key: str, num_shards: int) -> int:
    """The shard serving ``key`` (0 for one shard)."""
    if num_shards <= 1:
        return 0
    digest = hashlib.blake2b(str(key).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % int(num_shards)
