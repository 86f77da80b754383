"""The command line (``python -m trainfold``): its config reader, builders and the demo."""
