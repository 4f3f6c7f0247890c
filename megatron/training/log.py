"""Megatron's training log line, the validation line, a per-rank logger and
an exact per-iteration metrics file."""

import datetime
import json
import logging
import math
import os
import sys
from typing import Dict, Optional, Sequence

from megatron.training.config import Config, moe_layer_pattern


def get_logger(rank: int) -> logging.Logger:
    """A logger that prefixes every line with the rank, to stderr."""
    logger = logging.getLogger(f"megatron.training.rank{rank}")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(asctime)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("MEGATRON_LOG_LEVEL", "INFO"))
        logger.propagate = False
    return logger


def timestamp() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")


def training_log_line(
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_ms: float,
    learning_rate: float,
    global_batch_size: int,
    losses: Dict[str, float],
    loss_scale: float,
    grad_norm: Optional[float],
    skipped: int,
    nans: int,
    tflops: Optional[float] = None,
    extra: Sequence[str] = (),
    num_zeros: Optional[float] = None,
    params_norm: Optional[float] = None,
) -> str:
    """The line users grep and plot; field order and widths as Megatron's."""
    parts = [
        f" [{timestamp()}] iteration {iteration:8d}/{train_iters:8d} |",
        f" consumed samples: {consumed_samples:12d} |",
        f" elapsed time per iteration (ms): {elapsed_ms:.1f} |",
    ]
    if tflops is not None:
        parts.append(f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |")
    parts += [
        f" learning rate: {learning_rate:.6E} |",
        f" global batch size: {global_batch_size:5d} |",
    ]
    parts += [f" {name}: {value:.6E} |" for name, value in losses.items()]
    parts.append(f" loss scale: {loss_scale:.1f} |")
    if grad_norm is not None:
        parts.append(f" grad norm: {grad_norm:.3f} |")
    if num_zeros is not None:
        parts.append(f" num zeros: {num_zeros} |")
    if params_norm is not None:
        parts.append(f" params norm: {params_norm:.3f} |")
    parts += [
        f" number of skipped iterations: {skipped:3d} |",
        f" number of nan iterations: {nans:3d} |",
    ]
    parts += [f" {field} |" for field in extra]
    return "".join(parts)


def validation_log_line(where: str, losses: Dict[str, float]) -> str:
    parts = [f" validation loss at {where} |"]
    for name, value in losses.items():
        parts.append(f" {name} value: {value:.6E} | {name} PPL: {math.exp(min(20, value)):.6E} |")
    return "".join(parts)


def flops_per_iteration(config: Config, global_batch_size: int) -> float:
    """Model FLOPs of one iteration (forward and backward, 3x forward), as
    Megatron-LM counts them: each layer's attention and its dense or MoE MLP
    (--moe-layer-freq); each multi-token-prediction layer as one more layer
    like the last, with its two norms, its projection and its own logits."""
    m = config.model
    h, mtp = m.hidden_size, m.mtp_num_layers or 0
    layers = moe_layer_pattern(config)
    layers += layers[-1:] * mtp
    gemms = 3 if m.swiglu else 2
    mlp = sum(2 * h * mlp_width(config, bool(moe)) * gemms for moe in layers)
    attention = len(layers) * attention_flops_per_token(config)
    mtp_extra = mtp * 2 * (3 * h + 2 * h * h)
    logits = (mtp + 1) * 2 * h * (config.run.padded_vocab_size or 0)
    forward_per_token = mlp + attention + mtp_extra + logits
    return 3.0 * forward_per_token * m.seq_length * global_batch_size


def attention_flops_per_token(config: Config) -> float:
    """One layer's self-attention, forward, per token: its projections, and
    QK^T and (QK^T)V over half the positions (the causal mask), as Megatron-LM
    counts them (multi-latent attention's low-rank projections and their
    norms included)."""
    m = config.model
    h, s, heads = m.hidden_size, m.seq_length, m.num_attention_heads
    if m.multi_latent_attention:
        qk = m.qk_head_dim + m.qk_pos_emb_head_dim
        if m.q_lora_rank is None:
            queries = h * heads * qk
        else:
            queries = m.q_lora_rank * (h + heads * qk + 1)
        keys_values = m.kv_lora_rank * (h + heads * (m.qk_head_dim + m.v_head_dim) + 1)
        keys_values += h * m.qk_pos_emb_head_dim
        output = heads * m.v_head_dim * h
        core = s * heads * qk / 2 + s * heads * m.v_head_dim / 2
        return 2 * (queries + keys_values + output + core)
    kv_channels = m.kv_channels or h // heads
    q_size = kv_channels * heads
    kv_size = kv_channels * m.num_query_groups
    return 2 * h * (q_size + 2 * kv_size) + 2 * q_size * h + 2 * s * q_size


def mlp_width(config: Config, moe_layer: bool) -> int:
    """The hidden width a token goes through in one layer's MLP: a dense
    layer's, or an MoE layer's top-k experts' and shared expert's."""
    m, moe = config.model, config.moe
    if not moe_layer:
        return m.ffn_hidden_size
    return moe.moe_ffn_hidden_size * moe.moe_router_topk + (
        moe.moe_shared_expert_intermediate_size or 0
    )


class MetricsFile:
    """Each iteration's values as JSON (floats round-trip exactly), so runs
    can be compared bit for bit."""

    def __init__(self, path: Optional[str], append: bool):
        self.file = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "a" if append else "w")

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def rewind(self, iteration: int) -> None:
        """Forget the records after ``iteration`` (a recovery redoes them)."""
        if self.file is None:
            return
        self.file.flush()
        with open(self.file.name) as f:
            kept = [line for line in f if json.loads(line)["iteration"] <= iteration]
        self.file.seek(0)
        self.file.truncate()
        self.file.writelines(kept)
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
