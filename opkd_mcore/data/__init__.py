"""Prompt datasets (jsonl/parquet), their checks, and the synthetic exact-answer task of the demo."""
from opkd_mcore.data.addition import ALPHABET, AdditionTask, exact_match
from opkd_mcore.data.build import build_datasets, encode_chat, encode_prompt, encode_record
from opkd_mcore.data.lengths import (
    Overlong,
    build_train_set,
    check_prompt_lengths,
    drop_overlong,
    overlong_error,
)
from opkd_mcore.data.prompts import PromptDataset, PromptSampler, read_records
from opkd_mcore.data.records import CHAT_ROLES, DataError, read_rows
from opkd_mcore.data.teacher_prompts import MissingTeacherPrompt, TeacherPrompts, encode_teacher_prompt

__all__ = ["ALPHABET", "AdditionTask", "CHAT_ROLES", "DataError", "MissingTeacherPrompt", "Overlong",
           "PromptDataset", "PromptSampler", "TeacherPrompts", "build_datasets", "build_train_set",
           "check_prompt_lengths", "drop_overlong", "encode_chat", "encode_prompt", "encode_record",
           "encode_teacher_prompt", "exact_match", "overlong_error", "read_records", "read_rows"]
