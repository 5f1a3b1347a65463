"""A served teacher that returns final-norm hidden states (`output: hidden`), end to end on CPU.

- the teacher's output weight, as the trainer holds it: TP shards of `lm_head` (or the tied
  embedding) read from the HF checkpoint, zero rows past its vocabulary;
- the `/pooling` bytes protocol of a stock vLLM server (bf16 on the wire) through
  `RemoteVllmTeacher(output="hidden")` against a fake server speaking that protocol;
- a training step on hidden-state rows: fused LM head on == off (the teacher's logits formed from
  the rows and the held weight), and == the loss of the same teacher's materialised logits;
- config rules; and (`-m vllm`, slow) an in-process vLLM pooling engine returning the hidden states
  of `transformers`' `last_hidden_state`.
"""
from __future__ import annotations

import http.server
import json
import threading

import pytest
import torch

from opkd_mcore.data import ALPHABET
from opkd_mcore.models.tiny import TinyModelShape, save_tiny_hf_model
from tests._dist import run_distributed

V = 32
SHAPE = dict(vocab_size=V, hidden_size=64, num_layers=2, num_attention_heads=2, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=64)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("served_hidden")
    teacher = TinyModelShape(**{**SHAPE, "vocab_size": 37, "hidden_size": 96})
    tied = TinyModelShape(**{**SHAPE, "tie_word_embeddings": True})
    return {"student": save_tiny_hf_model(str(root / "student"), "qwen3", TinyModelShape(**SHAPE), seed=1,
                                          alphabet=ALPHABET),
            "teacher": save_tiny_hf_model(str(root / "teacher"), "qwen3", teacher, seed=2, alphabet=ALPHABET,
                                          init_std=0.1),
            "tied": save_tiny_hf_model(str(root / "tied"), "qwen3", tied, seed=3, alphabet=ALPHABET)}


def _hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)


@pytest.mark.parametrize("name", ["teacher", "tied"])
def test_output_weight_shards_are_the_lm_head_rows(models, name):
    from opkd_mcore.teacher.hidden_states import load_output_weight_shard

    full = _hf(models[name]).get_output_embeddings().weight.detach()
    shards = [load_output_weight_shard(models[name], 40, r, 2, torch.float32) for r in range(2)]
    assert all(s.shape == (20, full.shape[1]) for s in shards)
    held = torch.cat(shards)
    torch.testing.assert_close(held[:full.shape[0]], full, rtol=0, atol=0)
    assert not held[full.shape[0]:].any()


def _states(model_dir, seqs):
    hf = _hf(model_dir)
    with torch.no_grad():
        return [hf.model(torch.tensor([s])).last_hidden_state[0] for s in seqs]


def _fake_pooling_server(states_by_seq: dict):
    """Answers POST /pooling like vLLM (encoding_format bytes, embed_dtype bfloat16), GET /v1/models."""
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = json.dumps({"data": [{"id": "teacher"}]}).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(req)
            chunks, items, offset = [], [], 0
            for i, ids in enumerate(req["input"]):
                x = states_by_seq.get(tuple(ids), torch.zeros(len(ids), 96)).to(torch.bfloat16)
                raw = x.view(torch.int16).numpy().tobytes()
                items.append(dict(index=i, embed_dtype="bfloat16", endianness="native", start=offset,
                                  end=offset + len(raw), shape=list(x.shape)))
                chunks.append(raw)
                offset += len(raw)
            self.send_response(200)
            self.send_header("metadata", json.dumps({"data": items}))
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            self.wfile.write(b"".join(chunks))

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, seen


def test_remote_hidden_teacher_reads_vllm_bytes_responses(models):
    from opkd_mcore.losses import HiddenTeacher
    from opkd_mcore.teacher.remote import RemoteTeacherConfig, RemoteVllmTeacher

    seqs = [[1, 4, 5, 14, 6], [1, 7, 8, 14, 9, 15, 10], [1, 3, 3]]
    states = _states(models["teacher"], seqs)
    # the server is sent each sequence without its last token (its position scores nothing), whose
    # states are the full sequence's but the last (causal attention)
    httpd, seen = _fake_pooling_server({tuple(s[:-1]): x[:-1] for s, x in zip(seqs, states)})
    try:
        teacher = RemoteVllmTeacher(RemoteTeacherConfig(url=f"http://127.0.0.1:{httpd.server_port}",
                                                        output="hidden", batch_size=2))
        rows = teacher.score(seqs)
    finally:
        httpd.shutdown()
    assert all(isinstance(r, HiddenTeacher) and r.weight is None and r.hidden.dtype == torch.bfloat16 for r in rows)
    for s, x, r in zip(seqs, states, rows):
        assert r.hidden.shape == (len(s) - 1, 96)   # row t scores token t+1: the last position scores nothing
        torch.testing.assert_close(r.hidden, x[:-1].to(torch.bfloat16), rtol=0, atol=0)
    # response bodies: 2 H bytes a position sent (bf16; the 1-token probe of the mode included) and
    # the model listing's JSON
    listing = len(json.dumps({"data": [{"id": "teacher"}]}))
    assert teacher.stats["wire_bytes"] == (sum(len(s) - 1 for s in seqs) + 1) * 96 * 2 + listing
    sent = [[s[:-1] for s in seqs[:2]], [seqs[2][:-1]]]
    scoring = [q for q in seen if q["input"] in sent]
    # batches go out concurrently: their order at the server is not the client's
    assert sorted(q["input"] for q in scoring) == sorted(sent)  # a request filling the context never ends on vLLM 0.26
    assert scoring and all(q["encoding_format"] == "bytes" and q["embed_dtype"] == "bfloat16"
                           and q["task"] == "token_embed" for q in scoring)


def _served_step(rank, world, student_dir, teacher_dir, fused):
    """One train_stage on hidden-state rows (as a served teacher sends them) with the held weight shard."""
    from megatron.core import parallel_state as ps

    from opkd_mcore.config import LossSection, ParallelSection
    from opkd_mcore.config.schema import OptimSection
    from opkd_mcore.losses import HiddenTeacher
    from opkd_mcore.losses.plan import resolve_loss_plan
    from opkd_mcore.platform.parallel import ParallelConfig, destroy_parallel, init_parallel
    from opkd_mcore.teacher.hidden_states import rows_from_states
    from opkd_mcore.train.components import build_student, shard_layout
    from opkd_mcore.train.stages import train_stage
    from opkd_mcore.train.teacher_setup import with_hidden_teacher_head
    from tests.test_train_integration import _scored

    init_parallel(ParallelConfig(tp=world, seed=3))
    try:
        from opkd_mcore.config import load_config

        cfg = load_config(None, [f"model.student={student_dir}", f"teacher.teachers.0.model={teacher_dir}",
                                 "teacher.teachers.0.backend=vllm", "teacher.teachers.0.output=hidden",
                                 "loss.support=null"], check_files=False, validate=False)
        scored = _scored(7, dense=False)
        states = _states(teacher_dir, [s.sequence for s in scored.samples])
        scored.teacher = [rows_from_states(s.sequence, x[:-1], "test")
                          for s, x in zip(scored.samples, states)]
        out = {}
        for mode in fused:
            engine, _ = build_student(student_dir, OptimSection(lr=1.0, adam_eps=1.0, clip_grad=0.0))
            shard = with_hidden_teacher_head(cfg, shard_layout(engine), torch.float32)
            assert isinstance(scored.teacher[0], HiddenTeacher) and shard.teacher_vocab == V
            loss = LossSection(fused_lm_head=mode, divergence="jsd", beta=0.3, temperature=1.5)
            plan = resolve_loss_plan(loss, device=engine.device, dtype=engine.params_dtype,
                                     teacher_kind="hidden")
            result = train_stage(engine, scored, plan,
                                 ParallelSection(micro_batch_size=2, global_batch_size=4), shard,
                                 ps.get_tensor_model_parallel_group())
            out[mode] = (result.metrics, [p.detach().clone() for p in engine.parameters()])
        return out
    finally:
        destroy_parallel()


def test_training_step_on_served_hidden_states_fused_on_equals_off(models):
    per_rank = run_distributed(_served_step, 2, models["student"], models["teacher"], ["on", "off"])
    for out in per_rank:
        (m_on, p_on), (m_off, p_off) = out["on"], out["off"]
        for k in ("train/loss", "train/grad_norm", "kd/per_token_loss", "teacher/top1_agreement"):
            assert m_on[k] == pytest.approx(m_off[k], rel=2e-5, abs=1e-6), k
        assert m_on["teacher/nonfinite_rows"] == 0.0
        for a, b in zip(p_on, p_off):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("overrides, match", [
    (["teacher.teachers.0.backend=hf", "teacher.teachers.0.output=hidden"], "^teacher.teachers.0.output: 'hidden'"),
    (["teacher.teachers.0.backend=remote", "teacher.teachers.0.url=http://127.0.0.1:1",
      "teacher.teachers.0.model=", "teacher.teachers.0.output=hidden"], "^teacher.teachers.0.model: a remote teacher"),
    (["teacher.teachers.0.output=hidden", "loss.confidence_alpha=1.0"], "^loss.confidence_alpha"),
])
def test_hidden_output_config_rules(models, overrides, match):
    from opkd_mcore.config import ConfigError, load_config

    base = [f"model.student={models['student']}", f"teacher.teachers.0.model={models['teacher']}",
            "teacher.teachers.0.backend=vllm", "loss.support=null", "rollout.max_model_len=64"]
    with pytest.raises(ConfigError, match=match):
        load_config(None, base + overrides)
    load_config(None, base + ["teacher.teachers.0.output=hidden", "loss.fused_lm_head=on"])


def _vllm_hidden(model_dir, seqs):
    from opkd_mcore.teacher.vllm_teacher import VllmTeacher, VllmTeacherConfig

    teacher = VllmTeacher(model_dir, VllmTeacherConfig(output="hidden", dtype="float32", max_model_len=64,
                                                       gpu_memory_utilization=0.12))
    try:
        return teacher.score(seqs)
    finally:
        teacher.close()


@pytest.mark.slow
@pytest.mark.vllm
def test_in_process_vllm_returns_the_final_norm_hidden_states(models):
    seqs = [[1, 4, 5, 14, 6, 15, 9, 2], [1, 7, 8, 14, 9]]
    rows = run_distributed(_spawned_vllm_hidden, 1, models["teacher"], seqs, backend=None)[0]
    for s, x, r in zip(seqs, _states(models["teacher"], seqs), rows):
        assert r.shape == (len(s) - 1, 96)
        torch.testing.assert_close(r.float(), x[:-1].to(torch.bfloat16).float(), rtol=0, atol=0.02)


def _spawned_vllm_hidden(rank, world, model_dir, seqs):
    return [r.hidden for r in _vllm_hidden(model_dir, seqs)]
