"""``freeze_vision_tower`` as a verl pull request: read by ``scripts/upstream.py``."""

from verl_qwen3vl_plugin.patches.freeze_vision_tower import replacement
from verl_qwen3vl_plugin.patches.freeze_vision_tower.spec import TOWERS, WRAP_POLICY
from verl_qwen3vl_plugin.staging import Constant, Decorate, MoveFunctions, Overlap, StagedTest, Staging

CONFIG = "verl/workers/config/actor.py"
UTILS = "verl/utils/fsdp_utils.py"
ENGINE = "verl/workers/engine/fsdp/transformer_impl.py"
# The plugin's own wording, made verl's: its log messages lose its prefix, its private attributes its name, its
# logger is the module's, and "the plugin" (which freezes, or covers engines) is verl.
PREFIX = ("verl-qwen3vl-plugin: ", "")
PRIVATE = ("_verl_qwen3vl_", "_verl_")
LOGGER = ('"verl_qwen3vl_plugin"', "__name__")
CONFIG_WORDING = (
    ("plugin covers only verl's FSDP engine (fsdp, fsdp2)", "FSDP engine (fsdp, fsdp2) alone does"),
    ("no engine the plugin covers will read it", "the strategy's engine does not read it"),
)

STAGING = Staging(
    base="verl==0.9.1",
    modules=("fsdp",),
    type="fix",
    description="honour actor.freeze_vision_tower in the FSDP engine",
    edits=(
        # The actor config hands the setting to its FSDP engine config, the one object the engine is built from ...
        MoveFunctions(
            file=CONFIG,
            source=replacement,
            names=("carry_request",),
            before="ActorConfig",
            replace=(PREFIX, PRIVATE, *CONFIG_WORDING, LOGGER),
        ),
        Decorate(file=CONFIG, functions=("ActorConfig.__post_init__",), decorator="carry_request"),
        # ... FSDP's utilities learn to freeze a tower, and give a frozen one a wrap unit of its own ...
        MoveFunctions(
            file=UTILS,
            source=replacement,
            names=("freeze_towers", "tower_unit"),
            before=WRAP_POLICY,
            replace=(PREFIX, PRIVATE, ("this plugin", "verl"), ("the plugin", "verl")),
        ),
        Decorate(
            file=UTILS,
            functions=(WRAP_POLICY,),
            decorator="tower_unit",
            note=(
                "The plugin wraps the name the engine's module imports; here the function itself is decorated, which "
                "every caller shares: the policy changes only for a module holding a tower `freeze_towers` marked, "
                "which only the engine freezes."
            ),
        ),
        # ... and the engine freezes the towers the plugin knows before it wraps the module and builds the optimizer.
        Constant(file=ENGINE, name="VISION_TOWERS", value=TOWERS, before="FSDPEngine"),
        MoveFunctions(file=ENGINE, source=replacement, names=("freeze_before_wrapping",), before="FSDPEngine"),
        Decorate(
            file=ENGINE,
            functions=("FSDPEngine._build_fsdp_module",),
            decorator="functools.partial(freeze_before_wrapping, towers=VISION_TOWERS)",
            imports=("import functools",),
            note="The plugin passes its `TOWERS`, written out above as `VISION_TOWERS`.",
        ),
    ),
    tests=(
        StagedTest(
            path="tests/workers/engine/test_fsdp_engine_freeze_vision_tower_on_cpu.py",
            source="tests/patches/freeze_vision_tower/staged_fsdp_engine_freeze_vision_tower.py",
        ),
    ),
    order=40,
    overlaps=(
        Overlap(
            pr="verl#6320",
            state="open",
            advice=(
                "review it first: its freeze_module_pattern (a name regex, on every engine) is the general mechanism. "
                "Ask there for the frozen tower's own FSDP1 wrap unit (FSDP1 without use_orig_params refuses a unit "
                "mixing frozen and trainable parameters, which a pattern on the tower leaves) and for "
                "actor.freeze_vision_tower to map onto it; send this one, which honours the declared setting on the "
                "FSDP engine with a two-rank engine test, if it stalls."
            ),
        ),
    ),
)
