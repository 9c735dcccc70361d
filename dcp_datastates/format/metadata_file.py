"""The names a checkpoint's ``.metadata`` pickles, at the path every checkpoint records them
under (the file format's, kept for as long as such checkpoints are read; not API): a plain
``pickle.load`` of our ``.metadata`` (DCP's default reader) finds them here and fails saying
to use ``DataStatesReader``."""

from .._format.metadata_file import ItemLocation, written_by_datastates

__all__ = ["ItemLocation", "written_by_datastates"]
