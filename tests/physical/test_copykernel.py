"""The native batched-copy kernel (``_copykernel``) and the choice between it and the
pure-Python fallback kernels."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvstrata.physical import (DeviceStorage, HostStorage, MemmoveCopyEngine, StagedCopyEngine,
                               TransferEngine, TransferPlan)
from kvstrata.physical import copy as copy_mod
from kvstrata.physical.copy import NATIVE_KERNEL, NATIVE_KERNEL_ERROR, native_kernel_status

from .conftest import block_bytes_of, fill_random, small_config

needs_native = pytest.mark.skipif(not NATIVE_KERNEL, reason=f"native kernel: {NATIVE_KERNEL_ERROR}")


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


@pytest.fixture
def kernel():
    if not NATIVE_KERNEL:
        pytest.skip(f"native kernel: {NATIVE_KERNEL_ERROR}")
    from kvstrata.physical import _copykernel
    return _copykernel


def test_status_reports_the_kernel_in_use():
    status = native_kernel_status()
    assert status["available"] is NATIVE_KERNEL
    assert (status["reason"] is None) is NATIVE_KERNEL
    expected = "native" if NATIVE_KERNEL else "python"
    assert MemmoveCopyEngine().kernel == expected
    assert StagedCopyEngine().kernel == expected
    assert MemmoveCopyEngine(native=False).kernel == "python"
    assert StagedCopyEngine(host_engine=MemmoveCopyEngine(native=False)).kernel == "python"
    with TransferEngine({"G2": HostStorage(small_config())}) as engine:
        assert engine.copy_kernel == expected


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prefetch", [False, True])
def test_copy_pieces_exact_with_uneven_pieces(kernel, threads, stream, prefetch):
    """Odd lengths and unaligned addresses; parts cut mid-piece; untouched bytes stay."""
    rng = np.random.default_rng(threads * 4 + stream * 2 + prefetch)
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 17, dtype=np.uint8)
    lengths = rng.integers(0, 700, 40).astype(np.int64)
    lengths[3] = 5000   # one piece much larger than the rest: split across threads
    s_off = rng.integers(0, src.size - 5000, 40)
    d_off = np.cumsum(np.concatenate(([3], lengths[:-1] + 17)))   # disjoint, unaligned
    expected = np.zeros_like(dst)
    for s, d, n in zip(s_off, d_off, lengths):
        expected[d:d + n] = src[s:s + n]
    moved = kernel.copy_pieces((d_off + _addr(dst)).astype(np.uint64),
                               (s_off + _addr(src)).astype(np.int64), lengths, threads,
                               stream, prefetch)
    assert moved == int(lengths.sum())
    assert np.array_equal(dst, expected)


def test_copy_pieces_uniform_length_and_edge_cases(kernel):
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    s = np.array([_addr(src) + 64, _addr(src)], dtype=np.int64)
    d = np.array([_addr(dst), _addr(dst) + 128], dtype=np.int64)
    assert kernel.copy_pieces(d, s, np.int64(64), threads=2) == 128
    assert np.array_equal(dst[:64], src[64:128]) and np.array_equal(dst[128:192], src[:64])
    assert not dst[64:128].any() and not dst[192:].any()
    empty = np.zeros(0, dtype=np.int64)
    assert kernel.copy_pieces(empty, empty, empty) == 0
    assert kernel.copy_pieces(empty, empty, 4096, threads=64) == 0
    with pytest.raises(ValueError):
        kernel.copy_pieces(d, s[:1], 64)
    with pytest.raises(ValueError):
        kernel.copy_pieces(d, s, np.array([64], dtype=np.int64))
    with pytest.raises(ValueError):
        kernel.copy_pieces(d, s, -1)
    with pytest.raises(ValueError):
        kernel.copy_pieces(d, s, np.array([8, -8], dtype=np.int64))
    with pytest.raises(TypeError):
        kernel.copy_pieces(d.astype(np.int32), s.astype(np.int32), 64)
    with pytest.raises(TypeError):
        kernel.copy_pieces(d.astype(np.float64), s, 64)


@needs_native
@pytest.mark.parametrize("kind", ["outer_contiguous", "block_contiguous", "fully_contiguous"])
def test_native_and_python_kernels_agree_on_big_batches(kind):
    """A batch above the streaming and threading thresholds: same bytes from both kernels."""
    cfg = small_config(num_blocks=64, num_layers=4, page_size=16, inner_dim=64, alignment=4096)
    g1 = DeviceStorage.allocate(cfg, kv_layout=kind, device="cpu")
    fill_random(g1.memory.regions, seed=11)
    ids = list(np.random.default_rng(0).permutation(64)[:48])
    outs = []
    for native in (True, False):
        engine = MemmoveCopyEngine(native=native, parallel_bytes=1, stream_bytes=1)
        host = HostStorage(cfg)
        engine.copy(g1.memory, ids, host.memory, list(range(48)))
        back = DeviceStorage.allocate(cfg, kv_layout=kind, device="cpu")
        engine.copy(host.memory, list(range(48)), back.memory, ids[::-1])
        outs.append([block_bytes_of(back, b) for b in range(64)])
        engine.close()
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    for s, d in zip(ids, ids[::-1]):
        assert torch.equal(block_bytes_of(g1, s), outs[0][d])


def test_native_true_requires_the_kernel(monkeypatch):
    monkeypatch.setattr(copy_mod, "_native", None)
    monkeypatch.setattr(copy_mod, "NATIVE_KERNEL_ERROR", "not built: test")
    with pytest.raises(RuntimeError, match="not built: test"):
        MemmoveCopyEngine(native=True)
    engine = MemmoveCopyEngine()            # silently the Python kernels
    assert engine.kernel == "python"
    cfg = small_config(num_blocks=5)
    a, b = HostStorage(cfg), HostStorage(cfg)
    fill_random(a.memory.regions, seed=2)
    engine.copy(a.memory, [4, 0], b.memory, [1, 2])
    assert torch.equal(block_bytes_of(a, 4), block_bytes_of(b, 1))
    assert torch.equal(block_bytes_of(a, 0), block_bytes_of(b, 2))


def test_env_var_forces_the_python_fallback_end_to_end():
    """KVSTRATA_NATIVE_COPY=0 (as when the extension failed to build): the whole engine runs
    on the Python kernels and stays exact."""
    code = (
        "import torch\n"
        "from kvstrata.physical import DeviceStorage, HostStorage, LayoutConfig, "
        "TransferEngine, TransferPlan\n"
        "from kvstrata.physical.copy import native_kernel_status\n"
        "cfg = LayoutConfig(num_blocks=8, num_layers=2, outer_dim=2, page_size=4, inner_dim=8,"
        " dtype='bf16')\n"
        "g1 = DeviceStorage.allocate(cfg, kv_layout='outer_contiguous', device='cpu')\n"
        "[r.random_(0, 256) for r in g1.memory.regions]\n"
        "with TransferEngine({'G1': g1, 'G2': HostStorage(cfg)}) as e:\n"
        "    assert e.copy_kernel == 'python', e.copy_kernel\n"
        "    assert e.submit(TransferPlan.for_path('G1->G2', [1, 5], [0, 1], [7, 8], job_id=0)).result().all_ok\n"
        "    assert e.submit(TransferPlan.for_path('G2->G1', [0, 1], [2, 3], [7, 8], job_id=0)).result().all_ok\n"
        "for s, d in ((1, 2), (5, 3)):\n"
        "    a, b = (g1.block_view(x).contiguous().view(torch.uint8) for x in (s, d))\n"
        "    assert torch.equal(a, b)\n"
        "st = native_kernel_status()\n"
        "assert not st['available'] and 'KVSTRATA_NATIVE_COPY' in st['reason'], st\n"
        "print('ok')\n")
    env = dict(os.environ, KVSTRATA_NATIVE_COPY="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
def test_transfer_engine_on_each_kernel(tmp_path, native):
    cfg = small_config(num_blocks=12, alignment=64)
    g1 = DeviceStorage.allocate(cfg, kv_layout="outer_contiguous", device="cpu")
    fill_random(g1.memory.regions, seed=4)
    engine_ = MemmoveCopyEngine(native=native, parallel_bytes=1, stream_bytes=1)
    for eager in (True, False):
        g2 = HostStorage(cfg, checksums="eager" if eager else "deferred")
        with TransferEngine({"G1": g1, "G2": g2}, copy_engine=engine_) as engine:
            assert engine.copy_kernel == ("native" if native else "python")
            r = engine.submit(TransferPlan.for_path("G1->G2", [3, 7, 0], [0, 1, 2], [1, 2, 3], job_id=0)).result()
            assert r.all_ok
            assert engine.submit(TransferPlan.for_path("G2->G1", [0, 1, 2], [9, 10, 11],
                                              [1, 2, 3], job_id=0)).result().all_ok
        for s, d in ((3, 9), (7, 10), (0, 11)):
            assert torch.equal(block_bytes_of(g1, s), block_bytes_of(g1, d))
    engine_.close()
