"""edgestream: online deep learning on edge sensor streams over Kafka.

Every module lives under this one import package: ``edgestream.pipeline``,
``edgestream.compression``, ``edgestream.cli`` ... An installed wheel holds them inside
it. In a checkout they are the repository's top-level folders (``pipeline/``,
``streams/`` ...): this package's search path is extended with the checkout's root.
"""

from __future__ import annotations

from pathlib import Path as _Path

#: The checkout this package sits in, or None for an installed copy.
CHECKOUT: _Path | None = _Path(__file__).resolve().parent.parent
if not ((CHECKOUT / "pyproject.toml").is_file() and (CHECKOUT / "pipeline" / "__init__.py").is_file()):
    CHECKOUT = None
else:
    __path__.append(str(CHECKOUT))  # noqa: F821  (a package's __path__)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("edgestream")
    except PackageNotFoundError:  # a checkout never installed: its pyproject.toml says
        import tomllib

        assert CHECKOUT is not None
        return tomllib.loads((CHECKOUT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]


__version__ = _version()
