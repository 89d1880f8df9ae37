"""Every verdict other than ``apply`` and ``unrecognized`` stands on a named, known upstream shape, not on the probe
failing to see the affected one.

For each known safe shape installed on this stack, near-misses are generated from the real installed source: a
renamed helper, another call form, another op for the same dense computation, an extra argument. Each must come out
``unrecognized``, or ``apply`` where the patch provably still works on it. The contract test fails when a stack shows
a safe verdict that has no near-misses here. The generator lives in the tests, not in the wheel.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from typing import NamedTuple

import pytest

from tests.helpers import judge, source_text, use_sources
from verl_qwen3vl_plugin import vision_towers
from verl_qwen3vl_plugin.patches import PATCHES
from verl_qwen3vl_plugin.registry import Patch, Target, Verdict

Edit = Callable[[str], str]
APPLY, UNRECOGNIZED = Verdict.APPLY, Verdict.UNRECOGNIZED
SAFE = (Verdict.FIXED_UPSTREAM, Verdict.NOT_USED)
NPU_PATCH = "verl.models.transformers.npu_patch"
BALANCING = "verl.utils.seqlen_balancing"
ENGINE = "verl.workers.engine.fsdp.transformer_impl"
ENGINE_UTILS = "verl.workers.engine.utils"
VISION = "transformers.models.qwen3_vl.modeling_qwen3_vl"
MOE = "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe"
QWEN3_5_VERL = "verl.models.transformers.qwen3_5"


def replace(old: str, new: str) -> Edit:
    def edit(source: str) -> str:
        assert old in source, f"{old!r} is not in the source"
        return source.replace(old, new)

    return edit


def substitute(pattern: str, repl: str) -> Edit:
    def edit(source: str) -> str:
        edited, count = re.subn(pattern, repl, source)
        assert count, f"{pattern!r} matches nothing"
        return edited

    return edit


def in_method(cls: str, method: str, change: Callable[[ast.FunctionDef], None]) -> Edit:
    """Edit one method's syntax tree, and print the module back."""

    def edit(source: str) -> str:
        tree = ast.parse(source)
        scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        change(next(n for n in scope.body if isinstance(n, ast.FunctionDef) and n.name == method))
        return ast.unparse(tree)

    return edit


def in_class(cls: str, change: Callable[[ast.ClassDef], None]) -> Edit:
    def edit(source: str) -> str:
        tree = ast.parse(source)
        change(next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls))
        return ast.unparse(tree)

    return edit


def statement(code: str) -> ast.stmt:
    return ast.parse(code).body[0]


def prepend(code: str) -> Callable[[ast.FunctionDef], None]:
    """Insert ``code`` at the top of a function body, after its docstring."""

    def change(func: ast.FunctionDef) -> None:
        docstring = isinstance(func.body[0], ast.Expr) and isinstance(func.body[0].value, ast.Constant)
        func.body.insert(1 if docstring else 0, statement(code))

    return change


def before_return(code: str) -> Callable[[ast.FunctionDef], None]:
    def change(func: ast.FunctionDef) -> None:
        func.body.insert(len(func.body) - 1, statement(code))

    return change


def extra_parameter(name: str, position: int | None = None) -> Callable[[ast.FunctionDef], None]:
    def change(func: ast.FunctionDef) -> None:
        func.args.args.insert(len(func.args.args) if position is None else position, ast.arg(name))
        if position is None:
            func.args.defaults.append(ast.Constant(None))

    return change


def add_method(code: str) -> Callable[[ast.ClassDef], None]:
    return lambda cls: cls.body.append(statement(code))


def guard_scatter(func: ast.FunctionDef) -> None:
    """Move the block's top-level scatter under ``if not self.training:``: verl 0.7.1's shape."""
    index = next(i for i, s in enumerate(func.body) if "scatter_" in ast.unparse(s))
    func.body[index] = ast.If(test=ast.parse("not self.training", mode="eval").body, body=[func.body[index]], orelse=[])


def scatter_unless_training(func: ast.FunctionDef) -> None:
    """The top-level scatter written as ``x = <scatter> if not self.training else x``: verl 0.7.1's bug, inline."""
    index = next(i for i, s in enumerate(func.body) if "scatter_" in ast.unparse(s))
    stmt = func.body[index]
    target = ast.unparse(stmt.targets[0])
    func.body[index] = statement(f"{target} = ({ast.unparse(stmt.value)}) if not self.training else {target}")


def rename_stream_keys(func: ast.FunctionDef) -> None:
    """``(name, tensor) for name, param in ...`` -> ``(rename(name), tensor) ...``: names no longer as stored."""
    gen = next(n for n in ast.walk(func) if isinstance(n, ast.GeneratorExp))
    gen.elt.elts[0] = ast.parse("rename(name)", mode="eval").body


class Variant(NamedTuple):
    name: str
    module: str  # whose source is edited: the target's own, or one its probe reads
    edit: Edit
    expected: Verdict


class Shape(NamedTuple):
    """A known safe shape: the patch, the target, and a phrase of the reason its verdict gives."""

    patch: str
    target: str
    reason: str
    variants: tuple[Variant, ...]


def _vision_fixed(module: str) -> tuple[Variant, ...]:
    helper = "get_vision_bilinear_indices_and_weights"
    cls = vision_towers.VISION_CLASSES[module]
    return (
        Variant("renamed helper", module, substitute(rf"\b{helper}\(", "get_vision_bilinear_weights("), UNRECOGNIZED),
        Variant(
            "helper as an attribute call",
            module,
            substitute(rf"(?<!\.)\b{helper}\(", f"vision_utils.{helper}("),
            UNRECOGNIZED,
        ),  # fmt: skip
        Variant(
            "helper from another module",
            module,
            replace(f"from ...vision_utils import {helper}", f"from ...vision_helpers import {helper}"),
            UNRECOGNIZED,
        ),  # fmt: skip
        Variant(
            "helper on another grid", module, substitute(rf"({helper}\(\s*)grid_thw", r"\1grid_thw * 2"), UNRECOGNIZED
        ),  # fmt: skip
        # The patched method is called again: the patch replaces it, so it still works.
        Variant(
            "forward also calls the method",
            module,
            in_method(cls, "forward", prepend("self.fast_pos_embed_interpolate(grid_thw)")),
            APPLY,
        ),  # fmt: skip
    )


def _balancing_near_misses(base: str) -> tuple[Variant, ...]:
    return (
        Variant(
            "guard on the group's truth", BALANCING, replace(base, base.replace(":", " and dp_group:")), UNRECOGNIZED
        ),  # fmt: skip
        # The guard through a named condition is verl 0.7.1's behaviour: the patch passes a group, so it works.
        Variant(
            "guard through a named condition",
            BALANCING,
            replace(
                base, "sync = " + base.removeprefix("if ").removesuffix(":") + " and dp_group is not None\n    if sync:"
            ),
            APPLY,
        ),  # fmt: skip
        Variant(
            "early return without a group",
            BALANCING,
            replace(base, "if dp_group is None:\n        pass\n    " + base),
            UNRECOGNIZED,
        ),
        Variant(
            "named guard in a compound test",
            BALANCING,
            replace(
                base,
                "sync = "
                + base.removeprefix("if ").removesuffix(":")
                + " and dp_group is not None\n    if sync and True:",
            ),
            UNRECOGNIZED,
        ),
        Variant(
            "group passed by position",
            BALANCING,
            replace("op=dist.ReduceOp.MAX, group=dp_group)", "dist.ReduceOp.MAX, dp_group)"),
            UNRECOGNIZED,
        ),  # fmt: skip
        Variant(
            "renamed split", BALANCING, substitute(r"\brearrange_micro_batches\(", "split_micro_batches("), UNRECOGNIZED
        ),  # fmt: skip
        Variant(
            "extra argument before dp_group",
            BALANCING,
            substitute(
                r"def prepare_dynamic_batch\(\s*data(: [\w.]+)?,\s*max_token_len(: \w+)?,",
                "def prepare_dynamic_batch(data, max_token_len, extra,",
            ),
            UNRECOGNIZED,
        ),  # fmt: skip
    )


def _engine_near_misses() -> tuple[Variant, ...]:
    return (
        Variant(
            "engine passes no group",
            ENGINE,
            replace("dp_group=self.get_data_parallel_group()", "dp_group=None"),
            UNRECOGNIZED,
        ),  # fmt: skip
        Variant(
            "engine splits by another call",
            ENGINE,
            substitute(r"\bprepare_micro_batches\(", "rearrange_micro_batches("),
            UNRECOGNIZED,
        ),  # fmt: skip
        Variant(
            "renamed split in the helper",
            ENGINE_UTILS,
            substitute(r"\brearrange_micro_batches\(", "split_micro_batches("),
            UNRECOGNIZED,
        ),  # fmt: skip
        Variant(
            "helper drops the group", ENGINE_UTILS, substitute(r"dp_group=dp_group,", "dp_group=None,"), UNRECOGNIZED
        ),  # fmt: skip
    )


def _stored_stream_near_misses() -> tuple[Variant, ...]:
    method = ("FSDPEngine", "get_per_tensor_param")
    return (
        Variant(
            "split by a helper of another name",
            ENGINE,
            in_method(*method, before_return("per_tensor_param = split_experts(per_tensor_param)")),
            UNRECOGNIZED,
        ),  # fmt: skip
        Variant("keys renamed", ENGINE, in_method(*method, rename_stream_keys), UNRECOGNIZED),
        Variant(
            "unfused, with no unfuse_moe_params to wrap",
            ENGINE,
            in_method(*method, before_return("per_tensor_param = unfuse_moe_params(per_tensor_param, 'qwen3_vl_moe')")),
            UNRECOGNIZED,
        ),  # fmt: skip
    )


_STATE_DICT_READER = "def export_shards(self):\n    return self.module.state_dict()"
_SHAPES = [
    *(
        Shape(
            "qwen3_vl_pos_embed", module, "get_vision_bilinear_indices_and_weights on grid_thw", _vision_fixed(module)
        )
        for module in vision_towers.VISION_CLASSES
    ),
    Shape(
        "qwen3_vl_moe_sparse_experts",
        MOE,
        "experts_implementation",
        (
            Variant(
                "renamed decorator",
                MOE,
                replace(
                    "@use_experts_implementation\nclass Qwen3VLMoeTextExperts",
                    "@use_kernel_implementation\nclass Qwen3VLMoeTextExperts",
                ),
                UNRECOGNIZED,
            ),
            Variant(
                "decorator called",
                MOE,
                replace(
                    "@use_experts_implementation\nclass Qwen3VLMoeTextExperts",
                    "@use_experts_implementation()\nclass Qwen3VLMoeTextExperts",
                ),
                UNRECOGNIZED,
            ),
            *(
                Variant(
                    f"dense eager path ({op})",
                    MOE,
                    in_method(
                        "Qwen3VLMoeTextExperts",
                        "forward",
                        prepend(f"dense = torch.{op}(hidden_states, self.gate_up_proj)"),
                    ),
                    UNRECOGNIZED,
                )
                for op in ("bmm", "matmul")
            ),
            Variant(
                "dense eager path (@)",
                MOE,
                in_method("Qwen3VLMoeTextExperts", "forward", prepend("dense = hidden_states @ self.gate_up_proj")),
                UNRECOGNIZED,
            ),
            Variant(
                "dense eager path (linear on the whole parameter)",
                MOE,
                in_method(
                    "Qwen3VLMoeTextExperts", "forward", prepend("dense = F.linear(hidden_states, self.gate_up_proj)")
                ),
                UNRECOGNIZED,
            ),
            Variant(
                "decorator of another module",
                MOE,
                substitute(r"from \.\.\.integrations import \(", "from ...experts_helpers import ("),
                UNRECOGNIZED,
            ),
            Variant(
                "dense eager path (einsum)",
                MOE,
                in_method(
                    "Qwen3VLMoeTextExperts",
                    "forward",
                    prepend("dense = torch.einsum('th,ehi->eti', hidden_states, self.gate_up_proj)"),
                ),
                UNRECOGNIZED,
            ),
        ),
    ),  # fmt: skip
    *(
        Shape(
            "dp_actor_dynamic_batch_sync",
            module,
            "without a dp_group (0.7.0)",
            _balancing_near_misses("if dist.is_initialized() and same_micro_num_in_dp:"),
        )
        for module in ("verl.workers.actor.dp_actor", "verl.workers.critic.dp_critic")
    ),  # fmt: skip
    *(
        Shape("dp_actor_dynamic_batch_sync", module, "every split of the FSDP engine", _engine_near_misses())
        for module in ("verl.workers.actor.dp_actor", "verl.workers.critic.dp_critic")
    ),
    Shape(
        "npu_qwen3_vl_moe_routing",
        NPU_PATCH,
        "in every mode (verl >= 0.8)",
        (
            Variant(
                "scatter not in place",
                NPU_PATCH,
                in_method(
                    "NPUQwen3VLMoeTextSparseMoeBlock",
                    "forward",
                    lambda f: [
                        setattr(n.func, "attr", "scatter")
                        for n in ast.walk(f)
                        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "scatter_"
                    ],
                ),
                UNRECOGNIZED,
            ),
            # The scatter guarded as in verl 0.7.1, with experts that read the dense matrix: the patch's case.
            Variant(
                "scatter under a conditional expression",
                NPU_PATCH,
                in_method("NPUQwen3VLMoeTextSparseMoeBlock", "forward", scatter_unless_training),
                UNRECOGNIZED,
            ),
            Variant(
                "scatter only in eval",
                NPU_PATCH,
                in_method("NPUQwen3VLMoeTextSparseMoeBlock", "forward", guard_scatter),
                APPLY,
            ),
            Variant(
                "extra argument to the block",
                NPU_PATCH,
                in_method("NPUQwen3VLMoeTextSparseMoeBlock", "forward", extra_parameter("padding_mask")),
                UNRECOGNIZED,
            ),
            Variant(
                "extra argument to the experts",
                NPU_PATCH,
                in_method("NPUQwen3VLMoeTextExperts", "forward", extra_parameter("expert_mask")),
                UNRECOGNIZED,
            ),
        ),
    ),  # fmt: skip
    Shape(
        "npu_qwen3_vl_moe_routing",
        NPU_PATCH,
        "top-k weights directly in training (0.7.0)",
        (
            Variant(
                "unpermuted with another weight",
                NPU_PATCH,
                in_method(
                    "NPUQwen3VLMoeTextExperts",
                    "forward",
                    lambda f: [
                        setattr(k, "value", ast.parse("routing_weights.float()", mode="eval").body)
                        for n in ast.walk(f)
                        if isinstance(n, ast.Call)
                        for k in n.keywords
                        if k.arg == "probs"
                    ],
                ),
                UNRECOGNIZED,
            ),
            Variant(
                "experts also read the dense matrix",
                NPU_PATCH,
                in_method(
                    "NPUQwen3VLMoeTextExperts",
                    "forward",
                    prepend("picked = routing_weights[batch_idx, router_indices]"),
                ),
                UNRECOGNIZED,
            ),
            Variant(
                "extra argument to the block",
                NPU_PATCH,
                in_method("NPUQwen3VLMoeTextSparseMoeBlock", "forward", extra_parameter("padding_mask")),
                UNRECOGNIZED,
            ),
        ),
    ),  # fmt: skip
    *(
        Shape("npu_qwen3_vl_moe_weight_sync", module, "as they are stored (verl 0.7/0.8)", _stored_stream_near_misses())
        for module in ("verl.workers.engine.fsdp.utils", ENGINE)
    ),
    Shape(
        "npu_qwen3_vl_moe_weight_sync",
        f"{ENGINE}:FSDPEngine.get_per_tensor_param_shard",
        "no shard export",
        (
            Variant(
                "another method reads the state dict",
                ENGINE,
                in_class("FSDPEngine", add_method(_STATE_DICT_READER)),
                UNRECOGNIZED,
            ),
            Variant(
                "a method reads it through another function",
                ENGINE,
                in_class(
                    "FSDPEngine", add_method("def export_shards(self):\n    return get_model_state_dict(self.module)")
                ),
                UNRECOGNIZED,
            ),
            Variant(
                "a shard export on another class",
                ENGINE,
                in_class(
                    "FSDPEngineWithLMHead", add_method("def get_per_tensor_param_shard(self):\n    return iter(())")
                ),
                UNRECOGNIZED,
            ),
            Variant(
                "renamed full export",
                ENGINE,
                substitute(r"def get_per_tensor_param\(", "def export_weights("),
                UNRECOGNIZED,
            ),
        ),
    ),  # fmt: skip
    Shape(
        "qwen3_vl_moe_routing_replay",
        f"{MOE}:Qwen3VLMoeTextSparseMoeBlock.forward",
        "takes its routes from",
        (
            Variant(
                "the block also takes a top-k",
                MOE,
                in_method("Qwen3VLMoeTextSparseMoeBlock", "forward", prepend("torch.topk(hidden_states, 1)")),
                UNRECOGNIZED,
            ),
            Variant(
                "renamed router class",
                MOE,
                substitute(r"class Qwen3VLMoeTextTopKRouter\(", "class Qwen3VLMoeTextRouter("),
                UNRECOGNIZED,
            ),
        ),
    ),
    Shape(
        "qwen3_vl_moe_routing_replay",
        f"{MOE}:Qwen3VLMoeTextTopKRouter.forward",
        "no Qwen3VLMoeTextTopKRouter",
        (
            Variant(
                "the block sorts instead of a top-k",
                MOE,
                replace("torch.topk(routing_weights", "torch.sort(routing_weights"),
                UNRECOGNIZED,
            ),
            Variant(
                "the block returns one value",
                MOE,
                replace("return routed_out, router_logits", "return routed_out"),
                UNRECOGNIZED,
            ),
        ),
    ),
    *(
        Shape(
            "qwen3_vl_moe_routing_replay",
            target,
            "no legacy FSDP actor (verl >= 0.8)",
            (
                Variant(
                    "the engine reads router_replay",
                    ENGINE,
                    in_class(
                        "FSDPEngineWithLMHead",
                        add_method("def replay_mode(self):\n    return self.engine_config.router_replay.mode"),
                    ),
                    UNRECOGNIZED,
                ),
                Variant(
                    "the engine names its pad otherwise",
                    ENGINE,
                    substitute(r"output_args\[\"pad_size\"\] =", 'output_args["padding"] ='),
                    UNRECOGNIZED,
                ),
            ),
        )
        for target in (
            "verl.workers.actor.dp_actor",
            "verl.workers.fsdp_workers:ActorRolloutRefWorker.compute_log_prob",
        )
    ),
    *(
        Shape(
            "qwen3_vl_nested_position_ids",
            target,
            "never calls maybe_fix_3d_position_ids (verl 0.7.0)",
            (
                Variant(
                    "the class is renamed", target, substitute(rf"(?m)^class {cls}\b", f"class {cls}2"), UNRECOGNIZED
                ),
                Variant(
                    "the caller names the function",
                    target,
                    lambda source: source + "\n\ndef _fix(data):\n    maybe_fix_3d_position_ids(data)\n",
                    UNRECOGNIZED,
                ),
            ),
        )
        for target, cls in (
            ("verl.workers.engine_workers", "TrainingWorker"),
            ("verl.workers.engine.base", "BaseEngine"),
        )
    ),
    Shape(
        "qwen3_5_packed_delta_net",
        QWEN3_5_VERL,
        "verl 0.8 has no delta-net forward of its own",
        (
            Variant(
                "verl defines a delta-net forward of another shape",
                QWEN3_5_VERL,
                lambda source: source + "\n\ndef qwen3_5_gated_delta_net_forward(self, hidden_states):\n    return 0\n",
                UNRECOGNIZED,
            ),
            Variant(
                "the base forward is renamed",
                QWEN3_5_VERL,
                substitute(r"\bdef qwen3_5_base_forward\b", "def qwen3_5_base_forward2"),
                UNRECOGNIZED,
            ),
        ),
    ),
    *(
        Shape(
            "qwen3_5_packed_delta_net",
            target,
            "verl replaces this layer's forward",
            (
                # Without verl's forward, or with apply_monkey_patch no longer installing it, transformers' layer
                # runs: the plugin wraps it, which is right whether verl's decoder passes boundaries or not.
                Variant(
                    "verl's forward is renamed",
                    QWEN3_5_VERL,
                    substitute(r"\bqwen3_5_gated_delta_net_forward\b", "qwen3_5_linear_forward"),
                    APPLY,
                ),
                Variant(
                    "apply_monkey_patch no longer installs it",
                    "verl.models.transformers.monkey_patch",
                    substitute(r"\bqwen3_5_gated_delta_net_forward\b", "qwen3_5_linear_forward"),
                    APPLY,
                ),
            ),
        )
        for target in (
            "transformers.models.qwen3_5.modeling_qwen3_5",
            "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
        )
    ),
    Shape(
        "vision_placeholder_ban",
        "verl.workers.rollout.vllm_rollout.utils",
        "bans the processor's placeholder ids",
        (
            Variant(
                "the ban parameter is renamed",
                "verl.workers.rollout.vllm_rollout.utils",
                substitute(r"\bbanned_token_ids\b", "banned_ids"),
                UNRECOGNIZED,
            ),
        ),
    ),
    *(
        Shape(
            "vision_placeholder_ban",
            target,
            "this verl patches vLLM's logits in",
            (
                Variant(
                    "the module patches compute_logits another way",
                    target,
                    lambda source: source + "\n\ndef _patch(model):\n    model.compute_logits = None\n",
                    UNRECOGNIZED,
                ),
                Variant("not verl's module", target, substitute(rf"\b{marker}\b", f"{marker}2"), UNRECOGNIZED),
            ),
        )
        for target, marker in (
            ("verl.workers.rollout.vllm_rollout.utils", "get_vllm_max_lora_rank"),
            ("verl.workers.rollout.vllm_rollout.vllm_rollout", "ServerAdapter"),
        )
    ),
]


def _installed(patch: Patch, target: Target):
    return judge(patch, target, source_text(target.module))


INSTALLED = [(patch, target, _installed(patch, target)) for patch in PATCHES for target in patch.targets]
# A module this stack does not have (Qwen3.5 before transformers 5.2 or verl 0.8) has no shape to miss: its verdict is
# the target's own ``absent`` (tests/test_registry_contract.py checks which targets may have one).
SAFE_HERE = [(p, t, d) for p, t, d in INSTALLED if d.verdict in SAFE and source_text(t.module) is not None]


def _shape_of(patch: Patch, target: Target, reason: str) -> Shape | None:
    return next((s for s in _SHAPES if (s.patch, s.target) == (patch.name, target.label) and s.reason in reason), None)


@pytest.mark.parametrize(
    ("patch", "target", "decision"), SAFE_HERE, ids=[f"{p.name}-{t.label}" for p, t, _ in SAFE_HERE]
)
def test_every_safe_verdict_here_has_near_misses(patch, target, decision):
    assert _shape_of(patch, target, decision.reason), f"no near-misses for {decision} of {patch.name} on {target.label}"


CASES = [
    (patch, target, variant)
    for patch, target, decision in SAFE_HERE
    if (shape := _shape_of(patch, target, decision.reason))
    for variant in shape.variants
]


@pytest.mark.skipif(not CASES, reason="no known safe shape is installed on this stack")
@pytest.mark.parametrize(
    ("patch", "target", "variant"), CASES, ids=[f"{p.name}-{t.label}-{v.name}" for p, t, v in CASES]
)
def test_near_miss_of_a_safe_shape_is_not_called_safe(monkeypatch, patch, target, variant):
    base = source_text(variant.module)
    edited = variant.edit(base)
    assert edited != base
    if variant.module == target.module:
        decision = judge(patch, target, edited)
    else:
        use_sources(monkeypatch, {variant.module: edited})
        decision = judge(patch, target, source_text(target.module))
    assert decision.verdict is variant.expected, decision
