import pytest

from kvstrata.logical.block import Block, BlockHashError, BlockState, BlockStateError
from kvstrata.logical.registry import BlockRecord
from kvstrata.tokens import TokenError, hash_blocks


def fresh(size=4):
    return Block(0, size)


def snapshot(block):
    return (block.state, block.tokens and list(block.tokens), block.sequence_hash, block.parent_hash)


def test_full_lifecycle_hashes_like_tokens_module():
    local, seqs = hash_blocks(list(range(1, 9)), 4)
    first, second = fresh(), Block(1, 4)
    first.init_sequence()
    first.add_tokens([1, 2, 3, 4])
    first.commit()
    second.init_sequence(parent_hash=first.sequence_hash)
    second.add_tokens([5, 6])
    second.add_token(7)
    second.add_token(99)
    assert second.pop_token() == 99
    second.add_token(8)
    second.commit()
    assert (first.sequence_hash, second.sequence_hash) == tuple(seqs)
    assert second.local_hash == local[1]
    assert second.state is BlockState.COMPLETE
    second.reset()
    assert second.state is BlockState.RESET and second.sequence_hash is None


def test_apply_token_block_path():
    block = fresh()
    block.apply_token_block(BlockRecord(11, 22, None, 4))
    assert block.state is BlockState.COMPLETE and block.sequence_hash == 11
    assert block.record() == BlockRecord(11, 22, None, 4)


@pytest.mark.parametrize(
    "setup, action",
    [
        (lambda b: None, lambda b: b.add_token(1)),  # Reset cannot take tokens
        (lambda b: None, lambda b: b.commit()),  # Reset cannot commit
        (lambda b: b.init_sequence(), lambda b: b.init_sequence()),  # Partial cannot re-init
        (lambda b: b.init_sequence(), lambda b: b.commit()),  # not full
        (lambda b: (b.init_sequence(), b.add_tokens([1, 2, 3])), lambda b: b.add_tokens([4, 5])),  # overflow
        (lambda b: b.init_sequence(), lambda b: b.pop_token()),  # nothing to pop
        (lambda b: b.init_sequence(), lambda b: b.apply_token_block(BlockRecord(1, 1, None, 4))),
        (lambda b: None, lambda b: b.apply_token_block(BlockRecord(1, 1, None, 8))),  # wrong size
        (lambda b: None, lambda b: b.apply_token_block(BlockRecord(1, 1, None, 4, (1, 2)))),
        (lambda b: (b.init_sequence(), b.add_tokens([1, 2, 3, 4]), b.commit()), lambda b: b.add_token(5)),
        (lambda b: None, lambda b: b.record()),
    ],
)
def test_invalid_transitions_raise_and_change_nothing(setup, action):
    block = fresh()
    setup(block)
    before = snapshot(block)
    with pytest.raises(BlockStateError):
        action(block)
    assert snapshot(block) == before


def test_bad_token_is_typed_and_changes_nothing():
    block = fresh()
    block.init_sequence()
    block.add_tokens([1])
    with pytest.raises(TokenError):
        block.add_tokens([2, -5])
    assert block.tokens == [1]


def test_reset_from_any_state():
    for prepare in (lambda b: None, lambda b: b.init_sequence(),
                    lambda b: b.apply_token_block(BlockRecord(1, 2, None, 4))):
        block = fresh()
        prepare(block)
        block.reset()
        assert block.state is BlockState.RESET and block.tokens is None


def test_views_of_one_slot_share_its_fields():
    block = Block(1, 4)
    other = Block(1, store=block._store)
    block.init_sequence(parent_hash=7)
    block.add_tokens([1, 2, 3, 4])
    block.commit()
    assert other == block and other.state is BlockState.COMPLETE
    assert (other.sequence_hash, other.parent_hash, other.tokens) == (
        block.sequence_hash, 7, [1, 2, 3, 4])


@pytest.mark.parametrize("record", [
    BlockRecord(-1, 1, None, 4), BlockRecord(2**64, 1, None, 4), BlockRecord(1, "x", None, 4),
    BlockRecord(1, 1, -3, 4), BlockRecord(1.5, 1, None, 4),
])
def test_hashes_outside_u64_are_refused_and_change_nothing(record):
    block = fresh()
    with pytest.raises(BlockHashError):
        block.apply_token_block(record)
    assert snapshot(block) == (BlockState.RESET, None, None, None)
    with pytest.raises(BlockHashError):
        block.init_sequence(parent_hash=-1)
    assert block.state is BlockState.RESET
