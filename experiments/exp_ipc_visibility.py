"""Experiment: can a process map a device IPC handle of a GPU it cannot see? (two GPUs)

Ray gives each actor one visible GPU (CUDA_VISIBLE_DEVICES=<its id>). Under the Ray controller,
trainer rank 1 maps rank 0's bucket buffers (the peer export) and colocated engine 1 reads them, both
from processes that see only their own GPU. This maps one exporter's buffer (GPU 0 visible only)
from importers with other visibilities, through `opkd_mcore.platform.ipc_handles`, and reports for
each whether the mapping opens, reads the exporter's bytes, and (peer) writes them.

    python experiments/exp_ipc_visibility.py
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [  # (CUDA_VISIBLE_DEVICES of the importer, open as peer)
    ("1", False), ("1", True), ("1,0", False), ("1,0", True), ("0", False)]
NBYTES = 64 << 20


def _exporter(q_out, q_done, receivers):
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    sys.path.insert(0, ROOT)
    import torch

    from opkd_mcore.platform.ipc_handles import encode_handles, export_ipc_handles, share_buffer

    buf = share_buffer(NBYTES, torch.device("cuda", 0))
    buf.copy_((torch.arange(NBYTES, device="cuda") % 251).to(torch.uint8))
    torch.cuda.synchronize()
    words, raw = encode_handles(export_ipc_handles(buf, receivers))
    q_out.put((words.tolist(), bytes(raw.tolist())))
    q_done.get()  # importers finished: then check what peers wrote
    torch.cuda.synchronize()
    q_out.put(int(buf[:4096].to(torch.int64).sum()))


def _importer(visible, peer, index, fields, q):
    os.environ["CUDA_VISIBLE_DEVICES"] = visible
    sys.path.insert(0, ROOT)
    import torch

    from opkd_mcore.platform.ipc_handles import decode_handles, open_ipc_handle

    words, raw = fields
    try:
        h = decode_handles(torch.tensor(words), torch.tensor(list(raw), dtype=torch.uint8), "exp")[index]
        view = open_ipc_handle(h, "exp", peer=peer)
        expect = (torch.arange(NBYTES, device=view.device) % 251).to(torch.uint8)
        same = bool(torch.equal(view, expect))
        if peer and visible == "1,0":
            view[:4096].fill_(1)  # the exporter sees 4096 if it lands
            torch.cuda.synchronize()
        q.put(f"CUDA_VISIBLE_DEVICES={visible} peer={peer}: opened on {view.device}, bytes equal: {same}")
    except Exception as err:  # noqa: BLE001  (the experiment reports every outcome)
        q.put(f"CUDA_VISIBLE_DEVICES={visible} peer={peer}: {type(err).__name__}: {err}")


def main() -> int:
    ctx = mp.get_context("spawn")
    q_out, q_done, q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    exporter = ctx.Process(target=_exporter, args=(q_out, q_done, len(CASES)))
    exporter.start()
    fields = q_out.get(timeout=120)
    for i, (visible, peer) in enumerate(CASES):
        p = ctx.Process(target=_importer, args=(visible, peer, i, fields, q))
        p.start()
        p.join(120)
        print(q.get(timeout=5) if not q.empty() else f"CUDA_VISIBLE_DEVICES={visible} peer={peer}: "
              f"no report (exit code {p.exitcode})", flush=True)
    q_done.put(None)
    print("exporter's first 4096 bytes sum after the peer write:", q_out.get(timeout=60), flush=True)
    exporter.join(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
