"""The file format: the bytes on disk (data files, ``.metadata``, checksums, the checkpoint
directory). Change a module here and checkpoints written before may stop loading; every other
folder may change without touching what is on disk."""
