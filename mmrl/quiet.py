"""A quiet start: what the libraries print while mmrl loads models, silenced unless ``--verbose``.

Two sources of noise at every start:

* **bitsandbytes**, when installed, is imported by diffusers' quantizer module as soon as any diffusers model class
  is imported, whether or not anything is quantized. Importing it costs about 2.4 s here, and on CPUs with
  AVX512-BF16 it logs "Failed to load CPU gemm_4bit_forward from kernels-community". :func:`defer_import` puts a
  stand-in module in its place: diffusers' ``import bitsandbytes as bnb`` binds it, and the real import runs at
  its first use: a quantized explorer, 8-bit AdamW, QLoRA, or peft, which probes ``bnb.nn`` the first time it
  creates LoRA layers (so LoRA runs still import it then). Its kernels message is silenced unless verbose.
  (The standard library's ``importlib.util.LazyLoader`` does not do here: ``inspect.getmodule`` touches every
  module while torch is still importing, which starts the lazy import too early and leaves a half-initialised
  module behind.)
* **Loading bars**: diffusers' "Loading pipeline components", transformers' "Loading weights" and the Hub's
  download bars, all tqdm. ``TQDM_DISABLE=1`` (tqdm's own switch for its default) turns them off.

Library warnings (missing weights, deprecations) are left alone: they can matter.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types
from typing import Any

__all__ = ["defer_import", "quiet_libraries"]


class _DeferredModule(types.ModuleType):
    """Stands in ``sys.modules`` for a module not imported yet. The first attribute it lacks imports the real module
    (which then takes its place in ``sys.modules``); every attribute is then read from the real one, so a reference
    taken before the import keeps working.

    It carries the real ``__spec__`` (``importlib.util.find_spec`` returns it) and ``__file__`` (``inspect.getmodule``
    reads every module's ``__file__``, and torch calls it while torch itself is half imported: importing there
    would fail), but no ``__path__``: importing a submodule reads it, and so imports the package first, as it should.
    """

    def __init__(self, spec: importlib.machinery.ModuleSpec) -> None:
        super().__init__(spec.name)
        self.__spec__ = spec
        self.__loader__ = spec.loader
        self.__file__ = spec.origin

    def __getattr__(self, attr: str) -> Any:
        name = self.__name__
        if sys.modules.get(name) is self:
            del sys.modules[name]
            try:
                importlib.import_module(name)
            except BaseException:
                sys.modules[name] = self  # nothing half-done is left in sys.modules; the next access retries
                raise
        return getattr(sys.modules[name], attr)


def defer_import(name: str) -> bool:
    """Make ``import name`` bind a stand-in whose first use runs the real import.

    Returns whether a stand-in was installed (``False``: already imported, or not installed).
    """
    if name in sys.modules:
        return False
    spec = importlib.util.find_spec(name)
    if spec is None:
        return False
    sys.modules[name] = _DeferredModule(spec)
    return True


def quiet_libraries(verbose: bool = False) -> None:
    """Defer bitsandbytes' import to its first use; unless ``verbose``, also turn off the libraries' loading
    bars and bitsandbytes' kernels message. Call before the libraries are imported (the CLI does, first thing).
    Environment variables the user set (``TQDM_DISABLE``, ``HF_HUB_DISABLE_PROGRESS_BARS``) win."""
    defer_import("bitsandbytes")
    if verbose:
        return
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
