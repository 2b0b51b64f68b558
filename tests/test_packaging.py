"""What ``pip install kvplug`` ships: setuptools finds only folders with an ``__init__.py``,
so a module folder without one would be missing from a non-editable install."""

from __future__ import annotations

from pathlib import Path

import kvplug

PACKAGE = Path(kvplug.__file__).resolve().parent


def test_every_module_folder_is_a_package() -> None:
    folders = {path.parent for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts}
    missing = sorted(
        str(f.relative_to(PACKAGE)) for f in folders if not (f / "__init__.py").exists()
    )
    assert not missing, f"folders setuptools would leave out: {missing}"


def test_the_packaged_traces_name_their_source_and_licence() -> None:
    readme = (PACKAGE / "data" / "traces" / "README.md").read_text()
    for trace in (PACKAGE / "data" / "traces").glob("*.jsonl"):
        assert f"`{trace.name}`" in readme
    assert "Apache License 2.0" in readme and "kvcache-ai/Mooncake" in readme
