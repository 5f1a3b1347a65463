"""`MegatronEngine`: forward/backward of Megatron GPTModel chunks with a caller-supplied loss.

The engine owns the parallel training mechanics and nothing about distillation:

* Megatron DDP around every model chunk (gradients summed over DP, because the caller's loss is
  already normalised by the *global* token count), optionally the distributed optimizer;
* `get_forward_backward_func()` for the schedule, so PP and interleaved VPP work unchanged; the
  model is called without labels and `loss_fn` receives this rank's vocab-parallel logits
  `[T, V_local]` (Megatron's built-in cross entropy is never used);
* clipping + optimizer step + LR schedule (`optim.clip_and_step`, correct on CPU too);
* forward-only mode (`optim=None`) for a Megatron teacher or evaluation;
* an optional dense teacher run inside the step (`engine/teacher_in_step.py`): its TP-sharded
  logits of each micro-batch reach `loss_fn` as the batch's `DenseTeacher`;
* the fused LM head (`engine/lm_head.py`): with `train_step(..., fused_lm_head=True)` (the run's
  loss plan decides, `losses/plan.py`) the chunks run without their output layer and `loss_fn`
  receives an `LmHeadInput` (hidden states + output-weight shard) instead of logits; an in-step
  teacher then hands over its hidden states + weight shard as a `HiddenTeacher`;
* a step whose loss or gradient norm is not finite is skipped (counted, never applied);
* MoE students: Megatron's router load-balancing loss when the model was built with a coefficient,
  scaled per step, and the `moe/*` router metrics (`engine/moe_stats.py`);
* checkpoints of model + optimizer + scheduler through `megatron.core.dist_checkpointing`
  (`engine/checkpoint.py`).

Precision: whatever the chunks were built with (`build_model` picks fp32 on CPU, bf16 on accelerators);
with bf16 the optimizer keeps fp32 main params.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import math
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from opkd_kernels.linear_kd_common import PAD_LOGIT
from opkd_mcore import platform
from opkd_mcore.config.schema import OptimSection
from opkd_mcore.engine.checkpoint import load_engine_checkpoint, save_engine_checkpoint
from opkd_mcore.engine.context_parallel import gather_cp_rows, shard_batch
from opkd_mcore.engine.lm_head import LmHeadInput, gpt_model, hidden_output, hidden_rows, output_weight
from opkd_mcore.engine.moe_stats import MoeStepStats
from opkd_mcore.engine.optim import build_optimizer, clip_and_step, ddp_config
from opkd_mcore.engine.packing import PackedBatch, pad_for_pipeline
from opkd_mcore.engine.response_pairing import gather_rows
from opkd_mcore.engine.teacher_in_step import PairedChunk, paired_chunks, unpair
from opkd_mcore.losses.span_teacher import CrossTokenizerTeacher
from opkd_mcore.losses.teacher_outputs import (
    INVALID_ROWS,
    PAD_ID,
    DenseTeacher,
    HiddenTeacher,
    MalformedTeacherOutputError,
)
from opkd_mcore.models.builder import layout_of

logger = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, PackedBatch], "tuple[torch.Tensor, dict[str, torch.Tensor | float]]"]


def _finalize_grads_without_token_scaling(model, num_tokens=None, **kwargs):
    """Megatron's grad finalisation (DP reduce, tied-embedding and layernorm reduces) without its
    division by the token count: the caller's loss is normalised already."""
    from megatron.core.distributed import finalize_model_grads

    return finalize_model_grads(unpair(model), num_tokens=None, **kwargs)


class MegatronEngine:
    """Train (or only run) the GPTModel chunks of this rank (one per VPP chunk)."""

    def __init__(self, model_chunks: Sequence[torch.nn.Module], optim: OptimSection | None = None, *,
                 mask_vocab_padding: bool = True, teacher=None):
        from megatron.core.utils import get_model_config

        if not model_chunks:
            raise ValueError("model_chunks: expected at least one model chunk, got none")
        self.optim_config = optim
        self.config = get_model_config(model_chunks[0])
        self.on_cpu = platform.is_cpu()
        self.device = platform.current_device()
        self.params_dtype = self.config.params_dtype
        self.vocab_size, self.padded_vocab_size = _vocab_sizes(model_chunks, mask_vocab_padding)
        self.optimizer = self.scheduler = None
        self.num_steps = 0
        self.num_skipped_steps = 0  # steps whose loss or gradient norm was not finite
        # an applied step with optim.overlap_param_gather leaves the chunks' params stale (`fresh_params`)
        self._params_stale = False
        self.teacher = teacher  # InStepTeacher or None
        if teacher is not None and self.vocab_size is not None and not teacher.own_vocabulary:
            teacher.vocab_size = min(teacher.vocab_size, self.vocab_size)
        # Pipeline stages exchange activations of one fixed shape: every micro-batch of a step is
        # padded to the longest (Megatron's shape exchange for variable lengths deadlocks in the
        # interleaved schedule and costs a round trip per micro-batch in the others).
        self.config.variable_seq_lengths = False
        self.pipelined = self.config.pipeline_model_parallel_size > 1
        self.cp = self.config.context_parallel_size
        if self.cp > 1 and self.pipelined:
            raise ValueError(f"model_chunks: context parallelism (cp={self.cp}) runs without pipeline stages "
                             f"here, got pp={self.config.pipeline_model_parallel_size}")
        if optim is None:
            self.model = list(model_chunks)
            for chunk in self.model:
                chunk.eval()
                chunk.requires_grad_(False)
        else:
            optim.validate()
            self.model = self._wrap_ddp(model_chunks, optim)
            self.optimizer, self.scheduler = build_optimizer(self.model, optim, self.params_dtype)

        self.moe_stats = MoeStepStats.attach(model_chunks, self.config) if optim is not None else None

    # ------------------------------------------------------------------ setup
    def _wrap_ddp(self, model_chunks, optim: OptimSection) -> list:
        from megatron.core.distributed import DistributedDataParallel

        # Megatron reads this when DDP is built: sum (not average) gradients over DP, and hand the
        # schedule's 3-tuple losses through unscaled.
        self.config.calculate_per_token_loss = True
        self.config.finalize_model_grads_func = _finalize_grads_without_token_scaling
        cfg = ddp_config(optim)
        wrapped = [DistributedDataParallel(self.config, cfg, chunk, disable_bucketing=i > 0)
                   for i, chunk in enumerate(model_chunks)]
        for chunk in wrapped:
            chunk.broadcast_params()  # every DP replica starts from the same weights
        if optim.overlap_grad_reduce:
            no_sync = [chunk.no_sync for chunk in wrapped]
            self.config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        return wrapped

    @property
    def is_last_stage(self) -> bool:
        from megatron.core import parallel_state as ps

        return ps.is_pipeline_last_stage(ignore_virtual=True)

    @property
    def lr(self) -> float:
        if self.optimizer is None:
            return 0.0
        return float(self.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------ forward step
    def _mask_padding(self, logits_local: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
        """Vocabulary columns >= `vocab_size` (padding; only on the last TP shards) get probability 0.

        Written in place outside autograd: an autograd op here would cost one more [T, V_local]
        buffer in backward, and the loss's gradient on those columns is exactly 0 anyway.
        """
        vocab_size = self.vocab_size if vocab_size is None else vocab_size
        if vocab_size is None or vocab_size >= self.padded_vocab_size:
            return logits_local
        from megatron.core import parallel_state as ps

        width = logits_local.shape[-1]
        real = vocab_size - ps.get_tensor_model_parallel_rank() * width
        if real < width:
            with torch.no_grad():
                logits_local[..., max(real, 0):].fill_(PAD_LOGIT)
        return logits_local

    @staticmethod
    def _rows(output_tensor: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """[1, T_padded, V_local] -> [T, V_local]; a view when there is no pipeline padding, so
        backward allocates nothing here."""
        if output_tensor.shape[1] == num_tokens:
            return output_tensor.squeeze(0)
        return output_tensor[0, :num_tokens]

    def _run_model(self, model, batch: PackedBatch, hidden: bool = False) -> torch.Tensor:
        """Logits of the last stage, or with `hidden` its final-norm hidden states (fused LM head)."""
        extra = {}
        if batch.teacher_tokens is not None:  # an in-step teacher on its own packing
            t = batch.teacher_tokens
            extra["teacher_input"] = (t.tokens.unsqueeze(0), t.position_ids.unsqueeze(0),
                                      t.packed_seq_params())

        def run():
            return model(batch.tokens.unsqueeze(0), batch.position_ids.unsqueeze(0), attention_mask=None,
                         packed_seq_params=batch.packed_seq_params(), **extra)
        if not hidden:
            return run()

        gpts = [gpt_model(model)] + ([model.teacher[0]] if isinstance(model, PairedChunk) else [])
        with hidden_output(*gpts):
            return run()

    def _lm_head_input(self, model, hidden_SBH: torch.Tensor, num_tokens: int):
        """The fused LM head's operands on the last stage: hidden rows [T, H] + output-weight shard."""
        from megatron.core import parallel_state as ps

        gpt = gpt_model(model)
        weight = self._gathered(output_weight(gpt))
        rows = hidden_rows(hidden_SBH, num_tokens, gpt, ps.get_tensor_model_parallel_group())
        # a wrapper that upcasts last-stage outputs (Megatron's Float16Module) would hand over float32
        rows = rows if rows.dtype == weight.dtype else rows.to(weight.dtype)
        # columns past the real vocabulary are padding, as `_mask_padding` treats materialised logits
        return LmHeadInput(rows, weight, self.vocab_size)

    def _teacher_hidden(self, model, hidden_SBH: torch.Tensor, num_tokens: int, dtype: torch.dtype):
        """The in-step teacher's hidden rows + output-weight shard, for the fused LM head."""
        from megatron.core import parallel_state as ps

        gpt = model.teacher[0]
        rows = hidden_rows(hidden_SBH, num_tokens, gpt, ps.get_tensor_model_parallel_group(), trainable=False)
        # a self teacher's output weight is the student's own
        weight = self._gathered(output_weight(gpt)).detach().to(dtype)
        return HiddenTeacher(rows.detach().to(dtype), weight, self.teacher.vocab_size)

    def _own_packing_teacher(self, model, hidden_SBH: torch.Tensor, batch: PackedBatch, dtype: torch.dtype,
                             fused_head: bool):
        """What the loss reads of an in-step teacher that ran on its own packing (`batch.teacher_tokens`,
        engine/teacher_in_step.py): its final-norm hidden rows `[M, H]`, paired with the student's rows
        by response position (`batch.teacher_index`: `[T, H]` gathered, never `[T, V]`) or, across
        tokenizers, kept in the teacher's layout for the span loss; then its output layer on those rows
        only (with the fused LM head, the rows and the output weight as they are)."""
        cross = isinstance(batch.teacher, CrossTokenizerTeacher)  # rows filled in here, paired by span
        weight_dtype = output_weight(model.teacher[0]).dtype
        hidden = self._teacher_hidden(model, hidden_SBH, batch.teacher_tokens.num_tokens,
                                      dtype if fused_head and not cross else weight_dtype)
        if batch.teacher_index is not None:
            hidden = gather_rows(hidden, batch.teacher_index)
        if fused_head and not cross:
            return hidden
        logits = torch.matmul(hidden.hidden, hidden.weight.t())  # the output layer's GEMM, on these rows
        rows = DenseTeacher(self._mask_padding(logits, self.teacher.vocab_size))
        return dataclasses.replace(batch.teacher, rows=rows) if cross else rows

    def _forward_step_func(self, loss_fn: LossFn | None, fused_head: bool = False):
        """Megatron's forward_step_func: returns (output, loss closure) for one micro-batch; with
        `fused_head` the last stage hands `loss_fn` an `LmHeadInput` instead of logits."""

        def forward_step(data_iterator, model):
            batch, model_input = next(data_iterator)
            # the model reads the batch itself unless it was padded: one copy of each tensor, not two
            on_device = batch.to(self.device)
            model_input = on_device if model_input is batch else model_input.to(self.device)
            batch = on_device
            output = self._run_model(model, model_input, hidden=fused_head)
            if isinstance(output, tuple):  # last stage of a step with the teacher in it
                output, teacher_out = output
                batch = copy.copy(batch)  # the engine's own copy: the caller's batch is not changed
                if batch.teacher_tokens is not None:  # it ran on its own packing
                    batch.teacher = self._own_packing_teacher(model, teacher_out, batch, output.dtype,
                                                              fused_head)
                elif fused_head:
                    batch.teacher = self._teacher_hidden(model, teacher_out, batch.num_tokens, output.dtype)
                else:
                    teacher_logits = self._rows(teacher_out, batch.num_tokens)
                    batch.teacher = DenseTeacher(self._mask_padding(teacher_logits, self.teacher.vocab_size))

            def loss_closure(output_tensor, non_loss_data: bool = False):
                if fused_head:  # [S, 1, H] hidden states: the loss applies the output layer itself
                    rows = self._lm_head_input(model, output_tensor, batch.num_tokens)
                    loss, metrics = loss_fn(rows, batch)
                    return self._reported(loss, metrics)
                # [1, T_padded, V_local] -> [T, V_local]: the pipeline padding is cut off here
                logits = self._mask_padding(self._rows(output_tensor, batch.num_tokens))
                if non_loss_data:
                    return logits.detach()
                loss, metrics = loss_fn(logits, batch)
                return self._reported(loss, metrics)

            return output, loss_closure
        return forward_step

    @staticmethod
    def _reported(loss, metrics):
        """Megatron's loss-closure triple: (loss, token count placeholder, reported metrics)."""
        if loss.dim() != 0:
            raise ValueError(f"loss_fn: expected a scalar loss, got shape {tuple(loss.shape)}")
        reported = {"train/loss": loss.detach().float()}
        reported.update({k: torch.as_tensor(v, device=loss.device).detach().float()
                         for k, v in metrics.items()})
        # the token count is a placeholder: the caller normalised already (see finalize above)
        return loss, torch.ones((), dtype=torch.int, device=loss.device), reported

    def _run_schedule(self, micro_batches: list[PackedBatch], loss_fn, forward_only: bool,
                      collect_logits: bool, with_teacher: bool = False, fused_lm_head: bool = False) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not micro_batches:
            raise ValueError("micro_batches: expected at least one PackedBatch, got none")
        for i, mb in enumerate(micro_batches):
            if not isinstance(mb, PackedBatch):
                raise ValueError(f"micro_batches[{i}]: expected a PackedBatch, got {type(mb).__name__}")
        pp = self.config.pipeline_model_parallel_size
        if len(self.model) > 1 and len(micro_batches) < pp:
            raise ValueError(f"micro_batches: the interleaved pipeline ({len(self.model)} chunks per stage) "
                             f"needs at least pp={pp} micro-batches, got {len(micro_batches)}")
        if not with_teacher and any(mb.teacher_tokens is not None for mb in micro_batches):
            raise ValueError("micro_batches: they carry an in-step teacher's own packing (teacher_tokens), "
                             "but this engine has no teacher in its step")
        micro_batches = self._shard(micro_batches)
        seq_length, inputs = self._model_inputs(micro_batches)
        # one iterator per VPP chunk: every chunk reads the same micro-batches in the same order
        iterators = [iter(list(zip(micro_batches, inputs))) for _ in self.model]
        model = self.model
        if with_teacher:
            model = paired_chunks(self.model, self.teacher, self.config)
        return get_forward_backward_func()(
            forward_step_func=self._forward_step_func(loss_fn, fused_lm_head),
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=model if len(model) > 1 else model[0],
            num_microbatches=len(micro_batches),
            seq_length=seq_length, micro_batch_size=1,
            forward_only=forward_only, collect_non_loss_data=collect_logits,
        )

    def _shard(self, micro_batches: list[PackedBatch]) -> list[PackedBatch]:
        """With context parallelism, this CP rank's share of each micro-batch (`engine/context_parallel.py`:
        load-balanced chunks of every sequence, per-token rows sliced alike); else the batches as given."""
        if self.cp == 1:
            return list(micro_batches)
        from megatron.core import parallel_state as ps

        multiple = self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1
        rank = ps.get_context_parallel_rank()
        return [mb if mb.context is not None else shard_batch(mb.to("cpu"), self.cp, rank, multiple)
                for mb in micro_batches]

    def _model_inputs(self, micro_batches: list[PackedBatch]) -> tuple[int, list[PackedBatch]]:
        """(the pipeline's activation length, what the model reads of each micro-batch): padded to one
        length for a pipeline, and to a multiple of TP with sequence parallelism (Megatron splits the
        sequence evenly over the TP ranks); the outputs' padding rows are cut off before the loss."""
        multiple = self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1
        # a teacher on its own packing shares the pipeline's one activation shape
        lengths = [max(mb.num_tokens, 0 if mb.teacher_tokens is None else mb.teacher_tokens.num_tokens)
                   for mb in micro_batches]
        seq_length = _round_up(max(lengths), multiple)
        if self.pipelined:
            return seq_length, [pad_for_pipeline(mb, seq_length) for mb in micro_batches]
        if multiple > 1:  # a CP rank's share is a multiple already (`_shard`)
            return seq_length, [mb if n % multiple == 0 else pad_for_pipeline(mb, _round_up(n, multiple))
                                for mb, n in zip(micro_batches, lengths)]
        return seq_length, list(micro_batches)

    # ------------------------------------------------------------------ public
    def train_step(self, micro_batches: list[PackedBatch], loss_fn: LossFn, *,
                   fused_lm_head: bool = False) -> dict[str, float]:
        """Forward + backward over `micro_batches`, then clip, step and advance the LR schedule.

        `loss_fn(logits_local [T, V_local], batch) -> (loss, metrics)`: `loss` is a scalar already
        normalised by the global token count (so gradients are summed over micro-batches and DP);
        `metrics` values must be additive the same way (they are summed over micro-batches and DP).
        Returns the same metrics dict on every rank: `train/loss`, the loss_fn metrics,
        `train/grad_norm`, `train/lr`, `train/update_applied`, `train/skipped_steps` (steps so far
        whose loss or gradient norm was not finite: those are never applied).
        With a teacher in the step, each batch's `teacher` is replaced by the teacher's logits.
        `fused_lm_head`: the last stage skips the output layer and `loss_fn` gets an `LmHeadInput`
        (hidden states + output-weight shard; an in-step teacher's as a `HiddenTeacher`).
        """
        if self.optimizer is None:
            raise RuntimeError("train_step: this engine is forward-only (built with optim=None)")
        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self.lr
        if self.moe_stats is not None:
            self.moe_stats.begin_step(len(micro_batches))
        if self.teacher is not None:
            self.teacher.acquire()
        try:
            per_micro_batch = self._run_schedule(micro_batches, loss_fn, forward_only=False,
                                                 collect_logits=False, with_teacher=self.teacher is not None,
                                                 fused_lm_head=fused_lm_head)
        finally:
            if self.teacher is not None:
                self.teacher.release()
        metrics = self._reduce_metrics(per_micro_batch)
        if self.moe_stats is not None:
            metrics.update(self.moe_stats.end_step())
        invalid = metrics.pop(INVALID_ROWS, 0.0)
        if invalid > 0:
            raise MalformedTeacherOutputError(
                f"teacher top-k rows: {invalid:.3g} of the step's response tokens (fraction) have ids "
                f"outside [0, {self.padded_vocab_size or 'V'}) other than the padding {PAD_ID}, NaN "
                "logprobs or an id twice in a row; no update applied")
        if metrics.get("teacher/nonfinite_rows", 0.0) > 0:
            raise MalformedTeacherOutputError(
                f"teacher {self.teacher.name}: NaN in its logits for {metrics['teacher/nonfinite_rows']:.3g} "
                "of the step's response tokens (fraction); no update applied")
        finite_loss = math.isfinite(metrics.get("train/loss", 0.0))
        applied, grad_norm = clip_and_step(self.optimizer, self.optim_config.clip_grad, self.on_cpu,
                                           skip=not finite_loss)
        if applied:
            self.scheduler.step(increment=1)
            self.num_steps += 1
            self._params_stale = self.optim_config.overlap_param_gather
            if self.teacher is not None:  # a teacher that follows the student (EMA) takes the new weights
                self.fresh_params()
                self.teacher.after_update(self.model)
        elif not finite_loss or not math.isfinite(grad_norm):
            self.num_skipped_steps += 1
            logger.warning("step skipped: loss %s, gradient norm %s (not finite); no update applied",
                           metrics.get("train/loss"), grad_norm)
        metrics.update({"train/grad_norm": grad_norm, "train/lr": lr,
                        "train/update_applied": float(applied),
                        "train/skipped_steps": float(self.num_skipped_steps)})
        return metrics

    @torch.no_grad()
    def forward_logits(self, batch: PackedBatch) -> torch.Tensor | None:
        """Vocab-parallel logits `[T, V_local]` of one packed batch on the last PP stage, else None."""
        return self.forward_logits_many([batch])[0]

    @torch.no_grad()
    def forward_logits_many(self, batches: list[PackedBatch]) -> list[torch.Tensor | None]:
        """`forward_logits` for several batches in one pipeline pass (one micro-batch each)."""
        from megatron.core import parallel_state as ps

        self.fresh_params()
        was_training = [chunk.training for chunk in self.model]
        for chunk in self.model:
            chunk.eval()
        batches = self._shard(batches)
        try:
            outputs = self._run_schedule(batches, None, forward_only=True, collect_logits=True)
        finally:
            for chunk, mode in zip(self.model, was_training):
                chunk.train(mode)
        if not self.is_last_stage:
            return [None] * len(batches)
        if self.cp > 1:  # every CP rank's rows, back in the batch's order
            group = ps.get_context_parallel_group()
            return [gather_cp_rows(out, mb.context, group) for out, mb in zip(outputs, batches)]
        return list(outputs)

    def _reduce_metrics(self, per_micro_batch: list[dict]) -> dict[str, float]:
        """Sum micro-batch metrics, sum over DP, and hand the result from the last PP stage to all."""
        from megatron.core import parallel_state as ps

        names, values = [], None
        if self.is_last_stage and per_micro_batch:
            names = sorted(per_micro_batch[0])
            values = torch.stack([sum(mb[n] for mb in per_micro_batch) for n in names]).to(self.device)
            dp_group = ps.get_data_parallel_group(with_context_parallel=True)
            if dist.get_world_size(dp_group) > 1:
                dist.all_reduce(values, group=dp_group)
        pp_group = ps.get_pipeline_model_parallel_group()
        if dist.get_world_size(pp_group) > 1:
            box = [(names, None if values is None else values.cpu().tolist())]
            dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                       group=pp_group)
            names, flat = box[0]
            return dict(zip(names, flat))
        return dict(zip(names, values.cpu().tolist())) if values is not None else {}

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self, ckpt_dir: str) -> None:
        """Model + optimizer + scheduler state as a Megatron distributed checkpoint (collective)."""
        self.fresh_params()
        save_engine_checkpoint(self, ckpt_dir)

    def load_checkpoint(self, ckpt_dir: str) -> None:
        """Restore what `save_checkpoint` wrote; any TP/PP layout may load it (collective)."""
        load_engine_checkpoint(self, ckpt_dir)
        self._params_stale = False  # every rank loaded whole parameters

    def _gathered(self, param: torch.Tensor) -> torch.Tensor:
        """`param` once its overlapped all-gather has landed. The fused LM head reads the output weight
        without running the output layer, whose forward pre-hook would otherwise wait for it."""
        if self.optim_config is not None and self.optim_config.overlap_param_gather:
            for chunk in self.model:
                bucket_group = chunk.param_to_bucket_group.get(param)
                if bucket_group is not None:  # dispatches the all-gather if no hook has yet
                    bucket_group.finish_param_sync()
        return param

    def fresh_params(self) -> None:
        """Make the chunks' parameters those of the last optimizer step, before anything reads them.

        With `optim.overlap_param_gather` an optimizer step updates only this DP rank's shard of the
        params and leaves the all-gather of the rest to the next forward's pre-hooks, so between a step
        and the next forward the weights are stale. Everything that reads them in between (the weight
        export into the rollout engine, checkpoints, an HF export, an EMA teacher, a forward-only pass)
        calls this first. Collective over the data-parallel group (every DP rank calls it at the same
        point); a no-op when the params are current (no overlap, or no step since the last call).
        """
        if not self._params_stale:
            return
        for chunk in self.model:
            chunk.start_param_sync(force_sync=True)  # waits for one in flight, else gathers now
        self._params_stale = False

    def parameters(self) -> Iterable[torch.nn.Parameter]:
        for chunk in self.model:
            yield from chunk.parameters()


def _vocab_sizes(model_chunks, mask_vocab_padding: bool) -> tuple[int | None, int | None]:
    """(real, padded) vocabulary sizes from the chunks' `ModelLayout`; (None, None) if unknown."""
    if not mask_vocab_padding:
        return None, None

    try:
        layout = layout_of(model_chunks)
    except ValueError:
        logger.warning("model_chunks carry no ModelLayout: padded vocabulary columns are not masked")
        return None, None
    return layout.vocab_size, layout.padded_vocab_size


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
