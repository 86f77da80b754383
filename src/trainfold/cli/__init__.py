"""The command line (``python -m trainfold.cli``): its config reader, builders and the demo."""
