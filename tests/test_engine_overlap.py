"""`optim.overlap_param_gather` on CPU (gloo runs Megatron's async coalesced all-gather): two DP ranks
train the same steps with the distributed optimizer, once with the param all-gather and the grad
reduce-scatter overlapped and once without. The run without is the reference: with the overlap, every
reader of the weights after a step (the weight export into the rollout engine, a checkpoint, a
forward-only pass) must see exactly its weights, although the chunks' own params are stale right after
the step (checked too: otherwise the comparison would prove nothing).
"""
from __future__ import annotations

import pytest
import torch

from opkd_mcore.engine.packing import PackedBatch, pack_sequences
from tests._dist import run_distributed

megatron = pytest.importorskip("megatron.core")

SEQUENCES = [[1, 4, 5, 14, 6, 15, 9, 2], [1, 7, 8, 14, 9, 15, 10, 11, 2], [1, 3, 3, 14, 12, 15, 13, 2],
             [1, 6, 3, 14, 5, 15, 8, 2]]
PROMPT_LENGTHS = [4, 4, 3, 4]
STEPS = 3


def _my_micro_batches() -> list[PackedBatch]:
    """This DP rank's two sequences, a micro-batch each (the overlapped grad reduction waits for the last)."""
    from megatron.core import parallel_state as ps

    mine = range(ps.get_data_parallel_rank(), len(SEQUENCES), ps.get_data_parallel_world_size())
    return [pack_sequences([SEQUENCES[i]], [PROMPT_LENGTHS[i]]) for i in mine]


def _loss_fn(logits, batch: PackedBatch):
    from megatron.core import tensor_parallel

    targets = torch.roll(batch.tokens, -1)
    per_token = tensor_parallel.vocab_parallel_cross_entropy(logits.float().unsqueeze(1),
                                                             targets.unsqueeze(1)).squeeze(1)
    num_tokens = sum(len(s) - p for s, p in zip(SEQUENCES, PROMPT_LENGTHS))
    return (per_token * batch.loss_mask).sum() / num_tokens, {}


def _captured_export(engine, fresh_params):
    """What a `MegatronWeightExport` of the engine's chunks sends (DP rank 0 sends, the other DP rank
    takes part in `fresh_params` only): the sender's transfer replaced by a copy of the stream."""
    from opkd_mcore.weight_sync.megatron_source import MegatronWeightExport, SyncGroupsConfig

    export = MegatronWeightExport(engine.model, SyncGroupsConfig(base_port=0), fresh_params=fresh_params)
    sent = {}
    if export.sender is not None:
        export.sender.sync = lambda stream, version: sent.update({n: t.clone() for n, t in stream})
    export.sync(version=1)
    return sent


def _named_params(chunks) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in chunks[0].named_parameters()}


def _engine(hf_dir: str, overlap_grad_reduce: bool, overlap_param_gather: bool):
    """The checkpoint's student in a `MegatronEngine` with the distributed optimizer and these overlaps
    (in an initialised parallel state)."""
    from opkd_mcore.config.schema import OptimSection
    from opkd_mcore.engine.megatron_engine import MegatronEngine
    from opkd_mcore.models import build_model, load_hf_config, load_hf_weights

    chunks = build_model(load_hf_config(hf_dir))
    load_hf_weights(chunks, hf_dir)
    return MegatronEngine(chunks, OptimSection(lr=5e-3, clip_grad=0.05, use_distributed_optimizer=True,
                                               overlap_grad_reduce=overlap_grad_reduce,
                                               overlap_param_gather=overlap_param_gather))


def _run(hf_dir: str, ckpt_dir: str, overlap: bool) -> dict:
    from opkd_mcore.models import build_model, load_hf_config
    from opkd_mcore.models.convert import load_mcore_model
    from opkd_mcore.platform import ParallelConfig, destroy_parallel, init_parallel

    init_parallel(ParallelConfig(tp=1, pp=1, seed=7))
    try:
        engine = _engine(hf_dir, overlap, overlap)
        losses = [engine.train_step(_my_micro_batches(), _loss_fn)["train/loss"] for _ in range(STEPS)]
        out = {"right_after_step": _named_params(engine.model)}
        if overlap:  # the trap: an export that does not ask for fresh params reads the stale ones
            out["export_unsynced"] = _captured_export(engine, fresh_params=None)
        out["export"] = _captured_export(engine, fresh_params=engine.fresh_params)
        engine.train_step(_my_micro_batches(), _loss_fn)  # the checkpoint is saved right after a step
        engine.save_checkpoint(ckpt_dir)
        reloaded = build_model(load_hf_config(hf_dir))
        load_mcore_model(reloaded, ckpt_dir)
        out["checkpoint"] = _named_params(reloaded)
        engine.train_step(_my_micro_batches(), _loss_fn)
        out["logits"] = engine.forward_logits(pack_sequences([SEQUENCES[0]], [PROMPT_LENGTHS[0]]))
        out["params_after_forward"] = _named_params(engine.model)
        # one more step after the forced syncs: the pre-hooks still gather what the next step changes
        losses.append(engine.train_step(_my_micro_batches(), _loss_fn)["train/loss"])
        engine.fresh_params()
        out.update(losses=losses, final=_named_params(engine.model))
        return out
    finally:
        destroy_parallel()


def _fused_head_loss_fn(head, batch: PackedBatch):
    """Cross entropy of the logits the fused LM head would compute, from its `LmHeadInput`."""
    return _loss_fn(head.hidden.float() @ head.weight.float().t(), batch)


def _run_fused_head(hf_dir: str, overlap: bool) -> dict:
    """The fused LM head reads the output weight without running the output layer (whose forward
    pre-hook would wait for its all-gather); a bucket per parameter puts that weight's all-gather last.
    Both runs overlap the grad reduction (the same buckets, so the same sums); one the param gather too."""
    from opkd_mcore.engine import megatron_engine
    from opkd_mcore.platform import ParallelConfig, destroy_parallel, init_parallel

    def small_buckets(cfg):
        ddp = real_ddp_config(cfg)
        ddp.bucket_size = 1000
        return ddp

    real_ddp_config, megatron_engine.ddp_config = megatron_engine.ddp_config, small_buckets
    init_parallel(ParallelConfig(tp=1, pp=1, seed=7))
    try:
        engine = _engine(hf_dir, True, overlap)
        losses = [engine.train_step(_my_micro_batches(), _fused_head_loss_fn,
                                    fused_lm_head=True)["train/loss"] for _ in range(STEPS)]
        engine.fresh_params()
        return {"losses": losses, "final": _named_params(engine.model),
                "buckets": len(engine.model[0].bucket_groups)}
    finally:
        megatron_engine.ddp_config = real_ddp_config
        destroy_parallel()


def _worker(rank, world, hf_dir, ckpt_root):
    runs = {name: _run(hf_dir, f"{ckpt_root}/{name}", overlap) for name, overlap in
            (("plain", False), ("overlap", True))}
    runs.update({f"fused_{name}": _run_fused_head(hf_dir, overlap) for name, overlap in
                 (("plain", False), ("overlap", True))})
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model

    shape = TinyModelShape(vocab_size=64, num_layers=2, hidden_size=64, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, intermediate_size=128)
    hf_dir = str(save_tiny_hf_model(str(tmp_path_factory.mktemp("qwen3")), "qwen3", shape, seed=3,
                                    alphabet="0123456789+= ", init_std=0.05))
    return run_distributed(_worker, 2, hf_dir, str(tmp_path_factory.mktemp("ckpt")))


def _assert_equal_dicts(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), what
    different = [n for n in expected if not torch.equal(got[n], expected[n])]
    assert not different, f"{what}: {different[:3]} differ from the run without overlap"


def test_the_overlapped_step_leaves_stale_params_until_something_asks(runs):
    """Right after a step, each rank's chunks hold only its own shard of the update: the case the
    readers below must handle (if this fails, the overlap is not on and the other tests prove nothing)."""
    for rank in runs:
        plain, overlap = rank["plain"]["right_after_step"], rank["overlap"]["right_after_step"]
        assert any(not torch.equal(overlap[n], plain[n]) for n in plain)
    sent_plain, stale = runs[0]["plain"]["export"], runs[0]["overlap"]["export_unsynced"]
    assert sent_plain and any(not torch.equal(stale[n], sent_plain[n]) for n in sent_plain)


def test_training_with_the_overlap_gives_the_same_losses_and_weights(runs):
    for rank in runs:
        assert rank["overlap"]["losses"] == rank["plain"]["losses"]
        _assert_equal_dicts(rank["overlap"]["final"], rank["plain"]["final"], "weights after the last step")


def test_the_weight_export_sends_the_fresh_weights(runs):
    assert runs[1]["plain"]["export"] == {} and runs[1]["overlap"]["export"] == {}  # DP rank 1 sends nothing
    _assert_equal_dicts(runs[0]["overlap"]["export"], runs[0]["plain"]["export"], "exported tensors")


def test_a_checkpoint_saved_right_after_a_step_holds_the_fresh_weights(runs):
    for rank in runs:
        _assert_equal_dicts(rank["overlap"]["checkpoint"], rank["plain"]["checkpoint"],
                            "checkpointed weights")


def test_a_forward_only_pass_after_a_step_runs_on_the_fresh_weights(runs):
    for rank in runs:
        torch.testing.assert_close(rank["overlap"]["logits"], rank["plain"]["logits"], rtol=0, atol=0)
        _assert_equal_dicts(rank["overlap"]["params_after_forward"],
                            rank["plain"]["params_after_forward"], "params after the forward-only pass")


def test_the_fused_lm_head_reads_the_gathered_output_weight(runs):
    for rank in runs:
        plain, overlap = rank["fused_plain"], rank["fused_overlap"]
        assert overlap["buckets"] == plain["buckets"] > 2  # the output weight's all-gather comes last
        assert overlap["losses"] == plain["losses"]
        _assert_equal_dicts(overlap["final"], plain["final"], "weights after fused-LM-head steps")
