"""Typed schema of one distillation run: one dataclass per component, one field per option.

Every default works on a CPU with a tiny model; the real-scale recipes in `configs/` override
what they need. Types here are what the loader checks (`opkd_mcore.config.loader`), so keep the
annotations to plain types: bool, int, float, str, `X | None`, `list[X]`, `dict[str, X]` and
nested dataclasses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
SUPPORTS = (None, "teacher", "union")
MASSES = ("renorm", "tail", "raw")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
LOSS_FORMS = ("logit", "policy_gradient")
KL_ESTIMATORS = ("k1", "k3")
CROSS_TOKENIZER_MODES = ("off", "exact", "uld", "gold")  # loss.cross_tokenizer
LOSS_IMPLS = ("auto", "reference", "fused", "triton", "cpp")
FUSED_LM_HEAD_MODES = ("auto", "on", "off")
LM_HEAD_ENGINES = ("auto", "tiles", "chunked", "rows")
TEACHER_BACKENDS = ("vllm", "remote", "hf", "megatron", "self")
# auto: dense for megatron and self, top-k for the others
TEACHER_OUTPUTS = ("auto", "topk", "dense", "hidden")
HIDDEN_BACKENDS = ("vllm", "remote")  # backends that can hand over final-norm hidden states
TEACHER_SCORINGS = ("auto", "prompt_logprobs", "device")  # how a vllm / remote teacher computes top-k rows
TOPK_BACKENDS = ("vllm", "remote", "hf", "self")
DENSE_BACKENDS = ("megatron", "hf", "self")  # backends that can hand the loss full-vocabulary logits
SELF_WEIGHTS = ("current", "initial", "ema")  # teacher.teachers.N.weights of a self teacher
ROUTINGS = ("data_source",)
SCHEDULES = ("sync", "one_step_off", "two_step_off", "async")
OVERLAPPED_SCHEDULES = ("one_step_off", "two_step_off", "async")  # need controller.kind: ray
STALE_POLICIES = ("drop", "truncated_is")
IN_FLIGHT_UPDATES = ("finish", "abort_resume")
CONTROLLERS = ("torchrun", "ray")
PLACEMENTS = ("disaggregated", "colocated")
DTYPES = ("float32", "bfloat16", "float16")
TASKS = ("addition",)
CHAT_TEMPLATES = ("auto", "always", "none")
SAMPLE_SEEDS = ("per_sample", "engine")  # rollout.sample_seeds
OVERLONG_POLICIES = ("error", "skip")  # data.overlong
MISSING_TEACHER_PROMPT_POLICIES = ("error", "skip")  # data.missing_teacher_prompt
LR_DECAY_STYLES = ("constant", "linear", "cosine")
BUILTIN_REWARDS = ("exact_match",)  # data.rewards values besides "module:function"
MOE_EXPERTS = ("auto", "te_grouped", "torch_grouped", "sequential")  # model.moe_experts
SEED_MAX = 2**31 - 1  # seeds reach numpy (32-bit) after Megatron and vLLM add rank/step offsets
RECOMPUTE_MODES = ("none", "selective", "full")  # parallel.recompute


@dataclass(kw_only=True)
class ModelSection:
    """The student: where it comes from and how it is held in Megatron."""

    student: str = ""
    """HF checkpoint directory of the student (initial weights, tokenizer)"""
    params_dtype: str = "float32"
    """Megatron parameter dtype: float32 | bfloat16 | float16"""
    moe_experts: str = "auto"
    """MoE students: the routed experts' implementation: auto | te_grouped (Transformer Engine's grouped
    GEMM) | torch_grouped (torch._grouped_mm) | sequential (Megatron's SequentialMLP, a loop over the
    experts). auto = torch_grouped where torch._grouped_mm runs for the dtype and expert shapes (CPU
    float32/bfloat16, H100/H200 bfloat16; the fastest measured), else te_grouped where TE is installed, else
    sequential;
    the choice and its reason are logged. Dense students ignore it"""


@dataclass(kw_only=True)
class ParallelSection:
    """How the student is split over the ranks, and the batch shapes of one optimizer step."""

    tp: int = 1
    """tensor parallel size (must divide attention and KV heads)"""
    pp: int = 1
    """pipeline parallel size (must divide the layer count)"""
    vpp: int | None = None
    """virtual pipeline chunks per stage; None = off (needs pp > 1)"""
    cp: int = 1
    """context parallel size: each packed sequence is cut into 2*cp chunks and rank r of the CP group takes
    chunks r and 2*cp-1-r (load balance under the causal mask); > 1 needs Transformer Engine (its attention
    does the CP exchange), pp = 1 and loss.aggregation token-mean"""
    ep: int = 1
    """expert parallel size: MoE students only, must divide the number of experts"""
    etp: int | None = None
    """expert tensor-parallel size (MoE); None = tp"""
    micro_batch_size: int = 1
    """sequences per packed micro-batch on each DP rank"""
    max_tokens_per_micro_batch: int | None = None
    """tokens per packed micro-batch on each DP rank (verl's dynamic batch size): the step's sequences are
    dealt to the DP ranks balanced by tokens, then into as few micro-batches as fit the budget (a longer
    sequence alone); None = micro_batch_size sequences per micro-batch"""
    global_batch_size: int = 8
    """sequences per optimizer step over all DP ranks"""
    world_size: int | None = None
    """ranks the run expects; None = the launcher's WORLD_SIZE (or 1)"""
    recompute: str = "none"
    """activation recompute of the student in backward: none | selective (the core attention of every
    layer, Megatron's default selective module) | full (each layer's whole forward: Megatron's uniform
    method, one layer per group); less memory for more time; an in-step teacher runs no backward and
    never recomputes"""
    sequence_parallel: bool = False
    """Megatron sequence parallelism for the student: norms and residuals split along the sequence over
    the TP ranks (activation memory / tp); needs Transformer Engine and tp > 1"""


@dataclass(kw_only=True)
class LossSection:
    """The objective. Field names match `kd_loss` / `policy_gradient_kd_loss` keywords."""

    form: str = "logit"
    """logit: kd_loss on distributions | policy_gradient: sampled-token KL as reward"""
    divergence: str = "forward_kl"
    """forward_kl | reverse_kl | jsd"""
    beta: float = 0.5
    """JSD interpolation; 0 and 1 are the unscaled forward / reverse KL"""
    temperature: float = 1.0
    """softmax temperature of student (and dense teacher) logits"""
    support: str | None = None
    """None: full vocab (dense teacher) | teacher | union (dense only)"""
    k: int | None = None
    """support size for a dense teacher's top-k / union support"""
    mass: str = "renorm"
    """renorm | tail | raw (forward KL only)"""
    coverage_coef: float = 0.0
    """TCAD coverage regulariser weight (-log of student mass on S)"""
    impl: str = "auto"
    """auto: fused kernels where built (Triton on GPU, C++ twin on CPU) | reference | fused | triton | cpp
    (error if unavailable)"""
    fused_lm_head: str | bool = "auto"
    """output layer + loss as one call, no logits: auto (on where Triton runs and the objective/teacher are
    covered) | on | off (YAML's bare on/off = true/false also work)"""
    lm_head_engine: str = "auto"
    """fused LM head: auto (GPU: rows; elsewhere the chunked twin) | tiles (Triton, logits only on chip) |
    chunked (library GEMMs into [N, <=4096] blocks) | rows (gradients in the forward from the aggregation's
    per-token weights: logits formed once, chunk by chunk of rows; any device); without Triton, auto /
    chunked run the chunked twin"""
    lm_head_chunk_mb: int | None = None
    """rows engine: MiB of one chunk's logits (student + dense teacher); None = 1280 off CPU (2048 rows at
    V=151936 bf16), 32 on CPU; smaller trades speed for memory"""
    aggregation: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum"""
    confidence_alpha: float = 0.0
    """TCAD teacher-confidence sequence weights; 0 = uniform"""
    kl_estimator: str = "k3"
    """policy-gradient form: k1 | k3 sampled-token KL estimator"""
    pg_coef: float = 1.0
    """policy-gradient form: advantage = -pg_coef * sampled KL"""
    clip_eps: float = 0.2
    """policy-gradient form: PPO clip range"""
    task_reward_coef: float = 0.0
    """policy-gradient form: weight of task-reward (GRPO) advantages"""
    moe_aux_loss_coef: float = 0.0
    """MoE students: router load-balancing loss weight (Megatron's aux_loss); 0 = off"""
    cross_tokenizer: str | bool = "off"
    """a teacher with another tokenizer: off (the vocabularies must match; YAML's bare off works) | exact |
    uld | gold. The response
    is re-tokenized with the teacher's tokenizer and aligned by character spans; exact: the divergence on 1:1
    spans of the same token (teacher top-k mapped to student ids); uld: sorted-probability distance on every
    span; gold: exact where the tokens map, uld elsewhere (docs/losses.md, "Across tokenizers")"""
    gold_exact_weight: float = 1.0
    """cross_tokenizer: gold: weight of the exact term (1:1 spans of the same token)"""
    gold_uld_weight: float = 1.0
    """cross_tokenizer: gold: weight of the ULD term (the other spans)"""


@dataclass(kw_only=True)
class RolloutSection:
    """Student sampling with vLLM (colocated with the trainer)."""

    prompts_per_step: int = 4
    """prompts drawn from the dataset per step"""
    n: int = 2
    """samples per prompt (a prompt's group)"""
    temperature: float = 1.0
    """sampling temperature"""
    top_p: float = 1.0
    """nucleus sampling"""
    top_k: int = -1
    """-1 = off, else >= 1"""
    max_new_tokens: int = 16
    """response length cap"""
    max_model_len: int = 256
    """vLLM context length"""
    gpu_memory_utilization: float = 0.3
    """vLLM share of accelerator memory, in (0, 1] (ignored on CPU)"""
    enforce_eager: bool = True
    """no graph capture: faster start, needed on CPU"""
    seed: int = 0
    """vLLM sampling seed, 0..SEED_MAX (offset by step so every step differs)"""
    sample_seeds: str = "per_sample"
    """per_sample: every sample is a vLLM request of its own, seeded from its prompt's seed (the same samples
    whatever the batching, schedule or resume; vLLM's V1 sampler then draws each request's noise in a kernel
    of its own per decode step) | engine: a prompt's n samples are one request drawn from the engine's
    stream seeded by `seed`, as TRL samples (one noise kernel per step; the same samples only for the same
    batches on the same engine)"""
    engine_in_process: bool = False
    """vLLM's engine core (scheduler, output processing) and, at TP=1, its model worker in the rollout's
    own process, as TRL's colocated mode runs it: no message between processes per decode step, but the
    output processing of a step no longer overlaps the next one. controller.kind: ray only (the rollout
    actor): under torchrun the worker would join the trainer's torch.distributed world"""


@dataclass(kw_only=True)
class TeacherEndpoint:
    """One teacher: a backend and where it lives."""

    name: str = "teacher"
    """label used in metrics and routing"""
    backend: str = "vllm"
    """vllm (in-process) | remote (OpenAI server) | hf (transformers): top-k; megatron: dense; self: the
    student itself (no model), usually with a prompt of its own (data.teacher_prompt_key / _template)"""
    model: str = ""
    """HF checkpoint directory (vllm, megatron, hf; remote: for output: hidden, or the teacher's tokenizer
    with loss.cross_tokenizer); empty for self"""
    url: str | None = None
    """base URL of the OpenAI server (remote)"""
    top_k: int = 16
    """logprobs per position for top-k backends"""
    data_sources: list[str] = field(default_factory=list)
    """routed here; empty = default teacher"""
    replica_urls: list[str] = field(default_factory=list)
    """more servers of this teacher (remote), load-balanced: each chunk of sequences goes to the least-loaded
    reachable replica"""
    output: str = "auto"
    """auto | topk | dense (megatron, hf, self) | hidden (vllm, remote: hidden states, the trainer applies the
    teacher's output weight from `model`). self: dense (auto) runs a no-grad forward of the student's chunks
    in its step; topk has the rollout engine score with prompt logprobs (torchrun, weights: current)"""
    scoring: str = "auto"
    """how a vllm or remote teacher computes top-k rows: device (output weight, log-softmax and top-k on the
    engine's device, packed tensors back; a remote one needs `opkd teacher-serve --scoring device`) |
    prompt_logprobs (vLLM's per-position prompt logprobs: any model vLLM runs, any stock server) | auto
    (vllm: device unless the checkpoint's logits are more than its output weight's product; remote: device
    when the server offers it)"""
    offload: bool = False
    """megatron, or self with weights initial | ema: the teacher's weights in host memory between steps"""
    weights: str = "current"
    """self: current (the student's weights now, no copy) | initial (a frozen copy of the starting weights:
    what backend megatron with model = model.student builds) | ema (a float32 moving average of the
    student's weights, sharded like it, updated after each optimizer step, kept in run checkpoints)"""
    ema_decay: float = 0.999
    """self, weights: ema: after each optimizer step ema = decay * ema + (1 - decay) * student; in (0, 1)"""
    dtype: str = "auto"
    """auto | float32 | bfloat16 | float16: the compute dtype of a vllm or hf teacher. auto: vLLM's choice
    for vllm (a float32 checkpoint runs in bfloat16: slow on CPUs without AVX-512 BF16, and not what a
    float32 student trains against), float32 for hf"""


@dataclass(kw_only=True)
class TeacherSection:
    """Teachers and how samples are routed to them."""

    teachers: list[TeacherEndpoint] = field(default_factory=lambda: [TeacherEndpoint()])
    routing: str = "data_source"
    """a sample goes to the teacher listing its data_source, else the default"""


@dataclass(kw_only=True)
class OptimSection:
    """Optimizer + LR schedule of the student. Defaults work for the CPU demo."""

    lr: float = 1e-5
    """peak learning rate (reached after warmup)"""
    min_lr: float = 0.0
    """floor of the decay schedule"""
    weight_decay: float = 0.0
    """decoupled (AdamW) weight decay"""
    adam_beta1: float = 0.9
    """Adam first-moment decay"""
    adam_beta2: float = 0.999
    """Adam second-moment decay"""
    adam_eps: float = 1e-8
    """Adam denominator epsilon"""
    clip_grad: float = 1.0
    """max global grad norm; 0 disables clipping"""
    warmup_steps: int = 0
    """linear warmup from 0 to `lr` over this many optimizer steps"""
    lr_decay_steps: int | None = None
    """steps until `min_lr`; None = no decay (constant after warmup)"""
    lr_decay_style: str = "constant"
    """constant | linear | cosine"""
    use_distributed_optimizer: bool = False
    """shard optimizer state over the data-parallel group"""
    overlap_grad_reduce: bool = False
    """overlap DP gradient reduction with backward (GPU only)"""
    overlap_param_gather: bool = False
    """distributed optimizer: overlap the param all-gather after each optimizer step with the next forward
    (Megatron's forward pre-hooks); needs use_distributed_optimizer and overlap_grad_reduce"""
    grad_reduce_in_fp32: bool = True
    """reduce bf16 gradients in fp32 across DP"""

    def validate(self) -> None:
        # NaN passes every `<` check below and inf makes Adam's update NaN: reject both first
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"optim.{f.name}: expected a finite number, got {value}")
        if not self.lr > 0:
            raise ValueError(f"optim.lr: expected > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.min_lr: expected 0 <= min_lr <= lr={self.lr}, got {self.min_lr}")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay: expected >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optim.{name}: expected in [0, 1), got {getattr(self, name)}")
        if self.adam_eps <= 0:
            raise ValueError(f"optim.adam_eps: expected > 0, got {self.adam_eps}")
        if self.clip_grad < 0:
            raise ValueError(f"optim.clip_grad: expected >= 0 (0 = off), got {self.clip_grad}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps: expected >= 0, got {self.warmup_steps}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"optim.lr_decay_style: expected one of {LR_DECAY_STYLES}, "
                             f"got {self.lr_decay_style!r}")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= 0:
            raise ValueError(f"optim.lr_decay_steps: expected > 0 or None (no decay), "
                             f"got {self.lr_decay_steps}")
        if self.overlap_param_gather and not (self.use_distributed_optimizer
                                              and self.overlap_grad_reduce):
            # Megatron-LM refuses the same: the all-gather it overlaps is the distributed optimizer's,
            # and its forward pre-hooks are only exercised with the grad reduction overlapped too
            raise ValueError("optim.overlap_param_gather: needs optim.use_distributed_optimizer=true and "
                             "optim.overlap_grad_reduce=true, got use_distributed_optimizer="
                             f"{self.use_distributed_optimizer}, overlap_grad_reduce={self.overlap_grad_reduce}")
        if self.lr_decay_style != "constant":
            if self.lr_decay_steps is None or self.lr_decay_steps <= self.warmup_steps:
                raise ValueError(f"optim.lr_decay_steps: a {self.lr_decay_style!r} decay needs "
                                 f"lr_decay_steps > warmup_steps={self.warmup_steps}, "
                                 f"got {self.lr_decay_steps}")


@dataclass(kw_only=True)
class WeightSyncSection:
    """Student -> vLLM weight transfer after each optimizer step."""

    bucket_mb: int = 512
    """MiB per bucket of the transfer plan (why 512 on GPUs: docs/benchmarks.md)"""
    transport: str = "auto"
    """auto: colocated_ipc where engines share trainer devices (accelerators; Ray: placement colocated), else
    group | group | colocated_ipc"""
    every_steps: int = 1
    """sync every N steps (1 = fully on-policy)"""
    host: str = "127.0.0.1"
    """address the weight-sync groups and the Ray trainer ranks' process-group store listen on (rank 0's
    node, reachable by the engines; on several nodes the default 127.0.0.1 becomes rank 0's node address)"""
    tp_export: str = "auto"
    """TP > 1, dense: peer (TP ranks write into the sender's buckets) | gather | auto"""
    high_priority_stream: bool = True
    """accelerators: the transfers' kernels go ahead of the next bucket's pack (docs/benchmarks.md)"""


@dataclass(kw_only=True)
class DataSection:
    """Where prompts come from."""

    train_path: str | None = None
    """jsonl/parquet of prompts; None with task set = synthetic"""
    eval_path: str | None = None
    """held-out prompts with answers (optional)"""
    prompt_key: str = "prompt"
    """column holding the prompt text"""
    answer_key: str = "answer"
    """column holding the exact answer (for eval / task reward)"""
    data_source_key: str = "data_source"
    """column used for teacher routing"""
    messages_key: str = "messages"
    """column holding chat messages (used instead of prompt_key when present)"""
    chat_template: str = "auto"
    """auto: chat template for `messages` records | always: also wraps a text prompt as a user turn | none:
    raw text"""
    overlong: str = "error"
    """a prompt whose tokens (chat template applied) + rollout.max_new_tokens exceed rollout.max_model_len,
    found before any engine starts: error (each named by file:line and length) | skip (removed before
    sampling: prompt_index and the audit's dataset size count the kept prompts; the log says how many,
    <output_dir>/skipped_prompts.jsonl lists each by index as read, file location and length)"""
    teacher_prompt_key: str | None = None
    """column holding the teacher's own prompt (privileged context: a reference solution, feedback), a text or
    chat messages; the teacher scores the student's response after it. None = the student's prompt"""
    teacher_prompt_template: str | None = None
    """the teacher's own prompt as a str.format template over the record's fields, e.g. "{prompt} (a correct
    solution: {solution})" ({prompt}: the record's text prompt); exclusive with teacher_prompt_key"""
    missing_teacher_prompt: str = "error"
    """a record without its teacher prompt's field: error (each named by file:line and field) | skip (left out
    before sampling, listed in <output_dir>/skipped_prompts.jsonl like data.overlong: skip)"""
    rewards: dict[str, str] = field(default_factory=dict)
    """data_source -> "exact_match" | "module:function" """
    task: str | None = "addition"
    """synthetic task when train_path is None"""
    task_digits: int = 2
    """synthetic addition: max digits per operand"""
    num_train: int = 2000
    """synthetic: training prompts"""
    num_eval: int = 64
    """synthetic: held-out prompts"""
    shuffle: bool = True
    """reshuffle each epoch (seeded, resumable)"""
    seed: int = 0
    """data order seed"""


@dataclass(kw_only=True)
class LoggingSection:
    """Where metrics go."""

    jsonl: bool = True
    """write <output_dir>/metrics.jsonl"""
    progress_bar: bool = True
    """tqdm progress bar on rank 0"""
    console_every: int = 1
    """print a metrics line every N steps (0 = never)"""
    tensorboard: bool = False
    """write TensorBoard events (needs tensorboard installed)"""
    wandb_project: str | None = None
    """log to Weights & Biases (needs wandb installed)"""
    profile_steps: list[int] = field(default_factory=list)
    """steps (numbered as in metrics.jsonl, from 0) run under the torch profiler: each trainer rank writes
    <output_dir>/profile/step<N>.rank<R>.json (a Chrome / Perfetto trace) and .txt (operators by device
    time); the whole step under torchrun, the trainer's part of it under the Ray controller; [] = off"""


@dataclass(kw_only=True)
class CheckpointSection:
    """Checkpoints and export."""

    save_every: int = 0
    """save every N steps (0 = only at the end)"""
    keep_last: int = 2
    """checkpoints kept on disk"""
    save_at_end: bool = True
    """save a checkpoint after the last step"""
    export_hf_at_end: bool = True
    """write <output_dir>/student_hf at the end"""


@dataclass(kw_only=True)
class RunSection:
    """The run as a whole."""

    output_dir: str = "runs/opkd"
    """run directory: config.yaml, metrics.jsonl, checkpoints, student_hf"""
    steps: int = 10
    """optimizer steps"""
    seed: int = 1234
    """global seed (model init RNG, dropout)"""
    schedule: str = "sync"
    """sync (in order) | one_step_off | two_step_off | async (these three need controller.kind: ray)"""
    max_staleness: int = 1
    """async: weight versions a trained sample may lag the trainer by; also bounds the queue"""
    stale_policy: str = "drop"
    """async: a sample past max_staleness is dropped (prompt re-generated) | truncated_is (kept, weighted)"""
    is_truncation: float = 2.0
    """truncated_is: cap C of a stale sequence's weight min(ratio, C), ratio vs the sampler's logprobs"""
    in_flight_update: str = "finish"
    """async: generations in flight at a weight update finish on the old weights | abort_resume"""
    partial_rollout_tokens: int = 8
    """abort_resume: tokens per engine call; an update waits at most one such chunk"""
    device: str | None = None
    """one of opkd_mcore.platform.DEVICE_TYPES; None = auto-detect"""


@dataclass(kw_only=True)
class ControllerSection:
    """Who runs the stages: one SPMD job (torchrun) or the Ray controller's worker groups."""

    kind: str = "torchrun"
    """torchrun: one SPMD job, rollout and teachers on rank 0 | ray: worker groups as Ray actors"""
    placement: str = "disaggregated"
    """ray: disaggregated (own devices per group) | colocated (rollout on the trainer's devices)"""
    rollout_engines: int = 1
    """ray: data-parallel vLLM rollout engines (each its own actor)"""
    rollout_tp: int = 1
    """ray: tensor-parallel size of each rollout engine (devices per engine)"""
    teacher_replicas: int = 1
    """ray: actors per in-process scoring teacher (vllm, hf); a remote teacher gets one per URL"""
    teachers_with_rollout: bool = False
    """ray, disaggregated: teachers share the rollout engines' devices (rollout_tp 1)"""
    teacher_call_tokens: int = 65536
    """ray: tokens (prompt + response) per scoring call: the groups of one rollout reply go to a teacher
    in calls of up to this many tokens (a longer sample alone) and at least one call per replica; a
    large call keeps the teacher's device busy, small ones let its result reach the trainer sooner"""
    cpus_per_worker: float = 1.0
    """ray: CPUs each actor reserves (Ray places by declared resources, not load)"""
    max_restarts: int = 3
    """ray: restarts of a dead rollout or teacher actor before the run stops"""
    sync_timeout_s: float = 300.0
    """ray: deadline of a weight-sync group join or transfer (the error names group, ranks, bucket)"""
    call_timeout_s: float = 1800.0
    """ray: deadline of one stage call (rollout, scoring, train step, checkpoint)"""


@dataclass(kw_only=True)
class TrainConfig:
    """A whole run. Sections are independent: each component reads only its own."""

    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    loss: LossSection = field(default_factory=LossSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    teacher: TeacherSection = field(default_factory=TeacherSection)
    weight_sync: WeightSyncSection = field(default_factory=WeightSyncSection)
    optim: OptimSection = field(default_factory=OptimSection)
    data: DataSection = field(default_factory=DataSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    run: RunSection = field(default_factory=RunSection)
    controller: ControllerSection = field(default_factory=ControllerSection)
