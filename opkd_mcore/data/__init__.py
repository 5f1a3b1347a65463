"""Prompt datasets (jsonl/parquet) and the synthetic exact-answer task of the demo."""
from opkd_mcore.data.addition import ALPHABET, AdditionTask, exact_match
from opkd_mcore.data.build import build_datasets, encode_chat, encode_prompt, encode_record
from opkd_mcore.data.prompts import PromptDataset, PromptSampler, read_records

__all__ = ["ALPHABET", "AdditionTask", "PromptDataset", "PromptSampler", "build_datasets", "encode_chat",
           "encode_prompt", "encode_record",
           "exact_match", "read_records"]
