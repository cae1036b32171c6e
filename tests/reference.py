"""Reference computations with the torch source model, shared by the tests."""

import torch

from mla_deploy.modeling import AttentionForm, new_caches


def torch_greedy(torch_model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation with the torch source (naive prefill, absorbed decode)."""
    cfg = torch_model.cfg
    caches = new_caches(cfg, 1, len(prompt) + n)
    mask = torch.ones(1, len(prompt) + n)
    logits = torch_model(
        torch.tensor([prompt]),
        torch.arange(len(prompt))[None],
        caches,
        torch.zeros(1, dtype=torch.long),
        mask,
        form=AttentionForm.NAIVE,
    )[:, -1]
    out = []
    for step in range(n):
        token = int(logits.argmax(-1))
        out.append(token)
        slot = len(prompt) + step
        logits = torch_model(torch.tensor([[token]]), torch.tensor([[slot]]), caches, torch.tensor([slot]), mask)[:, -1]
    return out
