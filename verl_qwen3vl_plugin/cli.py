"""The ``verl-qwen3vl-plugin`` console script."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from verl_qwen3vl_plugin import __version__

DESCRIPTION = "Check that verl loads the Qwen3-VL plugin, and what each of its patches does on this stack."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verl-qwen3vl-plugin", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=__version__)
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser("doctor", help="report whether the plugin is active and what each patch does here")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument(
        "--selftest", action="store_true", help="also check every patch on embedded tiny models on the CPU"
    )
    args = parser.parse_args(argv)  # bad flags: argparse prints usage and exits 2

    from verl_qwen3vl_plugin.doctor import UsageError, build_report, render

    try:
        report = build_report(selftest=args.selftest)
    except UsageError as exc:
        print(f"verl-qwen3vl-plugin doctor: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**dataclasses.asdict(report), "exit_code": report.exit_code}, indent=2))
    else:
        print(render(report))
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
