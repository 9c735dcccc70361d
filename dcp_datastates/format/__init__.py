"""The names a checkpoint's ``.metadata`` records (part of the file format, not API)."""
