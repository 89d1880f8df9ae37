"""One test session per supported verl x transformers stack, each a fresh venv built from PyPI.

torch is pinned to 2.13.0 (a CPU build) in every stack: an unpinned torch pulls a multi-GB CUDA build.
"""

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = False

TORCH = "torch==2.13.0"
# verl < 0.9 has no plugin discovery: this is the activation line the README documents.
ACTIVATE = {
    "VERL_USE_EXTERNAL_MODULES": "verl_qwen3vl_plugin.hooks.model_patch,verl_qwen3vl_plugin.hooks.npu_patch",
}
STACKS = {
    # The Ascend vllm-ascend 0.13 stack. verl < 0.9 needs numpy < 2, which pyarrow >= 26 no longer supports.
    "verl0.7.1-tf4.57.6": ["verl==0.7.1", "transformers==4.57.6", "numpy<2", "pyarrow<26"],
    "verl0.8.0-tf5.3.0": ["verl==0.8.0", "transformers==5.3.0", "numpy<2", "pyarrow<26"],
    # The newest transformers verl 0.9.1 accepts; its trainer modules import these undeclared dependencies.
    "verl0.9.1-tf5.10.4": [
        "verl==0.9.1",
        "transformers==5.10.4",
        "cachetools",
        "uvicorn",
        "fastapi",
        "pyzmq",
        "msgspec",
    ],
}


@nox.session
@nox.parametrize("stack", list(STACKS))
def tests(session: nox.Session, stack: str) -> None:
    session.install(TORCH, *STACKS[stack], "-e", ".[test]")
    session.run("pytest", "-m", "not fake_npu", *session.posargs)
    # verl's npu_patch rewires transformers for the rest of its process: it gets a process of its own.
    session.run("pytest", "-m", "fake_npu", *session.posargs)


@nox.session
def doctor(session: nox.Session) -> None:
    """The main job: on the Ascend verl 0.7.1 stack, where both patches act, activate the plugin and self-test it."""
    session.install(TORCH, *STACKS["verl0.7.1-tf4.57.6"], "-e", ".")
    session.run("verl-qwen3vl-plugin", "doctor", "--selftest", *session.posargs, env=ACTIVATE)


@nox.session
def bench(session: nox.Session) -> None:
    """CPU benchmarks (docs/performance.md): verl 0.8.0 + transformers 5.3.0 has both upstream implementations.

    A regular (not editable) install, as users have it: the import cost depends on it.
    """
    session.install(TORCH, *STACKS["verl0.8.0-tf5.3.0"], ".", "matplotlib")
    session.run("python", "benchmarks/pos_embed.py", "--plot", "docs/performance.png", *session.posargs)
    session.run("python", "benchmarks/import_cost.py")


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")
