"""``bench moe`` decides which backends can run before it launches a rank (no GPU, no process group here)."""

from __future__ import annotations

from tensorwire.bench.moe import skip_reason


def test_nccl_with_two_ranks_on_one_gpu_is_skipped_with_the_reason():
    reason = skip_reason("torch", "cuda", world_size=2, gpu_count=1)
    assert reason is not None and "2 ranks share 1 GPU(s)" in reason and "--ranks 1" in reason, reason


def test_no_gpu_at_all_is_a_duplicate_gpu_too():
    assert "share 0 GPU(s)" in skip_reason("torch", "cuda", world_size=1, gpu_count=0)


def test_host_backends_run_on_host_memory():
    assert skip_reason("torch", "cpu", world_size=4, gpu_count=0) is None
    assert skip_reason("nixl", "cpu", world_size=4, gpu_count=0) is None
    assert skip_reason("nixl", "cuda", world_size=2, gpu_count=1) is None  # NIXL takes two ranks on one GPU


def test_the_cuda_backend_needs_gpu_memory():
    assert "pass --memory cuda" in skip_reason("cuda", "cpu", world_size=2, gpu_count=0)
