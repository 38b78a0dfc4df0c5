"""A small decoder-only transformer trained with AdamW on a deterministic synthetic token stream."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from resilience.caps import WorkloadCaps
from resilience.settings.checks import require_int
from resilience.workloads.base import Workload, stream_seed
from resilience.workloads.tokens import MarkovTokens


def dropout(p: float) -> nn.Module:
    # p = 0 builds no dropout at all: not even a draw from the RNG, so the replayable loop's states stay as they were
    return nn.Dropout(p) if p > 0 else nn.Identity()


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then an MLP, each with dropout on its output (a
    real loop's RNG state is then real state: train=real)."""

    def __init__(self, d_model: int, n_head: int, p_drop: float = 0.0) -> None:
        super().__init__()
        self.n_head = n_head
        self.drop = dropout(p_drop)
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, vocab: int, d_model: int, n_layer: int, n_head: int, seq_len: int,
                 p_drop: float = 0.0) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.drop = dropout(p_drop)
        self.blocks = nn.ModuleList(Block(d_model, n_head, p_drop) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class GPTStage(nn.Module):
    """Blocks ``lo`` to ``hi - 1`` of a ``GPT`` under their own names (``blocks.3``), with the embeddings on the first
    stage and the final norm and head on the last: ``GPT.forward``'s operations, cut between blocks."""

    def __init__(self, full: GPT, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok, self.pos, self.drop = full.tok, full.pos, full.drop
        self.blocks = nn.ModuleDict({str(i): full.blocks[i] for i in range(lo, hi)})
        if last:
            self.ln_f, self.head = full.ln_f, full.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok(x) + self.pos(pos))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def stage_blocks(n_layer: int, stage: int, stages: int) -> tuple[int, int]:
    """The blocks ``[lo, hi)`` of ``stage``: as even as can be, the first ``n_layer % stages`` stages one more (the
    last stage also holds the head)."""
    if n_layer < stages:
        raise ValueError(f"workload.n_layer={n_layer}: fewer blocks than parallel.stages={stages}")
    base, extra = divmod(n_layer, stages)
    lo = stage * base + min(stage, extra)
    return lo, lo + base + (stage < extra)


class GPTWorkload(Workload):
    """Next-token prediction on a stream drawn from a seed-fixed Markov chain, so the loss really falls; or on
    bytes of text through a data loader (``train.data=loader``: a byte is a token, so vocab must be >= 256)."""

    caps = WorkloadCaps(reads_tokens=True, splits_into_stages=True)

    def __init__(
        self,
        seed: int,
        vocab: int = 256,
        d_model: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        seq_len: int = 64,
        batch_size: int = 8,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        follow_prob: float = 0.8,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(seed)
        for field, value in (("vocab", vocab), ("d_model", d_model), ("n_layer", n_layer), ("n_head", n_head),
                             ("seq_len", seq_len), ("batch_size", batch_size)):
            require_int(f"workload.{field}", value, 1)
        if d_model % n_head:
            raise ValueError(f"workload.d_model={d_model}: must be divisible by workload.n_head={n_head}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"workload.dropout={dropout}: must be in [0, 1)")
        self.dropout = dropout
        self.vocab, self.d_model, self.n_layer, self.n_head = vocab, d_model, n_layer, n_head
        self.seq_len, self.batch_size = seq_len, batch_size
        self.tokens_per_sample = seq_len
        self.lr, self.weight_decay, self.follow_prob = lr, weight_decay, follow_prob
        self.tokens = MarkovTokens(seed, vocab, seq_len, batch_size, follow_prob)

    def build_model(self) -> nn.Module:
        # Initialise under a private seed and restore the global generator: the run's RNG stays untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(stream_seed(self.seed, "init"))
            return GPT(self.vocab, self.d_model, self.n_layer, self.n_head, self.seq_len, self.dropout)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        # foreach=False: the per-tensor loop is the reference implementation, identical on every device count.
        return torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=self.weight_decay, foreach=False)

    def batch(self, step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        return self.tokens.batch(step, rank, device)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        return self.loss_fn(model(x), y)

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))

    def pipeline_stage(self, model: nn.Module, stage: int, stages: int) -> nn.Module:
        return GPTStage(model, *stage_blocks(self.n_layer, stage, stages), stage == 0, stage == stages - 1)

    def stage_io(self, stage: int, stages: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        # requires_grad on the activations: without it the schedule allocates no gradient to send back, and the
        # stages before the last would train on no gradient at all
        hidden = torch.empty(micro, self.seq_len, self.d_model, device="meta", requires_grad=True)
        first = torch.zeros(micro, self.seq_len, dtype=torch.long, device="meta")
        last = torch.empty(micro, self.seq_len, self.vocab, device="meta")
        return first if stage == 0 else hidden, last if stage == stages - 1 else hidden
