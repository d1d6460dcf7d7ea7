"""Token embedding and LM head, vocab-parallel or replicated.

Vocab-parallel (``vocab_parallel=True``): rank ``r`` holds rows
``[r * shard, (r + 1) * shard)`` of the ``[vocab, hidden]`` table, with
``shard = ceil(vocab / tp)`` (the last shard is zero-padded). The embedding looks up the
ids it owns, zeros the others and all-reduces; the LM head computes its logit columns and
all-gathers them. Replicated: every rank holds the whole table and needs no collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.worker.distributed import TensorParallelGroup
from kvserve.worker.layers.linear import LoadedWeight, copy_weight, narrow_weight, new_parameter, weight_shape

# NOTE: measured on CPU, TP 2 over gloo, float32, one thread per rank, two runs: the
# vocab-parallel LM head took 0.36-0.98x the time of the replicated one (hidden 1024 /
# vocab 32000 and hidden 2048 / vocab 151936; 8 and 256 tokens): its half-size matmul
# beats the logits all-gather, and it halves the table's memory. The embedding's
# all-reduce costs more than a replicated lookup (0.6-7 ms vs 0.01-0.6 ms), far less
# than the head saves.
DEFAULT_VOCAB_PARALLEL = True


class VocabParallelEmbedding(nn.Module):
    """``[num_tokens] -> [num_tokens, embedding_dim]`` lookup, same result on every rank."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp: TensorParallelGroup,
        vocab_parallel: bool = DEFAULT_VOCAB_PARALLEL,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.vocab_parallel = vocab_parallel and tp.world_size > 1
        if self.vocab_parallel:
            self.shard_size = -(-num_embeddings // tp.world_size)
            self.vocab_start = tp.rank * self.shard_size
        else:
            self.shard_size, self.vocab_start = num_embeddings, 0
        # Rows of the checkpoint this rank owns (fewer than shard_size on a padded last shard).
        self.num_owned = max(0, min(self.shard_size, num_embeddings - self.vocab_start))
        self.weight = new_parameter(self.shard_size, embedding_dim, weight_loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} got shard_id {shard_id!r}")
        expected = (self.num_embeddings, self.embedding_dim)
        if weight_shape(loaded) != expected:
            raise ValueError(f"embedding: expected shape {expected}, got {weight_shape(loaded)}")
        param.data.zero_()
        rows = narrow_weight(loaded, 0, self.vocab_start, self.num_owned)
        copy_weight(param.data.narrow(0, 0, self.num_owned), rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.vocab_parallel:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        owned = (local_ids >= 0) & (local_ids < self.num_owned)
        embeds = F.embedding(torch.where(owned, local_ids, 0), self.weight)
        embeds = embeds * owned.unsqueeze(-1).to(embeds.dtype)
        return self.tp.all_reduce(embeds)

    def extra_repr(self) -> str:
        return (
            f"vocab={self.num_embeddings}, dim={self.embedding_dim}, "
            f"vocab_parallel={self.vocab_parallel}, rows=[{self.vocab_start}, "
            f"{self.vocab_start + self.num_owned})"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states to full-vocabulary logits. Tie it to an embedding by assigning the
    embedding's ``weight`` (both must be built with the same ``vocab_parallel``)."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden] -> [n, vocab]`` float32 logits, identical on every rank."""
        logits = F.linear(hidden_states, self.weight)
        if self.vocab_parallel:
            logits = self.tp.all_gather(logits, dim=-1)[..., : self.num_embeddings]
        return logits.float()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden_states)
