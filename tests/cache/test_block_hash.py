"""Block hashing: chaining, determinism, incremental updates."""

from vx.cache import hash_block_tokens, update_block_hashes


def test_hash_is_deterministic_bytes():
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(h, bytes) and len(h) == 32
    assert h == hash_block_tokens(None, [1, 2, 3, 4])
    assert h == hash_block_tokens(None, (1, 2, 3, 4))


def test_hash_depends_on_parent_tokens_and_extra_keys():
    base = hash_block_tokens(None, [1, 2, 3, 4])
    other_parent = hash_block_tokens(hash_block_tokens(None, [0, 0, 0, 0]), [1, 2, 3, 4])
    assert len({
        base,
        other_parent,
        hash_block_tokens(None, [1, 2, 3, 5]),
        hash_block_tokens(None, [1, 2, 3, 4], ("lora", 1)),
        hash_block_tokens(None, [1, 2, 3, 4], ("lora", 2)),
        hash_block_tokens(None, [1, 2, 3, 4], ()),
    }) == 6


def test_update_hashes_full_blocks_only_and_chains():
    hashes: list[bytes] = []
    update_block_hashes(hashes, [1, 2, 3], 4)
    assert hashes == []
    update_block_hashes(hashes, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    assert hashes == [h0, h1]


def test_update_is_incremental_and_matches_one_shot():
    tokens = [7, 3, 3, 1, 0, 9, 2, 2, 5, 5, 1, 4, 8]
    one_shot: list[bytes] = []
    update_block_hashes(one_shot, tokens, 3, ("salt",))
    grown: list[bytes] = []
    for n in range(len(tokens) + 1):
        update_block_hashes(grown, tokens[:n], 3, ("salt",))
        assert len(grown) == n // 3
    assert grown == one_shot


def test_update_does_not_rehash_existing_entries():
    # The existing entries are trusted as the chain's parents (that is what makes it O(1)).
    hashes = [b"x" * 32]
    update_block_hashes(hashes, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert hashes[0] == b"x" * 32
    assert hashes[1] == hash_block_tokens(b"x" * 32, [5, 6, 7, 8])


def test_same_block_different_prefix_differs():
    a: list[bytes] = []
    b: list[bytes] = []
    update_block_hashes(a, [1, 1, 2, 2], 2)
    update_block_hashes(b, [3, 3, 2, 2], 2)
    assert a[1] != b[1]
