"""The local web studio (``SD_Studio.py``): pages over the same commands the command line runs."""
