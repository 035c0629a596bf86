"""sd.cli: a part whose packages are an extra, used where the extra is not installed, says which one in a line."""

import json
import sys

import pytest

import sd.cli


def test_import_extra_returns_the_module_or_names_the_extra_to_install(monkeypatch):
    assert sd.cli.import_extra("json", "studio", "the studio") is json
    monkeypatch.setitem(sys.modules, "gradio", None)  # as where it is not installed
    with pytest.raises(sd.cli.MissingExtra) as missing:
        sd.cli.import_extra("gradio", "studio", "the studio")
    assert str(missing.value) == "the studio needs its extra: pip install -e .[studio] (gradio is not installed)"
    assert isinstance(missing.value, ImportError)  # what a caller that tolerates a missing package catches
    with pytest.raises(sd.cli.MissingExtra, match=r"\.\[caption\] \(no_such_package is not installed\)$"):
        sd.cli.import_extra("no_such_package.helper", "caption", "a part")  # a module inside names its package
