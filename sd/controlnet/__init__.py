"""ControlNets: spatial conditioning of a frozen model (``model.py``) and their files for other tools (``files.py``)."""
