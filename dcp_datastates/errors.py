"""Exceptions that dcp_datastates raises for checkpoints it cannot trust."""


class CheckpointError(Exception):
    """A checkpoint cannot be saved or loaded."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files are missing, truncated or do not match their checksums."""


def brief(value: object, limit: int = 200) -> str:
    """How an error shows ``value`` read from a file: its repr, cut to about ``limit``
    characters, sequences rendered only as far as shown, integers too long to print (Python
    refuses beyond 4300 digits) or to read (beyond 256 bits) by their size."""
    if isinstance(value, (tuple, list)):
        parts: list[str] = []
        for v in value:
            if sum(len(p) + 2 for p in parts) > limit:
                break
            parts.append(brief(v, limit))
        more = ", ..." if len(parts) < len(value) else ""
        text = f"[{', '.join(parts)}{more}]"
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        text = f"<an integer of {value.bit_length()} bits>"
    else:
        try:
            text = repr(value)
        except ValueError:  # holds an integer too long to print
            text = f"<a {type(value).__name__} holding an integer too long to print>"
    return text if len(text) <= limit else f"{text[:limit]}..."
