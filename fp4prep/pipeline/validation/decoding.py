"""Plain greedy decoding, what the benchmarks and tests hold validation's checked continuations and
teacher-forced figures to (validation itself decodes nothing: ``continuations``)."""

from __future__ import annotations

from typing import Any

import torch

from .parity import end_of_turn, output_head, padded
from .prompt_cache import kv_budget, kv_bytes_per_token


@torch.no_grad()
def greedy(model: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt's greedy continuation of ``n`` tokens (through the first end-of-turn token).

    Prompts are decoded together, left-padded, with a KV cache: one pass over the layers per
    token for the whole batch; decoding stops once every prompt has ended its turn. The head is
    applied here, to each row's last hidden state, and held for the whole decoding. Validation
    finds the BF16 model's continuations with ``verified_greedy`` (fewer passes); this is the plain
    decoding the benchmarks and tests hold it and the teacher-forced figures to.
    """
    device = next(model.parameters()).device
    eos = end_of_turn(model)
    decoder = model.get_decoder()
    results: list[list[int]] = []
    per_token = kv_bytes_per_token(model)
    budget = kv_budget(model)
    start = 0
    with output_head(model) as head, torch.no_grad():
        while start < len(prompts):
            chunk = [prompts[start]]
            while (
                start + len(chunk) < len(prompts)
                and (len(chunk) + 1) * (max(map(len, chunk + [prompts[start + len(chunk)]])) + n) * per_token
                <= budget
            ):
                chunk.append(prompts[start + len(chunk)])
            start += len(chunk)
            ids, mask = padded(chunk, device, left=True)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            out = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
            steps = []
            ended = torch.zeros(len(chunk), dtype=torch.bool)
            stops = torch.tensor(sorted(eos), dtype=torch.long)
            for step in range(n):
                # A contiguous [batch, hidden]: a strided 3-D slice makes some CPU matmul kernels
                # expand the whole head per row (gigabytes for a large vocabulary).
                token = head(out.last_hidden_state[:, -1, :].contiguous()).argmax(-1)
                steps.append(token)
                ended |= torch.isin(token.cpu(), stops)
                # Every row has ended its turn: what follows would be cut off anyway.
                if step == n - 1 or bool(ended.all()):
                    break
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
                positions = positions[:, -1:] + 1
                out = decoder(
                    input_ids=token[:, None].to(device),
                    attention_mask=mask,
                    position_ids=positions,
                    cache=out.cache,
                    use_cache=True,
                )
            for row in torch.stack(steps, dim=1).tolist() if steps else [[] for _ in chunk]:
                end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
                results.append(row[:end])
    return results

