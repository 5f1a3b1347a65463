"""Weight sync of an MoE student (Megatron, EP=2) into a real vLLM (CPU) engine.

A tiny Qwen2-MoE (8 experts, top-2, gated shared expert, q/k/v biases) trained for one step at
EP=2 over two processes, then synced: two sources, each with its own sender and group: rank 0
sends the shared tensors and experts 0-3, rank 1 sends experts 4-7 (nothing gathers them onto one
rank). The receiving engine loads them through vLLM's fused-MoE weight loader (per-expert HF names).
The reference is a fresh engine started from the student's HF export: every parameter it holds
(the CPU backend's prepacked fused-expert tensors included) equals the synced engine's bit for bit,
and it generates the same greedy tokens. That fresh engine then serves as an MoE teacher through
the vLLM backend (`VllmTeacher`): its top-k logprobs equal the HF forward of the export. (vLLM's own `reload_weights` is no reference on the CPU:
it leaves the experts unpacked, see `receiver._cpu_moe_prepack_on_update`.)
"""
from __future__ import annotations

from dataclasses import asdict, replace

import pytest
import torch

from opkd_mcore.rollout.vllm_rollout import shutdown_llm
from opkd_mcore.weight_sync.megatron_source import SyncGroupsConfig
from opkd_mcore.weight_sync.receiver import VllmWeightReceiver
from opkd_mcore.weight_sync.vllm_handle import VllmReceiverHandle
from tests._dist import free_port, require_devices, run_distributed
from tests.conftest import VLLM_FP32_LOGPROB_ATOL, engine_kwargs
from tests.test_weight_sync_vllm import TRAIN_SEQUENCES, TRANSPORT, _ce_loss, greedy, hf_state

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FAMILY = "qwen2_moe"
VERSION = 5


class MoeProbeForTest:
    """Worker extension mixin: every parameter vLLM holds (fused experts included), as bytes."""

    def probe_parameters(self) -> dict:
        return {n: (list(p.shape), str(p.dtype), p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
                for n, p in self.model_runner.model.named_parameters() if p.numel() > 0}


class LoadOrderForTest:
    """Worker extension mixin: the names of every `load_weights` call of the engine's model."""

    def record_loads(self) -> None:
        model, self._loads = self.model_runner.model, []
        load = model.load_weights

        def recording(weights):
            weights = list(weights)
            self._loads.append([n for n, _ in weights])
            return load(weights=weights)

        model.load_weights = recording

    def recorded_loads(self) -> list[list[str]]:
        return self._loads


class MoeReceiverForTest(VllmWeightReceiver, MoeProbeForTest, LoadOrderForTest):
    pass


def _position(name: str, layers: int) -> int:
    """Where a tensor's group comes in the HF order: the embedding -1, layer L at L, the rest last."""
    if ".layers." in name:
        return int(name.split(".")[2])
    return -1 if "embed_tokens" in name else layers


def _check_layer_by_layer(loads: list[list[str]], layers: int) -> None:
    """Within the bucket granularity, the engine gets the layers in order: every load starts at the
    earliest layer still outstanding (so layer L of both sources is in before a load starts at L+1)."""
    for k, names in enumerate(loads):
        outstanding = min(_position(n, layers) for load in loads[k:] for n in load)
        assert _position(names[0], layers) == outstanding, (k, [load[0] for load in loads])


def train_step_and_sync(rank, hf_dir, export_dir, sync_cfg, parallel: dict) -> dict:
    """Train one step in the `parallel` layout (ParallelConfig's fields), save the HF export, sync the
    live weights into the engine; what each rank saw."""
    from opkd_mcore.config.schema import OptimSection
    from opkd_mcore.engine.megatron_engine import MegatronEngine
    from opkd_mcore.engine.packing import pack_sequences
    from opkd_mcore.models import build_model, load_hf_config, load_hf_weights, save_hf_checkpoint
    from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel
    from opkd_mcore.weight_sync.megatron_source import MegatronWeightExport

    init_parallel(ParallelConfig(**parallel, seed=7))
    try:
        # float32 as the engine: the probe compares bytes (an accelerator's default is bf16)
        chunks = build_model(load_hf_config(hf_dir), params_dtype=torch.float32, moe_aux_loss_coeff=0.01)
        load_hf_weights(chunks, hf_dir)
        engine = MegatronEngine(chunks, OptimSection(lr=1e-2))
        batch = [pack_sequences([TRAIN_SEQUENCES[rank]], [4])]  # one sequence per DP rank
        metrics = engine.train_step(batch, _ce_loss(2 * batch[0].num_loss_tokens))
        save_hf_checkpoint(chunks, export_dir, src_hf_dir=hf_dir, progress=False)
        sync = MegatronWeightExport(chunks, SyncGroupsConfig(**sync_cfg))
        sync.connect()
        stats = sync.sync(VERSION)
        sent = [] if sync.sender is None else \
            [s.name for s in sync.plan.slots if s.pp_stage == sync.sender.stage]
        sync.close()
        return {"source": sync.source, "sent": sent, "order": sync.plan.order, "metrics": metrics,
                "num_groups": len(sync.groups),
                "stats": None if stats is None else (stats.syncs, stats.handshakes, stats.bytes_sent)}
    finally:
        destroy_parallel()


def _trainer(rank, world, hf_dir, export_dir, sync_cfg):
    return train_step_and_sync(rank, hf_dir, export_dir, sync_cfg, {"ep": 2})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model

    # head_dim 64 = hidden_size / heads: vLLM's Qwen2-MoE ignores a config head_dim that differs
    shape = TinyModelShape(vocab_size=200, num_layers=2, num_attention_heads=2, num_key_value_heads=1)
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("moe_sync") / FAMILY), FAMILY, shape, seed=2)


TEACHER_K = 5
# float32 engine vs float32 HF eager forward: 1e-4 on CPU; on a GPU vLLM's fused-MoE and attention
# kernels multiply float32 in TF32 (2.4e-4 seen on an H200), bounded as in tests/conftest.py
MOE_LOGPROB_ATOL = VLLM_FP32_LOGPROB_ATOL if torch.cuda.is_available() else 1e-4


def _check_vllm_moe_teacher(llm, hf_dir: str) -> None:
    """`VllmTeacher` over an MoE engine: top-k logprobs == log_softmax of the HF forward at those ids."""
    from transformers import AutoModelForCausalLM

    from opkd_mcore.teacher.vllm_teacher import VllmTeacher, VllmTeacherConfig

    seqs = [TRAIN_SEQUENCES[0], [1, 9, 9, 12, 4, 7]]
    rows = VllmTeacher(llm, VllmTeacherConfig(k=TEACHER_K)).score(seqs)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    for seq, row in zip(seqs, rows):
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([seq])).logits[0, :-1].double(), dim=-1)
        assert row.ids.shape == (len(seq) - 1, TEACHER_K)
        torch.testing.assert_close(row.logprobs.double(), logprobs.gather(1, row.ids), rtol=0,
                                   atol=MOE_LOGPROB_ATOL)
        # the k ids are the HF model's k most likely ones
        torch.testing.assert_close(row.logprobs.double(), logprobs.topk(TEACHER_K, dim=-1).values,
                                   rtol=0, atol=MOE_LOGPROB_ATOL)


def _probe(llm) -> dict:
    return llm.collective_rpc("probe_parameters")[0]


def sync_from_two_trainers(llm, cfg: SyncGroupsConfig, groups: int, trainer, checkpoint: str,
                           export_dir: str) -> list[dict]:
    """The engine joins `groups` sync groups and waits for weights while two trainer processes
    (`trainer`) each train one step from `checkpoint` and send; their results, after the engine's
    join and receive both returned."""
    handle = VllmReceiverHandle(llm)
    joined = handle.join_async(cfg.stage_groups(groups), transport=TRANSPORT)
    received = handle.receive_async()
    per_rank = run_distributed(trainer, 2, checkpoint, export_dir, asdict(cfg),
                               backend=None if torch.cuda.is_available() else "gloo")
    assert joined.result(60) == [1] and received.result(120) == [VERSION]
    return per_rank


def test_ep2_student_synced_matches_its_hf_export(checkpoint, tmp_path):
    import vllm

    require_devices(2)  # two EP ranks: one device each on an accelerator machine

    llm = vllm.LLM(checkpoint, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
                   **engine_kwargs(), worker_extension_cls=f"{__name__}.MoeReceiverForTest")
    try:
        before = greedy(llm)
        cfg = SyncGroupsConfig(base_port=free_port(8), num_receivers=1, timeout_s=300, bucket_bytes=1 << 18)
        llm.collective_rpc("record_loads")
        # one group per source (stage 0, EP rank 0 / 1); on GPUs the transport the trainer picks for an
        # engine on rank 0's device, device IPC (rank 1's buffers are mapped from the other GPU)
        cfg = replace(cfg, transport=TRANSPORT)
        export_dir = str(tmp_path / "export")
        per_rank = sync_from_two_trainers(llm, cfg, 2, _trainer, checkpoint, export_dir)

        assert [r["source"] for r in per_rank] == [0, 1] and per_rank[0]["num_groups"] == 2
        assert all(r["stats"][:2] == (1, 1) for r in per_rank)
        assert [r["order"] for r in per_rank] == ["layer", "layer"]  # each rank sends one source
        loads = llm.collective_rpc("recorded_loads")[0]
        assert {n for names in loads for n in names} == set(hf_state(checkpoint))  # each tensor once
        assert sum(len(names) for names in loads) == len(hf_state(checkpoint))
        _check_layer_by_layer(loads, layers=2)
        experts_of = {r["source"]: {int(n.split(".")[5]) for n in r["sent"] if ".experts." in n} for r in per_rank}
        assert experts_of == {0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}}
        assert all(".experts." in n for n in per_rank[1]["sent"])  # rank 1 sends only its experts
        assert per_rank[0]["metrics"]["train/update_applied"] == 1.0
        assert per_rank[0]["metrics"]["moe/aux_loss"] > 0

        exported, original = hf_state(export_dir), hf_state(checkpoint)
        assert exported.keys() == original.keys()
        changed = [k for k in original if not torch.equal(exported[k], original[k])]
        assert any(".experts.6." in k for k in changed)  # rank 1's experts were trained and sent
        synced_params, synced_tokens = _probe(llm), greedy(llm)
    finally:
        shutdown_llm(llm)
    fresh = vllm.LLM(export_dir, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
                     max_logprobs=TEACHER_K, enable_prefix_caching=False,
                     **engine_kwargs(), worker_extension_cls=f"{__name__}.MoeReceiverForTest")
    try:
        fresh_params = _probe(fresh)
        assert fresh_params.keys() == synced_params.keys()
        assert sum("w13_weight" in n for n in fresh_params) == 2  # one fused-expert tensor per layer
        for name, value in fresh_params.items():
            assert synced_params[name] == value, name
        assert greedy(fresh) == synced_tokens
        _check_vllm_moe_teacher(fresh, export_dir)
    finally:
        shutdown_llm(fresh)
    assert synced_tokens != before  # the step and the sync changed what the engine generates
