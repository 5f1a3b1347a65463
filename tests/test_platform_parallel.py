"""Platform: device/backend selection (NPU through a test double), CPU emulation, init_parallel,
the model-parallel RNG tracker on CPU, and the SDPA core attention against a float64 reference."""
from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import pytest
import torch

from opkd_mcore.platform import device as platform_device
from opkd_mcore.platform import megatron_cpu
from opkd_mcore.platform.parallel import ParallelConfig
from tests._dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- NPU selection
# Naming torch's out-of-tree device slot "npu" (what importing torch_npu does) lasts for the process
# and leaves torch asking for NPU hooks that a test double cannot register: a later `dist.barrier()`
# in the same process can fail. So the NPU cases run in a process of their own.
NPU_DOUBLE = '''
import sys, types
import torch
from opkd_mcore.platform import device as platform_device
from opkd_mcore.platform import megatron_cpu, parallel
from opkd_mcore.platform.parallel import ParallelConfig


class FakeNpuForSelectionTest:
    """Test double for `torch.npu` (Ascend): records set_device; nothing here can run on an NPU."""

    def __init__(self):
        self.devices_set = []

    def is_available(self):
        return True

    def device_count(self):
        return 8

    def set_device(self, index):
        self.devices_set.append(index)

    def current_device(self):
        return self.devices_set[-1] if self.devices_set else 0


fake_npu = FakeNpuForSelectionTest()
torch.utils.rename_privateuse1_backend("npu")
sys.modules["torch_npu"] = types.ModuleType("torch_npu")
torch.npu = fake_npu
torch.cuda.is_available = lambda: False
platform_device.importlib.util.find_spec = lambda name: object() if name == "torch_npu" else None
platform_device.detect_device_type.cache_clear()
'''


def _with_npu_double(body: str, **env: str) -> None:
    """Run `body` after the NPU double is installed, in a fresh interpreter; its asserts fail the test."""
    environ = {k: v for k, v in os.environ.items() if k != "OPKD_DEVICE"}
    proc = subprocess.run([sys.executable, "-c", NPU_DOUBLE + textwrap.dedent(body)], cwd=ROOT,
                          env={**environ, "PYTHONPATH": ROOT, **env}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_npu_is_detected_and_uses_hccl():
    _with_npu_double("""
        assert platform_device.device_type() == "npu"
        assert platform_device.collective_backend() == "hccl"
        assert parallel.bind_local_device("npu") == torch.device("npu", 3)
        assert fake_npu.devices_set == [3]
        assert platform_device.current_device() == torch.device("npu", 3)
    """, LOCAL_RANK="3")


def test_init_parallel_on_npu_leaves_cpu_emulation_off():
    _with_npu_double("""
        class StopBeforeProcessGroup(Exception):
            pass

        def stop(backend, timeout):
            assert backend == "hccl"
            raise StopBeforeProcessGroup

        parallel._init_process_group = stop
        try:
            parallel.init_parallel(ParallelConfig())
            raise AssertionError("init_parallel went past the process group")
        except StopBeforeProcessGroup:
            pass
        assert not megatron_cpu.is_enabled()
    """)


def test_device_override_and_bad_value(monkeypatch):
    monkeypatch.setenv("OPKD_DEVICE", "cpu")
    assert platform_device.device_type() == "cpu"
    assert platform_device.collective_backend() == "gloo"
    with pytest.raises(ValueError, match="device: expected one of"):
        platform_device.device_type("tpu")


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize("kwargs, match", [
    (dict(tp=0), "ParallelConfig.tp"), (dict(pp="2"), "ParallelConfig.pp"),
    (dict(vpp=0), "ParallelConfig.vpp"), (dict(vpp=2, pp=1), "needs pp >= 2"),
])
def test_parallel_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs).validate()


def test_parallel_config_rejects_world_size_not_divisible():
    with pytest.raises(ValueError, match="world size 3 is not divisible by tp\\*pp\\*cp"):
        ParallelConfig(tp=2).validate(world_size=3)


# ----------------------------------------------------------------------------- emulation
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU emulation is for CPU-only torch")
def test_cpu_emulation_bridges_cuda_calls_and_is_reversible():
    megatron_cpu.enable_cpu_emulation()
    try:
        assert torch.cuda.current_device() == 0
        assert torch.empty(3, device="cuda").device.type == "cpu"
        assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.ones(2).cuda().device.type == "cpu"
        assert torch.ones(2).to("cuda:0", torch.float64).dtype == torch.float64
        assert torch.ones(2).type() == "torch.cuda.FloatTensor"  # Megatron's optimizers check this
        assert torch.tensor([1.0], device=torch.device("cuda", 0), pin_memory=True).device.type == "cpu"
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda.nvtx.range_push("x")
            torch.cuda.nvtx.range_pop()
        seen = []
        worker = threading.Thread(target=lambda: seen.append(torch.empty(1, device="cuda").device))
        worker.start(), worker.join()
        assert seen == [torch.device("cpu")]  # the device mode also covers threads started now
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(), end.record()
        assert start.elapsed_time(end) >= 0
    finally:
        megatron_cpu.disable_cpu_emulation()
    assert not megatron_cpu.is_enabled()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.empty(3, device="cuda")


# ----------------------------------------------------------------------------- SDPA attention
def _reference_attention(q, k, v, segments, scale):
    """float64 brute force: per segment, causal softmax(q k^T * scale) v with GQA groups."""
    t, heads, d = q.shape
    groups = k.shape[1]
    out = torch.zeros(t, heads, d, dtype=torch.float64)
    for start, end in segments:
        for h in range(heads):
            g = h // (heads // groups)
            for i in range(start, end):
                scores = [float(q[i, h].double() @ k[j, g].double()) * scale for j in range(start, i + 1)]
                m = max(scores)
                w = torch.tensor([math.exp(s - m) for s in scores], dtype=torch.float64)
                w = w / w.sum()
                out[i, h] = (w[:, None] * v[start:i + 1, g].double()).sum(0)
    return out


def _attention(heads=4, groups=2, d=8):
    from opkd_mcore.platform.sdpa_attention import SdpaCoreAttention

    cfg = SimpleNamespace(context_parallel_size=1, attention_dropout=0.0, kv_channels=d,
                          num_attention_heads=heads, num_query_groups=groups)
    return SdpaCoreAttention(cfg, layer_number=1, attn_mask_type=SimpleNamespace(name="causal")).eval()


def _packed_params(lengths):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths)), cu.tolist()


@pytest.mark.parametrize("budget", [0.0, 1e9], ids=["per-sequence", "padded-batch"])
def test_sdpa_attention_packed_gqa_matches_float64_reference(monkeypatch, budget):
    from opkd_mcore.platform import sdpa_attention

    monkeypatch.setattr(sdpa_attention, "PADDED_BATCH_BUDGET", budget)
    torch.manual_seed(0)
    lengths = [3, 1, 5]
    t = sum(lengths)
    q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    params, bounds = _packed_params(lengths)
    out = _attention()(q, k, v, None, packed_seq_params=params)
    expected = _reference_attention(q, k, v, list(zip(bounds[:-1], bounds[1:])), 1 / math.sqrt(8))
    assert out.shape == (t, 32)
    torch.testing.assert_close(out.double(), expected.reshape(t, 32), rtol=1e-5, atol=1e-6)


def test_sdpa_attention_padded_batch_and_per_sequence_agree_with_gradients(monkeypatch):
    """The one-call padded batch and the per-sequence loop: same outputs and input gradients,
    including a pipeline-padding tail past the last sequence (its output stays 0)."""
    from opkd_mcore.platform import sdpa_attention

    torch.manual_seed(2)
    lengths = [4, 6, 5, 2]
    t = sum(lengths) + 3
    inputs = [torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)]
    params, _ = _packed_params(lengths)
    results = []
    for budget in (0.0, 1e9):
        monkeypatch.setattr(sdpa_attention, "PADDED_BATCH_BUDGET", budget)
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = _attention()(*leaves, None, packed_seq_params=params)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), [x.grad for x in leaves]))
    (out_loop, grads_loop), (out_batch, grads_batch) = results
    assert torch.equal(out_batch[sum(lengths):], torch.zeros_like(out_batch[sum(lengths):]))
    torch.testing.assert_close(out_batch, out_loop, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_batch, grads_loop):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_sdpa_attention_batched_sbhd_matches_reference():
    torch.manual_seed(1)
    s, b = 6, 2
    q, k, v = torch.randn(s, b, 4, 8), torch.randn(s, b, 2, 8), torch.randn(s, b, 2, 8)
    out = _attention()(q, k, v, None)
    assert out.shape == (s, b, 32)
    for i in range(b):
        expected = _reference_attention(q[:, i], k[:, i], v[:, i], [(0, s)], 1 / math.sqrt(8))
        torch.testing.assert_close(out[:, i].double(), expected.reshape(s, 32), rtol=1e-5, atol=1e-6)


def test_sdpa_attention_rejects_cu_seqlens_longer_than_input():
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    with pytest.raises(ValueError, match="cu_seqlens ends at 12"):
        _attention()(torch.randn(8, 4, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8), None,
                     packed_seq_params=params)


# ----------------------------------------------------------------------------- real processes
def _init_and_probe(rank, world_size):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from opkd_mcore.platform import destroy_parallel, init_parallel

    init_parallel(ParallelConfig(tp=2, seed=42))
    try:
        probe = dict(tp=ps.get_tensor_model_parallel_world_size(),
                     tp_rank=ps.get_tensor_model_parallel_rank(),
                     dp=ps.get_data_parallel_world_size(), emulated=megatron_cpu.is_enabled())
        default_before = torch.get_rng_state()
        with get_cuda_rng_tracker().fork():
            probe["tp_draw"] = torch.rand(4).tolist()
        probe["default_untouched"] = torch.equal(default_before, torch.get_rng_state())
        with get_cuda_rng_tracker().fork("data-parallel-rng"):
            probe["dp_draw"] = torch.rand(4).tolist()
        probe["default_draw"] = torch.rand(4).tolist()
    finally:
        destroy_parallel()
    probe["emulated_after_destroy"] = megatron_cpu.is_enabled()
    return probe  # plain Python values: tensors would travel as shared memory of an exiting process


@pytest.fixture(scope="module")
def probes():
    return run_distributed(_init_and_probe, 2)


def test_init_parallel_builds_tp_groups_with_cpu_emulation(probes):
    assert [p["tp_rank"] for p in probes] == [0, 1]
    assert all(p["tp"] == 2 and p["dp"] == 1 and p["emulated"] for p in probes)
    assert not any(p["emulated_after_destroy"] for p in probes)


def test_rng_tracker_on_cpu_differs_per_tp_rank_and_spares_default_stream(probes):
    assert probes[0]["tp_draw"] != probes[1]["tp_draw"]
    assert probes[0]["dp_draw"] == probes[1]["dp_draw"]
    assert probes[0]["default_draw"] == probes[1]["default_draw"]
    assert all(p["default_untouched"] for p in probes)
    g = torch.Generator().manual_seed(42 + 2718 + 1)  # Megatron's TP seed offset for TP rank 1
    assert probes[1]["tp_draw"] == torch.rand(4, generator=g).tolist()
