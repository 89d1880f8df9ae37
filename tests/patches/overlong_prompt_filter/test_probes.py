"""``overlong_prompt_filter``: the probe on the installed verl, the affected shape edited into verl 0.8's (and back),
and the near-misses of verl 0.8's shape."""

from __future__ import annotations

import pytest

from tests.helpers import VERL, decide_text, source_text
from tests.source_edits import NearMisses, Variant, check_near_miss, near_miss_cases, replace, substitute
from verl_qwen3vl_plugin.patches.overlong_prompt_filter import spec
from verl_qwen3vl_plugin.registry import Verdict

PATCH = spec.PATCH
TARGET = PATCH.targets[0]
SOURCE = source_text(TARGET.module)
AFFECTED = VERL.release[:2] == (0, 7)


def test_installed_verl_decision():
    decision = decide_text(PATCH, TARGET, SOURCE)
    expected = spec.POPS_BEFORE_READING if AFFECTED else spec.KEEPS_COLUMNS
    assert (decision.verdict, decision.shape) == (expected.verdict, expected.id), decision.reason


@pytest.mark.skipif(not AFFECTED, reason="edits of verl 0.7.x's source")
@pytest.mark.parametrize(
    ("name", "old", "new", "verdict"),
    [
        # verl 0.8's change, made in 0.7's source: the columns read, not removed.
        ("reads without removing", "example.pop(self.", "example.get(self.", Verdict.FIXED_UPSTREAM),
        ("pops one column only", "example.pop(self.video_key", "example.get(self.video_key", Verdict.UNRECOGNIZED),
        ("tests the column first", "if image_key in doc", "if image_key in {**doc}", Verdict.UNRECOGNIZED),
        ("measures another row", "self._build_messages(doc)", "self._build_messages(dict(doc))", Verdict.UNRECOGNIZED),
    ],
)
def test_edits_of_verl_07(name, old, new, verdict):
    edited = SOURCE.replace(old, new)
    assert edited != SOURCE
    assert decide_text(PATCH, TARGET, edited).verdict is verdict


POP_AFTER_READING = "        example.pop(self.image_key)\n        videos = example.get("
KEPT_COLUMNS_NEAR_MISSES = (
    Variant(
        "pops the image column", TARGET.module, replace("example.get(self.image_key", "example.pop(self.image_key")
    ),
    Variant("reads one column only", TARGET.module, replace("example.get(self.video_key, None)", "None")),
    Variant("filter measures otherwise", TARGET.module, substitute(r"self\._build_messages\(doc", "self._msgs(doc")),
    Variant("pops after reading", TARGET.module, replace("        videos = example.get(", POP_AFTER_READING)),
)
NEAR_MISSES = [NearMisses(PATCH.name, TARGET.label, spec.KEEPS_COLUMNS.id, KEPT_COLUMNS_NEAR_MISSES)]


@pytest.mark.parametrize(("patch", "target", "variant"), near_miss_cases(NEAR_MISSES))
def test_near_miss_of_a_safe_shape_is_not_called_safe(monkeypatch, patch, target, variant):
    check_near_miss(monkeypatch, patch, target, variant)
