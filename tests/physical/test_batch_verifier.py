"""The native batch verifier of verified remote reads (``verify_batches`` / ``verify_arrived``
in ``_tokenhash.c``, loaded as ``checksum.BATCH_VERIFIER``) driven directly with numpy memory
and real threads, checked block by block against :func:`block_checksum`; and the Python glue
around it (``remote.importer._NativeVerifyJob``).

State protocol: uint32[4] = [arrived | FINISHED, claimed, done, failed]. Mode 0: the
verifying thread hashes arrived batches until FINISHED and none left; mode 1: the reading
thread hashes the oldest one if more than ``lag`` wait; mode 2: the reading thread hashes what
is left, sets FINISHED and waits until every claimed batch is done.

"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from kvstrata.physical import checksum as checksum_module
from kvstrata.physical.checksum import BATCH_VERIFIER, block_checksum

pytestmark = pytest.mark.skipif(BATCH_VERIFIER is None,
                                reason="the native batch verifier is not built")

FIN = 0x80000000
if BATCH_VERIFIER is not None:
    VERIFY, ARRIVED = BATCH_VERIFIER


class Read:
    """``blocks`` blocks of ``per_block`` ranges each in a numpy array this test owns, their
    true checksums (block_checksum of the concatenated ranges) and ``expected`` checksums of
    which those of ``truth`` (the blocks that must be flagged bad) are wrong."""

    def __init__(self, rng, blocks: int, per_block: int = 1, max_len: int = 300,
                 bad_fraction: float = 0.3, memory_size: int = 1 << 16) -> None:
        self.blocks, self.per_block = blocks, per_block
        self.memory = rng.integers(0, 256, memory_size, dtype=np.uint8)
        n = blocks * per_block
        lengths = rng.integers(0, max_len + 1, n)
        lengths[rng.random(n) < 0.1] = 0                      # empty ranges too
        starts = rng.integers(0, memory_size - max_len, n)
        self.addresses = (starts + self.memory.ctypes.data).astype(np.uint64)
        self.lengths = lengths.astype(np.uint64)
        sums = []
        for b in range(blocks):
            pieces = [self.memory[s:s + ln] for s, ln in
                      zip(starts[b * per_block:(b + 1) * per_block],
                          lengths[b * per_block:(b + 1) * per_block])]
            sums.append(block_checksum(np.concatenate(pieces) if pieces else b""))
        self.expected = np.array(sums, dtype=np.uint64)
        self.truth = sorted(np.flatnonzero(rng.random(blocks) < bad_fraction).tolist())
        self.expected[self.truth] ^= np.uint64(1 << 17)
        self.state = np.zeros(4, np.uint32)
        self.bad = np.zeros(blocks, np.uint8)

    def batches(self, step: int) -> int:
        return -(-self.blocks // step)

    def verify(self, step: int, mode: int, lag: int = 0) -> int:
        return VERIFY(self.state, self.addresses, self.lengths, self.expected, self.bad,
                      self.per_block, step, mode, lag)

    def report(self, count: int, finished: bool = False) -> None:
        ARRIVED(self.state, count, finished)

    def flagged(self) -> list[int]:
        return np.flatnonzero(self.bad).tolist()

    def flagged_in(self, first: int, stop: int) -> list[int]:
        return [b for b in self.flagged() if first <= b < stop]

    def truth_in(self, first: int, stop: int) -> list[int]:
        return [b for b in self.truth if first <= b < stop]


def start(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def release(read: Read, thread: threading.Thread) -> None:
    """Let a verifying thread that a failed test left waiting go (nothing more to claim)."""
    if thread.is_alive():
        ARRIVED(read.state, int(read.state[1]), True)
        thread.join(2)


# --- one thread: the modes, batch bounds, multi-range blocks ---------------------------------

@pytest.mark.parametrize("per_block", [1, 3])
@pytest.mark.parametrize("blocks,step", [(10, 1), (10, 3), (10, 4), (10, 10), (10, 11),
                                         (1, 1), (7, 2), (12, 5)])
def test_each_batch_hashed_by_mode1_flags_exactly_its_bad_blocks(per_block, blocks, step):
    read = Read(np.random.default_rng(blocks * 100 + step * 10 + per_block), blocks, per_block)
    nb = read.batches(step)
    for b in range(nb):
        read.report(b + 1)
        assert read.verify(step, 1, 0) == 1
        assert read.verify(step, 1, 0) == 0                   # none waiting now
        first, stop = b * step, min((b + 1) * step, blocks)   # last batch may be partial
        assert read.flagged_in(first, stop) == read.truth_in(first, stop)
        assert read.flagged_in(stop, blocks) == []            # nothing beyond the batch
        assert read.state.tolist() == [b + 1, b + 1, b + 1, 0]
    assert read.verify(step, 2) == 0
    assert read.state.tolist() == [nb | FIN, nb, nb, 0]
    assert read.flagged() == read.truth


@pytest.mark.parametrize("per_block", [1, 2])
@pytest.mark.parametrize("step", [1, 3, 8, 50])
def test_mode2_alone_hashes_every_reported_batch_once(per_block, step):
    read = Read(np.random.default_rng(step + per_block), 23, per_block)
    nb = read.batches(step)
    read.report(nb)
    assert read.verify(step, 2) == 0
    assert read.state.tolist() == [nb | FIN, nb, nb, 0]
    assert read.flagged() == read.truth
    assert read.verify(step, 2) == 0                          # again: nothing left, no hang
    assert read.state.tolist() == [nb | FIN, nb, nb, 0]


def test_mode1_hashes_the_oldest_batch_only_beyond_the_lag():
    read = Read(np.random.default_rng(5), 12, bad_fraction=1.0)   # every block bad
    step = 2
    read.report(3)
    assert read.verify(step, 1, 3) == 0 and read.verify(step, 1, 5) == 0
    assert read.flagged() == [] and read.state.tolist() == [3, 0, 0, 0]
    assert read.verify(step, 1, 2) == 1                       # 3 waiting > lag 2
    assert read.flagged() == [0, 1]                           # the oldest batch
    assert read.verify(step, 1, 2) == 0                       # 2 waiting, not > 2
    assert read.verify(step, 1, 1) == 1
    assert read.flagged() == [0, 1, 2, 3]
    read.report(6)
    assert read.verify(step, 2) == 0
    assert read.flagged() == list(range(12))
    assert read.state.tolist() == [6 | FIN, 6, 6, 0]


def test_no_blocks_and_batches_reported_beyond_the_last_block_read_nothing_out_of_bounds():
    empty = Read(np.random.default_rng(0), 0)
    empty.report(0)
    assert empty.verify(4, 2) == 0 and empty.state.tolist() == [FIN, 0, 0, 0]
    empty = Read(np.random.default_rng(0), 0)
    empty.report(3)                                           # batches of no blocks
    assert empty.verify(4, 2) == 0 and empty.state.tolist() == [3 | FIN, 3, 3, 0]
    read = Read(np.random.default_rng(1), 9, 2)
    read.report(read.batches(4) + 5)                          # counted, not hashed
    assert read.verify(4, 2) == 0
    n = read.batches(4) + 5
    assert read.state.tolist() == [n | FIN, n, n, 0]
    assert read.flagged() == read.truth


def test_bad_flags_are_only_ever_set_never_cleared():
    read = Read(np.random.default_rng(2), 6, bad_fraction=0.0)
    read.bad[:] = 1                                           # caller's own zeros expected
    read.report(1)
    read.verify(6, 2)
    assert read.flagged() == list(range(6))


# --- threads ---------------------------------------------------------------------------------

def _stress_once(rng) -> None:
    blocks = int(rng.integers(0, 40))
    per_block = int(rng.integers(1, 4))
    step = int(rng.integers(1, 8))
    lag = int(rng.integers(0, 4))
    verifiers = int(rng.integers(1, 3))
    read = Read(rng, blocks, per_block, max_len=200, memory_size=1 << 14)
    nb = read.batches(step)
    threads = [start(read.verify, step, 0) for _ in range(verifiers)]
    try:
        if rng.random() < 0.3:
            time.sleep(float(rng.random()) * 2e-4)            # verifiers wait first
        for b in range(nb):
            read.report(b + 1)
            r = rng.random()
            if r < 0.3:
                read.verify(step, 1, lag)
            elif r < 0.6:
                time.sleep(float(rng.random()) * 1e-4)
        read.verify(step, 2)
        # mode 2 returned: every claimed batch is done, every reported batch claimed
        assert read.state.tolist() == [nb | FIN, nb, nb, 0]
        assert read.flagged() == read.truth
        for t in threads:
            t.join(2)
            assert not t.is_alive(), "a verifying thread did not return after FINISHED"
        assert read.state.tolist() == [nb | FIN, nb, nb, 0]   # nothing hashed after
    finally:
        for t in threads:
            release(read, t)


def test_reader_and_verifying_threads_hash_every_batch_once_with_the_right_flags():
    rng = np.random.default_rng(1234)
    deadline = time.monotonic() + 4.0
    runs = 0
    while runs < 1500 and time.monotonic() < deadline:
        _stress_once(rng)
        runs += 1
    assert runs >= 50


def test_finish_waits_for_the_batch_the_verifying_thread_is_hashing():
    # big blocks (a few ms each to hash), every one bad: mode 2 must not return before the
    # verifying thread's in-flight batch is done and flagged
    rng = np.random.default_rng(7)
    memory = rng.integers(0, 256, 8 << 20, dtype=np.uint8)
    for _ in range(6):
        addresses = np.array([memory.ctypes.data], np.uint64)
        lengths = np.array([memory.size], np.uint64)
        expected = np.array([block_checksum(memory) ^ 1], np.uint64)
        state, bad = np.zeros(4, np.uint32), np.zeros(1, np.uint8)
        args = (addresses, lengths, expected, bad, 1, 1)
        verifier = start(VERIFY, state, *args, 0, 0)
        try:
            ARRIVED(state, 1, False)
            t0 = time.monotonic()
            while state[1] == 0 and time.monotonic() - t0 < 2:   # the verifier claimed it
                pass
            assert state[1] == 1
            VERIFY(state, *args, 2, 0)
            assert bad.tolist() == [1]
            assert state.tolist() == [1 | FIN, 1, 1, 0]
            verifier.join(2)
            assert not verifier.is_alive()
        finally:
            if verifier.is_alive():
                ARRIVED(state, 1, True)
                verifier.join(2)


def test_a_waiting_verifier_is_woken_by_each_report_not_by_its_50ms_timeout():
    read = Read(np.random.default_rng(9), 20, max_len=64)
    verifier = start(read.verify, 1, 0)
    latencies = []
    try:
        for b in range(20):
            time.sleep(0.003)                                 # let it go to sleep
            t0 = time.perf_counter()
            read.report(b + 1)
            while read.state[2] < b + 1 and time.perf_counter() - t0 < 1:
                time.sleep(0)
            latencies.append(time.perf_counter() - t0)
        read.verify(1, 2)
        verifier.join(2)
        assert not verifier.is_alive()
    finally:
        release(read, verifier)
    assert read.flagged() == read.truth
    assert sorted(latencies)[len(latencies) // 2] < 0.02, latencies


def test_a_reader_whose_read_failed_lets_the_verifier_go_with_finished():
    """finished=True is the reader giving up: batches nobody claimed are skipped, `failed`
    is set, the verifier is let go, and the call returns only once it is out of the read."""
    read = Read(np.random.default_rng(11), 15, 2)
    verifier = start(read.verify, 4, 0)
    try:
        read.report(2)
        deadline = time.monotonic() + 2
        while read.state[2] < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert read.state[2] == 2                             # two batches hashed
        read.report(3, finished=True)                         # no mode 2 call
        assert read.state.tolist() == [3 | FIN, 3, 3, 1]      # done == claimed on return
        verifier.join(2)
        assert not verifier.is_alive()
        flagged = set(read.flagged())
        assert flagged & set(range(8)) == set(read.truth_in(0, 8))
        assert flagged <= set(read.truth)                     # the third batch: hashed or not
    finally:
        release(read, verifier)


def test_a_verifier_started_after_finish_returns_at_once_and_hashes_nothing():
    read = Read(np.random.default_rng(12), 10)
    read.report(5)
    read.verify(2, 2)
    before = read.state.tolist()
    verifier = start(read.verify, 2, 0)
    verifier.join(2)
    assert not verifier.is_alive()
    assert read.state.tolist() == before == [5 | FIN, 5, 5, 0]


# --- argument validation ---------------------------------------------------------------------

def _good(blocks=4):
    read = Read(np.random.default_rng(3), blocks)
    return read, [read.state, read.addresses, read.lengths, read.expected, read.bad, 1, 1, 1, 0]


@pytest.mark.parametrize("index,value,error", [
    (0, np.zeros(3, np.uint32), ValueError),                  # state of the wrong size
    (0, np.zeros(8, np.uint32)[::2], ValueError),             # state not contiguous
    (0, "state", TypeError),
    (1, np.zeros(4, np.int64), TypeError),                    # addresses not uint64
    (1, np.zeros(8, np.uint64)[::2], TypeError),              # not contiguous
    (1, np.zeros(4, ">u8"), TypeError),                       # big-endian
    (1, [0, 0, 0, 0], TypeError),
    (2, np.zeros(3, np.uint64), ValueError),                  # lengths: another count
    (3, np.zeros(4, np.uint32), TypeError),                   # expected not uint64
    (3, np.zeros(5, np.uint64), ValueError),                  # ranges do not make the blocks
    (4, np.zeros(3, np.uint8), ValueError),                   # bad: not one per block
    (4, np.zeros(8, np.uint8)[::2], ValueError),              # bad not contiguous
    (5, 0, ValueError), (5, -1, ValueError), (5, 3, ValueError),   # per_block
    (6, 0, ValueError), (6, -2, ValueError), (6, 1.0, TypeError),  # step
    (7, 3, ValueError), (7, -1, ValueError), (7, None, TypeError),  # mode
    (8, -1, ValueError), (8, "0", TypeError),                 # lag
])
def test_bad_arguments_raise_and_touch_nothing(index, value, error):
    read, args = _good()
    read.report(4)
    args[index] = value
    with pytest.raises(error):
        VERIFY(*args)
    assert read.state.tolist() == [4, 0, 0, 0] and read.flagged() == []


def test_read_only_buffers_and_wrong_argument_counts_raise():
    read, args = _good()
    frozen = np.zeros(4, np.uint32)
    frozen.setflags(write=False)
    with pytest.raises(ValueError):
        VERIFY(frozen, *args[1:])
    frozen_bad = np.zeros(4, np.uint8)
    frozen_bad.setflags(write=False)
    with pytest.raises(ValueError):
        VERIFY(*args[:4], frozen_bad, *args[5:])
    with pytest.raises(TypeError):
        VERIFY(*args[:8])
    with pytest.raises(TypeError):
        ARRIVED(read.state, 1)
    with pytest.raises(ValueError):
        ARRIVED(np.zeros(5, np.uint32), 1, False)
    with pytest.raises(TypeError):
        ARRIVED(read.state, "1", False)


@pytest.mark.parametrize("state", ["float32", "misaligned uint8"])
def test_a_state_that_is_not_an_aligned_uint32_array_is_refused(state):
    read, args = _good()
    args[0] = (np.zeros(4, np.float32) if state == "float32"
               else np.zeros(20, np.uint8)[1:17])
    with pytest.raises((TypeError, ValueError)):
        VERIFY(*args)


@pytest.mark.parametrize("count", [-1, 1 << 31])
def test_verify_arrived_refuses_counts_it_cannot_store(count):
    state = np.zeros(4, np.uint32)
    with pytest.raises((ValueError, OverflowError)):
        ARRIVED(state, count, False)


def test_mode1_with_a_lag_beyond_32_bits_never_helps():
    read = Read(np.random.default_rng(4), 4)
    read.report(1)
    assert read.verify(1, 1, 1 << 32) == 0


def test_a_step_larger_than_the_read_is_one_batch():
    read = Read(np.random.default_rng(6), 5)
    read.report(1)
    read.verify(1 << 58, 2)
    assert read.flagged() == read.truth


_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    from kvstrata import _tokenhash
    from kvstrata.tokens import xxhash_function_address as f
    _tokenhash.bind(f())
    _tokenhash.bind_stream(*(f("XXH3_" + n) for n in (
        "createState", "64bits_reset", "64bits_update", "64bits_digest", "freeState")))
    case = sys.argv[1]
    state = np.zeros(4, np.uint32)
    _tokenhash.verify_arrived(state, 1, False)
    if case == "step":          # step * 8 wraps to 0 bytes: sums overflows the heap
        blocks = 100000
        memory = np.zeros(blocks, np.uint8)
        addresses = memory.ctypes.data + np.arange(blocks, dtype=np.uint64)
        args = (addresses.astype(np.uint64), np.ones(blocks, np.uint64),
                np.zeros(blocks, np.uint64), np.zeros(blocks, np.uint8), 1, 1 << 61)
    else:                       # blocks * per_block wraps to 0 == len(addresses)
        empty = np.zeros(0, np.uint64)
        args = (empty, empty.copy(), np.zeros(4, np.uint64), np.zeros(4, np.uint8), 1 << 62, 1)
    try:
        _tokenhash.verify_batches(state, *args, 2, 0)
    except (TypeError, ValueError, MemoryError) as exc:
        print("raised", type(exc).__name__)
    else:
        print("returned")
""")


@pytest.mark.parametrize("case", ["step", "per_block"])
def test_huge_step_or_per_block_is_not_a_crash(case):
    done = subprocess.run([sys.executable, "-c", _CHILD, case], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr[-500:])
    # a step past the read is one batch (hashed whole); a per_block that does not make the
    # blocks from the ranges is refused
    assert done.stdout.startswith("returned" if case == "step" else "raised"), done.stdout


# --- the Python glue: remote.importer._NativeVerifyJob -----------------------------------------

class _Memory:
    """What _NativeVerifyJob needs of the importer's _LocalMemory (no region check)."""

    def arrays(self, ranges):
        pairs = np.array(ranges, dtype=np.uint64).reshape(-1, 2)
        return np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1])


def _job(read: Read, step: int):
    from kvstrata.remote.importer import _NativeVerifyJob
    local = list(zip(read.addresses.tolist(), read.lengths.tolist()))
    return _NativeVerifyJob(_Memory(), local, read.per_block, read.expected.tolist(), step)


@pytest.mark.parametrize("per_block,step", [(1, 1), (2, 3), (3, 40)])
def test_native_job_like_copy_verified_finds_the_bad_blocks(per_block, step):
    from kvstrata.remote.importer import LAG_BATCHES
    rng = np.random.default_rng(per_block * 7 + step)
    for _ in range(20):
        read = Read(rng, int(rng.integers(1, 30)), per_block)
        job = _job(read, step)
        verifier = start(job.serve)
        try:
            for first in range(0, read.blocks, step):
                if rng.random() < 0.3:
                    time.sleep(float(rng.random()) * 1e-4)
                job.add(first, min(first + step, read.blocks))
                if job.waiting() > LAG_BATCHES:
                    job.hash_newest()
        finally:
            job.finish()
        verifier.join(2)
        assert not verifier.is_alive()
        assert job.error is None
        assert job.bad == read.truth
        nb = read.batches(step)
        assert job._state.tolist() == [nb | FIN, nb, nb, 0]


def test_native_job_a_failing_call_is_an_error_and_lets_the_verifier_go(monkeypatch):
    read = Read(np.random.default_rng(21), 12)
    verify, report = BATCH_VERIFIER

    def refusing(*args):
        raise ValueError("injected")

    monkeypatch.setattr(checksum_module, "BATCH_VERIFIER", (refusing, report))
    job = _job(read, 2)
    job.serve()                                               # caught, stored
    assert isinstance(job.error, ValueError)
    job.add(0, 2)
    job.hash_newest()
    job.finish()
    assert job._state[0] & FIN                                # reported finished anyway
    assert isinstance(job.error, ValueError)
    # a verifier of the real function on the same state returns (hashes what was reported)
    t = start(verify, job._state, job._addresses, job._lengths, job._expected, job._bad,
              1, 2, 0, 0)
    t.join(2)
    assert not t.is_alive()


def test_native_job_nothing_is_hashed_after_a_failed_finish(monkeypatch):
    read = Read(np.random.default_rng(22), 12, bad_fraction=1.0)
    verify, report = BATCH_VERIFIER

    def failing_finish(*args):
        if args[7] == 2:
            raise MemoryError("injected")
        return verify(*args)

    monkeypatch.setattr(checksum_module, "BATCH_VERIFIER", (failing_finish, report))
    job = _job(read, 2)
    for first in range(0, 12, 2):                # the verifying thread is busy elsewhere
        job.add(first, first + 2)
    job.finish()
    assert isinstance(job.error, MemoryError)
    claimed = int(job._state[1])
    verifier = start(job.serve)                  # ... and gets to this job now
    verifier.join(2)
    assert not verifier.is_alive()
    assert int(job._state[1]) == claimed and job.bad == []   # it read the slots afterwards
