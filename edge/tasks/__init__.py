"""Task handlers, one module per task, behind the small interfaces in `base`: what the
branch workers call. Each module also has the start step that loads its models."""
