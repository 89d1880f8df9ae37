"""Compose this recipe against the installed verl's own config files and print it as YAML (``run.sh --dry-run``).

verl's ``fully_async_ppo_trainer.yaml`` stays the primary config, so its ``hydra.searchpath`` is allowed (a config
that lists it in its defaults fails on verl >= 0.8). The search path is replaced by one that works from any working
directory (verl 0.7.1's points at ``file://verl/trainer/config``, relative to the cwd) and adds this folder, whose
``recipe/`` group holds the run (``+recipe=NAME``, package ``_global_``, merged after verl's values).

Usage: compose.py [--hydra-args] OVERRIDE...
  --hydra-args  print the primary-config arguments for verl's fully_async_main, one per line, and exit
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
    from omegaconf import OmegaConf

    print(OmegaConf.to_yaml(compose(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
