"""Forward + backward step time and peak memory of a Qwen3-shaped Megatron GPTModel.

Default shape: ~1.1B parameters (hidden 2048, 16 layers, 16 heads / 8 KV heads of dim 128,
FFN 6144, vocab 151936, tied embeddings), bf16, random weights, vocab-parallel cross entropy.
Launch with torchrun, one process per GPU (TP = number of processes by default):

    torchrun --nproc-per-node 2 tools/bench_models.py --out bench_models.json

Prints a table on rank 0 and writes the numbers as JSON (`--out`; `--results FILE` appends a row with
the run's metadata, tools/bench_common.py).

`--moe`: a Qwen3-30B-A3B-shaped MoE student (hidden 2048, 32 heads / 4 KV heads of dim 128, 128
experts of FFN 768, top-8, vocab 151936) with fewer layers (`--layers`, default 8), its experts
split over `--ep` ranks (default: the world size / `--etp`; `--etp N` splits each expert's FFN over
N ranks), trained by `MegatronEngine` for real: DDP, Adam with fp32 main params, the router
load-balancing loss (`--aux-coef`), and a forward-KL loss through `kd_loss` (fused kernels where
built) against a fixed random dense teacher. Reports step time, tokens/s over all ranks, peak memory
and the router metrics of the last step, for each experts implementation of `--moe-experts` (side by
side in one table):

    torchrun --nproc-per-node 2 tools/bench_models.py --moe --layers 8 --seq 4096 --out moe.json \
        --moe-experts sequential,torch_grouped,te_grouped

`--tokens-per-rank N` trains each rank on N tokens per step, as micro-batches of `--seq` tokens (what
the per-step costs, Adam and the DP gradient / param collectives, amortise over). The optimizer is
Megatron's Adam with DP-replicated state unless `--distributed-optimizer` (state sharded over DP)
or `--overlap` (sharded, with the DP gradient reduce-scatter overlapped with backward and the param
all-gather with the next forward: `optim.overlap_grad_reduce` + `optim.overlap_param_gather`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_models_moe, bench_common

from bench_common import add_results_argument, positive_int, record, run_metadata, time_it  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=positive_int, default=2048, help="hidden size")
    p.add_argument("--layers", type=positive_int, default=16, help="decoder layers")
    p.add_argument("--heads", type=positive_int, default=16, help="query heads")
    p.add_argument("--kv-heads", type=positive_int, default=8, help="key/value heads (GQA)")
    p.add_argument("--head-dim", type=positive_int, default=128, help="head dimension")
    p.add_argument("--ffn", type=positive_int, default=6144, help="SwiGLU intermediate size")
    p.add_argument("--vocab", type=positive_int, default=151936, help="vocabulary size")
    p.add_argument("--seq", type=positive_int, default=4096, help="tokens per sequence")
    p.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per step")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps")
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: world size)")
    p.add_argument("--out", default=None, help="JSON output path (rank 0)")
    add_results_argument(p)
    p.add_argument("--moe", action="store_true", help="Qwen3-30B-A3B-shaped MoE student (see above)")
    p.add_argument("--ep", type=int, default=None,
                   help="--moe: expert-parallel size (default: world size / --etp)")
    p.add_argument("--etp", type=int, default=None,
                   help="--moe: expert tensor-parallel size, each expert's FFN split over it (parallel.etp; "
                        "default: --tp)")
    p.add_argument("--experts", type=positive_int, default=128, help="--moe: routed experts")
    p.add_argument("--topk", type=positive_int, default=8, help="--moe: experts per token")
    p.add_argument("--moe-ffn", type=positive_int, default=768, help="--moe: FFN size of one expert")
    p.add_argument("--aux-coef", type=float, default=1e-3, help="--moe: router load-balancing loss weight")
    p.add_argument("--moe-experts", default="auto",
                   help="--moe: comma-separated experts implementations (model.moe_experts: auto, "
                        "te_grouped, torch_grouped, sequential), timed one after the other on the same "
                        "shape and batches, one table row each")
    p.add_argument("--tokens-per-rank", type=int, default=None,
                   help="--moe: tokens per rank per step, as micro-batches of --seq tokens (a multiple of "
                        "--seq; default: --seq x --micro-batch)")
    p.add_argument("--distributed-optimizer", action="store_true",
                   help="--moe: shard Adam's state over DP (optim.use_distributed_optimizer)")
    p.add_argument("--overlap", action="store_true",
                   help="--moe: the distributed optimizer with optim.overlap_grad_reduce and "
                        "optim.overlap_param_gather (DP collectives overlapped with backward / forward)")
    p.add_argument("--moe-fusions", default="auto", choices=("auto", "on", "off"),
                   help="--moe: Megatron's fused token permutation and fused router top-k with its aux loss "
                        "(moe_permute_fusion, moe_router_fusion: Transformer Engine's kernels); auto: as "
                        "opkd train builds the model (on where TE builds it, models.builder.kernel_fusions)")
    p.add_argument("--balanced-routing", action="store_true",
                   help="--moe: Megatron's moe_router_force_load_balancing (random router logits, every expert "
                        "about the mean load), standing in for a trained router: a random-weight router sends "
                        "up to 13x the mean load to one expert, which a rank's all-to-all then waits on")
    p.add_argument("--profile", default=None,
                   help="--moe: trace one more step of each implementation; operators by GPU time into "
                        "PREFIX_<impl>.txt (rank 0)")
    args = p.parse_args()
    if args.moe:  # the Qwen3-30B-A3B attention shape unless given on the command line
        for key, value in (("heads", 32), ("kv_heads", 4), ("layers", 8)):
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    if args.tokens_per_rank is not None:
        if args.tokens_per_rank <= 0 or args.tokens_per_rank % args.seq:
            p.error(f"--tokens-per-rank: expected a positive multiple of --seq={args.seq}, "
                    f"got {args.tokens_per_rank}")
        args.micro_batch = args.tokens_per_rank // args.seq
    return args


def _peak_memory_gib(on_gpu: bool) -> float:
    """Peak GPU memory allocated by torch, or peak resident memory of the process on CPU."""
    import resource

    import torch

    if on_gpu:
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main():
    import torch
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    from opkd_mcore.models import build_model, hf_weight_metadata
    from opkd_mcore.models.tiny import TinyModelShape, tiny_hf_config
    from opkd_mcore.platform import ParallelConfig, current_device, destroy_parallel, init_parallel

    args = parse_args()
    if args.moe:
        from bench_models_moe import run_moe

        return run_moe(args)
    init_parallel(ParallelConfig(tp=args.tp or int(os.environ.get("WORLD_SIZE", "1"))))
    shape = TinyModelShape(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                           num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                           head_dim=args.head_dim, intermediate_size=args.ffn,
                           max_position_embeddings=max(args.seq, 4096), tie_word_embeddings=True)
    model = build_model(tiny_hf_config("qwen3", shape))[0]
    num_params = sum(torch.Size(m.shape).numel() for m in hf_weight_metadata([model]))
    device = current_device()
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), device=device, generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    pos = torch.arange(args.seq, device=device).unsqueeze(0).expand_as(inputs)

    losses = []

    def step():
        logits = model(input_ids=inputs, position_ids=pos, attention_mask=None)  # [b, s, V/tp]
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels).mean()
        loss.backward()
        losses.append(loss)

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    timing = time_it(step, args.warmup, args.steps, torch.cuda.synchronize if on_gpu else None,
                     after_each=lambda: model.zero_grad(set_to_none=True))
    peak = torch.tensor([_peak_memory_gib(on_gpu)], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    result = dict(
        device=torch.cuda.get_device_name() if on_gpu else "cpu", world_size=dist.get_world_size(),
        tp=args.tp or dist.get_world_size(),
        params_billion=round(num_params / 1e9, 3), seq=args.seq, micro_batch=args.micro_batch,
        dtype=str(model.config.params_dtype).replace("torch.", ""),
        step_ms_median=round(timing.p50 * 1e3, 1), step_ms_p20=round(timing.p20 * 1e3, 1),
        step_ms_p80=round(timing.p80 * 1e3, 1), step_ms_min=round(min(timing.samples) * 1e3, 1),
        tokens_per_s=round(args.seq * args.micro_batch / timing.p50),
        peak_mem_gib_max_rank=round(peak.item(), 2), loss=round(losses[-1].item(), 3),
    )
    if dist.get_rank() == 0:
        meta = run_metadata(device=result["device"])
        result["meta"] = meta
        record(args.results, meta, [{k: v for k, v in result.items() if k != "meta"}])
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
    destroy_parallel(destroy_process_group=True)


if __name__ == "__main__":
    main()
