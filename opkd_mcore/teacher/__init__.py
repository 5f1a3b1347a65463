"""Teacher backends (see DESIGN.md): each scores token sequences, row t scoring token t+1.

    VllmTeacher          in-process vLLM: top-k on its device or by prompt_logprobs, or hidden states
                                                                        (vllm_teacher.py, device_topk.py)
    RemoteVllmTeacher    client of a teacher server: opkd's packed top-k route or vLLM's OpenAI server
                                                                        (remote.py, score_server.py)
    MegatronTeacher      forward-only Megatron model, dense TP-sharded  (megatron_teacher.py)
    TransformersTeacher  plain HF forward, dense or top-k               (hf_teacher.py)
    TeacherRouter        per-sample choice by a data field, replicas    (router.py)

Heavy dependencies (vLLM, Megatron, transformers) are imported only when a backend is used.
"""
import importlib

from opkd_mcore.teacher.base import (
    MalformedTeacherOutputError,
    Teacher,
    TeacherError,
    TeacherUnavailableError,
)

_LAZY = {
    "VllmTeacher": "vllm_teacher", "VllmTeacherConfig": "vllm_teacher",
    "RemoteVllmTeacher": "remote", "RemoteTeacherConfig": "remote",
    "MegatronTeacher": "megatron_teacher", "MegatronTeacherConfig": "megatron_teacher",
    "TransformersTeacher": "hf_teacher", "TeacherRouter": "router",
    "TeacherServer": "serve", "TeacherServerConfig": "serve",
}

__all__ = ["MalformedTeacherOutputError", "Teacher", "TeacherError", "TeacherUnavailableError",
           *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"opkd_mcore.teacher.{_LAZY[name]}"), name)
    raise AttributeError(name)
