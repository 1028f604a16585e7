"""The package's public API (``oscar_calib/__init__.py``): each name is the object its module
defines, loaded on first use, so importing the package stays light; a subpackage never shadows a
name of the API (``calibrate`` is the function, also after ``oscar_calib.calibration`` loads)."""

from __future__ import annotations

import importlib
import json
import pkgutil
import subprocess
import sys

import pytest

import oscar_calib

HEAVY = ("torch", "transformers", "triton")


def test_importing_the_package_and_listing_its_api_loads_nothing_heavy():
    code = ("import json, sys, oscar_calib; names = sorted(oscar_calib.__all__); listed = dir(oscar_calib); "
            f"print(json.dumps([names, [n for n in names if n not in listed], [m for m in {HEAVY!r} if m in sys.modules]]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    names, unlisted, heavy = json.loads(out)
    assert {"load_model", "calibrate", "verify_artifact", "run_eval", "OscarCache", "generate", "KVScheme",
            "export_artifact", "load_artifact"} <= set(names)
    assert unlisted == [] and heavy == []


@pytest.mark.parametrize("name", sorted(oscar_calib._API))
def test_each_name_is_the_object_its_module_defines(name):
    module = importlib.import_module(oscar_calib._API[name])
    obj = getattr(oscar_calib, name)
    assert obj is getattr(module, name) and obj.__module__ == module.__name__


def test_no_subpackage_shadows_a_name_of_the_api():
    import oscar_calib.calibration.pipeline  # noqa: F401 - binds oscar_calib.calibration, not .calibrate
    from oscar_calib import calibrate

    assert callable(calibrate) and calibrate.__module__ == "oscar_calib.calibration.pipeline"
    subpackages = {m.name for m in pkgutil.iter_modules(oscar_calib.__path__)}
    assert not subpackages & set(oscar_calib._API)
    with pytest.raises(AttributeError, match="no attribute 'calibrate_model'"):
        oscar_calib.calibrate_model
