"""The wire format of the top-k scoring route of `opkd teacher-serve --scoring device`.

    GET  /opkd/v1/topk   {"format": "OPKDTK01", "vocab_size", "max_model_len", "model"}
    POST /opkd/v1/topk   {"sequences": [[token ids], ...], "k": K, "temperature": 1.0}
                         -> application/octet-stream, the rows of every sequence (below)

Response body, all little-endian, no pickle (N sequences, R_i = len(sequence i) - 1 rows each,
T = sum R_i):

    bytes 0-7     b"OPKDTK01"
    uint32 N, uint32 K
    int32[N]      R_i
    float32[T, K] logprobs, row-major, sequences in request order, each row descending (-inf: padding)
    int32[T, K]   token ids (-1: padding, where the vocabulary has fewer than K ids)

Row t of a sequence scores its token t+1. An error is a JSON body `{"error": {"message": ...}}` with
HTTP 400 (the request: an id outside the vocabulary says "Token id N is out of vocabulary", as vLLM
does) or 500 (the engine). A sequence may be as long as the engine's `max_model_len`.
"""
from __future__ import annotations

import struct

import numpy as np
import torch

from opkd_mcore.losses.teacher_outputs import MalformedTeacherOutputError, TopKTeacher
from opkd_mcore.teacher.device_topk import check_topk_rows

TOPK_ROUTE = "/opkd/v1/topk"
MAGIC = b"OPKDTK01"
_HEAD = struct.Struct("<8sII")


def encode_topk_response(rows: list[TopKTeacher]) -> bytes:
    """The response body for `rows` (one `TopKTeacher` per sequence, all of the same k)."""
    k = rows[0].ids.shape[1] if rows else 0
    counts = np.asarray([r.ids.shape[0] for r in rows], dtype="<i4")
    logprobs = torch.cat([r.logprobs for r in rows]) if rows else torch.empty(0, k)
    ids = torch.cat([r.ids for r in rows]) if rows else torch.empty(0, k, dtype=torch.int64)
    return b"".join([_HEAD.pack(MAGIC, len(rows), k), counts.tobytes(),
                     np.ascontiguousarray(logprobs.float().numpy(), dtype="<f4").tobytes(),
                     np.ascontiguousarray(ids.numpy(), dtype="<i4").tobytes()])


def decode_topk_response(body: bytes, sequences: list[list[int]], k: int, vocab_size: int,
                         where: str) -> list[TopKTeacher]:
    """The rows of `sequences` from a response body; MalformedTeacherOutputError naming `where` for a
    body of another format, count, k or size, and for rows that fail `check_topk_rows`."""
    if len(body) < _HEAD.size:
        raise MalformedTeacherOutputError(f"{where}: a top-k response of {len(body)} bytes has no header")
    magic, n, got_k = _HEAD.unpack_from(body)
    if magic != MAGIC or n != len(sequences) or got_k != k:
        raise MalformedTeacherOutputError(
            f"{where}: expected {MAGIC!r} rows of {len(sequences)} sequences at k={k}, got {magic!r}, "
            f"{n} sequences, k={got_k}")
    counts = np.frombuffer(body, dtype="<i4", count=n, offset=_HEAD.size).tolist()
    want = [len(s) - 1 for s in sequences]
    total, start = sum(want), _HEAD.size + 4 * n
    if counts != want or len(body) != start + 8 * total * k:
        raise MalformedTeacherOutputError(f"{where}: expected {want} rows ({start + 8 * total * k} bytes), "
                                          f"got {counts} ({len(body)} bytes)")
    logprobs = torch.from_numpy(np.frombuffer(body, dtype="<f4", count=total * k, offset=start)
                                .astype(np.float32).reshape(total, k))
    ids = torch.from_numpy(np.frombuffer(body, dtype="<i4", count=total * k, offset=start + 4 * total * k)
                           .astype(np.int64).reshape(total, k))
    out = []
    for i, (lp, tok) in enumerate(zip(logprobs.split(want), ids.split(want))):
        check_topk_rows(tok, lp, vocab_size, f"{where}, sequence {i}")
        out.append(TopKTeacher(ids=tok, logprobs=lp))
    return out


class RequestError(ValueError):
    """A request the server refuses (HTTP 400)."""


def parse_request(payload, vocab_size: int, max_model_len: int) -> tuple[list[list[int]], int, float]:
    """(sequences, k, temperature) of a POST body; RequestError naming the bad field."""
    if not isinstance(payload, dict):
        raise RequestError(f"expected a JSON object, got {type(payload).__name__}")
    seqs, k, temperature = payload.get("sequences"), payload.get("k"), payload.get("temperature", 1.0)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise RequestError(f"k: expected an integer >= 1, got {k!r}")
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise RequestError(f"temperature: expected a number > 0, got {temperature!r}")
    if not isinstance(seqs, list) or not seqs:
        raise RequestError("sequences: expected a non-empty list of token-id lists")
    for i, seq in enumerate(seqs):
        if not isinstance(seq, list) or not 2 <= len(seq) <= max_model_len or \
                not all(isinstance(t, int) and not isinstance(t, bool) for t in seq):
            got = len(seq) if isinstance(seq, list) else type(seq).__name__
            raise RequestError(f"sequences[{i}]: expected 2..{max_model_len} integer token ids, got {got}")
        bad = [t for t in seq if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"sequences[{i}]: Token id {max(bad)} is out of vocabulary "
                               f"(vocabulary of {vocab_size})")
    return seqs, k, float(temperature)
