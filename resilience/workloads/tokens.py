"""The synthetic token stream every causal-LM workload trains on: a seed-fixed Markov chain, so the loss really falls,
and the batch of (step, rank) a pure function of (seed, step, rank)."""

from __future__ import annotations

import torch

from resilience.settings.checks import require_int
from resilience.workloads.base import stream_seed


class MarkovTokens:
    """Windows of ``seq_len + 1`` tokens: each token follows the chain's successor of the previous one with
    probability ``follow_prob``, else is uniform noise. Returns (inputs, next-token targets)."""

    def __init__(self, seed: int, vocab: int, seq_len: int, batch_size: int, follow_prob: float = 0.8) -> None:
        for field, value in (("vocab", vocab), ("seq_len", seq_len), ("batch_size", batch_size)):
            require_int(f"workload.{field}", value, 1)
        if not 0.0 <= follow_prob <= 1.0:
            raise ValueError(f"workload.follow_prob={follow_prob}: must be in [0, 1]")
        self.seed, self.vocab, self.seq_len, self.batch_size = seed, vocab, seq_len, batch_size
        self.follow_prob = follow_prob
        g = torch.Generator().manual_seed(stream_seed(seed, "chain"))
        self._next = torch.randperm(vocab, generator=g)  # the chain the model can learn

    def batch(self, step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(stream_seed(self.seed, step, rank))
        n, t = self.batch_size, self.seq_len + 1
        tokens = torch.empty(n, t, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab, (n,), generator=g)
        follow = torch.rand(n, t, generator=g) < self.follow_prob
        noise = torch.randint(self.vocab, (n, t), generator=g)
        for i in range(1, t):
            tokens[:, i] = torch.where(follow[:, i], self._next[tokens[:, i - 1]], noise[:, i])
        tokens = tokens.to(device)
        return tokens[:, :-1], tokens[:, 1:]
