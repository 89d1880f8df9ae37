"""The pass that ``mixed_media_fsdp2.py`` and ``ulysses_actor.py`` compare between runs: one seeded loss, so a
reference pass and a sharded or SP = 2 pass differentiate the same function and their gradients can be compared
entry for entry. Imported by those sibling scripts; not a child of its own."""

import torch
from ulysses_ranks import log_prob_forward  # this folder's sibling module


def full(tensor):
    """FSDP2 holds parameters and their gradients as DTensor shards: compare whole tensors, sharded or not."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def seeded_pass(model, batch, sp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropies), detached, after the seeded loss's backward from zeroed gradients."""
    model.zero_grad(set_to_none=True)
    log_probs, entropy = log_prob_forward(model, batch, sp)
    generator = torch.Generator().manual_seed(5)
    loss = (log_probs * torch.randn(log_probs.shape, generator=generator)).sum()
    (loss + (entropy * torch.randn(entropy.shape, generator=generator)).sum()).backward()
    return log_probs.detach(), entropy.detach()
