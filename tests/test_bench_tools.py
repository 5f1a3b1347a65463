"""The benchmark tools' own outputs on CPU: `tools/bench_common.py` (percentiles, run metadata, the
results file), `bench_kernels.py --profile`, `bench_weight_sync.py`'s row and timeline, and
`tools/gpu/step_table.py`."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests._dist import free_port
from tools import bench_common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METADATA_KEYS = {"tool", "commit", "dirty", "device", "versions", "utc", "host", "argv"}


def test_percentiles_of_a_known_sequence():
    # 1..11 in any order: ranks 0..10, so p20 / p50 / p80 fall exactly on 3, 6 and 9
    got = bench_common.percentiles([7, 1, 11, 3, 5, 9, 2, 10, 4, 8, 6])
    assert got == {"p20": 3.0, "p50": 6.0, "p80": 9.0}
    # between ranks the value is interpolated, and a single sample is every percentile
    assert bench_common.percentiles([0.0, 10.0]) == {"p20": 2.0, "p50": 5.0, "p80": 8.0}
    assert bench_common.percentiles([4.5]) == {"p20": 4.5, "p50": 4.5, "p80": 4.5}
    with pytest.raises(ValueError):
        bench_common.percentiles([])


def test_time_it_times_only_the_repeats_and_runs_the_hooks_around_every_call():
    calls, events = [], []
    seconds = iter([0.5, 0.1, 0.3, 0.2, 0.4])  # a fake timer: one value per timed call

    def timer(fn, synchronize):
        fn()
        synchronize()
        return next(seconds)

    timing = bench_common.time_it(lambda: calls.append(len(calls)), warmup=2, repeats=5,
                                  synchronize=lambda: events.append("sync"),
                                  before_each=lambda: events.append("before"),
                                  after_each=lambda: events.append("after"), timer=timer)
    assert calls == list(range(7))
    assert events == ["before", "sync", "after"] * 7
    assert timing.samples == [0.5, 0.1, 0.3, 0.2, 0.4]
    assert (timing.p20, timing.p50, timing.p80) == pytest.approx((0.18, 0.3, 0.42))
    assert timing.row("step_ms", scale=1e3) == {"step_ms": 300.0, "step_ms_p20": 180.0, "step_ms_p80": 420.0}


def test_run_metadata_and_a_results_row_read_back(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("OPKD_GIT_COMMIT", raising=False)
    meta = bench_common.run_metadata(device="test device", tp=2)
    assert METADATA_KEYS <= set(meta) and meta["tp"] == 2 and meta["device"] == "test device"
    if os.path.exists(os.path.join(ROOT, ".git")):  # a source copy without git history has no commit
        assert meta["commit"] and isinstance(meta["dirty"], bool)
    assert meta["versions"]["torch"] == torch.__version__
    assert meta["utc"].endswith("+00:00")
    monkeypatch.setenv("OPKD_GIT_COMMIT", "abc1234-dirty")  # a copy of the tree without .git
    assert bench_common.git_commit() == {"commit": "abc1234", "dirty": True}

    path = tmp_path / "runs.jsonl"
    rows = [{"method": "fused", "ms": 1.5}, {"method": "reference", "ms": 12.0}]
    bench_common.record(str(path), meta, rows)
    bench_common.record(str(path), meta, rows[:1], table=False)
    first, second = bench_common.read_results(str(path))
    assert {k: first[k] for k in meta} == json.loads(json.dumps(meta))
    assert first["results"] == rows and second["results"] == rows[:1]
    out = capsys.readouterr().out
    assert "test device" in out and "| method | ms |" in out and "| reference | 12 |" in out


def test_bench_kernels_profile_writes_the_kernel_table(tmp_path):
    out, prefix, results = tmp_path / "bench.json", tmp_path / "prof", tmp_path / "runs.jsonl"
    env = {**os.environ, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "tools/bench_kernels.py", "--device", "cpu", "--shapes", "32x200",
                           "--objectives", "topk64", "--methods", "fused", "--repeats", "1", "--warmup", "0",
                           "--out", str(out), "--profile", str(prefix), "--results", str(results)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["method"] == "fused" and row["ms_p20"] <= row["ms"] <= row["ms_p80"]
    (run,) = bench_common.read_results(str(results))
    assert METADATA_KEYS <= set(run) and run["device"].startswith("cpu") and run["results"] == [row]
    table = (tmp_path / "prof_topk64_tp1.txt").read_text()
    assert "FusedKdLoss" in table and "# of Calls" in table


@pytest.mark.parametrize("tool, argv, message", [
    ("bench_step", ["--schedules", "sync,nope"], "--schedules: expected some of sync, one_step_off"),
    ("bench_teacher", ["--ks", "20,0"], "--ks: expected an integer >= 1, got '0'"),
    ("bench_teacher", ["--paths", "device,logits"], "--paths: expected some of prompt_logprobs, device"),
    ("bench_models", ["--layers", "0"], "--layers: expected an integer >= 1, got '0'"),
    ("bench_train_step", ["--impls", "fused,triton"], "--impls: expected some of fused, reference"),
    ("bench_peers", ["--runners", "opkd,nope"], "--runners: expected some of opkd, plain, trl, verl"),
])
def test_bench_tools_refuse_bad_options_before_any_work(tool, argv, message, monkeypatch, capsys):
    import importlib

    module = importlib.import_module(f"tools.{tool}")
    monkeypatch.setattr(sys, "argv", [f"{tool}.py", *argv])  # bench_models reads sys.argv
    with pytest.raises(SystemExit) as exit_:
        module.parse_args(*([] if tool == "bench_models" else [argv]))
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_bench_tools_parse_their_list_options():
    assert bench_common.positive_ints("20,64") == [20, 64]
    assert bench_common.choices_list(("a", "b"))("b,a") == ["b", "a"]


def test_bench_weight_sync_refuses_an_e2e_option_without_e2e():
    proc = subprocess.run([sys.executable, "tools/bench_weight_sync.py", "--layout", "tp2-coloc", "--layers", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "error: --layout, --layers: only with --e2e" in proc.stderr


def test_bench_weight_sync_row_verifies_the_copy_and_orders_both_ends_marks(tmp_path):
    """The standalone sync benchmark over gloo: the receiver's model holds the sender's values, and
    the last sync's timeline has every mark of both ends, in the order the protocol allows."""
    out = tmp_path / "ws.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "tools/bench_weight_sync.py", "--shape", "tiny", "--device", "cpu",
                           "--bucket-mb", "1", "--iters", "1", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(out.read_text())
    assert row["receiver_verified"] and row["buckets"] > 1 and row["sync_s"] > 0 and row["raw_s"] > 0
    assert METADATA_KEYS <= set(row["meta"]) and row["sync_s_p20"] <= row["sync_s"] <= row["sync_s_p80"]
    at = row["timeline"]
    assert at["at_send_start_ms"] == 0.0
    order = list(at)
    for end, names in (("send", ["start", "header_asked", "header_posted", "packed", "handshaken",
                                 "posted_last", "end"]),
                       ("recv", ["start", "header_asked", "header_landed", "header", "posted", "bytes_in",
                                 "end"])):
        positions = [order.index(f"at_{end}_{name}_ms") for name in names]
        assert positions == sorted(positions), (end, order)
    assert at["at_send_header_asked_ms"] <= at["at_recv_header_landed_ms"]
    assert at["at_send_handshaken_ms"] <= at["at_recv_bytes_in_ms"]
    assert "the last sync, ms from the sender's start:" in proc.stdout


def test_step_table_means_after_the_warm_up_step(tmp_path):
    step_table = _step_table()
    path = tmp_path / "metrics.jsonl"
    rows = [{"timing/step": 9.0, "timing/rollout": 5.0, "train/loss": 0.9, "perf/tokens_per_s": 10.0},
            {"timing/step": 3.0, "timing/rollout": 1.0, "timing/train": 1.5, "train/loss": 0.5,
             "perf/tokens_per_s": 100.0},
            {"timing/step": 2.0, "timing/rollout": 2.0, "timing/train": 0.5, "train/loss": 0.4,
             "rollout/response_tokens": 400.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = step_table.summarize(str(path), skip=1)
    cells = [c.strip() for c in line.strip("|").split("|")]
    # run, steps, rollout, teacher (absent), train, weight sync (absent), step, tokens/s, losses
    assert cells == ["metrics.jsonl", "2", "1.50", "-", "1.00", "-", "2.50", "150", "0.5000 0.4000"]
    assert "no steps" in step_table.summarize(str(path), skip=3)
    with pytest.raises(FileNotFoundError):
        step_table.summarize(str(tmp_path / "missing.jsonl"), skip=0)


def _step_table():
    sys.path.insert(0, os.path.join(ROOT, "tools", "gpu"))
    try:
        import step_table
    finally:
        sys.path.pop(0)
    return step_table


# Qwen3 model cards: parameters, and parameters without the input embedding and the output layer
CARD_PARAMS = {"qwen3-8b": (8.2e9, 6.95e9), "qwen3-14b": (14.8e9, 13.2e9), "qwen3-32b": (32.8e9, 31.2e9)}


@pytest.mark.parametrize("shape", sorted(CARD_PARAMS))
def test_named_shapes_have_the_model_cards_sizes(tmp_path, shape):
    """The shapes `tools/make_model.py` writes for the 4-GPU run have the real checkpoints' sizes
    (the published counts, to their 3 digits) and RoPE base, and the step table's N for MFU is the
    matmul weights: the card's non-embedding count plus one output layer."""
    from opkd_mcore.models.tiny import NAMED_SHAPES, tiny_hf_config

    tiny_hf_config("qwen3", NAMED_SHAPES[shape]).to_json_file(str(tmp_path / "config.json"))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 1e6 and config["rms_norm_eps"] == 1e-6
    assert config["max_position_embeddings"] == 40960 and config["tie_word_embeddings"] is False
    total, matmul = _step_table().model_params(str(tmp_path))
    embedding = config["vocab_size"] * config["hidden_size"]
    card_total, card_body = CARD_PARAMS[shape]
    assert total == pytest.approx(card_total, rel=5e-3)
    assert matmul - embedding == pytest.approx(card_body, rel=5e-3)


def test_step_table_per_gpu_figures_and_the_steps_window(tmp_path, capsys):
    step_table = _step_table()
    model = tmp_path / "model"
    model.mkdir()
    # 2 layers of h=4, 2 heads of 2, 1 KV head, FFN 8, vocab 10, untied: q, o 16 each, k, v 8 each, MLP 96:
    # 2*144 + the output layer's 40 = 328 matmul weights, and the input embedding's 40 more
    (model / "config.json").write_text(json.dumps(
        {"hidden_size": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 2,
         "intermediate_size": 8, "num_hidden_layers": 2, "vocab_size": 10, "tie_word_embeddings": False}))
    assert step_table.model_params(str(model)) == (368, 328)
    path = tmp_path / "metrics.jsonl"
    rows = [{"timing/step": 50.0, "timing/train": 40.0, "rollout/response_tokens": 1.0},
            {"timing/step": 10.0, "timing/train": 4.0, "rollout/response_tokens": 4e12},
            {"timing/step": 6.0, "timing/train": 2.0, "rollout/response_tokens": 2e12}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # the two steps after the warm-up end at t=100 and lasted 16 s: samples in [84, 100] count
    smi = [(83.9, 0, 100.0, 90 * 1024.0), (84.0, 0, 50.0, 10 * 1024.0), (99.0, 0, 70.0, 20 * 1024.0),
           (90.0, 1, 30.0, 5 * 1024.0), (100.5, 1, 100.0, 70 * 1024.0)]
    line = step_table.efficiency(str(path), 1, gpus=2, n_student=1, n_teacher=3, peak_tflops=100.0,
                                 smi=smi, end=100.0)
    cells = [c.strip() for c in line.strip("|").split("|")]
    # 6e12 tokens: /16 s /2 GPUs; /6 s /2 GPUs; (6*1 + 2*3) FLOPs a token: 12 * 6e12 / 6 / 2 = 6 TFLOP/s
    assert cells == ["metrics.jsonl", "2", "2", "8.00", str(round(6e12 / 16 / 2)), str(round(6e12 / 6 / 2)),
                     "6", "6.0%", "60 / 30", "20.0 / 5.0"]
    smi_file = tmp_path / "gpus.smi"
    smi_file.write_text("".join(f"{t}, {i}, {u}, {m}\n" for t, i, u, m in smi) + "101.0, 0, [N/A], 1\n")
    assert step_table.read_smi(str(smi_file)) == smi
    os.utime(path, (100.0, 100.0))
    step_table.main([str(path), "--gpus", "2", "--student", str(model), "--smi", str(smi_file)])
    out = capsys.readouterr().out
    assert "| metrics.jsonl | 2 | 2 | 8.00 |" in out and "| 60 / 30 | 20.0 / 5.0 |" in out
    assert "N student 0.00B, N teacher 0.00B, peak 989 TFLOP/s per GPU" in out


@pytest.mark.slow
def test_bench_step_reuses_its_actors_across_schedules(tmp_path):
    """`opkd bench step`: the second schedule runs on the first one's actors, which closes the weight-sync
    groups on both ends, resets the trainer and rebuilds the groups (on two GPUs that once hung); each
    schedule's row is written as soon as it is done."""
    out = tmp_path / "step.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "opkd_mcore.cli", "bench", "step", "--steps", "2",
                           "--schedules", "sync,one_step_off", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["sync", "one_step_off"]
    for schedule, r in results.items():
        assert len(r["per_step"]) == 2 and r["step"] > 0, schedule
        assert all(s["timing/weight_sync"] > 0 for s in r["per_step"]), schedule
    rows = [line.split("|")[0].strip() for line in proc.stdout.splitlines() if "|" in line]
    assert rows == ["schedule", "sync", "one_step_off"]


@pytest.mark.parametrize("argv, world, message", [
    (["--cp", "2"], 1, "--tp 1 x --cp 2 does not divide the 1 ranks"),
    (["--tp", "1", "--sequence-parallel"], 2, "--sequence-parallel: needs tp > 1"),
    (["--cp", "2"], 2, "need Transformer Engine on a GPU"),
])
def test_bench_train_step_refuses_a_layout_that_cannot_run_before_any_group_forms(argv, world, message,
                                                                                   monkeypatch):
    from opkd_mcore.models import builder
    from tools import bench_train_step

    monkeypatch.setattr(builder, "transformer_engine_usable", lambda device=None: False)  # as on any CPU

    with pytest.raises(SystemExit, match=message):
        bench_train_step.check_layout(bench_train_step.parse_args(argv), world)
    assert bench_train_step.check_layout(bench_train_step.parse_args(["--cp", "1"]), 4) == 4


def test_bench_models_moe_tokens_per_rank_and_optimizer_flags(monkeypatch, capsys):
    """`--tokens-per-rank` becomes micro-batches of `--seq` tokens; `--distributed-optimizer` and
    `--overlap` become the engine's optimizer options (valid ones); a count that is no multiple is refused."""
    from tools import bench_models
    from tools.bench_models_moe import optim_section, optimizer_name

    def parse(*argv):
        monkeypatch.setattr(sys, "argv", ["bench_models.py", "--moe", "--seq", "32", *argv])
        return bench_models.parse_args()

    expected = {(): ((False, False, False), "replicated"),
                ("--distributed-optimizer",): ((True, False, False), "distributed"),
                ("--overlap",): ((True, True, True), "distributed+overlap")}
    for flags, (options, name) in expected.items():
        args = parse("--tokens-per-rank", "96", *flags)
        optim = optim_section(args)
        optim.validate()
        assert args.micro_batch == 3 and optimizer_name(args) == name
        assert options == (optim.use_distributed_optimizer, optim.overlap_grad_reduce,
                           optim.overlap_param_gather)
    assert parse("--micro-batch", "2").micro_batch == 2  # without --tokens-per-rank: as before
    with pytest.raises(SystemExit):
        parse("--tokens-per-rank", "50")
    assert "--tokens-per-rank: expected a positive multiple of --seq=32, got 50" in capsys.readouterr().err


def test_bench_models_moe_trains_with_the_overlapped_distributed_optimizer_on_cpu(tmp_path):
    """The lane's `MOE_OVERLAP=1 MOE_TOKENS=...` run in miniature: 2 ranks (EP=2), 2 micro-batches each."""
    out = tmp_path / "moe.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    shape = ["--hidden", "64", "--layers", "1", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
             "--vocab", "256", "--seq", "32", "--experts", "4", "--topk", "2", "--moe-ffn", "32"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           "2", "tools/bench_models.py", "--moe", *shape, "--warmup", "1", "--steps", "1",
                           "--tokens-per-rank", "64", "--overlap", "--moe-experts", "sequential",
                           "--balanced-routing", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(out.read_text())
    assert row["optimizer"] == "distributed+overlap"
    assert (row["tokens_per_rank"], row["micro_batches_per_rank"]) == (64, 2)
    assert row["tokens_per_step"] == 128 and row["ep"] == 2 and 0 < row["loss"] < float("inf")
    assert row["routing"] == "balanced" and row["moe_fusions"] is False


def test_bench_models_moe_fusions_without_transformer_engine_is_an_error_naming_it(monkeypatch):
    from tools import bench_models
    from tools.bench_models_moe import _run_one

    monkeypatch.setattr(sys, "argv", ["bench_models.py", "--moe", "--moe-fusions", "on"])
    with pytest.raises(SystemExit, match="--moe-fusions: .*Transformer Engine is not importable"):
        _run_one(bench_models.parse_args(), 1, "sequential")


def test_make_model_never_writes_into_a_directory_it_did_not_make(tmp_path, capsys):
    """`tools/make_model.py --out` a user's directory (a real checkpoint, say) is refused, --force too,
    every file unchanged; its own output, even half-written, is replaced with --force."""
    from tools import make_model

    mine = tmp_path / "Qwen3-8B"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    (mine / "model.safetensors").write_bytes(b"weights")
    for force, says in (([], "already exists and is not empty"), (["--force"], "has no .opkd_make_model marker")):
        with pytest.raises(SystemExit) as exit_:
            make_model.main(["--shape", "qwen3-0.6b", "--out", str(mine), *force])
        assert exit_.value.code == 2 and says in capsys.readouterr().err
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "model.safetensors"]
    assert (mine / "model.safetensors").read_bytes() == b"weights"
    half = tmp_path / "made"  # a call stopped after the marker and before the weights
    half.mkdir()
    (half / make_model.MARKER_FILE).write_text("qwen3-0.6b\n")
    (half / "stale.safetensors").write_bytes(b"x")
    assert make_model.main(["--shape", "qwen3-0.6b", "--layers", "1", "--dtype", "fp32", "--out", str(half),
                            "--force"]) == 0
    assert not (half / "stale.safetensors").exists() and (half / "tokenizer_config.json").is_file()
