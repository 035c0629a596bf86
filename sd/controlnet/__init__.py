"""ControlNets: spatial conditioning of a frozen model (``model.py``) and their file formats for other tools (``formats.py``)."""
