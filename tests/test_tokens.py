import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvstrata.tokens as tokens_module
from kvstrata.tokens import (
    DEFAULT_SEED,
    TokenError,
    TokenSequence,
    chain_hash,
    chain_hashes,
    hash_blocks,
    isolation_seed,
    local_block_hash,
)

@pytest.fixture(autouse=True, params=["python", "native"])
def hashing_path(request):
    """Every test here runs on both hashing paths: the pure-Python one and the optional
    native one (skipped when the extension is not built)."""
    if request.param == "native" and not tokens_module.NATIVE:
        pytest.skip("native hashing extension (kvstrata._tokenhash) not built")
    previous = tokens_module.use_native(request.param == "native")
    yield request.param
    tokens_module.use_native(previous)


def _both_paths(fn):
    """``fn()`` on the Python path and on the native one: (value or exception type+message)."""
    out = []
    for native in (False, True):
        previous = tokens_module.use_native(native)
        try:
            out.append(("ok", fn()))
        except Exception as exc:  # the same exception, same message, is what must agree
            out.append((type(exc), str(exc)))
        finally:
            tokens_module.use_native(previous)
    return out


_token = st.one_of(st.integers(0, 0xFFFFFFFF), st.integers(0, 40),
                   st.sampled_from([-1, 2**32, 2**64, True, False]))


@pytest.mark.skipif(not tokens_module.NATIVE, reason="native hashing extension not built")
@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=st.lists(_token, max_size=70), block_size=st.integers(1, 9),
       seed=st.sampled_from([DEFAULT_SEED, 0, 2**64 - 1, 2**64]),
       parent=st.one_of(st.none(), st.integers(0, 2**64 - 1), st.just(2**64), st.just(-1)),
       as_array=st.booleans())
def test_native_and_python_paths_agree(hashing_path, tokens, block_size, seed, parent, as_array):
    """Same hashes, or the same error, from both paths: lists with odd items, numpy arrays,
    seeds and parents out of range, and the chain of local hashes alone."""
    if as_array:
        clean = [int(t) for t in tokens if 0 <= t <= 0xFFFFFFFF]
        for dtype in ("int64", "<u4"):
            arr = np.asarray(clean, dtype=dtype)
            a, b = _both_paths(lambda: hash_blocks(arr, block_size, seed, parent))
            assert a == b
        return
    a, b = _both_paths(lambda: hash_blocks(tokens, block_size, seed, parent))
    assert a == b
    locals_ = [t for t in tokens if type(t) is int and 0 <= t]
    a, b = _both_paths(lambda: chain_hashes(locals_, seed, parent))
    assert a == b


# Test vector of the Dynamo-compatible scheme: tokens 1..10 in blocks of 4 (two full blocks,
# the partial tail [9, 10] has no hash), seed 1337.
VECTOR_LOCAL = [14643705804678351452, 16777012769546811212]
VECTOR_SEQ = [14643705804678351452, 4945711292740353085]


def test_reference_vector_from_list():
    local, seqs = hash_blocks(list(range(1, 11)), 4)
    assert local == VECTOR_LOCAL
    assert seqs == VECTOR_SEQ


@pytest.mark.parametrize("dtype", ["int64", "int32", "uint32", "<u4"])
def test_reference_vector_from_numpy(dtype):
    local, seqs = hash_blocks(np.arange(1, 11, dtype=dtype), 4)
    assert (local, seqs) == (VECTOR_LOCAL, VECTOR_SEQ)


def test_chain_hash_definition():
    assert chain_hash(None, VECTOR_LOCAL[0]) == VECTOR_LOCAL[0]
    assert chain_hash(VECTOR_SEQ[0], VECTOR_LOCAL[1]) == VECTOR_SEQ[1]
    assert local_block_hash([5, 6, 7, 8]) == VECTOR_LOCAL[1]


def test_partial_tail_has_no_hash():
    local, seqs = hash_blocks([1, 2, 3], 4)
    assert local == [] and seqs == []


def test_incremental_append_equals_bulk():
    tokens = list(np.random.default_rng(0).integers(0, 50_000, size=203))
    seq = TokenSequence(block_size=16)
    completed = []
    for t in tokens:
        h = seq.append(int(t))
        if h is not None:
            completed.append(h)
    _, bulk = hash_blocks(tokens, 16)
    assert seq.sequence_hashes == bulk == completed
    assert len(seq) == 203 and seq.tail_tokens == [int(t) for t in tokens[192:]]


def test_extend_in_uneven_chunks_equals_bulk():
    tokens = np.arange(1000, 1100)
    seq = TokenSequence(block_size=8)
    for start, stop in [(0, 3), (3, 20), (20, 21), (21, 100)]:
        seq.extend(tokens[start:stop])
    assert seq.sequence_hashes == hash_blocks(tokens, 8)[1]
    assert seq.num_full_blocks == 12


def test_pop_only_from_tail():
    seq = TokenSequence([1, 2, 3, 4, 5], block_size=4)
    assert seq.pop() == 5
    with pytest.raises(TokenError):
        seq.pop()
    assert seq.num_full_blocks == 1


def test_continuing_a_chain_equals_hashing_whole():
    tokens = list(range(64))
    _, whole = hash_blocks(tokens, 16)
    _, first = hash_blocks(tokens[:32], 16)
    _, rest = hash_blocks(tokens[32:], 16, parent_sequence_hash=first[-1])
    assert first + rest == whole


@pytest.mark.parametrize("bad", [[-1, 2, 3, 4], [2**32, 1, 1, 1], ["a", 1, 2, 3]])
def test_bad_tokens_rejected(bad):
    with pytest.raises(TokenError):
        hash_blocks(bad, 4)


@pytest.mark.parametrize("size", [0, -4, 2.5])
def test_bad_block_size_rejected(size):
    with pytest.raises(TokenError):
        hash_blocks([1, 2, 3, 4], size)


def test_isolation_seeds_are_distinct_and_stable():
    assert isolation_seed() == DEFAULT_SEED
    lora = isolation_seed(lora_name="adapter-a")
    salt = isolation_seed(cache_salt="adapter-a")
    both = isolation_seed(lora_name="adapter-a", cache_salt="tenant-1")
    assert len({DEFAULT_SEED, lora, salt, both}) == 4
    assert isolation_seed(lora_name="adapter-a") == lora  # deterministic
    assert isolation_seed(cache_salt=b"adapter-a") == salt


def test_isolation_seed_formulas():
    import xxhash

    lora = (DEFAULT_SEED + xxhash.xxh3_64_intdigest(b"my-adapter")) % 2**64  # Dynamo's LoRA rule
    assert isolation_seed(lora_name="my-adapter") == lora
    assert isolation_seed(cache_salt="t1") == xxhash.xxh3_64_intdigest(b"salt:t1", seed=DEFAULT_SEED)
    assert isolation_seed("my-adapter", "t1") == xxhash.xxh3_64_intdigest(b"salt:t1", seed=lora)


def test_lora_name_cannot_impersonate_a_salt():
    assert isolation_seed(lora_name="salt:x") != isolation_seed(cache_salt="x")
    assert isolation_seed(lora_name="x") != isolation_seed(cache_salt="x")


def test_two_salts_never_share_a_block():
    tokens = list(range(256))
    chains = {
        salt: set(hash_blocks(tokens, 16, isolation_seed(cache_salt=salt))[1])
        for salt in ("tenant-a", "tenant-b", None)
    }
    assert not chains["tenant-a"] & chains["tenant-b"]
    assert not chains["tenant-a"] & chains[None]
    # Same salt, same tokens: identical chains (sharing inside a tenant still works).
    assert set(hash_blocks(tokens, 16, isolation_seed(cache_salt="tenant-a"))[1]) == chains["tenant-a"]


def test_a_salt_never_names_an_adapters_tenant():
    from kvstrata.tokens import tenant_key

    assert tenant_key(lora_name="gold") == "lora:gold"
    assert tenant_key(cache_salt="lora:gold") == "salt:lora:gold"
    assert tenant_key(lora_name="gold", cache_salt="x") == "salt:x"
    assert tenant_key() == ""
    long = tenant_key(cache_salt="s" * 201)
    assert long.startswith("salt#") and len(long) == 37
    assert tenant_key(cache_salt=b"raw").startswith("salt#")
    assert tenant_key(lora_name="l" * 196).startswith("lora#")


def test_a_lora_path_makes_another_seed_for_the_same_name():
    """vLLM keys its prefix cache by an adapter's name and path; so does the connector."""
    import xxhash

    name_only = isolation_seed(lora_name="ad")
    a = isolation_seed(lora_name="ad", lora_path="/adapters/a")
    b = isolation_seed(lora_name="ad", lora_path="/adapters/b")
    assert len({name_only, a, b}) == 3
    assert a == xxhash.xxh3_64_intdigest(b"lora_path:/adapters/a", seed=name_only)
    assert isolation_seed(lora_path="/adapters/a") == DEFAULT_SEED    # no adapter, no path
