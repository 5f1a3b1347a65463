"""Fused-MoE experts loaded in place ("direct") into a vLLM engine, and their loads replayed.

vLLM's unquantized fused-MoE processing after loading leaves the experts as the weight loader
wrote them only on a Triton backend (`receiver._fused_moe_layout_change`). The rule is checked on
test doubles of the layer state it reads (the backend the method selected, its kernel, the expert
map, the layout of w13 / w2). The copy replay is checked on a test double of vLLM's per-expert
weight loader (select the expert, narrow to the TP shard and to the w1 / w3 half of w13, copy_):
replayed syncs equal an independent `torch.cat` of the checkpoint's tensors bit for bit. On a GPU,
a real engine is synced twice (the second sync replayed) and compared with a fresh engine.
"""
from __future__ import annotations

import logging

import pytest
import torch

from opkd_mcore.platform import is_cpu
from opkd_mcore.rollout.vllm_rollout import shutdown_llm
from opkd_mcore.weight_sync import BucketPlan, BucketSender, make_transport
from opkd_mcore.weight_sync.bucket_receiver import BucketReceiver
from opkd_mcore.weight_sync.copy_replay import BucketReplay, model_storages, replay_key
from opkd_mcore.weight_sync.receiver import VllmWeightReceiver
from opkd_mcore.weight_sync.vllm_handle import VllmReceiverHandle
from tests.conftest import engine_kwargs
from tests.test_weight_sync_vllm import TRANSPORT, _connect_both, _groups, _sync, greedy, hf_state

EXPERTS, INTER, HIDDEN = 4, 8, 16
SHARDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


# ---------------------------------------------------------------------------------------------
# the rule that picks in-place loading for a fused-MoE layer
# ---------------------------------------------------------------------------------------------

class FusedMoeLayerDouble(torch.nn.Module):
    """Test double of vLLM's RoutedExperts after start-up: what `engine_load_mode` reads of it."""

    def __init__(self, method, expert_map=None):
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(EXPERTS, 2 * INTER, HIDDEN), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(EXPERTS, HIDDEN, INTER), requires_grad=False)
        self.expert_map = expert_map
        self.quant_method = method


def moe_method_double(backend_name: str, kernel: bool = True, cls=None):
    """Test double of vLLM's UnquantizedFusedMoEMethod after processing: the real class, built
    without its backend selection (which needs the platform), holding the backend it selected and
    a stand-in kernel (None: processing has not run)."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    cls = cls or UnquantizedFusedMoEMethod
    method = cls.__new__(cls)
    torch.nn.Module.__init__(method)
    method.unquantized_backend = UnquantizedMoeBackend[backend_name]
    method.moe_kernel = object() if kernel else None
    return method


def _model(layer: torch.nn.Module) -> torch.nn.Module:
    """A dense linear layer (loads in place off the CPU) beside the fused-MoE layer double."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), layer)
    model[0].quant_method = UnquantizedLinearMethod()
    return model


def test_fused_moe_on_triton_loads_direct():
    pytest.importorskip("vllm")
    from opkd_mcore.weight_sync.receiver import engine_load_mode

    for backend in ("TRITON", "BATCHED_TRITON"):
        model = _model(FusedMoeLayerDouble(moe_method_double(backend)))
        assert engine_load_mode(model, on_cpu=False) == "direct", backend
        assert engine_load_mode(model, on_cpu=True) == "layerwise"


@pytest.mark.parametrize("backend", ["FLASHINFER_CUTLASS", "FLASHINFER_TRTLLM", "AITER", "XPU", "CPU"])
def test_fused_moe_on_a_relayout_backend_loads_layerwise(backend, caplog):
    pytest.importorskip("vllm")
    from opkd_mcore.weight_sync.receiver import engine_load_mode

    model = _model(FusedMoeLayerDouble(moe_method_double(backend)))
    with caplog.at_level(logging.INFO, logger="opkd_mcore.weight_sync.receiver"):
        assert engine_load_mode(model, on_cpu=False) == "layerwise"
    assert "1 (fused-MoE backend" in caplog.text  # names the module and the backend


def test_fused_moe_layer_states_that_load_layerwise(monkeypatch):
    """Each condition of the rule on its own: the rest of the layer as in the direct case."""
    pytest.importorskip("vllm")
    import vllm
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    from opkd_mcore.weight_sync.receiver import engine_load_mode

    class SubclassedMethodDouble(UnquantizedFusedMoEMethod):  # e.g. a platform's override
        pass

    def mode(layer):
        return engine_load_mode(_model(layer), on_cpu=False)

    assert mode(FusedMoeLayerDouble(moe_method_double("TRITON", kernel=False))) == "layerwise"
    assert mode(FusedMoeLayerDouble(moe_method_double("TRITON", cls=SubclassedMethodDouble))) == "layerwise"
    # vLLM expert parallelism: experts placed through a map that EPLB may change
    assert mode(FusedMoeLayerDouble(moe_method_double("TRITON"),
                                    expert_map=torch.arange(EXPERTS, dtype=torch.int32))) == "layerwise"
    padded = FusedMoeLayerDouble(moe_method_double("TRITON"))  # ROCm's padded rows: a strided view
    padded.w13_weight.data = torch.zeros(EXPERTS, 2 * INTER, HIDDEN + 64)[..., :HIDDEN]
    assert mode(padded) == "layerwise"
    shuffled = FusedMoeLayerDouble(moe_method_double("TRITON"))
    shuffled.w2_weight.is_shuffled = True
    assert mode(shuffled) == "layerwise"
    assert mode(FusedMoeLayerDouble(moe_method_double("TRITON"))) == "direct"
    monkeypatch.setattr(vllm, "__version__", "0.27.0")  # a release whose processing was not read
    assert mode(FusedMoeLayerDouble(moe_method_double("TRITON"))) == "layerwise"


# ---------------------------------------------------------------------------------------------
# replaying the per-expert loader's copies
# ---------------------------------------------------------------------------------------------

class FusedExpertsDouble(torch.nn.Module):
    """Test double of vLLM's RoutedExperts loading per-expert HF tensors, as TP rank `tp_rank` of
    `tp_size`: the ops of its `load_weights` (unsqueeze + unbind), `weight_loader` (the expert's
    row of the parameter, an expert map lookup under EP) and `_load_w13` / `_load_w2` (narrow to
    the TP shard, narrow to the w1 / w3 half of w13, copy_)."""

    def __init__(self, layers: int, tp_size: int = 1, tp_rank: int = 0, expert_map=None):
        super().__init__()
        self.tp_size, self.tp_rank = tp_size, tp_rank
        inter = INTER // tp_size
        self.w13 = torch.nn.ParameterList([torch.nn.Parameter(
            torch.full((EXPERTS, 2 * inter, HIDDEN), 3.0, dtype=torch.bfloat16), requires_grad=False)
            for _ in range(layers)])
        self.w2 = torch.nn.ParameterList([torch.nn.Parameter(
            torch.full((EXPERTS, HIDDEN, inter), 3.0, dtype=torch.bfloat16), requires_grad=False)
            for _ in range(layers)])
        self.register_buffer("_expert_map", expert_map)

    def weight_loader(self, param, loaded_weight, shard_id: str, expert_id: int) -> None:
        if self._expert_map is not None:
            expert_id = self._expert_map[expert_id].item()
        expert_data = param.data[expert_id]
        shard_dim = 1 if shard_id == "w2" else 0
        per_rank = loaded_weight.shape[shard_dim] // self.tp_size
        loaded_weight = loaded_weight.narrow(shard_dim, per_rank * self.tp_rank, per_rank)
        if shard_id != "w2":
            half = expert_data.shape[0] // 2
            expert_data = expert_data.narrow(0, 0 if shard_id == "w1" else half, half)
        expert_data.copy_(loaded_weight)

    def load_weights(self, weights) -> None:
        for name, w in weights:  # model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight
            parts = name.split(".")
            layer, expert, shard = int(parts[2]), int(parts[5]), SHARDS[parts[6]]
            param = self.w2[layer] if shard == "w2" else self.w13[layer]
            for expert_id, one in enumerate(w.unsqueeze(0).unbind(), start=expert):
                self.weight_loader(param, one, shard, expert_id)


def _experts_state(layers: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN), "down_proj": (HIDDEN, INTER)}
    return {f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight":
            torch.randn(shape, generator=g).to(torch.bfloat16)
            for layer in range(layers) for e in range(EXPERTS) for proj, shape in shapes.items()}


def _expected(state: dict, layers: int, tp_size: int, tp_rank: int):
    """w13 / w2 of each layer from the HF tensors by `torch.cat` / `torch.stack` (not the loader)."""
    size = INTER // tp_size
    rows = slice(size * tp_rank, size * (tp_rank + 1))

    def t(layer, e, proj):
        return state[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"]

    w13 = [torch.stack([torch.cat([t(layer, e, "gate_proj")[rows], t(layer, e, "up_proj")[rows]])
                        for e in range(EXPERTS)]) for layer in range(layers)]
    w2 = [torch.stack([t(layer, e, "down_proj")[:, rows] for e in range(EXPERTS)]) for layer in range(layers)]
    return w13, w2


def _sync_buckets(model, replay, plan, bufs, state) -> tuple[int, int]:
    """Pack `state` into the plan's buckets and load each (or replay it); (replayed, loader calls)."""
    replayed, calls = 0, [0]

    def load(named):
        calls[0] += 1
        model.load_weights(named)

    for bucket in plan.buckets:
        buf = bufs[bucket.index % 2]
        for name, view in BucketReceiver.views(plan, bucket, buf, copy_split=False):
            view.copy_(state[name])
        views = BucketReceiver.views(plan, bucket, buf, copy_split=False)
        replayed += replay.run(replay_key(plan.digest(), bucket.index, buf), buf, lambda: load(views))
    return replayed, calls[0]


@pytest.mark.parametrize("tp_size,tp_rank", [(1, 0), (2, 1)])
def test_replayed_expert_loads_equal_the_checkpoint_bitwise(tp_size, tp_rank):
    """The first sync runs the loaders (recorded: only views and source -> engine copies, one per
    expert tensor); the next ones replay the copies, loader-free, into the w1 / w3 halves of w13 and
    into w2, TP-sharded; each sync's engine tensors equal the checkpoint's, concatenated, bit for bit."""
    layers = 2
    model = FusedExpertsDouble(layers, tp_size, tp_rank)
    first = _experts_state(layers, seed=1)
    plan = BucketPlan.from_named_tensors(first.items(), 1024)  # an expert layer spread over buckets
    assert len(plan.buckets) > 3
    bufs = [torch.zeros(plan.max_bucket_nbytes(), dtype=torch.uint8) for _ in range(2)]
    replay = BucketReplay(model_storages(model))
    for sync, seed in enumerate((1, 2, 3)):
        state = first if seed == 1 else _experts_state(layers, seed)
        replayed, calls = _sync_buckets(model, replay, plan, bufs, state)
        assert (replayed, calls) == ((0, len(plan.buckets)) if sync == 0 else (len(plan.buckets), 0))
        w13, w2 = _expected(state, layers, tp_size, tp_rank)
        for layer in range(layers):
            assert torch.equal(model.w13[layer], w13[layer]) and torch.equal(model.w2[layer], w2[layer])
    copies = sum(len(step[1]) for record in replay.records.values() for step in record.steps)
    assert copies == len(first) and all(r.impure is None for r in replay.records.values())


def test_expert_map_lookups_keep_their_loader():
    """Under vLLM expert parallelism the loader reads the expert map (a tensor of the model): the
    record is not a pure copy, so every sync runs the loader, and still lands bit for bit."""
    layers = 1
    model = FusedExpertsDouble(layers, expert_map=torch.arange(EXPERTS, dtype=torch.int32))
    first = _experts_state(layers, seed=1)
    plan = BucketPlan.from_named_tensors(first.items(), 1024)
    bufs = [torch.zeros(plan.max_bucket_nbytes(), dtype=torch.uint8) for _ in range(2)]
    replay = BucketReplay(model_storages(model))
    for seed in (1, 2):
        state = _experts_state(layers, seed)
        assert _sync_buckets(model, replay, plan, bufs, state) == (0, len(plan.buckets))
        w13, w2 = _expected(state, layers, 1, 0)
        assert torch.equal(model.w13[0], w13[0]) and torch.equal(model.w2[0], w2[0])
    assert all("_local_scalar_dense" in r.impure for r in replay.records.values())


# ---------------------------------------------------------------------------------------------
# a real engine on a GPU
# ---------------------------------------------------------------------------------------------

class MoeDirectProbeForTest(VllmWeightReceiver):
    """Worker extension: every parameter the engine holds (w13 / w2 of each layer included), as
    bytes; and, per bucket index, why its recorded load is not replayable (None: it is)."""

    def probe_parameters(self) -> dict:
        return {n: p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
                for n, p in self.model_runner.model.named_parameters() if p.numel() > 0}

    def replay_impurity(self) -> dict:
        return {key[1]: record.impure for key, record in self._opkd_replay.records.items()}


def _moe_engine(checkpoint: str):
    import vllm

    # bf16 and CUDA graphs: the rollout's GPU settings; the captured graphs read the weights' storage
    return vllm.LLM(checkpoint, dtype="bfloat16", enforce_eager=False, max_model_len=256, seed=0,
                    **engine_kwargs(), worker_extension_cls=f"{__name__}.MoeDirectProbeForTest")


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model

    shape = TinyModelShape(vocab_size=200, num_layers=2, num_attention_heads=2, num_key_value_heads=1)
    root = tmp_path_factory.mktemp("moe_direct")
    return {name: save_tiny_hf_model(str(root / name), "qwen3_moe", shape, seed=seed, dtype=torch.bfloat16)
            for name, seed in (("A", 1), ("B", 2))}


@pytest.mark.gpu
@pytest.mark.vllm
def test_moe_direct_sync_replays_into_the_engine_as_a_fresh_engine_loads(moe_checkpoints):
    """A bf16 Qwen3-MoE engine on one GPU (vLLM TP=1, no expert parallelism) started from B loads
    its syncs in place: A (the loaders run and are recorded), then B (replayed). After B every
    parameter, the fused experts included, equals what the engine held freshly started from B
    (vLLM's own checkpoint load and processing), bit for bit, and greedy tokens match; after A
    they differ. (The first, loader-run sync against a fresh engine: test_weight_sync_moe.py.)"""
    if is_cpu():
        pytest.skip("the fused-MoE Triton backend needs a GPU")
    llm = _moe_engine(moe_checkpoints["B"])
    try:
        fresh_b, tokens_b = llm.collective_rpc("probe_parameters")[0], greedy(llm)
        state_a, state_b = hf_state(moe_checkpoints["A"]), hf_state(moe_checkpoints["B"])
        plan = BucketPlan.from_named_tensors(state_a.items(), 256 * 1024)
        assert len(plan.buckets) > 3
        handle, groups = VllmReceiverHandle(llm), _groups()
        transport = make_transport(TRANSPORT, groups[0], rank=0)
        _connect_both(handle, transport, groups)
        sender = BucketSender(plan, transport)
        assert _sync(handle, sender, state_a, version=1)["receive"] == [1]
        stats_a, tokens_a = handle.stats()[0], greedy(llm)
        assert _sync(handle, sender, state_b, version=2)["receive"] == [2]
        stats_b, synced_b = handle.stats()[0], llm.collective_rpc("probe_parameters")[0]
        impurity = llm.collective_rpc("replay_impurity")[0]
        assert greedy(llm) == tokens_b != tokens_a
        transport.close()
    finally:
        shutdown_llm(llm)
    assert stats_a["load_mode"] == stats_b["load_mode"] == "direct"
    assert stats_a["last_replayed"] == 0 and stats_b["last_replayed"] > 0
    # every bucket that carries experts was replayed as plain copies (the per-expert loaders did not run)
    expert_buckets = {s.bucket for s in plan.slots if ".experts." in s.name}
    assert expert_buckets and {b: impurity[b] for b in expert_buckets} == dict.fromkeys(expert_buckets)
    assert stats_b["last_reload_s"] == 0 and stats_b["weights_consistent"]
    assert synced_b.keys() == fresh_b.keys()
    assert sum("w13_weight" in n for n in fresh_b) == 2 and sum("w2_weight" in n for n in fresh_b) == 2
    for name, value in fresh_b.items():
        assert synced_b[name] == value, name
