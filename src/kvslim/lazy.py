"""Names a package exports without importing their modules until first use (PEP 562).

``kvslim``, :mod:`kvslim.cache` and :mod:`kvslim.calibration` each export a few names whose modules pull
in torch or transformers; a package that only declares them stays cheap to import::

    __getattr__, __dir__ = lazy_exports(__name__, {"SlimCache": ("kvslim.cache.adapter", "SlimCache")}, globals())

``(module, None)`` exports the module itself. A loaded name is stored in the package's namespace, so the
hook runs once per name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, table: dict[str, tuple[str, str | None]], namespace: dict) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package`` exporting ``table``'s names (name -> (module, attribute))."""

    def __getattr__(name: str):
        try:
            module_name, attr = table[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        module = importlib.import_module(module_name)
        value = module if attr is None else getattr(module, attr)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
