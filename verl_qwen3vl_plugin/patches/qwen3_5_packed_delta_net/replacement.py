"""Qwen3.5's gated delta-net layers over verl's packed micro-batches: each sample's convolution and recurrence start
fresh at its boundary, with or without flash-linear-attention (FLA), on any device, under Ulysses SP too.

``packed_forward(upstream)`` wraps verl 0.9's layer forward (it receives ``cu_seqlens``);
``boundary_packed_forward(upstream)`` transformers' own (verl 0.8, which passes no boundaries:
``boundary_decoder_forward`` reads them from the packed position ids, where every sample restarts at 0, and hands
them down for the length of the decoder layer's call, so a recomputation under activation checkpointing sees them
too). Cached generation, unpacked batches, and verl 0.9's FLA path (FLA's varlen and context-parallel kernels given
the boundaries) go to ``upstream`` untouched.

Ulysses SP: a delta-net head only ever reads its own channels, so the layer runs like Ulysses attention: the local
projections are exchanged from sequence shards to head shards (one all-to-all), each rank runs whole sequences on its
heads, and the output goes back (one all-to-all). Heads that do not divide by the SP size raise the same ValueError
on every rank before the first collective.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from importlib import import_module

import torch
import torch.distributed as dist
import torch.nn.functional as F

from verl_qwen3vl_plugin.patches.qwen3_5_packed_delta_net.delta_net_varlen import (
    causal_conv1d,
    chunk_gated_delta_rule,
    layout_for,
    lengths_of,
)

# (cu_seqlens, its host copy) of the packed row the current decoder layer runs on (verl 0.8), or None
_BOUNDARIES: ContextVar[tuple[torch.Tensor, torch.Tensor] | None] = ContextVar("qwen3_5_boundaries", default=None)
# The last position ids read, and their boundaries: every layer of one forward (and its recomputation) gets the same
# tensor, so the host sync (and under SP the all-gather) happens once per forward.
_last: tuple[weakref.ref, tuple[torch.Tensor, torch.Tensor] | None] | None = None


def _sequence_parallel() -> tuple[int, dist.ProcessGroup | None]:
    from verl.utils.ulysses import get_ulysses_sequence_parallel_group, get_ulysses_sequence_parallel_world_size

    return get_ulysses_sequence_parallel_world_size(), get_ulysses_sequence_parallel_group()


def uses_fla(layer: torch.nn.Module) -> bool:
    """Whether the layer's chunked rule is FLA's kernel (transformers picks it at build time: CUDA with FLA)."""
    return getattr(layer.chunk_gated_delta_rule, "__module__", "").startswith("fla.")


def boundaries_from_positions(position_ids: torch.Tensor | None, local_len: int) -> tuple | None:
    """(cu_seqlens, host copy) of a packed row from its position ids ((rows, 1, seq) or (1, seq)): a sample starts
    where every row is 0. Under SP the ids are this rank's slice: the group's are gathered first. None where the row
    holds one sample or none is packed."""
    global _last
    if position_ids is None or position_ids.shape[-2] != 1:
        return None
    if _last is not None and _last[0]() is position_ids:
        return _last[1]
    rows = position_ids.reshape(-1, position_ids.shape[-1])
    size, group = _sequence_parallel()
    if size > 1 and rows.shape[-1] == local_len:
        shards = [torch.empty_like(rows) for _ in range(size)]
        dist.all_gather(shards, rows.contiguous(), group=group)
        rows = torch.cat(shards, dim=-1)
    starts = (rows == 0).all(0)
    starts[0] = True
    cu_cpu = torch.cat([starts.nonzero().flatten(), starts.new_tensor([starts.numel()], dtype=torch.long)]).cpu()
    found = (cu_cpu.to(position_ids.device), cu_cpu) if cu_cpu.numel() > 2 else None
    _last = (weakref.ref(position_ids), found)
    return found


def boundary_decoder_forward(upstream: Callable) -> Callable:
    """A decoder layer's forward that hands its linear-attention layer the packed row's boundaries (verl 0.8)."""

    @functools.wraps(upstream)
    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        kind = getattr(self, "layer_type", None) or self.block_type  # transformers >= 5.13 renamed it
        if kind != "linear_attention" or kwargs.get("past_key_values") is not None:
            return upstream(self, hidden_states, *args, **kwargs)
        token = _BOUNDARIES.set(boundaries_from_positions(kwargs.get("position_ids"), hidden_states.shape[1]))
        try:
            return upstream(self, hidden_states, *args, **kwargs)
        finally:
            _BOUNDARIES.reset(token)

    return forward


def masked(layer: torch.nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``hidden_states`` with padded positions zeroed as the layer's own forward zeroes them (its modeling module's
    ``apply_mask_to_padding_states``), where there is a mask."""
    if attention_mask is None:
        return hidden_states
    return import_module(type(layer).__module__).apply_mask_to_padding_states(hidden_states, attention_mask)


def packed_forward(upstream: Callable) -> Callable:
    """verl's gated delta-net forward ``upstream`` (verl >= 0.9: it receives the packed row's ``cu_seqlens``), with
    packed rows run by ``packed_delta_net`` wherever FLA's kernels do not run them: there transformers' torch rule
    ignores the boundaries (>= 5.9) or verl loops over the samples, and Ulysses SP has no kernel. Cached generation,
    unpacked batches and FLA's path go to ``upstream``."""

    @functools.wraps(upstream)
    def forward(
        self,
        hidden_states: torch.Tensor,
        cache_params=None,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cu_seqlens_cpu: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if cache_params is not None or cu_seqlens is None or hidden_states.shape[0] != 1 or uses_fla(self):
            return upstream(self, hidden_states, cache_params, attention_mask, cu_seqlens, cu_seqlens_cpu)
        return packed_delta_net(self, masked(self, hidden_states, attention_mask), cu_seqlens, cu_seqlens_cpu)

    return forward


def boundary_packed_forward(upstream: Callable) -> Callable:
    """transformers' own gated delta-net forward ``upstream`` (verl 0.8, which hands it no boundaries), with packed
    rows run by ``packed_delta_net`` on the boundaries ``boundary_decoder_forward`` read for its decoder layer, FLA
    or not. Cached generation and unpacked batches go to ``upstream``."""

    @functools.wraps(upstream)
    def forward(self, hidden_states: torch.Tensor, cache_params=None, attention_mask=None, **kwargs) -> torch.Tensor:
        boundaries = _BOUNDARIES.get()
        if cache_params is not None or boundaries is None or hidden_states.shape[0] != 1:
            return upstream(self, hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
        rule = fla_rule(self) if uses_fla(self) else chunk_gated_delta_rule
        return packed_delta_net(self, masked(self, hidden_states, attention_mask), *boundaries, rule=rule)

    return forward


def fla_rule(layer: torch.nn.Module) -> Callable:
    """``packed_delta_net``'s rule on the layer's own FLA kernel (verl 0.8 on CUDA with FLA), given the packed
    samples' boundaries, which verl 0.8 never passes it."""

    def rule(query, key, value, g, beta, layout) -> torch.Tensor:
        out, _ = layer.chunk_gated_delta_rule(
            query, key, value, g=g, beta=beta, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor(layout.offsets, device=query.device),
        )  # fmt: skip
        return out

    return rule


def _head_channels(layer: torch.nn.Module, rank: int, size: int) -> torch.Tensor:
    """The conv channels of rank ``rank``'s heads: its share of the query, key and value channels."""
    key, value = layer.key_dim // size, layer.value_dim // size
    return torch.cat([
        torch.arange(rank * key, (rank + 1) * key),
        torch.arange(layer.key_dim + rank * key, layer.key_dim + (rank + 1) * key),
        torch.arange(2 * layer.key_dim + rank * value, 2 * layer.key_dim + (rank + 1) * value),
    ])  # fmt: skip


def packed_delta_net(
    layer: torch.nn.Module,
    hidden_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor | None = None,
    rule: Callable = chunk_gated_delta_rule,
) -> torch.Tensor:
    """The gated delta-net layer ``layer`` on one packed row (1, seq, hidden), this rank's sequence shard under SP,
    each sample between ``cu_seqlens`` bounds on its own (a tail past the last bound, SP padding, is one more).
    ``rule``: the chunked rule over the packed samples, as ``chunk_gated_delta_rule`` takes them."""
    size, group = _sequence_parallel()
    heads_k, heads_v = layer.num_k_heads, layer.num_v_heads
    if size > 1 and (heads_k % size or heads_v % size):
        raise ValueError(
            f"Ulysses SP size {size} must divide Qwen3.5's linear-attention heads ({heads_k} key, {heads_v} value) "
            "for the plugin's packed gated delta-net"
        )
    mixed = layer.in_proj_qkv(hidden_states)
    gate = layer.in_proj_z(hidden_states)
    b, a = layer.in_proj_b(hidden_states), layer.in_proj_a(hidden_states)
    weight, bias, a_log, dt_bias = layer.conv1d.weight, layer.conv1d.bias, layer.A_log, layer.dt_bias
    if size > 1:
        from verl.utils.ulysses import gather_seq_scatter_heads

        key = layer.key_dim
        parts = (mixed[..., :key], mixed[..., key : 2 * key], mixed[..., 2 * key :], b, a)
        widths = [p.shape[-1] // size for p in parts]
        local = torch.cat([p.unflatten(-1, (size, -1)) for p in parts], dim=-1)  # (1, seq / size, size, ...)
        q_, k_, v_, b, a = gather_seq_scatter_heads(local, seq_dim=1, head_dim=2, group=group)[:, :, 0].split(
            widths, -1
        )
        mixed = torch.cat([q_, k_, v_], dim=-1)
        rank = dist.get_rank(group)
        channels = _head_channels(layer, rank, size).to(weight.device)
        weight, bias = weight[channels], bias[channels] if bias is not None else None
        heads = slice(rank * heads_v // size, (rank + 1) * heads_v // size)
        a_log, dt_bias = a_log[heads], dt_bias[heads]
        heads_k, heads_v = heads_k // size, heads_v // size
    total = mixed.shape[1]
    lengths = lengths_of(cu_seqlens, cu_seqlens_cpu)
    if sum(lengths) > total:
        raise ValueError(f"packed cu_seqlens end at {sum(lengths)}, past the row's {total} tokens")
    if sum(lengths) < total:
        lengths.append(total - sum(lengths))
    layout = layout_for(tuple(lengths), mixed.device)
    mixed = causal_conv1d(mixed.transpose(1, 2), weight, bias, layout).transpose(1, 2)
    key_width = heads_k * layer.head_k_dim
    query, key, value = mixed.split([key_width, key_width, heads_v * layer.head_v_dim], dim=-1)
    query = query.unflatten(-1, (heads_k, layer.head_k_dim))
    key = key.unflatten(-1, (heads_k, layer.head_k_dim))
    value = value.unflatten(-1, (heads_v, layer.head_v_dim))
    if heads_v > heads_k:
        query = query.repeat_interleave(heads_v // heads_k, dim=2)
        key = key.repeat_interleave(heads_v // heads_k, dim=2)
    beta = b.sigmoid()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    out = rule(query, key, value, g, beta, layout)
    if size > 1:
        from verl.utils.ulysses import gather_heads_scatter_seq

        out = gather_heads_scatter_seq(out, head_dim=2, seq_dim=1, group=group)
    out = layer.norm(out.reshape(-1, layer.head_v_dim), gate.reshape(-1, layer.head_v_dim))
    return layer.out_proj(out.reshape(*hidden_states.shape[:2], -1))
