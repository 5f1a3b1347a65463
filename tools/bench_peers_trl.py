"""The `trl` runner of `opkd bench peers`: the workload through TRL's DistillationTrainer.

Run by the interpreter that has TRL (1.16; `opkd bench peers --trl-python`), never imported by the
harness. TRL 1.16's `trl.DistillationTrainer` is its on-policy distillation trainer: the student
generates every completion (n = 1 per dataset row, so each prompt is a row `samples_per_prompt`
times, in order, unshuffled), the teacher is a local `transformers` model whose hidden states and
LM head give dense logits in the step, and the loss is the generalized JSD (`beta=0`: forward KL)
over the full vocabulary. It has no top-k teacher: with `--teacher topk:K` this row's objective
differs from opkd's and says so.

Mapping of the workload: per_device_train_batch_size = micro_batch_size, gradient_accumulation_steps
= sequences per step / micro_batch_size (one generation and one optimizer step per step),
max_completion_length = max_new_tokens with vLLM's min_tokens equal to it (transformers' generate on
CPU: min_new_tokens), constant learning rate, no weight decay, gradient checkpointing off (TRL turns it
on by default; no other runner recomputes), bf16 weights on GPU (`dtype` of both models), fused AdamW,
vLLM colocated in the trainer's process (`vllm_mode="colocate"`). With 2 GPUs: `trl vllm-serve` (vLLM's
server with NCCL weight transfer) holds the student's generation on the second GPU, the trainer and
teacher the first.

What TRL 1.16 generates per optimizer step with these settings (read from its source): the dataloader
hands every micro-step the whole generation batch (per_device_train_batch_size x gradient_accumulation_steps
rows, `RepeatSampler` repeating it once per micro-step: distillation_trainer.py:840-888), and
`_prepare_inputs` generates only on the first micro-step of each optimizer step (`_step %
gradient_accumulation_steps == 0`, distillation_trainer.py:1774-1783). So each optimizer step makes one
`_generate_single_turn` call for all `sequences_per_step` rows (`prompts_per_step` prompts x
`samples_per_prompt`, n = 1 each), with no skipped steps (its config has no lmbda / seq_kd: every step is
on-policy). Colocated, that call is one `LLM.generate` of those rows (vllm_generation.py:661-754) with
SamplingParams(n=1, max_tokens=max_completion_length, min_tokens from generation_kwargs, logprobs=None:
distillation_trainer.py:819, no per-request seed) on an engine built with max_num_seqs = the generation
batch (distillation_trainer.py:806), max_num_batched_tokens 4096 and its engine core in the trainer's
process (external_launcher, vllm_generation.py:347-364). It returns a list of unpadded id lists (vLLM's
`token_ids`; transformers' `generate` path: each row cut after its first EOS,
distillation_trainer.py:1090-1098).

Timing: TRL logs its profiling spans only to W&B / MLflow / Trackio, so this script times the
trainer's own methods: generation = every `_generate_single_turn` call of the optimizer step summed, less
the weight sync inside it, weight update = `vllm_generation.sync_weights`, teacher = the teacher's
`_get_last_hidden_state` (its backbone forward; projecting its hidden states through its LM head is
inside the loss, so inside train), step = `on_step_begin` .. `on_step_end` (transformers calls them once
per optimizer step, around all its micro-steps), train = step - generation - teacher - weight update.
Response tokens = the tokens those calls returned (`response_token_count`: padding excluded), and each
row says how many calls and sequences the step generated.

    python tools/bench_peers_trl.py WORKLOAD.json PROMPTS.jsonl ROWS.jsonl

On a CPU it generates with transformers' `generate` (no vLLM), unless OPKD_PEERS_TRL_VLLM=1: then the
colocated vLLM engine starts, and with the CPU build of vLLM 0.32 (newer than TRL 1.16 supports) the
first weight sync fails inside vLLM (its CPU linear layers have no `weight_loader`).
"""
from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_peers, beside this file

from bench_peers import StepRow, Workload, write_rows  # noqa: E402

from opkd_mcore.data import read_records  # noqa: E402


def response_token_count(completions, pad_token_id: int | None = None, eos_token_ids=()) -> int:
    """Response tokens in what one generate call returned, padding excluded. A list of id sequences
    (TRL's `_generate_single_turn` returns unpadded ones) counts their lengths. A right-padded 2-D tensor
    counts each row up to its last non-pad token, or, where the pad id is also an EOS id (Qwen's base
    tokenizers pad with their EOS), up to and including its first EOS."""
    if not isinstance(completions, torch.Tensor):
        return sum(len(ids) for ids in completions)
    if completions.dim() != 2:
        raise ValueError(f"completions: expected a [sequences, tokens] tensor, got shape "
                         f"{tuple(completions.shape)}")
    if pad_token_id is None:
        raise ValueError("completions: a padded tensor needs pad_token_id to leave its padding out")
    columns = torch.arange(1, completions.size(1) + 1)
    if pad_token_id in set(eos_token_ids):
        is_eos = completions == pad_token_id
        first_eos = torch.where(is_eos, columns, completions.size(1) + 1).amin(dim=1)
        return int(first_eos.clamp(max=completions.size(1)).sum())
    return int((columns * (completions != pad_token_id)).amax(dim=1).sum())


class StageClock:
    """Seconds per stage within the current step, the device drained around each timed call, and the
    generate calls, sequences and response tokens of the step."""

    def __init__(self, synchronize):
        self.sync, self.seconds = synchronize, defaultdict(float)
        self.calls = self.sequences = self.tokens = 0

    def reset(self) -> None:
        self.seconds.clear()
        self.calls = self.sequences = self.tokens = 0

    def wrap(self, stage: str, fn, when=None, count=None):
        """`fn` timed into `stage` (only the calls where `when(*args)`); `count(out)`: the response
        tokens of a generate call's output, counted into the step."""
        def timed(*args, **kwargs):
            if when is not None and not when(*args):
                return fn(*args, **kwargs)
            self.sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.sync()
            self.seconds[stage] += time.perf_counter() - start
            if count is not None:
                self.calls += 1
                self.sequences += len(out)
                self.tokens += count(out)
            return out
        return timed


def peak_memory(on_gpu: bool) -> tuple[list[float], str]:
    if on_gpu:
        return [round(torch.cuda.max_memory_allocated() / 2**30, 2)], "torch max allocated (trainer process)"
    return [round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)], "host peak RSS"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_vllm_server(w: Workload, gpu: str, log_path: str) -> tuple[subprocess.Popen, int]:
    """`trl vllm-serve` for the student on `gpu` (2 GPUs); the trainer waits for it to answer."""
    port = _free_port()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
    cmd = [sys.executable, "-m", "trl.scripts.vllm_serve", "--model", w.student, "--port", str(port),
           "--gpu_memory_utilization", "0.8", "--max_model_len", str(w.max_model_len), "--dtype", w.dtype]
    with open(log_path, "w") as log:  # the server keeps its own descriptor of the file
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), port


def build_config(w: Workload, run_dir: str, on_gpu: bool, server_port: int | None):
    from trl import DistillationConfig

    per_step = w.sequences_per_step
    if per_step % w.micro_batch_size:
        raise ValueError(f"micro_batch_size: {w.micro_batch_size} must divide the {per_step} "
                         "sequences of a step")
    use_vllm = on_gpu or os.environ.get("OPKD_PEERS_TRL_VLLM") == "1"
    vllm = dict(use_vllm=use_vllm, vllm_mode="server" if server_port else "colocate",
                vllm_gpu_memory_utilization=w.gpu_memory_utilization, vllm_max_model_length=w.max_model_len)
    if server_port:
        vllm.update(vllm_server_host="127.0.0.1", vllm_server_port=server_port, vllm_server_timeout=900.0)
    fixed = ({"min_tokens": w.max_new_tokens} if use_vllm else {"min_new_tokens": w.max_new_tokens}) \
        if w.fixed_length else None
    dtype = w.dtype if on_gpu else "float32"
    return DistillationConfig(
        output_dir=run_dir, per_device_train_batch_size=w.micro_batch_size,
        gradient_accumulation_steps=per_step // w.micro_batch_size, max_steps=w.total_steps,
        learning_rate=w.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=w.clip_grad, beta=0.0, temperature=w.temperature, top_p=w.top_p, top_k=max(w.top_k, 0),
        max_completion_length=w.max_new_tokens, generation_kwargs=fixed, gradient_checkpointing=False,
        bf16=on_gpu and dtype == "bfloat16", model_init_kwargs={"dtype": dtype},
        teacher_model_init_kwargs={"dtype": dtype}, optim="adamw_torch_fused" if on_gpu else "adamw_torch",
        use_cpu=not on_gpu, shuffle_dataset=False, seed=w.seed, logging_steps=1, report_to="none",
        save_strategy="no", dataloader_num_workers=0, disable_dropout=True, **vllm)


def objective(w: Workload) -> str:
    base = "generalized JSD with beta=0 (forward KL) over the full vocabulary, dense teacher in the step"
    if w.teacher_kind == "topk":
        return base + f" (not top-{w.teacher_top_k}: TRL's DistillationTrainer has no top-k teacher)"
    return base


def main(argv=None) -> int:
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DistillationTrainer

    workload_path, prompts_path, rows_path = (argv or sys.argv[1:])[:3]
    w = Workload.from_json(workload_path)
    run_dir = os.path.dirname(os.path.abspath(rows_path))
    on_gpu = torch.cuda.is_available()
    server, port = None, None
    if w.gpus == 2:
        server_gpu = os.environ.get("OPKD_PEERS_SECOND_GPU")
        if not server_gpu:
            raise SystemExit("trl with 2 GPUs: OPKD_PEERS_SECOND_GPU (set by opkd bench peers) "
                             "names the server's GPU")
        server, port = start_vllm_server(w, server_gpu, os.path.join(run_dir, "vllm_server.log"))
    try:
        # each prompt `samples_per_prompt` rows in a row: TRL samples n = 1 per row
        prompts = [r["prompt"] for r in read_records(prompts_path) for _ in range(w.samples_per_prompt)]
        rows = train(w, prompt_dataset(Dataset, prompts), build_config(w, run_dir, on_gpu, port), on_gpu,
                     port is not None, DistillationTrainer, TrainerCallback, f"trl {trl.__version__}")
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    write_rows(rows_path, rows)
    return 0


def prompt_dataset(dataset_cls, prompts: list[str]):
    """The prompts as a `datasets.Dataset` with a fingerprint of their text. `Dataset.from_list` would
    fingerprint it by pickling the Arrow table with dill, which fails on Python 3.12 with pyarrow 26
    (`Can't pickle <class 'MonthDayNano'>`, seen on the GPU machine)."""
    import hashlib

    from datasets.table import InMemoryTable

    digest = hashlib.sha256("\0".join(prompts).encode()).hexdigest()[:16]
    return dataset_cls(InMemoryTable.from_pydict({"prompt": prompts}), fingerprint=f"opkd-peers-{digest}")


def generation_notes(mode: str, calls: int, sequences: int, w: Workload) -> str:
    """The row's notes: where it generated, and how many calls and sequences the step made (the
    workload's count is said beside it where they differ)."""
    text = f"{mode}; {calls} generate call{'s' if calls != 1 else ''} of {sequences} sequences in the step"
    if sequences != w.sequences_per_step:
        text += f" (the workload: {w.sequences_per_step})"
    return text


def train(w, dataset, args, on_gpu, served, trainer_cls, callback_cls, version) -> list[StepRow]:
    """Run the trainer on `dataset` (`args`: its config; `served`: generation on `trl vllm-serve`) with
    its methods timed; one StepRow per optimizer step."""
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    clock, rows = StageClock(sync), []
    trainer = trainer_cls(model=w.student, teacher_model=w.teacher, args=args, train_dataset=dataset)
    teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
    pad_id, eos_ids = trainer._tokenizer.pad_token_id, list(trainer.eos_token_ids)
    trainer._generate_single_turn = clock.wrap(
        "generation", trainer._generate_single_turn,
        count=lambda out: response_token_count(out, pad_id, eos_ids))
    trainer._get_last_hidden_state = clock.wrap("teacher", trainer._get_last_hidden_state,
                                                when=lambda model, *rest: model is teacher)
    if trainer.use_vllm:
        gen = trainer.vllm_generation
        gen.sync_weights = clock.wrap("weight_update", gen.sync_weights)
    mode = ("vLLM server on the second GPU" if served else
            "vLLM colocated" if trainer.use_vllm else "transformers generate (no vLLM)")

    class StepTimer(callback_cls):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.reset()
            if on_gpu:
                torch.cuda.reset_peak_memory_stats()
            sync()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            step_s = time.perf_counter() - self.start
            s = clock.seconds
            generation = s["generation"] - s["weight_update"]
            peak, source = peak_memory(on_gpu)
            rows.append(StepRow(
                runner="trl", step=len(rows), warmup=len(rows) < w.warmup_steps, step_s=step_s,
                generation_s=generation, teacher_s=s["teacher"],
                weight_update_s=s["weight_update"] if trainer.use_vllm else None,
                train_s=step_s - s["generation"] - s["teacher"], response_tokens=clock.tokens,
                generation_calls=clock.calls, objective=objective(w), peak_memory_gib=peak,
                memory_source=source, version=version,
                notes=generation_notes(mode, clock.calls, clock.sequences, w)))

    trainer.add_callback(StepTimer())
    trainer.train()
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
