"""Checks of the models a run names: shapes from `config.json`, the student/teacher vocabulary by
their tokenizers, and the parallel layout against the student's heads, layers and experts.

For hub names that are not local directories a small table of known shapes is used, so that the
real-scale recipes validate on a laptop. Whether teacher and student share a vocabulary is decided
by their tokenizers where both checkpoints have one (`config.json` sizes include padding).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os

from opkd_mcore.config.checks import choice, positive
from opkd_mcore.config.errors import ConfigError
from opkd_mcore.config.schema import RECOMPUTE_MODES, TrainConfig

logger = logging.getLogger(__name__)

# Shapes of public checkpoints the recipes name (from their config.json), used when the path is a
# hub id rather than a local directory. Fields: heads, kv_heads, layers, vocab, max_positions
# (max_position_embeddings: the longest sequence the model is built for); an MoE model's experts
# (routed experts) and expert_ffn (each expert's FFN size, which expert TP splits).
_QWEN3 = dict(vocab=151936, max_positions=40960)
KNOWN_MODEL_SHAPES = {
    "Qwen/Qwen3-0.6B": dict(heads=16, kv_heads=8, layers=28, **_QWEN3),
    "Qwen/Qwen3-1.7B": dict(heads=16, kv_heads=8, layers=28, **_QWEN3),
    "Qwen/Qwen3-4B": dict(heads=32, kv_heads=8, layers=36, **_QWEN3),
    "Qwen/Qwen3-8B": dict(heads=32, kv_heads=8, layers=36, **_QWEN3),
    "Qwen/Qwen3-14B": dict(heads=40, kv_heads=8, layers=40, **_QWEN3),
    "Qwen/Qwen3-32B": dict(heads=64, kv_heads=8, layers=64, **_QWEN3),
    "Qwen/Qwen3-30B-A3B": dict(heads=32, kv_heads=4, layers=48, experts=128, expert_ffn=768, **_QWEN3),
    "Qwen/Qwen3-235B-A22B": dict(heads=64, kv_heads=4, layers=94, experts=128, expert_ffn=1536, **_QWEN3),
}


def model_shape(path_key: str, model: str, check_files: bool) -> dict | None:
    """heads / kv_heads / layers / vocab of a checkpoint, or None when unknown and not checked."""
    cfg_file = os.path.join(model, "config.json")
    if os.path.isfile(cfg_file):
        try:
            with open(cfg_file) as f:
                hf = json.load(f)
            hf = hf.get("text_config", hf)
            heads = hf["num_attention_heads"]
            # routed experts: Qwen MoE "num_experts", Mixtral "num_local_experts"; None = dense
            experts = hf.get("num_experts") or hf.get("num_local_experts") or None
            # an expert's FFN: Qwen MoE "moe_intermediate_size", Mixtral's experts "intermediate_size"
            expert_ffn = (hf.get("moe_intermediate_size") or hf.get("intermediate_size")) if experts else None
            return dict(heads=heads, kv_heads=hf.get("num_key_value_heads") or heads,
                        layers=hf["num_hidden_layers"], vocab=hf["vocab_size"], experts=experts,
                        expert_ffn=expert_ffn, max_positions=hf.get("max_position_embeddings"))
        except (ValueError, KeyError, AttributeError) as err:  # not JSON, or not a decoder config
            raise ConfigError(f"{path_key}: {cfg_file} is not a usable HF model config "
                              f"({type(err).__name__}: {err})") from None
    if model in KNOWN_MODEL_SHAPES:
        return KNOWN_MODEL_SHAPES[model]
    if check_files:
        raise ConfigError(f"{path_key}: no HF checkpoint at {model!r} (expected a directory with "
                          f"config.json, or one of {sorted(KNOWN_MODEL_SHAPES)})")
    return None


def check_context(path_key: str, model: str, shape: dict | None, max_model_len: int) -> None:
    """The model is built for sequences of `rollout.max_model_len` tokens (vLLM refuses a longer
    context; a Megatron or transformers forward would run positions the model never learnt)."""
    limit = shape.get("max_positions") if shape else None
    if limit and max_model_len > limit:
        raise ConfigError(f"rollout.max_model_len: {max_model_len} exceeds the max_position_embeddings "
                          f"{limit} of {path_key} ({model})")


def check_top_k(path_key: str, top_k: int, model: str, shape: dict | None) -> None:
    """A top-k teacher cannot return more entries per position than its vocabulary has."""
    if shape and top_k > shape["vocab"]:
        raise ConfigError(f"{path_key}: {top_k} exceeds the vocabulary of {shape['vocab']} tokens of the "
                          f"teacher's checkpoint ({model})")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


@dataclasses.dataclass
class TokenizerInfo:
    """What the vocabulary check needs of a checkpoint's tokenizer."""

    size: int  # len(tokenizer): every id the model can be asked to emit, added tokens included
    ids: dict[str, int]  # token string -> id (`get_vocab()`, added tokens included)


def load_tokenizer_info(path_key: str, model: str, cache: dict) -> TokenizerInfo | None:
    """The tokenizer of a local checkpoint, or None when it has no tokenizer files (or is a hub
    id: nothing is downloaded). `cache` maps model -> result within one validation."""
    if model not in cache:
        cache[model] = None
        if any(os.path.isfile(os.path.join(model, name)) for name in TOKENIZER_FILES):
            from transformers import AutoTokenizer

            try:
                tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
            except Exception as err:  # transformers raises many kinds; all mean a broken checkpoint
                raise ConfigError(f"{path_key}: cannot load the tokenizer of {model!r}: {err}") from None
            cache[model] = TokenizerInfo(size=len(tok), ids=tok.get_vocab())
    return cache[model]


def load_run_tokenizer(path_key: str, model: str):
    """The tokenizer a run reads `model` with: a local checkpoint's files, or a hub id's, fetched by
    transformers. One that cannot be loaded (an offline machine cannot fetch a hub id) is a
    `ConfigError` naming the key, raised before any engine starts."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as err:
        where = ("its checkpoint directory" if os.path.isdir(model) else
                 "the Hugging Face Hub (a hub id: without access to the Hub, pass a checkpoint directory)")
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{path_key}: cannot load the tokenizer of {model!r} from {where}: {reason}") from None


def check_student_vocab(shape: dict | None, tok: TokenizerInfo | None) -> None:
    if shape and tok and tok.size > shape["vocab"]:
        raise ConfigError(f"model.student: the tokenizer has {tok.size} tokens but config.json's "
                          f"vocab_size is {shape['vocab']} (the embedding must hold every token id)")


def check_vocab(path_key: str, teacher_vocab: int, teacher_tok: TokenizerInfo | None,
                student_vocab: int, student_tok: TokenizerInfo | None, cross_tokenizer: str = "off") -> None:
    """The teacher can score every id the student emits, and means the same token by it; with
    `loss.cross_tokenizer` set, the teacher scores its own tokenization instead, and both
    tokenizers must be there to align the two.

    config.json vocab sizes are padded (Qwen2.5: 151936 or 152064 for one tokenizer), so they
    are compared only as a fallback when a tokenizer is missing.
    """
    if cross_tokenizer != "off":
        for who, tok in (("the student's", student_tok), ("the teacher's", teacher_tok)):
            if tok is None:
                raise ConfigError(f"{path_key}: loss.cross_tokenizer: {cross_tokenizer} re-tokenizes each "
                                  f"response with the teacher's tokenizer; {who} tokenizer files are missing")
        return
    sizes = (f"student tokenizer {student_tok.size if student_tok else '?'} tokens, "
             f"teacher vocab_size {teacher_vocab}")
    across = "; or set loss.cross_tokenizer: exact | uld | gold to distil across tokenizers"
    if student_tok is not None and student_tok.size > min(teacher_vocab, student_vocab):
        raise ConfigError(f"{path_key}: the teacher cannot score every token the student can emit "
                          f"({sizes}{across})")
    if student_tok is not None and teacher_tok is not None:
        differ = [tok for tok, i in student_tok.ids.items() if teacher_tok.ids.get(tok) != i]
        if differ:
            tok = differ[0]
            raise ConfigError(f"{path_key}: the tokenizers differ: {len(differ)} of the student's "
                              f"tokens have another id in the teacher's (e.g. {tok!r}: student id "
                              f"{student_tok.ids[tok]}, teacher id {teacher_tok.ids.get(tok)}); "
                              f"{sizes} (same tokenizer needed{across})")
    elif student_tok is None and teacher_vocab != student_vocab:
        logger.warning("%s: cannot check that the teacher's tokenizer matches the student's (no "
                       "tokenizer files); vocab_size %d (teacher) vs %d (student) may only be padding",
                       path_key, teacher_vocab, student_vocab)


def launch_world_size(cfg: TrainConfig) -> int:
    """Ranks of the run: `parallel.world_size` if set, else the launcher's WORLD_SIZE, else 1; under
    the Ray controller (which starts the ranks itself) one model-parallel replica, tp*pp*cp."""
    if cfg.parallel.world_size:
        return cfg.parallel.world_size
    if cfg.controller.kind == "ray":
        return cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_parallel(cfg: TrainConfig, shape: dict | None) -> None:
    par = cfg.parallel
    for name in ("tp", "pp", "micro_batch_size", "global_batch_size"):
        positive(f"parallel.{name}", getattr(par, name))
    positive("parallel.cp", par.cp)
    choice("parallel.recompute", par.recompute, RECOMPUTE_MODES)
    if par.sequence_parallel and par.tp == 1:
        raise ConfigError("parallel.sequence_parallel: needs parallel.tp > 1 (it splits the sequence over "
                          "the tensor-parallel ranks), got tp=1")
    check_expert_parallel(cfg, shape)
    if par.world_size is not None:
        positive("parallel.world_size", par.world_size)
    if par.vpp is not None:
        positive("parallel.vpp", par.vpp)
        if par.pp == 1:
            raise ConfigError(f"parallel.vpp: virtual pipeline needs parallel.pp > 1, got vpp={par.vpp} "
                              "with pp=1 (set vpp: null)")
    if shape is not None:
        for key in ("heads", "kv_heads"):
            if shape[key] % par.tp:
                raise ConfigError(f"parallel.tp: {par.tp} does not divide the model's {shape[key]} "
                                  f"{'attention' if key == 'heads' else 'key/value'} heads "
                                  f"({cfg.model.student})")
        chunks = par.pp * (par.vpp or 1)
        if shape["layers"] % chunks:
            raise ConfigError(f"parallel.pp: pp*vpp = {chunks} does not divide the model's "
                              f"{shape['layers']} layers ({cfg.model.student})")
    world = launch_world_size(cfg)
    model_parallel = par.tp * par.pp * par.cp
    if world % model_parallel:
        raise ConfigError(f"parallel.tp: tp*pp*cp = {model_parallel} does not divide the world size "
                          f"{world}")
    expert_parallel = (par.etp or par.tp) * par.ep * par.pp
    if world % expert_parallel:
        key = "parallel.etp" if par.etp not in (None, par.tp) else "parallel.ep"
        raise ConfigError(f"{key}: etp*ep*pp = {expert_parallel} does not divide the world size {world} "
                          f"(etp={par.etp or par.tp}, ep={par.ep}, pp={par.pp}; Megatron lays the experts "
                          "out over the same ranks)")
    dp = world // model_parallel
    if par.max_tokens_per_micro_batch is not None:
        positive("parallel.max_tokens_per_micro_batch", par.max_tokens_per_micro_batch)
        if par.global_batch_size % dp:
            raise ConfigError(f"parallel.global_batch_size: {par.global_batch_size} is not divisible by "
                              f"dp = {dp} (every DP rank trains as many sequences)")
    elif par.global_batch_size % (par.micro_batch_size * dp):
        raise ConfigError(f"parallel.global_batch_size: {par.global_batch_size} is not divisible by "
                          f"micro_batch_size*dp = {par.micro_batch_size}*{dp}")
    samples = cfg.rollout.prompts_per_step * cfg.rollout.n
    if par.global_batch_size != samples:
        raise ConfigError(f"parallel.global_batch_size: {par.global_batch_size} must equal the "
                          f"samples per step rollout.prompts_per_step*rollout.n = {samples}")


def check_expert_parallel(cfg: TrainConfig, shape: dict | None) -> None:
    """ep/etp only for an MoE student, ep dividing its experts and etp each expert's FFN; MoE
    training at TP > 1 is refused. Expert TP > 1 at TP = 1 trains: Megatron's all-to-all dispatcher
    gathers the tokens of the expert-TP ranks (different data-parallel ranks there) over the expert
    TP group and reduce-scatters the partial expert outputs back, with no sequence parallelism."""
    par = cfg.parallel
    positive("parallel.ep", par.ep)
    if par.etp is not None:
        positive("parallel.etp", par.etp)
    experts = shape.get("experts") if shape is not None else None
    if shape is not None and not experts:
        if par.ep != 1:
            raise ConfigError(f"parallel.ep: expected 1, got {par.ep}: expert parallelism needs an MoE "
                              f"student, {cfg.model.student} has no experts")
        if par.etp not in (None, par.tp):
            raise ConfigError(f"parallel.etp: expected null (or tp={par.tp}), got {par.etp}: expert tensor "
                              f"parallelism needs an MoE student, {cfg.model.student} has no experts")
        return
    if experts and experts % par.ep:
        raise ConfigError(f"parallel.ep: {par.ep} does not divide the student's {experts} experts "
                          f"({cfg.model.student})")
    if experts and par.tp > 1:
        # megatron-core's MoELayer refuses to train with attention TP > 1 unless sequence parallelism
        # is on, and sequence parallelism needs the Transformer Engine layer spec
        raise ConfigError(f"parallel.tp: an MoE student trains at tp=1 here, got tp={par.tp} "
                          "(Megatron's MoE layer needs sequence parallelism with TP, which needs "
                          "Transformer Engine); scale the experts with parallel.ep and split each expert "
                          "with parallel.etp instead")
    expert_ffn = shape.get("expert_ffn") if shape is not None else None
    etp = par.tp if par.etp is None else par.etp
    if expert_ffn and expert_ffn % etp:
        raise ConfigError(f"parallel.etp: {etp} does not divide the student's expert FFN size {expert_ffn} "
                          f"({cfg.model.student}: each expert-TP rank holds an equal slice of every expert)")
