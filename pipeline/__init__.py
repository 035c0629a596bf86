"""The numbered data stages, run as scripts (``python pipeline/04_preprocess_to_cache.py ...``).

A package so that tests and other code can import a stage by its file name, which starts with a
digit and so cannot follow ``import``: ``importlib.import_module("pipeline.04_preprocess_to_cache")``.
"""
