"""The pass that ``mixed_media_fsdp2.py`` and ``ulysses_actor.py`` compare between runs: one seeded loss, so a
reference pass and a sharded or SP = 2 pass differentiate the same function and their gradients can be compared
entry for entry. Imported by those sibling scripts; not a child of its own."""

import torch
import torch.distributed as dist
from ulysses_ranks import log_prob_forward  # this folder's sibling module


def full(tensor):
    """FSDP2 holds parameters and their gradients as DTensor shards: compare whole tensors, sharded or not."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def averaged_grads(model, sp: int) -> dict[str, torch.Tensor]:
    """Each parameter's whole gradient (zeros where it has none), averaged over the ranks as FSDP averages them: a
    plain module's by an all-reduce here when sp > 1, an FSDP2 one's already."""
    grads = {}
    for name, p in model.named_parameters():
        grad = full(p.grad) if p.grad is not None else torch.zeros(p.shape)
        if sp > 1 and not hasattr(p, "full_tensor"):
            grad = grad.clone()
            dist.all_reduce(grad)
            grad /= dist.get_world_size()
        grads[name] = grad
    return grads


def seeded_pass(model, batch, sp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropies), detached, after the seeded loss's backward from zeroed gradients."""
    model.zero_grad(set_to_none=True)
    log_probs, entropy = log_prob_forward(model, batch, sp)
    generator = torch.Generator().manual_seed(5)
    loss = (log_probs * torch.randn(log_probs.shape, generator=generator)).sum()
    (loss + (entropy * torch.randn(entropy.shape, generator=generator)).sum()).backward()
    return log_probs.detach(), entropy.detach()
