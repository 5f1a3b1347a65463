"""Weight sync of an MoE student trained at expert TP = 2 (EP = 1, two processes) into a real vLLM (CPU)
engine: every expert's FFN is split over the two ranks, the export gathers each expert over the
expert-TP group and rank 0 alone sends (one source). The reference, as in `test_weight_sync_moe.py`, is
a fresh engine started from the student's HF export: every parameter equal bit for bit, and the same
greedy tokens. Extended suite (`tests/conftest.py`): the ETP layout's training is in CI
(`test_models_moe_etp.py`), and this engine round trip costs ~45 s.
"""
from __future__ import annotations

import pytest
import torch

from opkd_mcore.rollout.vllm_rollout import shutdown_llm
from opkd_mcore.weight_sync.megatron_source import SyncGroupsConfig
from tests._dist import free_port, require_devices
from tests.conftest import engine_kwargs
from tests.test_weight_sync_moe import (  # noqa: F401 (checkpoint: the same tiny Qwen2-MoE fixture)
    MoeReceiverForTest,
    _probe,
    checkpoint,
    sync_from_two_trainers,
    train_step_and_sync,
)
from tests.test_weight_sync_vllm import TRANSPORT, greedy, hf_state

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _trainer(rank, world, hf_dir, export_dir, sync_cfg):
    return train_step_and_sync(rank, hf_dir, export_dir, sync_cfg, {"etp": 2})


def test_etp2_student_synced_matches_its_hf_export(checkpoint, tmp_path):  # noqa: F811
    import vllm

    require_devices(2)
    llm = vllm.LLM(checkpoint, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
                   **engine_kwargs(), worker_extension_cls=MoeReceiverForTest.__module__ + ".MoeReceiverForTest")
    try:
        before = greedy(llm)
        cfg = SyncGroupsConfig(base_port=free_port(8), num_receivers=1, timeout_s=300, bucket_bytes=1 << 18,
                               transport=TRANSPORT)
        export_dir = str(tmp_path / "export")
        per_rank = sync_from_two_trainers(llm, cfg, 1, _trainer, checkpoint, export_dir)
        assert per_rank[0]["num_groups"] == 1 and per_rank[0]["stats"][0] == 1  # one source: rank 0
        assert per_rank[0]["metrics"]["train/update_applied"] == 1.0
        exported, original = hf_state(export_dir), hf_state(checkpoint)
        changed = [k for k in original if not torch.equal(exported[k], original[k])]
        assert any(".experts.6." in k for k in changed)
        synced_params, synced_tokens = _probe(llm), greedy(llm)
    finally:
        shutdown_llm(llm)
    fresh = vllm.LLM(export_dir, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
                     enable_prefix_caching=False, **engine_kwargs(),
                     worker_extension_cls=MoeReceiverForTest.__module__ + ".MoeReceiverForTest")
    try:
        fresh_params = _probe(fresh)
        assert fresh_params.keys() == synced_params.keys()
        for name, value in fresh_params.items():
            assert synced_params[name] == value, name
        assert greedy(fresh) == synced_tokens
    finally:
        shutdown_llm(fresh)
    assert synced_tokens != before
