"""Vocab-parallel token embedding and LM head.

The vocabulary is split into `tp_size` equal ranges of `ceil(vocab / tp_size)` rows; the last range is padded with
zero rows when the vocabulary does not divide evenly:

    rank 0: ids [0, n)   rank 1: ids [n, 2n)   ...   rank tp-1: ids [(tp-1)n, vocab) + zero padding up to tp*n

The embedding looks up the ids in this rank's range (others give zeros) and sums over ranks. The LM head computes
the logits of its range; `ParallelLMHead.compute_logits` gathers them on rank 0 and drops the padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.layers.linear import copy_loaded, loaded_shape
from workers.parallel import all_reduce, gather_to_rank0, get_tp_rank, get_tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype=torch.float32, device=None):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.vocab_per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.vocab_per_rank
        self.vocab_end = min(self.vocab_start + self.vocab_per_rank, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.vocab_per_rank, hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        assert shard_id is None, f"embedding takes no shard_id, got {shard_id!r}"
        assert loaded_shape(loaded) == (self.vocab_size, self.hidden_size), (
            f"embedding: expected {(self.vocab_size, self.hidden_size)}, loaded {loaded_shape(loaded)}")
        n = self.vocab_end - self.vocab_start
        copy_loaded(param.data[:n], loaded[self.vocab_start:self.vocab_end])
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        is_local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(is_local, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight) * is_local.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the full vocabulary. With tied embeddings the model shares the embedding's weight."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        assert embedding.weight.shape == self.weight.shape, "tied embedding and LM head must have the same shape"
        self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # hidden: [N, hidden] -> float32 logits [N, vocab] on rank 0 (None on the other ranks)
        logits = F.linear(hidden, self.weight)  # [N, vocab / tp]
        logits = gather_to_rank0(logits, dim=-1)
        if logits is None:
            return None
        return logits[:, :self.vocab_size].float()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.compute_logits(hidden)
