"""Truncated importance weights for samples past the staleness bound (`run.stale_policy: truncated_is`).

A stale sample was drawn from an older student (the sampler's logprobs say how likely each token
was then). Its distillation loss is weighted by min(r, C), with r the sequence's length-normalised
importance ratio exp(mean_t [log pi_now(y_t) - log pi_sampler(y_t)]) and C = `run.is_truncation`:
the geometric mean keeps long responses from collapsing to weight 0 or exploding, and the cap bounds
the variance (truncated IS). The ratio is detached: it reweights samples, it is not trained through.

Both logprobs are at temperature 1 (the rollout engine returns raw logprobs; the student's come from
its unscaled logits), so they compare like with like at any sampling temperature.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from opkd_mcore.config.schema import ParallelSection
from opkd_mcore.engine.micro_batches import micro_batch_groups
from opkd_mcore.engine.packing import pack_sequences
from opkd_mcore.train.stages import ShardLayout


@torch.no_grad()
def truncated_is_weights(engine, samples: list, stale: list[bool], par: ParallelSection, shard: ShardLayout,
                         cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-sample weights (1 for fresh samples and for other DP ranks' samples) and metrics.

    Collective over this rank's model-parallel group: every rank of a DP replica runs the same
    forward-only pass over its stale samples, the last pipeline stage turns logits into weights and
    hands them to the other stages.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    weights = torch.ones(len(samples), dtype=torch.float32)
    # the samples this rank trains (the same split as the training step), in its micro-batches
    groups = micro_batch_groups([len(s.sequence) for s in samples], shard.dp_size, shard.dp_rank,
                                micro_batch_size=par.micro_batch_size,
                                max_tokens=par.max_tokens_per_micro_batch)
    groups = [g for g in ([i for i in group if stale[i]] for group in groups) if g]
    mine = [i for g in groups for i in g]
    if not mine:
        return weights, {}
    batches = [pack_sequences([samples[i].sequence for i in g], [len(samples[i].prompt_ids) for i in g],
                              sampler_logprobs=[samples[i].response_logprobs for i in g]) for g in groups]
    outputs = engine.forward_logits_many(batches)
    found = torch.zeros(len(mine), dtype=torch.float32, device=engine.device)
    if engine.is_last_stage:
        ratios = []
        for batch, logits in zip(batches, outputs):
            batch = batch.to(logits.device)
            targets = torch.roll(batch.tokens, -1)
            lp = -tensor_parallel.vocab_parallel_cross_entropy(logits.unsqueeze(1).float(),
                                                               targets.unsqueeze(1)).squeeze(1)
            log_ratio = (lp - batch.sampler_logprobs.float()) * batch.loss_mask
            zeros = torch.zeros(batch.num_sequences, device=lp.device)
            per_seq = zeros.index_add(0, batch.seq_ids, log_ratio)
            tokens = zeros.index_add(0, batch.seq_ids, batch.loss_mask)
            ratios.append(torch.exp(per_seq / tokens.clamp_min(1)))
        found = torch.cat(ratios).to(found.device)
    pp_group = ps.get_pipeline_model_parallel_group()
    if dist.get_world_size(pp_group) > 1:
        dist.broadcast(found, src=ps.get_pipeline_model_parallel_last_rank(), group=pp_group)
    ratio = found.cpu()
    weights[mine] = ratio.clamp(max=cap)
    metrics = {"async/is_ratio_mean": float(ratio.mean()), "async/is_truncated_fraction":
               float((ratio > cap).float().mean())}
    return weights, metrics
