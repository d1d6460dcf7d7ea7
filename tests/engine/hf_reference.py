"""Ground truth for the engine: transformers' own ``generate()`` in float32 (on CPU, or on the
model's device)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def load_hf_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    stop_at_eos: bool = False,
) -> list[list[int]]:
    """Greedy continuations of a left-padded batch, as one ``generate()`` call.

    With ``stop_at_eos`` each continuation ends at (and includes) the model's
    EOS token; otherwise exactly ``max_new_tokens`` tokens are generated.
    """
    config = model.generation_config
    eos = config.eos_token_id
    pad = 0
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=model.device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    saved = config.eos_token_id
    config.eos_token_id = eos if stop_at_eos else None
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=pad,
            )
    finally:
        config.eos_token_id = saved
    results = []
    for row in out[:, width:].tolist():
        if stop_at_eos and eos in row:
            row = row[: row.index(eos) + 1]
        results.append(row)
    return results


def hf_log_softmax(model: torch.nn.Module, prompt: Sequence[int], output: Sequence[int]) -> torch.Tensor:
    """``[len(output), vocab]``: the float32 ``log_softmax`` of the logits that chose each token of ``output``
    after ``prompt`` (one forward pass over both)."""
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(output)], device=model.device)).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1).cpu()
