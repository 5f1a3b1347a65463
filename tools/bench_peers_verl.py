"""The `verl` runner of `opkd bench peers`: the workload through verl's on-policy distillation trainer.

Run by the interpreter that has verl (0.9.1; `opkd bench peers --verl-python`), never imported by the
harness. It writes the workload's prompts as verl's parquet (chat `prompt`, `data_source`,
`reward_model.ground_truth`), a zero task reward (the loss is distillation alone), and runs verl's own
entry point with Hydra overrides, as its examples (examples/on_policy_distillation_trainer/
run_qwen3_8b_fsdp.sh) do:

    python -m verl.trainer.main_ppo  <the overrides of `verl_overrides`>

What that runs (verl 0.9.1, the v1 trainer, `trainer.v1.trainer_mode=sync`): a Ray cluster on this
host; the student trained with the FSDP engine (`actor.strategy=fsdp`; verl's default mixed precision:
float32 master weights, bf16 compute) with its vLLM rollout engine in the same process group on the
trainer's GPU (hybrid engine, weights synced each step); the teacher as a vLLM server on a resource
pool of its own (`distillation.n_gpus_per_node=1`: the second GPU), scoring each sample as soon as
it is generated (its time is inside generation). Loss: top-k teacher -> `forward_kl_topk`
(sum over the teacher's top-k ids of p (log p - log q), student log-probs over the full vocabulary,
not renormalised; log-probs clamped at -10 and the per-token loss to [0, 10], as verl's examples set;
supervised, no policy gradient); dense teacher -> verl has no dense-teacher loss, so `k3`, its
sampled-token estimator of reverse KL from the teacher's log-prob of the sampled token. Token budget
per micro-batch: verl's dynamic batch size (`ppo_max_token_len_per_gpu`). Fixed response length:
`rollout.ignore_eos`. Metrics: verl's `file` logger (VERL_FILE_LOGGER_PATH), one JSON line per step:
timing_s/gen, timing_s/update_actor (+ timing_s/old_log_prob where verl runs it), timing_s/update_weights,
timing_s/step, response_length/mean, actor/perf/max_memory_allocated_gb.

Attention without the flash-attn package (the GPU machine has none): verl builds the student's HF config
with `override_config.attn_implementation`, flash_attention_2 unless set (verl/workers/config/model.py,
HFModelConfig.__post_init__), so the runner sets `sdpa`. The reference policy would share that model
config but is not built (no KL loss or reward), nor is a critic (GRPO advantages; its value-head loader
asks for flash_attention_2 whatever the config says); the teacher is a vLLM server, whose attention is
vLLM's own. Micro-batches are padded (`use_remove_padding=False`): verl's packed rows do work with sdpa
(transformers masks each packed sequence off from the others by its position ids), but sdpa then
computes attention over the whole packed row: at the default 16K-token micro-batches of ~265-token
sequences, 60x the padded batch's attention work, where fixed-length responses leave little padding.
No fused kernels, no Liger.

    python tools/bench_peers_verl.py WORKLOAD.json PROMPTS.jsonl ROWS.jsonl
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_peers, beside this file

from bench_peers import VERL_DEADLINE_ENV, VERL_DEADLINE_MARGIN_S, StepRow, Workload, write_rows  # noqa: E402
from bench_peers_process import run_in_session  # noqa: E402

from opkd_mcore.data import read_records  # noqa: E402

# the prompt text itself, as opkd train and TRL feed a text prompt (the character tokenizer has no template)
RAW_TEMPLATE = "{% for message in messages %}{{ message.content }}{% endfor %}"
NOTES = ("teacher scoring runs per sample inside generation (overlapped); train = update_actor + "
         "old_log_prob; tokens = mean response length x samples; attention: sdpa on padded micro-batches "
         "(no flash-attn on the machine)")
# the trainer's peak as verl 0.9.1 logs it
MEMORY_KEY = "actor/perf/max_memory_allocated_gb"
# what the machine's transformers can build without the flash-attn package
ATTENTION = "sdpa"
ZERO_REWARD = '''def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """No task reward: the run's loss is the distillation loss alone."""
    return 0.0
'''


def write_parquet(records: list[dict], path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": r.get("data_source", "addition"),
             "prompt": [{"role": "user", "content": r["prompt"]}],
             "ability": "arithmetic", "reward_model": {"style": "rule", "ground_truth": r.get("answer", "")},
             "extra_info": {"index": i}} for i, r in enumerate(records)]
    pq.write_table(pa.Table.from_pylist(rows), path)


def objective(w: Workload) -> str:
    if w.teacher_kind == "topk":
        return (f"top-{w.teacher_top_k} forward KL, not renormalised (sum over the teacher's ids of "
                "p(log p - log q), q over the full vocabulary), log-probs clamped at -10, per-token loss "
                "clamped to [0, 10]")
    return "k3 estimate of reverse KL on the sampled token only (verl 0.9.1 has no dense-teacher loss)"


def _group(prefix: str, **values) -> list[str]:
    return [f"{prefix}.{key}={value}" for key, value in values.items()]


def verl_overrides(w: Workload, data_path: str, reward_path: str, run_dir: str) -> list[str]:
    """Hydra overrides of verl's ppo_trainer config for the workload (2 GPUs: trainer | teacher)."""
    max_len, tokens = w.max_model_len, w.max_tokens_per_micro_batch
    loss = (dict(loss_mode="forward_kl_topk", topk=w.teacher_top_k, log_prob_min_clamp=-10.0)
            if w.teacher_kind == "topk" else dict(loss_mode="k3"))
    return [
        *_group("algorithm", adv_estimator="grpo", use_kl_in_reward=False),
        *_group("data", train_files=f"['{data_path}']", val_files=f"['{data_path}']",
                train_batch_size=w.prompts_per_step, max_prompt_length=max_len - w.max_new_tokens - 1,
                max_response_length=w.max_new_tokens, shuffle=False, filter_overlong_prompts=False,
                truncation="error", dataloader_num_workers=0),
        *_group("actor_rollout_ref.model", path=w.student, custom_chat_template=f"'{RAW_TEMPLATE}'",
                use_remove_padding=False, use_fused_kernels=False, use_liger=False,
                enable_gradient_checkpointing=False),
        # `+`: verl's default override_config is an empty dict, and Hydra adds a new key only with it
        f"+actor_rollout_ref.model.override_config.attn_implementation={ATTENTION}",
        "critic.enable=False",
        *_group("actor_rollout_ref.actor", strategy="fsdp", ppo_mini_batch_size=w.prompts_per_step,
                ppo_epochs=1, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=tokens, use_kl_loss=False,
                entropy_coeff=0),
        *_group("actor_rollout_ref.actor.optim", lr=w.lr, weight_decay=0.0, clip_grad=w.clip_grad),
        *_group("actor_rollout_ref.actor.fsdp_config", param_offload=False, optimizer_offload=False),
        *_group("actor_rollout_ref.rollout", name="vllm", tensor_model_parallel_size=1,
                gpu_memory_utilization=w.gpu_memory_utilization, n=w.samples_per_prompt,
                temperature=w.temperature, top_p=w.top_p, top_k=w.top_k, ignore_eos=w.fixed_length,
                dtype=w.dtype, max_model_len=max_len, max_num_seqs=w.sequences_per_step, enforce_eager=False,
                calculate_log_probs=False, log_prob_use_dynamic_bsz=True,
                log_prob_max_token_len_per_gpu=tokens),
        *_group("distillation", enabled=True, n_gpus_per_node=1, nnodes=1),
        *_group("distillation.teacher_models.teacher_model", model_path=w.teacher),
        *_group("distillation.teacher_models.teacher_model.inference", name="vllm",
                tensor_model_parallel_size=1, gpu_memory_utilization=0.8, max_model_len=max_len,
                enforce_eager=False),
        *_group("distillation.distillation_loss", use_task_rewards=False, use_policy_gradient=False,
                loss_max_clamp=10.0, **loss),
        *_group("reward.custom_reward_function", path=reward_path, name="compute_score"),
        *_group("trainer", use_v1=True, nnodes=1, n_gpus_per_node=w.gpus - 1, logger="['console','file']",
                val_before_train=False, test_freq=-1, save_freq=-1, resume_mode="disable", total_epochs=1,
                total_training_steps=w.total_steps, project_name="opkd_bench_peers", experiment_name="verl",
                default_local_dir=f"{run_dir}/checkpoints"),
        "trainer.v1.trainer_mode=sync",
    ]


def verl_command(w: Workload, data_path: str, reward_path: str, run_dir: str) -> list[str]:
    """verl's own entry point in this interpreter, with the workload's overrides."""
    overrides = verl_overrides(w, data_path, reward_path, run_dir)
    return [sys.executable, "-m", "verl.trainer.main_ppo", *overrides]


def rows_from_log(w: Workload, path: str, version: str) -> list[StepRow]:
    rows = []
    with open(path) as f:
        for line in f:
            data = json.loads(line)["data"]
            if "timing_s/step" not in data:
                continue
            train = data.get("timing_s/update_actor", 0.0) + data.get("timing_s/old_log_prob", 0.0)
            memory = data.get(MEMORY_KEY)
            rows.append(StepRow(
                runner="verl", step=len(rows), warmup=len(rows) < w.warmup_steps,
                step_s=data["timing_s/step"],
                generation_s=data.get("timing_s/gen"), teacher_s=None, train_s=train,
                weight_update_s=data.get("timing_s/update_weights"),
                response_tokens=round(data["response_length/mean"] * w.sequences_per_step),
                objective=objective(w),
                peak_memory_gib=[round(memory, 2)] if memory is not None else None,
                memory_source=f"verl {MEMORY_KEY} (trainer)" if memory is not None else "",
                version=version, notes=NOTES))
    return rows


def main(argv=None) -> int:
    import verl

    workload_path, prompts_path, rows_path = (argv or sys.argv[1:])[:3]
    w = Workload.from_json(workload_path)
    if w.gpus < 2:
        raise SystemExit("verl: the teacher needs a resource pool of its own: run with --gpus 2")
    run_dir = os.path.dirname(os.path.abspath(rows_path))
    data_path, reward_path = os.path.join(run_dir, "prompts.parquet"), os.path.join(run_dir, "zero_reward.py")
    write_parquet(read_records(prompts_path), data_path)
    with open(reward_path, "w") as f:
        f.write(ZERO_REWARD)
    log_path = os.path.join(run_dir, "verl_metrics.jsonl")
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": log_path}
    cmd = verl_command(w, data_path, reward_path, run_dir)
    print("$ " + " ".join(cmd), flush=True)
    deadline = float(os.environ[VERL_DEADLINE_ENV]) if os.environ.get(VERL_DEADLINE_ENV) else None
    rc = run_in_session(cmd, timeout_s=deadline, env=env, cwd=run_dir)
    if rc not in (0, None):
        raise SystemExit(f"verl.trainer.main_ppo exited {rc}")
    rows = rows_from_log(w, log_path, f"verl {verl.__version__}")
    write_rows(rows_path, rows if rc == 0 else rows_at_deadline(w, rows, deadline))
    return 0


def rows_at_deadline(w: Workload, rows: list[StepRow], deadline_s: float) -> list[StepRow]:
    """The steps verl finished before the runner's deadline stopped it, each row saying so; a run
    stopped before its first measured step is an error."""
    measured = sum(not r.warmup for r in rows)
    if not measured:
        raise SystemExit(f"verl: stopped at the runner's deadline ({deadline_s:.0f} s: --timeout less "
                         f"{VERL_DEADLINE_MARGIN_S:.0f} s) after {len(rows)} of {w.total_steps} steps, "
                         "before its first measured step (verl starts in ~7 minutes on a fresh machine: "
                         "raise --timeout)")
    note = (f"stopped at the runner's deadline after {len(rows)} of {w.total_steps} steps: medians over "
            f"the {measured} measured steps it finished")
    return [replace(r, notes=f"{r.notes}; {note}") for r in rows]


if __name__ == "__main__":
    raise SystemExit(main())
