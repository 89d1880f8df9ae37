"""Entry point: device-safe, vectorized ``fast_pos_embed_interpolate`` for the Qwen3-VL vision towers."""

from verl_qwen3vl_plugin.registry import POS_EMBED, install_patch

install_patch(POS_EMBED, "verl_qwen3vl_plugin.patches.qwen3_vl_pos_embed")
