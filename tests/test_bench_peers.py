"""`opkd bench peers` on CPU: the workload definition and its --help, the plain runner on a tiny model
pair (rows, times, token counts), the plain objective against the project's own loss, the overrides
each runner derives from the workload, the table's medians and ratios, and the TRL runner's step
accounting against a stand-in for TRL's trainer loop. The opkd runner (a real vLLM engine) is the slow
test; TRL's and verl's runs belong to the GPU machine."""
from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from dataclasses import asdict, fields, replace

import pytest
import torch

from opkd_mcore.cli import main as cli_main
from opkd_mcore.config.loader import load_config
from opkd_mcore.data import ALPHABET
from opkd_mcore.losses import DenseTeacher, TopKTeacher, kd_loss
from opkd_mcore.models.tiny import save_tiny_hf_model
from tools import bench_peers, bench_peers_process, bench_peers_trl, bench_peers_verl, plain_step

STEP_KEYS = {f.name for f in fields(bench_peers.StepRow)}


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("peers_models")
    student = save_tiny_hf_model(str(root / "student"), seed=1, alphabet=ALPHABET)
    teacher = save_tiny_hf_model(str(root / "teacher"), seed=2, alphabet=ALPHABET)
    return student, teacher


def tiny_workload(student: str, teacher: str, **changes) -> bench_peers.Workload:
    base = bench_peers.Workload(student=student, teacher=teacher, prompts_per_step=3, samples_per_prompt=2,
                                max_new_tokens=5, task_digits=2, steps=2, warmup_steps=0, micro_batch_size=4,
                                teacher_top_k=8, dtype="float32")
    return replace(base, **changes)


def test_help_documents_every_workload_field_with_its_default():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        cli_main(["bench", "peers", "--help"])
    assert stop.value.code == 0
    text = out.getvalue()
    epilog = text.split("the workload (", 1)[1].splitlines()
    for f in fields(bench_peers.Workload):
        line = next((ln for ln in epilog if ln.split()[:1] == [f.name]), None)
        assert line is not None, f"--help does not list the workload field {f.name}"
        assert str(f.default) in line and f.metadata["help"][:20] in line
    for flag in ("--runners", "--pairs", "--teacher", "--gpus", "--results"):
        assert flag in text


def test_workload_prompts_are_fixed_by_the_seed_and_distinct_per_step():
    w = bench_peers.Workload(prompts_per_step=4, steps=2, warmup_steps=1)
    records = w.prompt_records()
    assert len(records) == 12 and len({r["prompt"] for r in records}) == 12
    assert records == w.prompt_records() and records != replace(w, seed=1).prompt_records()
    with pytest.raises(ValueError, match="teacher_kind"):
        replace(w, teacher_kind="sparse").validate()


def test_micro_batches_mark_exactly_the_positions_that_predict_response_tokens():
    sequences = plain_step.step_sequences([[1, 4, 5], [1, 6]], samples=2, response_len=3, vocab_size=20,
                                          seed=0)
    assert [len(ids) for ids, _ in sequences] == [6, 6, 5, 5]
    batches = plain_step.pad_micro_batches(sequences, micro_batch_size=3, pad_id=0)
    assert [b.input_ids.shape for b in batches] == [(3, 6), (1, 5)]
    assert sum(b.num_loss_tokens for b in batches) == 4 * 3
    # the third sequence: prompt of 2, so logits 1..3 predict its response tokens 2..4
    assert batches[0].loss_mask[2].tolist() == [False, True, True, True, False, False]
    assert batches[0].input_ids[2, 2:5].tolist() == sequences[2][0][2:] and batches[0].input_ids[2, 5] == 0


def test_plain_objective_equals_the_projects_loss():
    # the plain runner's torch loss against kd_loss (an independent implementation), float64
    g = torch.Generator().manual_seed(3)
    student, teacher = torch.randn(7, 41, generator=g, dtype=torch.float64), torch.randn(7, 41, generator=g)
    dense = plain_step.forward_kl_sum(student, teacher_logits=teacher.double())
    ref = kd_loss(student, DenseTeacher(logits=teacher.double())).sum()
    assert torch.allclose(dense.double(), ref, rtol=1e-5)
    logprobs, ids = torch.log_softmax(teacher.double(), -1).topk(5, -1)
    topk = plain_step.forward_kl_sum(student, topk_ids=ids, topk_logprobs=logprobs)
    ref = kd_loss(student, TopKTeacher(ids=ids, logprobs=logprobs), support="teacher", mass="renorm").sum()
    assert torch.allclose(topk.double(), ref, rtol=1e-5)


@pytest.mark.parametrize("teacher_kind", ["topk", "dense"])
def test_plain_runner_reports_every_step_with_the_workloads_tokens(tiny_pair, tmp_path, teacher_kind):
    w = tiny_workload(*tiny_pair, teacher_kind=teacher_kind)
    ctx = bench_peers.make_context(w, str(tmp_path), [])
    (tmp_path / "plain").mkdir()
    rows = bench_peers.run_plain(w, str(tmp_path / "plain"), ctx)
    assert [r.step for r in rows] == [0, 1] and not any(r.warmup for r in rows)
    for row in rows:
        assert set(asdict(row)) == STEP_KEYS and row.runner == "plain"
        assert row.step_s > 0 and row.train_s == row.step_s
        assert row.response_tokens == w.prompts_per_step * w.samples_per_prompt * w.max_new_tokens
        assert row.generation_s is None and row.weight_update_s is None
        assert (row.teacher_s is not None and 0 < row.teacher_s < row.step_s) == (teacher_kind == "dense")
        assert row.objective and row.version.startswith("transformers") and row.peak_memory_gib[0] > 0
    summary = bench_peers.summarize("plain", "tiny", w, rows)
    assert summary["response_tokens"] == rows[0].response_tokens and summary["steps"] == 2


def _row(runner, step, step_s, tokens=100, warmup=False):
    return bench_peers.StepRow(runner=runner, step=step, warmup=warmup, step_s=step_s, train_s=step_s / 2,
                               response_tokens=tokens, objective=f"{runner} loss")


def test_table_medians_leave_out_the_warmup_and_ratios_compare_tokens_per_second():
    w = bench_peers.Workload()
    opkd = [_row("opkd", 0, 9.0, warmup=True), _row("opkd", 1, 1.0), _row("opkd", 2, 2.0),
            _row("opkd", 3, 3.0)]
    trl = [_row("trl", 0, 4.0), _row("trl", 1, 4.0), _row("trl", 2, 4.0)]
    summaries = [bench_peers.summarize("opkd", "a", w, opkd), bench_peers.summarize("trl", "a", w, trl),
                 {"runner": "verl", "pair": "a", "teacher": "top-64", "gpus": 1,
                  "error": "verl needs 2 GPUs\nmore"}]
    bench_peers.add_ratios(summaries)
    assert summaries[0]["step_s"] == {"p50": 2.0, "p20": 1.4, "p80": 2.6}
    assert summaries[0]["tokens_per_s"]["p50"] == 50.0 and summaries[1]["tokens_per_s"]["p50"] == 25.0
    assert summaries[0]["opkd_ratio"] == 1.0 and summaries[1]["opkd_ratio"] == 2.0
    assert summaries[1]["opkd_train_speedup"] == 2.0 and summaries[2].get("opkd_train_speedup") is None
    table = bench_peers.table_rows(summaries)
    assert table[1]["step s"] == "4 (4-4)" and table[1]["generation s"] == "-"
    assert table[2]["objective"] == "not run: verl needs 2 GPUs" and table[2]["step s"] == "-"


@pytest.mark.parametrize("teacher_kind,gpus", [("topk", 1), ("dense", 1), ("topk", 2), ("dense", 2)])
def test_opkd_overrides_load_into_the_gpu_config(tmp_path, teacher_kind, gpus):
    w = bench_peers.Workload(student="/s", teacher="/t", teacher_kind=teacher_kind, gpus=gpus, lr=3e-6)
    overrides = bench_peers.opkd_overrides(w, str(tmp_path / "run"), "/p.jsonl", on_gpu=True)
    cfg = load_config(bench_peers.GPU_CONFIG, overrides, check_files=False)
    assert cfg.optim.lr == 3e-6 and cfg.model.student == "/s" and cfg.teacher.teachers[0].model == "/t"
    per_step = cfg.rollout.n * cfg.rollout.prompts_per_step
    assert per_step == cfg.parallel.global_batch_size == w.sequences_per_step
    assert cfg.run.steps == w.total_steps and cfg.data.train_path == "/p.jsonl" and not cfg.data.shuffle
    assert cfg.teacher.teachers[0].backend == ("vllm" if teacher_kind == "topk" else "megatron")
    assert cfg.loss.support == ("teacher" if teacher_kind == "topk" else None)
    assert cfg.controller.kind == ("ray" if gpus == 2 else "torchrun")
    off = load_config(bench_peers.GPU_CONFIG, bench_peers.opkd_overrides(
        replace(w, schedule="one_step_off"), str(tmp_path / "r"), "/p.jsonl", on_gpu=True), check_files=False)
    assert off.run.schedule == "one_step_off" and off.controller.kind == "ray"
    # one GPU: the Ray controller's colocated placement, the engine generating beside the trainer
    assert off.controller.placement == ("colocated" if gpus == 1 else "disaggregated")
    assert cfg.run.schedule == "sync"


def test_verl_overrides_follow_the_workload():
    w = bench_peers.Workload(student="/s", teacher="/t", gpus=2)
    args = dict(a.split("=", 1) for a in bench_peers_verl.verl_overrides(w, "/d.parquet", "/r.py", "/run"))
    assert args["distillation.distillation_loss.loss_mode"] == "forward_kl_topk"
    assert args["distillation.distillation_loss.topk"] == "64" and args["actor_rollout_ref.rollout.n"] == "4"
    assert args["actor_rollout_ref.rollout.ignore_eos"] == "True" and args["trainer.n_gpus_per_node"] == "1"
    assert args["trainer.total_training_steps"] == str(w.total_steps)
    dense = dict(a.split("=", 1) for a in bench_peers_verl.verl_overrides(
        replace(w, teacher_kind="dense"), "/d", "/r", "/run"))
    assert dense["distillation.distillation_loss.loss_mode"] == "k3"


def test_verl_command_builds_its_models_with_sdpa_and_no_flash_attn_path():
    """The GPU machine has no flash-attn package: verl's model config defaults to flash_attention_2
    and its packed (remove-padding) rows, fused kernels and Liger are the paths that want more."""
    w = bench_peers.Workload(student="/s", teacher="/t", gpus=2)
    cmd = bench_peers_verl.verl_command(w, "/d.parquet", "/r.py", "/run")
    assert cmd[:3] == [sys.executable, "-m", "verl.trainer.main_ppo"]
    # verl's default override_config is {}: Hydra takes a key it lacks only with the `+` prefix
    assert "+actor_rollout_ref.model.override_config.attn_implementation=sdpa" in cmd
    args = dict(a.split("=", 1) for a in cmd[3:])
    for key in ("use_remove_padding", "use_fused_kernels", "use_liger"):
        assert args[f"actor_rollout_ref.model.{key}"] == "False", key
    assert args["critic.enable"] == "False"
    assert not [a for a in cmd if "flash" in a.lower()]


# two steps of verl 0.9.1's file logger as measured on 2026-11-28 (2x H200), keys trimmed to those read
VERL_LOG = [
    {"step": 1, "data": {"actor/perf/max_memory_allocated_gb": 48.35, "timing_s/gen": 8.073,
                         "timing_s/old_log_prob": 3.434, "timing_s/update_actor": 2.359,
                         "timing_s/update_weights": 0.359, "timing_s/step": 50.676,
                         "response_length/mean": 256.0}},
    {"step": 2, "data": {"actor/perf/max_memory_allocated_gb": 52.1, "timing_s/gen": 6.073,
                         "timing_s/old_log_prob": 2.252, "timing_s/update_actor": 1.443,
                         "timing_s/update_weights": 0.368, "timing_s/step": 10.282,
                         "response_length/mean": 256.0}},
]


def test_verl_rows_read_the_stages_and_the_trainers_memory_from_verls_metrics(tmp_path):
    path = tmp_path / "verl_metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in VERL_LOG))
    w = bench_peers.Workload(gpus=2)
    rows = bench_peers_verl.rows_from_log(w, str(path), "verl 0.9.1")
    assert [r.warmup for r in rows] == [True, False] and [r.step_s for r in rows] == [50.676, 10.282]
    assert rows[1].train_s == pytest.approx(1.443 + 2.252) and rows[1].generation_s == 6.073
    assert rows[1].weight_update_s == 0.368 and rows[1].response_tokens == 256 * w.sequences_per_step
    assert rows[1].peak_memory_gib == [52.1] and "max_memory_allocated_gb" in rows[1].memory_source


def test_verl_stopped_at_its_deadline_keeps_the_steps_it_finished_and_says_so():
    w = bench_peers.Workload(gpus=2)  # 1 warm-up + 5 measured steps
    rows = [bench_peers.StepRow(runner="verl", step=i, warmup=i == 0, step_s=10.0, response_tokens=1,
                                objective="o", notes="n") for i in range(5)]
    kept = bench_peers_verl.rows_at_deadline(w, rows, 540.0)
    assert [r.step_s for r in kept] == [10.0] * 5
    assert all(r.notes == "n; stopped at the runner's deadline after 5 of 6 steps: medians over the 4 "
               "measured steps it finished" for r in kept)
    with pytest.raises(SystemExit, match="before its first measured step"):
        bench_peers_verl.rows_at_deadline(w, rows[:1], 540.0)


def test_a_runner_past_its_timeout_is_killed_with_everything_it_started(tmp_path):
    """A peer's trainer starts Ray workers and engines of its own: at the deadline the whole session
    goes, where killing the runner alone would leave them holding the GPUs."""
    pid_file = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
              "time.sleep(120)\n")
    start = time.monotonic()
    with pytest.raises(bench_peers_process.RunnerFailed, match="exited timeout"):
        bench_peers_process.run_logged([sys.executable, "-c", script], str(tmp_path / "r.log"), timeout_s=8,
                               what="sleeper")
    assert time.monotonic() - start < 30
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is asynchronous; the process is reaped by init
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild), "the runner's own child outlived the deadline"
    exit_3 = [sys.executable, "-c", "raise SystemExit(3)"]
    assert bench_peers_process.run_in_session(exit_3, timeout_s=30) == 3


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_verl_with_one_gpu_and_a_missing_peer_fail_with_what_stopped_them(tmp_path):
    w = bench_peers.Workload(gpus=1)
    with pytest.raises(bench_peers.RunnerFailed, match="needs --gpus 2"):
        bench_peers.run_verl(w, str(tmp_path), {})
    with pytest.raises(bench_peers.RunnerFailed, match="no_such_peer is not importable by"):
        bench_peers.python_can_import(sys.executable, "no_such_peer")


def _fake_trl(root, with_value_head: bool) -> str:
    (root / "trl").mkdir(parents=True)
    body = "class AutoModelForCausalLMWithValueHead: pass\n" if with_value_head else ""
    (root / "trl" / "__init__.py").write_text("__version__ = '0.0'\n" + body)
    return str(root)


def test_verl_refuses_a_trl_it_would_fail_on_and_trl_runs_from_its_own_path(tmp_path):
    """verl 0.9.1 imports trl's value-head model wherever trl is importable; TRL 1.x has none: the
    runner says so before verl starts, and `--trl-path` puts TRL on TRL's runner's path only."""
    env = {**bench_peers.child_env(bench_peers.Workload(), []), "PYTHONPATH": ""}
    bench_peers.check_verl_sees_no_unusable_trl(sys.executable, env)  # no trl at all: fine
    old = _fake_trl(tmp_path / "old", with_value_head=True)
    bench_peers.check_verl_sees_no_unusable_trl(sys.executable, {**env, "PYTHONPATH": old})
    new = _fake_trl(tmp_path / "new", with_value_head=False)
    with pytest.raises(bench_peers.RunnerFailed, match="--trl-path"):
        bench_peers.check_verl_sees_no_unusable_trl(sys.executable, {**env, "PYTHONPATH": new})
    ctx = {"env": env, "trl_path": new}
    assert bench_peers.python_can_import(sys.executable, "trl", bench_peers.trl_env(ctx)) == "0.0"
    with pytest.raises(bench_peers.RunnerFailed, match="trl is not importable"):
        bench_peers.python_can_import(sys.executable, "trl", env)


def test_trl_token_count_leaves_the_padding_out():
    pad, eos = 0, 9
    right_padded = torch.tensor([[5, 6, 7, 0, 0], [8, 0, 0, 0, 0], [1, 2, 3, 4, 6], [0, 0, 0, 0, 0]])
    assert bench_peers_trl.response_token_count(right_padded, pad, [eos]) == 3 + 1 + 5 + 0
    # a pad id that is also an EOS id: each row counts up to and including its first EOS
    eos_padded = torch.tensor([[5, 9, 9, 9], [5, 6, 7, 8], [9, 9, 9, 9], [4, 9, 3, 9]])
    assert bench_peers_trl.response_token_count(eos_padded, 9, [eos, 7]) == 2 + 4 + 1 + 2
    # what TRL's _generate_single_turn returns: unpadded id lists (vLLM's token_ids)
    assert bench_peers_trl.response_token_count([[1, 2, 9], [3], []], pad, [eos]) == 4
    with pytest.raises(ValueError, match="pad_token_id"):
        bench_peers_trl.response_token_count(right_padded, None, [eos])


class _TrlLikeTrainer:
    """What the TRL runner touches of TRL's DistillationTrainer, and its loop: `on_step_begin` before
    the first micro-step of an optimizer step, `on_step_end` after the last; generation in the micro-steps
    `generate_at` names, each call syncing weights first and returning a right-padded batch."""

    def __init__(self, model, teacher_model, args, train_dataset):
        self.plan, self.teacher_model, self.callbacks = args, teacher_model, []
        self.accelerator = type("Accelerator", (), {"unwrap_model": staticmethod(lambda m: m)})()
        self._tokenizer = type("Tokenizer", (), {"pad_token_id": 0})()
        self.eos_token_ids, self.use_vllm = [9], True
        self.vllm_generation = type("Gen", (), {})()
        self.vllm_generation.sync_weights = lambda: time.sleep(0.01)

    def add_callback(self, callback):
        self.callbacks.append(callback)

    def _generate_single_turn(self, prompt_ids, images, fields):
        self.vllm_generation.sync_weights()
        time.sleep(0.02)
        return self.plan["batch"]

    def _get_last_hidden_state(self, model, *rest):
        return None

    def train(self):
        for generate_at in self.plan["generate_at"]:
            for cb in self.callbacks:
                cb.on_step_begin(self.plan, None, None)
            for micro in range(self.plan["accumulation"]):
                if micro in generate_at:
                    self._generate_single_turn([], None, {})
                self._get_last_hidden_state(self.teacher_model)
            for cb in self.callbacks:
                cb.on_step_end(self.plan, None, None)


def test_trl_runner_sums_every_generate_call_of_an_optimizer_step():
    w = bench_peers.Workload(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=5, steps=2,
                             warmup_steps=1)
    batch = torch.tensor([[5, 6, 7, 0, 0], [8, 0, 0, 0, 0], [1, 2, 3, 4, 6], [1, 9, 0, 0, 0]])
    plan = {"batch": batch, "accumulation": 4, "generate_at": [{0}, {0}, {0, 2}]}
    rows = bench_peers_trl.train(w, ["p"] * 4, plan, False, False, _TrlLikeTrainer, object, "trl fake")
    assert [r.warmup for r in rows] == [True, False, False]
    assert [r.generation_calls for r in rows] == [1, 1, 2]
    assert [r.response_tokens for r in rows] == [11, 11, 22]
    assert rows[1].notes == "vLLM colocated; 1 generate call of 4 sequences in the step"
    assert rows[2].notes == "vLLM colocated; 2 generate calls of 8 sequences in the step (the workload: 4)"
    for row in rows:  # the weight sync inside each generate call is the weight update, not generation
        assert row.generation_s >= 0.02 * row.generation_calls
        assert row.weight_update_s >= 0.01 * row.generation_calls
        assert row.train_s >= 0 and row.step_s >= row.generation_s + row.weight_update_s


def test_a_peer_generating_other_token_counts_shows_both():
    w = bench_peers.Workload()
    summaries = [bench_peers.summarize("opkd", "a", w, [_row("opkd", 0, 1.0, tokens=120)]),
                 bench_peers.summarize("trl", "a", w, [_row("trl", 0, 1.0, tokens=100)]),
                 bench_peers.summarize("plain", "a", w, [_row("plain", 0, 1.0, tokens=120)])]
    bench_peers.add_ratios(summaries)
    table = bench_peers.table_rows(summaries)
    assert table[1]["response tokens"] == "100 (opkd 120)" and "against opkd's 120" in table[1]["notes"]
    assert table[2]["response tokens"] == "120" and table[2]["notes"] == ""
    assert summaries[1]["opkd_ratio"] == 1.2


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("schedule", ["sync", "one_step_off"])  # one_step_off: the Ray controller, colocated
def test_opkd_runner_reads_its_stages_from_metrics(tiny_pair, tmp_path, schedule):
    w = tiny_workload(*tiny_pair, prompts_per_step=2, warmup_steps=1, steps=1, schedule=schedule)
    ctx = bench_peers.make_context(w, str(tmp_path), [])
    (tmp_path / "opkd").mkdir()
    rows = bench_peers.run_opkd(w, str(tmp_path / "opkd"), ctx)
    assert [r.warmup for r in rows] == [True, False]
    for row in rows:
        assert row.generation_s > 0 and row.teacher_s > 0 and row.train_s > 0 and row.step_s > 0
        assert 0 < row.response_tokens <= w.sequences_per_step * w.max_new_tokens
