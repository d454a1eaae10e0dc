"""transformers as the numerical oracle for Pagoda's outputs: one teacher-forced forward over prompt + completion
gives every position's log-softmax, which the prompt logprobs, the completion's logprobs and its greedy tokens
must match."""

from __future__ import annotations

import torch


@torch.no_grad()
def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] float32 log-softmax of transformers' logits; row i predicts token i + 1."""
    ids = torch.tensor([token_ids], device=model.device)
    return torch.log_softmax(model(ids).logits[0].float(), dim=-1).cpu()


def assert_matches_hf(model, out, num_top: int, atol: float, greedy: bool = True) -> None:
    """`out`, a RequestOutput of prompt_logprobs=num_top and logprobs=num_top, against transformers' `model`: each
    entry holds the token's own logprob and the num_top best, all equal to the oracle's within atol."""
    prompt, completion = out.prompt_token_ids, out.outputs[0]
    ref = hf_logprobs(model, prompt + completion.token_ids)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        _assert_entry(out.prompt_logprobs[i], prompt[i], ref[i - 1], num_top, atol, f"prompt token {i}")
    for j, token_id in enumerate(completion.token_ids):
        row = ref[len(prompt) - 1 + j]
        _assert_entry(completion.logprobs[j], token_id, row, num_top, atol, f"output token {j}")
        if greedy:
            assert token_id == row.argmax().item(), f"output token {j} is not transformers' greedy choice"


def _assert_entry(entry: dict[int, float], token_id: int, row: torch.Tensor, num_top: int, atol: float,
                  where: str) -> None:
    expected = set(row.topk(num_top).indices.tolist()) | {token_id} if num_top else {token_id}
    assert set(entry) == expected, f"{where}: ids {sorted(entry)}, transformers' {sorted(expected)}"
    for tid, logprob in entry.items():
        assert abs(logprob - row[tid].item()) < atol, f"{where}: token {tid}: {logprob} vs {row[tid].item()}"
