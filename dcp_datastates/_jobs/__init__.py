"""Jobs: one save or one load each, owning what it holds."""
