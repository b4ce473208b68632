"""pyproject.toml's per-service lists: mypy's path and the import layers."""

from __future__ import annotations

from pathlib import Path

from devstack.deploygen.model import Deployed
from devstack.deploygen.render import replace_block

PYPROJECT = Path("pyproject.toml")
# The shared layers, top (may import the ones below) to bottom, and their folders.
LIBRARIES = {
    "harness": "libs/harness",
    "servicekit": "libs/servicekit",
    "domain": "libs/domain",
    "contracts": "contracts",
}
LAUNCHER = ("devstack", "libs/devstack")
# What the tests and benches run the code with (the root's dev group, not in the image).
TESTKIT = ("testkit", "libs/testkit")


def pyproject_mypy_path(services: list[Deployed]) -> str:
    folders = [
        *LIBRARIES.values(),
        LAUNCHER[1],
        *(f"services/{s.module}" for s in services),
        TESTKIT[1],
    ]
    return "mypy_path = [\n" + "".join(f'    "{f}",\n' for f in folders) + "]\n"


def _toml_list(items: list[str]) -> str:
    return "[\n" + "".join(f'    "{i}",\n' for i in items) + "]"


def pyproject_layers(services: list[Deployed]) -> str:
    modules = [s.module for s in services]
    production = [*reversed(LIBRARIES), *modules, LAUNCHER[0]]
    layers = [LAUNCHER[0], " | ".join(modules), *LIBRARIES]
    return f"""# `make lint` checks the layers (import-linter): each may import only what is
# below it. The harness builds on servicekit (its metering client is a servicekit call), so it
# sits above it; services are independent of one another (`|`); the launcher finds
# them through entry points, at run time, and imports none either. The test kit stands
# outside the layers: it may import any of them, none may import it, as the image does
# not install it.
[tool.importlinter]
root_packages = {_toml_list([*production, TESTKIT[0]])}

[[tool.importlinter.contracts]]
name = "layers: contracts <- domain <- servicekit <- harness <- services <- launcher"
type = "layers"
layers = {_toml_list(layers)}

[[tool.importlinter.contracts]]
name = "no service imports another service"
type = "independence"
modules = {_toml_list(modules)}

[[tool.importlinter.contracts]]
name = "the shared libraries and the launcher import no service"
type = "forbidden"
source_modules = {_toml_list([*reversed(LIBRARIES), LAUNCHER[0]])}
forbidden_modules = {_toml_list(modules)}

[[tool.importlinter.contracts]]
name = "no production package imports the test kit"
type = "forbidden"
source_modules = {_toml_list(production)}
forbidden_modules = ["{TESTKIT[0]}"]
"""


def pyproject_file(current: str, services: list[Deployed]) -> str:
    """pyproject.toml with its per-service lists (mypy, import layers) up to date."""
    text = replace_block(current, "mypy_path", pyproject_mypy_path(services), "")
    return replace_block(text, "import layers", pyproject_layers(services), "")
