"""``freeze_vision_tower``: its decisions on the installed verl, on edits of its source, and near-misses of verl
0.7's legacy workers, which freeze the tower themselves (``tests/source_edits.py``)."""

from __future__ import annotations

import pytest

from tests.helpers import TRANSFORMERS, VERL, decide_text, source_text
from tests.source_edits import NearMisses, Variant, check_near_miss, near_miss_cases, replace
from verl_qwen3vl_plugin.patches.freeze_vision_tower import spec
from verl_qwen3vl_plugin.registry import Verdict

PATCH = spec.PATCH
CONFIG, ENGINE, WORKERS = (PATCH.target(m) for m in (spec.ACTOR_CONFIG, spec.FSDP_ENGINE, spec.FSDP_WORKERS))


@pytest.mark.parametrize("target", PATCH.targets, ids=lambda t: t.module.rsplit(".", 1)[-1])
def test_installed_verl_reads_as_declared(target):
    shape = target.shape_on(VERL.release, TRANSFORMERS.release)
    decision = decide_text(PATCH, target, source_text(target.module))
    assert (decision.verdict, decision.shape) == (shape.verdict, shape.id), decision.reason


WRAP = "module = self._build_fsdp_module(module)"
OPTIMIZER = "optimizer = build_optimizer(module.parameters(), self.optimizer_config)"
ENGINE_EDITS = {
    "engine names the setting": ("def _build_optimizer(self, module):", "\n        x = 'freeze_vision_tower'"),
    "optimizer before wrapping": (WRAP, "\n        self._build_optimizer(module)"),
    "optimizer of other parameters": (OPTIMIZER, None, OPTIMIZER.replace("module.parameters()", "self.trainable")),
    "policy of another module": ("module=module,", None, "module=self.module,"),
    "another wrap signature": ("def _build_fsdp_module(self, module):", None, "def _build_fsdp_module(self, m, p):"),
}
CONFIG_EDITS = {
    "config renames the field": ("freeze_vision_tower: bool = False", None, "freeze_vision_model: bool = False"),
    "engine config copied": ("self.engine = self.fsdp_config", None, "self.engine = copy(self.fsdp_config)"),
}
EDITS = [(ENGINE, name, edit) for name, edit in ENGINE_EDITS.items()]
EDITS += [(CONFIG, name, edit) for name, edit in CONFIG_EDITS.items()]


@pytest.mark.parametrize(("target", "name", "edit"), EDITS, ids=[name for _, name, _ in EDITS])
def test_edited_source_is_unrecognized(target, name, edit):
    """``edit``: (old, text added after it) or (old, None, its replacement)."""
    old, added, *replacement = edit
    source = source_text(target.module)
    assert old in source, f"{old!r} is not in {target.module}"
    decision = decide_text(PATCH, target, source.replace(old, replacement[0] if replacement else old + added))
    assert decision.verdict is Verdict.UNRECOGNIZED, decision.reason


# verl 0.7's legacy workers freeze model.visual when the actor asks, and switch FSDP1 to original parameters.
FREEZE = "vision_tower.requires_grad_(False)"
SETTING_OF_ACTOR = 'self.config.actor.get("freeze_vision_tower"'
TOWER = "return vl_model_instance.model.visual"
WORKER_NEAR_MISSES = (
    Variant("no original parameters", spec.FSDP_WORKERS, replace("self.use_orig_params = True", "pass")),
    Variant("tower unfrozen", spec.FSDP_WORKERS, replace(FREEZE, FREEZE.replace("False", "True"))),
    Variant(
        "setting of the model", spec.FSDP_WORKERS, replace(SETTING_OF_ACTOR, SETTING_OF_ACTOR.replace("actor", "model"))
    ),
    Variant("another tower", spec.FSDP_WORKERS, replace(TOWER, TOWER.replace("visual", "vision_tower"))),
    Variant("renamed setting", spec.FSDP_WORKERS, replace('"freeze_vision_tower"', '"freeze_vision_model"')),
)
NEAR_MISSES = [NearMisses(PATCH.name, WORKERS.label, spec.WORKERS_FREEZE_TOWER.id, WORKER_NEAR_MISSES)]


@pytest.mark.parametrize(("patch", "target", "variant"), near_miss_cases(NEAR_MISSES))
def test_near_miss_of_a_safe_shape_is_not_called_safe(monkeypatch, patch, target, variant):
    check_near_miss(monkeypatch, patch, target, variant)
