"""MegatronEngine on CPU: real Megatron-core, real processes over gloo (tests/_dist.py).

The training runs start from a tiny Qwen3 HF checkpoint; the reference is the same model in
`transformers` trained with `torch.optim.AdamW` in float64 on one process (an implementation that
shares no code with Megatron), so a wrong gradient, a missing DP/TP reduction, a wrong clip or a
wrong LR schedule shows up as a different loss curve.
"""
from __future__ import annotations

import pytest
import torch

from opkd_mcore.engine.packing import PackedBatch, pack_sequences, split_by_token_budget
from tests._dist import run_distributed

megatron = pytest.importorskip("megatron.core")

ALPHABET = "0123456789+= "
# three sequences (prompt, response) over the char vocabulary: ids 3.. are characters
SEQUENCES = [[1, 4, 5, 14, 6, 15, 9, 2], [1, 7, 8, 14, 9, 15, 10, 11, 2], [1, 3, 3, 14, 12, 15, 13, 2]]
PROMPT_LENGTHS = [4, 4, 3]
STEPS = 4
LR = 5e-3
CLIP = 0.05  # small enough that clipping is active on every step


def _micro_batches():
    """Two micro-batches: sequences 0+1 packed together, sequence 2 alone."""
    return [pack_sequences([SEQUENCES[i] for i in group], [PROMPT_LENGTHS[i] for i in group])
            for group in ([0, 1], [2])]


def _global_loss_tokens() -> int:
    return sum(mb.num_loss_tokens for mb in _micro_batches())


def _ce_loss_fn(num_global_tokens: int):
    """Cross entropy on the vocab-parallel logits, normalised by the global response-token count."""
    from megatron.core import tensor_parallel

    def loss_fn(logits, batch: PackedBatch):
        targets = torch.roll(batch.tokens, -1)  # position t predicts token t+1
        per_token = tensor_parallel.vocab_parallel_cross_entropy(logits.float().unsqueeze(1),
                                                                 targets.unsqueeze(1)).squeeze(1)
        loss = (per_token * batch.loss_mask).sum() / num_global_tokens
        return loss, {"train/loss_tokens": batch.loss_mask.sum() / 1.0}
    return loss_fn


CASES = {  # name -> (tp, pp, vpp, use_distributed_optimizer); the rest of the 2 ranks is data parallel
    "tp2": (2, 1, None, False),
    "pp2": (1, 2, None, False),
    "pp2vpp2": (1, 2, 2, False),
    "dp2_distopt": (1, 1, None, True),
}


def _my_micro_batches():
    """This DP rank's share of the micro-batches (all of them when DP=1)."""
    from megatron.core import parallel_state as ps

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    return _micro_batches()[dp_rank::dp_size]


def _train_case(name, hf_dir, ckpt_root):
    from opkd_mcore.config.schema import OptimSection
    from opkd_mcore.engine.megatron_engine import MegatronEngine
    from opkd_mcore.models import build_model, load_hf_config, load_hf_weights
    from opkd_mcore.platform import ParallelConfig, destroy_parallel, init_parallel

    tp, pp, vpp, distributed_optimizer = CASES[name]
    init_parallel(ParallelConfig(tp=tp, pp=pp, vpp=vpp, seed=7))
    try:
        chunks = build_model(load_hf_config(hf_dir))
        load_hf_weights(chunks, hf_dir)
        engine = MegatronEngine(chunks, OptimSection(lr=LR, clip_grad=CLIP, weight_decay=0.1,
                                                    use_distributed_optimizer=distributed_optimizer))
        loss_fn = _ce_loss_fn(_global_loss_tokens())
        history = [engine.train_step(_my_micro_batches(), loss_fn) for _ in range(STEPS // 2)]
        ckpt = f"{ckpt_root}/{name}"
        engine.save_checkpoint(ckpt)
        history += [engine.train_step(_my_micro_batches(), loss_fn) for _ in range(STEPS // 2)]
        engine.load_checkpoint(ckpt)  # rewind: model, optimizer moments, LR schedule, step count
        resumed = [engine.train_step(_my_micro_batches(), loss_fn) for _ in range(STEPS // 2)]
        result = {"history": history, "resumed": resumed, "num_steps": engine.num_steps}
        if name in ("tp2", "pp2"):
            result["teacher_logits"] = _teacher_logits(hf_dir)
        if name == "tp2":
            result["errors"] = _engine_errors(engine, loss_fn)
        return result
    finally:
        destroy_parallel()


def _teacher_logits(hf_dir):
    """Forward-only engine (a Megatron teacher): full-vocab logits of micro-batch 0, last stage only."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from opkd_mcore.engine.megatron_engine import MegatronEngine
    from opkd_mcore.models import build_model, load_hf_config, load_hf_weights

    chunks = build_model(load_hf_config(hf_dir))
    load_hf_weights(chunks, hf_dir)
    teacher = MegatronEngine(chunks, optim=None)
    local = teacher.forward_logits(_micro_batches()[0])
    if local is None:
        return None
    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _engine_errors(engine, loss_fn) -> dict[str, str]:
    """Messages of the errors the engine raises for bad calls (checked in the parent)."""
    from opkd_mcore.engine.megatron_engine import MegatronEngine

    def message(call):
        try:
            call()
        except (ValueError, RuntimeError) as err:
            return f"{type(err).__name__}: {err}"
        return "no error"

    teacher = MegatronEngine(engine.model, optim=None)
    return {
        "empty": message(lambda: engine.train_step([], loss_fn)),
        "not_packed": message(lambda: engine.train_step([{"tokens": [1, 2]}], loss_fn)),
        "vector_loss": message(lambda: engine.train_step(
            _micro_batches(), lambda logits, batch: (logits.sum(-1), {}))),
        "forward_only": message(lambda: teacher.train_step(_micro_batches(), loss_fn)),
    }


def _train_worker(rank, world, names, hf_dir, ckpt_root):
    return {name: _train_case(name, hf_dir, ckpt_root) for name in names}


def _hf_reference_losses(hf_dir: str) -> tuple[list[float], list[float]]:
    """Same steps with transformers + torch AdamW in float64: (losses, grad norms before clipping)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64)
    # Megatron's default param groups: no weight decay on biases and 1-D tensors (norms)
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=LR, betas=(0.9, 0.999), eps=1e-8)
    n_global = _global_loss_tokens()
    losses, norms = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        total = 0.0
        for seq, p in zip(SEQUENCES, PROMPT_LENGTHS):
            ids = torch.tensor([seq])
            logits = model(ids).logits[0, :-1]
            loss = torch.nn.functional.cross_entropy(logits[p - 1:], ids[0, p:], reduction="sum") / n_global
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        losses.append(total)
    return losses, norms


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model

    out = tmp_path_factory.mktemp("qwen3")
    # vocab 255 is not divisible by TP=2: the padded column must not change the loss
    shape = TinyModelShape(vocab_size=255, num_layers=4, hidden_size=128, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, intermediate_size=256)
    return str(save_tiny_hf_model(str(out), "qwen3", shape, seed=3, alphabet=ALPHABET, init_std=0.05))


@pytest.fixture(scope="module")
def reference(qwen3_dir):
    return _hf_reference_losses(qwen3_dir)


def _check_against_reference(history, reference):
    ref_losses, ref_norms = reference
    losses = [h["train/loss"] for h in history]
    norms = [h["train/grad_norm"] for h in history]
    assert losses[-1] < losses[0], f"loss did not go down: {losses}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=2e-3, atol=1e-5)
    assert all(h["train/update_applied"] == 1.0 for h in history)
    assert history[0]["train/loss_tokens"] == float(_global_loss_tokens())


@pytest.fixture(scope="module")
def trained(qwen3_dir, tmp_path_factory):
    """All layouts in ONE pair of processes (spawning + importing Megatron dominates on CPU)."""
    ckpt_root = str(tmp_path_factory.mktemp("engine_ckpt"))
    return run_distributed(_train_worker, 2, list(CASES), qwen3_dir, ckpt_root)


@pytest.mark.parametrize("name", list(CASES))
def test_train_steps_match_hf_adamw(trained, reference, name):
    results = [per_rank[name] for per_rank in trained]
    for result in results:  # every rank reports the same metrics
        assert result["history"] == results[0]["history"]
    _check_against_reference(results[0]["history"], reference)


@pytest.mark.parametrize("name", list(CASES))
def test_checkpoint_resume_reproduces_steps(trained, name):
    result = trained[0][name]
    assert result["num_steps"] == STEPS
    # after restoring step STEPS//2, the next steps repeat exactly (optimizer moments + LR restored)
    assert result["resumed"] == result["history"][STEPS // 2:]


@pytest.mark.parametrize("name", ["tp2", "pp2"])
def test_forward_only_logits_match_hf(trained, qwen3_dir, name):
    """Packed forward of a teacher engine == separate HF forwards; padded vocab column masked."""
    from transformers import AutoModelForCausalLM

    from opkd_kernels.linear_kd_common import PAD_LOGIT

    logits = [per_rank[name]["teacher_logits"] for per_rank in trained]
    logits = [x for x in logits if x is not None]
    assert logits, "no rank returned logits"
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = torch.cat([model(torch.tensor([SEQUENCES[i]])).logits[0] for i in (0, 1)])
    vocab = expected.shape[-1]
    for got in logits:
        width = 256 if CASES[name][0] == 2 else vocab  # TP=2 pads 255 up to 256
        assert got.shape == (expected.shape[0], width)
        torch.testing.assert_close(got[:, :vocab], expected, rtol=1e-4, atol=1e-4)
        assert bool((got[:, vocab:] == PAD_LOGIT).all())


def test_engine_rejects_bad_calls(trained):
    errors = trained[0]["tp2"]["errors"]
    assert errors["empty"].startswith("ValueError: micro_batches: expected at least one")
    assert errors["not_packed"].startswith("ValueError: micro_batches[0]: expected a PackedBatch")
    assert errors["vector_loss"].startswith("ValueError: loss_fn: expected a scalar loss")
    assert errors["forward_only"].startswith("RuntimeError: train_step: this engine is forward-only")


@pytest.mark.parametrize("field,value,match", [
    ("lr", 0.0, "optim.lr"),
    ("min_lr", 1.0, "optim.min_lr"),
    ("adam_beta2", 1.0, "optim.adam_beta2"),
    ("clip_grad", -1.0, "optim.clip_grad"),
    ("lr_decay_style", "step", "optim.lr_decay_style"),
    ("lr_decay_style", "cosine", "optim.lr_decay_steps"),
])
def test_optim_config_rejects_bad_values(field, value, match):
    from opkd_mcore.config.schema import OptimSection

    with pytest.raises(ValueError, match=match):
        OptimSection(**{field: value}).validate()


def test_pack_sequences_layout():
    batch = pack_sequences([[1, 2, 3, 4], [5, 6, 7]], [2, 1], sampler_logprobs=[[-0.5, -0.25], [-1.0, -2.0]])
    assert batch.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert batch.cu_seqlens.tolist() == [0, 4, 7]
    # position t predicts token t+1: sequence 0 response is tokens 3,4 -> positions 1,2
    assert batch.loss_mask.tolist() == [0, 1, 1, 0, 1, 1, 0]
    assert batch.sampler_logprobs.tolist() == [0, -0.5, -0.25, 0, -1.0, -2.0, 0]
    assert batch.seq_ids.tolist() == [0, 0, 0, 0, 1, 1, 1]
    params = batch.packed_seq_params()
    assert params.qkv_format == "thd" and params.max_seqlen_q == 4
    # moving keeps the host-side length and every tensor, and copies rather than aliases the batch
    moved = batch.to("cpu")
    assert moved is not batch and moved.max_seqlen == 4 and moved.packed_seq_params().max_seqlen_kv == 4
    assert torch.equal(moved.tokens, batch.tokens) and torch.equal(moved.cu_seqlens, batch.cu_seqlens)


@pytest.mark.parametrize("kwargs,match", [
    (dict(sequences=[[1, 2]], prompt_lengths=[3]), r"prompt_lengths\[0\]"),
    (dict(sequences=[[1, 2]], prompt_lengths=[1, 1]), "prompt_lengths"),
    (dict(sequences=[], prompt_lengths=[]), "sequences"),
    (dict(sequences=[[1, 2, 3]], prompt_lengths=[1], sampler_logprobs=[[0.0]]), r"sampler_logprobs\[0\]"),
])
def test_pack_sequences_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pack_sequences(**kwargs)


def test_packed_batch_rejects_inconsistent_tensors():
    good = pack_sequences([[1, 2, 3]], [1])
    with pytest.raises(ValueError, match="cu_seqlens"):
        PackedBatch(tokens=good.tokens, position_ids=good.position_ids,
                    cu_seqlens=torch.tensor([0, 2], dtype=torch.int32), loss_mask=good.loss_mask)
    with pytest.raises(ValueError, match="loss_mask"):
        PackedBatch(tokens=good.tokens, position_ids=good.position_ids, cu_seqlens=good.cu_seqlens,
                    loss_mask=torch.ones(2))


def test_split_by_token_budget():
    assert split_by_token_budget([3, 4, 2, 9, 1], 7) == [[0, 1], [2], [3], [4]]
    with pytest.raises(ValueError, match="max_tokens"):
        split_by_token_budget([1], 0)
