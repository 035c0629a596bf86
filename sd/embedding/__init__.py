"""Textual inversion: new tokens of the frozen CLIP text encoder (``tokens``) and their file formats (``formats``)."""
