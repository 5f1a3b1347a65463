"""`tools/bench_models.py --moe`: one MoE student trained for real at EP=N (see that file's docstring)."""
from __future__ import annotations

import json
import os
import tempfile

from bench_common import fusions_chosen, record, run_metadata, time_it  # tools/ is on the path: bench_models.py runs this

from opkd_mcore.config.schema import OptimSection
from opkd_mcore.platform.profiling import profiled


def _peak_memory_gib(on_gpu: bool) -> float:
    import resource

    import torch

    if on_gpu:
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def optim_section(args):
    """The engine's optimizer options of `--distributed-optimizer` / `--overlap`."""
    sharded = args.distributed_optimizer or args.overlap
    return OptimSection(lr=1e-5, clip_grad=1.0, use_distributed_optimizer=sharded,
                        overlap_grad_reduce=args.overlap, overlap_param_gather=args.overlap)


def optimizer_name(args) -> str:
    """The table's name of the optimizer variant."""
    if args.overlap:
        return "distributed+overlap"
    return "distributed" if args.distributed_optimizer else "replicated"


def _loss_fn(num_global_tokens: int):
    """Forward KL to the batch's dense teacher through `kd_loss` (fused kernels where built)."""
    from opkd_mcore.losses import kd_loss

    def loss_fn(logits, batch):
        from megatron.core import parallel_state as ps

        per_token = kd_loss(logits, batch.teacher, tp_group=ps.get_tensor_model_parallel_group(),
                            validate=False)
        return (per_token * batch.loss_mask).sum() / num_global_tokens, {}
    return loss_fn


def run_moe(args) -> None:
    """One row per experts implementation of `--moe-experts`, each a fresh model and engine on the
    same shape and batches. Not everything of one model is freed before the next is built, so a later
    row's peak memory can include an earlier one's: `lane.sh moe` runs one implementation per process."""
    import gc

    import torch
    import torch.distributed as dist

    from opkd_mcore.platform import ParallelConfig, destroy_parallel, init_parallel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    ep = args.ep or world // (args.etp or args.tp or 1)
    init_parallel(ParallelConfig(tp=args.tp or 1, ep=ep, etp=args.etp))
    rows = []
    for impl in [s.strip() for s in args.moe_experts.split(",") if s.strip()]:
        try:
            rows.append(_run_one(args, ep, impl))
        except ValueError as err:  # this machine cannot run it (e.g. te_grouped without TE): a row says why
            rows.append({"moe_experts": impl, "error": str(err)})
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        meta = run_metadata(device=next((r["device"] for r in rows if "device" in r), None))
        record(args.results, meta, rows)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows} if len(rows) > 1 else {**rows[0], "meta": meta},
                          f, indent=2)
    destroy_parallel(destroy_process_group=True)


def _run_one(args, ep: int, moe_experts: str) -> dict:
    import torch
    import torch.distributed as dist

    from opkd_mcore.engine.megatron_engine import MegatronEngine
    from opkd_mcore.engine.packing import pack_sequences
    from opkd_mcore.losses import DenseTeacher
    from opkd_mcore.models import build_model, hf_weight_metadata
    from opkd_mcore.models.tiny import TinyModelShape, tiny_hf_config
    from opkd_mcore.platform import current_device

    shape = TinyModelShape(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                           num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                           head_dim=args.head_dim, max_position_embeddings=max(args.seq, 4096),
                           extra=dict(num_experts=args.experts, num_experts_per_tok=args.topk,
                                      moe_intermediate_size=args.moe_ffn, norm_topk_prob=True))
    fused = fusions_chosen(args.moe_fusions, "--moe-fusions")
    chunks = build_model(tiny_hf_config("qwen3_moe", shape), moe_aux_loss_coeff=args.aux_coef,
                         moe_experts=moe_experts, moe_router_force_load_balancing=args.balanced_routing,
                         moe_permute_fusion=fused, moe_router_fusion=fused)
    experts_module = type(chunks[0].decoder.layers[0].mlp.experts).__name__
    num_params = sum(torch.Size(m.shape).numel() for m in hf_weight_metadata(chunks))
    local_params = sum(p.numel() for p in chunks[0].parameters())
    engine = MegatronEngine(chunks, optim_section(args))
    device = current_device()
    gen = torch.Generator(device="cpu").manual_seed(dist.get_rank())
    batches = []
    for _ in range(args.micro_batch):  # one packed sequence per micro-batch; the teacher is fixed
        seq = torch.randint(0, args.vocab, (args.seq,), generator=gen).tolist()
        batch = pack_sequences([seq], [1])
        local_vocab = engine.padded_vocab_size // engine.config.tensor_model_parallel_size
        batch.teacher = DenseTeacher(logits=torch.randn(args.seq, local_vocab, generator=gen)
                                     .to(device, engine.params_dtype))
        batches.append(batch)
    dp = dist.get_world_size() // (args.tp or 1)
    loss_fn = _loss_fn(sum(b.num_loss_tokens for b in batches) * dp)
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    metrics = {}

    def step():
        metrics.update(engine.train_step(batches, loss_fn))

    timing = time_it(step, args.warmup, args.steps, torch.cuda.synchronize if on_gpu else None)
    if args.profile:  # every rank runs the step (collectives); rank 0 writes its table
        with profiled(f"{args.profile}_{moe_experts}" if dist.get_rank() == 0 else
                      os.path.join(tempfile.mkdtemp(), "rank"), trace=False):
            step()
            if on_gpu:
                torch.cuda.synchronize()
    peak = torch.tensor([_peak_memory_gib(on_gpu)], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    tokens = args.seq * args.micro_batch * dp
    return dict(
        device=torch.cuda.get_device_name() if on_gpu else "cpu", world_size=dist.get_world_size(),
        moe_experts=moe_experts, experts_module=experts_module,
        tp=args.tp or 1, ep=ep, etp=args.etp or args.tp or 1,
        experts=args.experts, topk=args.topk, layers=args.layers,
        params_billion=round(num_params / 1e9, 3), params_per_rank_billion=round(local_params / 1e9, 3),
        seq=args.seq, micro_batches_per_rank=args.micro_batch, tokens_per_rank=args.seq * args.micro_batch,
        tokens_per_step=tokens, optimizer=optimizer_name(args),
        routing="balanced" if args.balanced_routing else "router", moe_fusions=fused,
        dtype=str(engine.params_dtype).replace("torch.", ""),
        step_ms_median=round(timing.p50 * 1e3, 1), step_ms_p20=round(timing.p20 * 1e3, 1),
        step_ms_p80=round(timing.p80 * 1e3, 1), step_ms_min=round(min(timing.samples) * 1e3, 1),
        tokens_per_s=round(tokens / timing.p50),
        peak_mem_gib_max_rank=round(peak.item(), 2), loss=round(metrics["train/loss"], 4),
        **{k: round(v, 4) for k, v in metrics.items() if k.startswith("moe/")},
    )
