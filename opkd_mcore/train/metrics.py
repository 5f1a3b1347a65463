"""Step metrics to the console (tqdm bar + periodic line), a JSONL file, TensorBoard and W&B; the
profiler traces of the steps `logging.profile_steps` names.

Only rank 0 writes. Names are `group/name`. On resume the JSONL file is cut back to the steps
before the resumed one (and a torn last line is dropped), and TensorBoard's event files get a purge
marker at that step (readers drop the earlier run's events from it on), so a resumed run's metrics
read exactly like an uninterrupted run's.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os

from opkd_mcore.config.schema import LoggingSection
from opkd_mcore.platform import global_rank
from opkd_mcore.platform.profiling import profiled

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"  # event files, under the output directory
PROFILE_DIR = "profile"  # profiler traces of logging.profile_steps, under the output directory
# shown on the progress bar, in this order, when present
BAR_KEYS = ("train/loss", "eval/accuracy", "rollout/response_len_mean", "timing/step")


def step_profile(cfg: LoggingSection, out_dir: str, step: int):
    """The profiler around step `step` (this rank's trace) when `logging.profile_steps` names it."""
    if step not in cfg.profile_steps:
        return contextlib.nullcontext()
    return profiled(os.path.join(out_dir, PROFILE_DIR, f"step{step}.rank{global_rank()}"))


def read_jsonl(path: str) -> list[dict]:
    """The records of a JSONL file ([] when it does not exist).

    A torn last line (a writer killed mid-line) is dropped with a warning: a prefix of a JSON object
    never parses, so only an incomplete record is lost. A bad line before the last is corruption,
    not a kill, and raises `ValueError` naming the file and line.
    """
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [(number, line) for number, line in enumerate(f, 1) if line.strip()]
    records = []
    for i, (number, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if i < len(lines) - 1:
                raise ValueError(f"{path}:{number}: not a JSON record ({err.msg})") from None
            logger.warning("%s:%d: dropped a torn last line (a run killed while writing it)", path, number)
    return records


def truncate_jsonl(path: str, before_step: int) -> None:
    """Keep only records with `step < before_step` (used when resuming; 0 empties the file).

    The kept records are written to a temporary file that replaces the old one, so a run killed
    while truncating leaves either file whole.
    """
    kept = [r for r in read_jsonl(path) if r.get("step", -1) < before_step] if before_step > 0 else []
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for r in kept:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


class MetricsLogger:
    """`log(step, metrics)` once per step; `close()` at the end."""

    def __init__(self, out_dir: str, cfg: LoggingSection, total_steps: int, *, start_step: int = 0,
                 enabled: bool = True, desc: str = "opkd train"):
        self.cfg, self.enabled = cfg, enabled
        self.path = os.path.join(out_dir, METRICS_FILE)
        self.bar = self.tb = self.wandb = None
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        if cfg.jsonl:
            truncate_jsonl(self.path, start_step)
        if cfg.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc=desc, unit="step", dynamic_ncols=True)
        if cfg.tensorboard:
            self.tb = _tensorboard_writer(os.path.join(out_dir, TENSORBOARD_DIR), start_step)
        if cfg.wandb_project:
            self.wandb = _wandb_run(cfg.wandb_project, out_dir)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: float(v) for k, v in sorted(metrics.items())}}
        if self.cfg.jsonl:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "step":
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(record, step=step)
        if self.bar is not None:
            self.bar.set_postfix({k.split("/")[-1]: f"{record[k]:.4g}" for k in BAR_KEYS if k in record},
                                 refresh=False)
            self.bar.update(1)
        every = self.cfg.console_every
        if every and (step + 1) % every == 0:
            line = " ".join(f"{k}={v:.4g}" for k, v in record.items() if k != "step")
            logger.info("step %d: %s", step, line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _tensorboard_writer(log_dir: str, start_step: int):
    """A writer whose first event, on resume, hides every event of step >= `start_step` already in
    `log_dir` (the steps the resumed run trains again): the files are kept, readers skip them."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ValueError("logging.tensorboard: needs the `tensorboard` package (pip install "
                         "tensorboard), or set logging.tensorboard=false") from err
    return SummaryWriter(log_dir, purge_step=start_step if start_step > 0 else None)


def _wandb_run(project: str, out_dir: str):
    try:
        import wandb
    except ImportError as err:
        raise ValueError("logging.wandb_project: needs the `wandb` package (pip install wandb), or "
                         "set logging.wandb_project=null") from err
    return wandb.init(project=project, dir=out_dir)
