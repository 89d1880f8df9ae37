"""Compose this recipe against the installed verl's own config files and print it as YAML (``run.sh --dry-run``).

verl's ``fully_async_ppo_trainer.yaml`` stays the primary config, so its ``hydra.searchpath`` is allowed (a config
that lists it in its defaults fails on verl >= 0.8). The search path is replaced by one that works from any working
directory (verl 0.7.1's points at ``file://verl/trainer/config``, relative to the cwd) and adds this folder, whose
``recipe/`` group holds the run (``+recipe=NAME``, package ``_global_``, merged after verl's values).

Usage: compose.py [--hydra-args | --routing-replay R2|R3] OVERRIDE...
  --hydra-args      print the primary-config arguments for verl's fully_async_main, one per line, and exit
  --routing-replay  print the overrides that turn on the plugin's routing replay on the installed verl, and exit
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

CONFIG_NAME = "fully_async_ppo_trainer"
HERE = Path(__file__).resolve().parent


def verl_config_dir() -> Path:
    spec = importlib.util.find_spec("verl")
    if spec is None:
        sys.exit("compose.py: verl is not installed in this Python environment")
    config = Path(spec.submodule_search_locations[0], "experimental", "fully_async_policy", "config")
    if not config.is_dir():
        sys.exit(f"compose.py: this verl has no fully async policy config ({config}); the recipe needs verl >= 0.7.1")
    return config


def hydra_args() -> list[str]:
    return [
        f"--config-path={verl_config_dir()}",
        f"--config-name={CONFIG_NAME}",
        f"hydra.searchpath=[pkg://verl.trainer.config,file://{HERE}]",
    ]


def routing_replay_overrides(mode: str) -> list[str]:
    """verl's own switch on the path the installed verl trains FSDP through: the legacy actor's
    ``router_replay.mode`` (verl 0.7), the FSDP engine config's (verl >= 0.8, whose YAML does not declare it); R3
    also turns on the rollout's record (vLLM's ``routed_experts``)."""
    if mode not in ("R2", "R3"):
        sys.exit(f"compose.py: routing replay mode must be R2 or R3, got {mode!r}")
    legacy = importlib.util.find_spec("verl.workers.actor") is not None
    key = (
        "actor_rollout_ref.actor.router_replay.mode"
        if legacy
        else "+actor_rollout_ref.actor.fsdp_config.router_replay.mode"
    )
    rollout = ["actor_rollout_ref.rollout.enable_rollout_routing_replay=True"] if mode == "R3" else []
    return [f"{key}={mode}", *rollout]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    searchpath = hydra_args()[2]
    with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
        return hydra_compose(CONFIG_NAME, overrides=[searchpath, *overrides])


def main(argv: list[str]) -> int:
    if argv[:1] == ["--hydra-args"]:
        print("\n".join(hydra_args()))
        return 0
    if argv[:1] == ["--routing-replay"]:
        print("\n".join(routing_replay_overrides(argv[1] if len(argv) > 1 else "")))
        return 0
    from omegaconf import OmegaConf

    print(OmegaConf.to_yaml(compose(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
